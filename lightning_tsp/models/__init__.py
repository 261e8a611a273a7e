from lightning_tsp.models.llama import PRESETS, ModelConfig, TSPDecoderLayer, TSPLlama

__all__ = ["ModelConfig", "PRESETS", "TSPLlama", "TSPDecoderLayer"]
