"""lightning-tsp: Tensor and Sequence Parallelism (TSP) for PyTorch and Lightning."""

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.models import PRESETS, ModelConfig, TSPLlama
from lightning_tsp.zigzag import shard_batch, zigzag_positions, zigzag_shard, zigzag_unshard

__version__ = "0.1.0"

__all__ = [
    "TSPGroup",
    "TSPConfigError",
    "ModelConfig",
    "PRESETS",
    "TSPLlama",
    "shard_batch",
    "zigzag_positions",
    "zigzag_shard",
    "zigzag_unshard",
]
