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
    mod = importlib.import_module(f"{__name__}.{STRATEGY_MODULES[setup.strategy]}")
    return mod.build(setup, full_state)
