"""Conversion plans: turn supported modules of a user's model into unsharded TSP models before sharding.

A plan is ``(matches, convert)``: ``matches(module) -> bool`` and ``convert(module) -> TSPLlama`` returning an
UNSHARDED (tsp=None) TSPLlama subclass that computes the same function (with the weights copied, or on the meta
device with a way to load them). :class:`~lightning_tsp.strategy.TSPStrategy` calls :func:`convert_modules`
on the LightningModule after ``configure_model`` and then shards every TSPLlama it finds. Register plans for your
own architectures with :func:`register_conversion`; built-in plans cover Hugging Face Llama-family causal LMs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

Plan = tuple[Callable[[nn.Module], bool], Callable[[nn.Module], nn.Module]]
_PLANS: list[Plan] = []
_BUILTINS_LOADED = False


def register_conversion(matches: Callable[[nn.Module], bool], convert: Callable[[nn.Module], nn.Module]) -> None:
    """Add a conversion plan (tried before the built-in ones, in registration order)."""
    _PLANS.insert(len(_PLANS) - _builtin_count(), (matches, convert))


def _builtin_count() -> int:
    return sum(1 for plan in _PLANS if getattr(plan[1], "_tsp_builtin", False))


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import importlib.util

    if importlib.util.find_spec("transformers") is not None and importlib.util.find_spec(__name__ + ".hf"):
        from lightning_tsp.convert import hf

        for plan in hf.PLANS:
            plan[1]._tsp_builtin = True
            _PLANS.append(plan)


def convert_modules(root: nn.Module) -> list[str]:
    """Replace, in place, every submodule of ``root`` that a plan matches (outermost first); returns their names."""
    _load_builtins()
    converted: list[str] = []
    for name, module in list(root.named_modules()):
        if any(name == c or name.startswith(c + ".") for c in converted):
            continue
        for matches, convert in _PLANS:
            if matches(module):
                new = convert(module)
                replace_module(root, module, new)
                converted.append(name)
                break
    return converted


def replace_module(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Swap every reference to ``old`` inside ``root`` (shared submodules included)."""
    for parent in root.modules():
        for key, child in list(parent._modules.items()):
            if child is old:
                parent._modules[key] = new
