"""lightning-tsp: Tensor and Sequence Parallelism (TSP) for PyTorch and Lightning.

Exports load on first use, so ``import lightning_tsp`` (and ``lightning-tsp plan``) stays light. Importing the
package registers the strategy name ``"tsp"`` with Lightning (now, or as soon as Lightning is imported).
"""

from __future__ import annotations

import importlib

from lightning_tsp import _registration

__version__ = "0.1.0"

_EXPORTS = {
    "TSPGroup": "lightning_tsp.group",
    "TSPConfigError": "lightning_tsp.checks",
    "ModelConfig": "lightning_tsp.models.llama",
    "PRESETS": "lightning_tsp.models.llama",
    "TSPLlama": "lightning_tsp.models.llama",
    "get_config": "lightning_tsp.models.llama",
    "shard_batch": "lightning_tsp.zigzag",
    "zigzag_positions": "lightning_tsp.zigzag",
    "zigzag_shard": "lightning_tsp.zigzag",
    "zigzag_unshard": "lightning_tsp.zigzag",
    "TSPStrategy": "lightning_tsp.strategy",
    "predict_logprobs": "lightning_tsp.predict",
    "TSPFabricStrategy": "lightning_tsp.fabric",
    "Perplexity": "lightning_tsp.metrics",
    "generate": "lightning_tsp.inference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'lightning_tsp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


_registration.install()
