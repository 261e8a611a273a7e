"""Baseline strategies for benchmarks.harness and benchmarks.multi_gpu: each module's ``build(setup) -> Runner``."""

from __future__ import annotations

STRATEGY_MODULES = {
    "tsp": "tsp",
    "tp": "tp",
    "tp_sp": "tp",
    "sp": "cp",
    "tp_x_sp": "tp_x_sp",
    "fsdp_cp": "fsdp_cp",
}
STRATEGIES = tuple(STRATEGY_MODULES)


def build(setup, full_state=None):
    import importlib

    mod = importlib.import_module(f"{__name__}.{STRATEGY_MODULES[setup.strategy]}")
    return mod.build(setup, full_state)
