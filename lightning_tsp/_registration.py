"""Registers the strategy name "tsp" with Lightning without importing Lightning (or torch) eagerly.

The ONLY registration path of the package. ``import lightning_tsp`` calls :func:`install`: for each registry below,
if its module is already imported the name is registered at once, otherwise a one-shot import hook registers it
right after Lightning loads that module:

* ``lightning.pytorch.strategies.StrategyRegistry`` (``Trainer(strategy="tsp")``, ``strategy: tsp`` in
  LightningCLI): a small factory that imports :class:`lightning_tsp.strategy.TSPStrategy` when a Trainer asks;
* ``lightning.fabric.strategies.STRATEGY_REGISTRY`` (``Fabric(strategy="tsp")``): the same for
  :class:`lightning_tsp.fabric.TSPFabricStrategy`;
* ``pytorch_lightning.strategies.StrategyRegistry``: an entry that refuses with a message pointing to
  ``lightning.pytorch`` (the two packages have separate registries and base classes).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from typing import Any

STRATEGY_NAME = "tsp"
DESCRIPTION = "Tensor and Sequence Parallelism (TSP) over a ('data_parallel', 'tsp') device mesh"
PL_MESSAGE = (
    "lightning_tsp.TSPStrategy is a `lightning.pytorch` strategy and cannot run under `pytorch_lightning.Trainer` "
    "(the two packages have separate strategy registries and base classes). Import the Trainer, LightningModule "
    "and callbacks from `lightning.pytorch` instead, e.g. `from lightning.pytorch import Trainer`."
)


def make_tsp_strategy(**kwargs: Any):
    from lightning_tsp.strategy import TSPStrategy

    return TSPStrategy(**kwargs)


def make_tsp_fabric_strategy(**kwargs: Any):
    from lightning_tsp.fabric import TSPFabricStrategy

    return TSPFabricStrategy(**kwargs)


def refuse_pytorch_lightning(**_: Any):
    from lightning_tsp.checks import TSPConfigError

    raise TSPConfigError(PL_MESSAGE)


def register_lightning(registry: Any) -> None:
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, make_tsp_strategy, description=DESCRIPTION)


def register_fabric(registry: Any) -> None:
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, make_tsp_fabric_strategy, description=DESCRIPTION + " for Fabric")


def register_pytorch_lightning(registry: Any) -> None:
    if STRATEGY_NAME not in registry:
        registry.register(STRATEGY_NAME, refuse_pytorch_lightning, description="(lightning.pytorch only) " + PL_MESSAGE)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``callback(module)`` once, right after the module ``name`` has been executed."""

    def __init__(self, name: str, callback: Callable[[Any], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # one shot
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_callback(module):
            exec_module(module)
            try:
                self.callback(module)
            except Exception:  # never break the user's import over a registration
                pass

        spec.loader.exec_module = exec_then_callback
        return spec


def _when_imported(name: str, attribute: str, callback: Callable[[Any], None]) -> None:
    module = sys.modules.get(name)
    if module is not None and hasattr(module, attribute):  # fully imported already
        callback(module)
    elif not any(isinstance(f, _AfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, callback))


def install() -> None:
    """Idempotent: register now where Lightning is loaded, else as soon as it loads."""
    _when_imported("lightning.pytorch.strategies", "StrategyRegistry", lambda m: register_lightning(m.StrategyRegistry))
    _when_imported("lightning.fabric.strategies", "STRATEGY_REGISTRY", lambda m: register_fabric(m.STRATEGY_REGISTRY))
    _when_imported(
        "pytorch_lightning.strategies", "StrategyRegistry", lambda m: register_pytorch_lightning(m.StrategyRegistry)
    )
