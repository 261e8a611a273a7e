"""Baseline strategies for benchmarks.harness and benchmarks.multi_gpu: each module's ``build(setup) -> Runner``."""

from __future__ import annotations

STRATEGY_MODULES = {
    "tsp": "tsp",
    "tp": "tp",
    "tp_sp": "tp",
    "sp": "cp",
    "tp_x_sp": "tp_x_sp",
    "fsdp_cp": "fsdp_cp",
    "fsdp": "fsdp_cp",
}
STRATEGIES = tuple(STRATEGY_MODULES)


def build(setup, full_state=None):
    import importlib

    if setup.compile and setup.strategy == "tsp":
        raise ValueError("compile=True with strategy 'tsp': TSP compiles its own pieces (lightning_tsp.kernels.fused: "
                         "on unless LIGHTNING_TSP_FUSED=0); per-block compile is for the rivals only")
    if setup.param_dtype != "float32" and setup.strategy != "tsp":
        raise ValueError(f"param_dtype={setup.param_dtype!r} (bf16-true) with strategy {setup.strategy!r}: only the "
                         "tsp runner builds bf16 weights; use bf16-mixed for the rivals")
    mod = importlib.import_module(f"{__name__}.{STRATEGY_MODULES[setup.strategy]}")
    return mod.build(setup, full_state)
