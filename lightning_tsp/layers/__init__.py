from lightning_tsp.layers.attention import TSPAttention
from lightning_tsp.layers.embedding import TSPEmbedding
from lightning_tsp.layers.lm_head import TSPLMHead
from lightning_tsp.layers.mlp import TSPGatedMLP
from lightning_tsp.layers.norm import TSPRMSNorm

__all__ = ["TSPAttention", "TSPGatedMLP", "TSPEmbedding", "TSPLMHead", "TSPRMSNorm"]
