from __future__ import annotations

from typing import Optional

import torch.nn as nn

from lightning_tsp.models.llama import PRESETS, ModelConfig, TSPDecoderLayer, TSPLlama

__all__ = ["ModelConfig", "PRESETS", "TSPLlama", "TSPDecoderLayer", "find_tsp_model", "named_tsp_models"]


def named_tsp_models(root: nn.Module) -> list[tuple[str, TSPLlama]]:
    """The outermost :class:`TSPLlama` modules of ``root`` with their attribute paths (``""``: ``root`` itself).

    The one model lookup of the package (strategies, callbacks, prediction): a TSPLlama nested inside another is
    part of it and not listed.
    """
    found: list[tuple[str, TSPLlama]] = []
    for name, module in root.named_modules():
        if not isinstance(module, TSPLlama):
            continue
        if any(prefix == "" or name.startswith(prefix + ".") for prefix, _ in found):
            continue
        found.append((name, module))
    return found


def find_tsp_model(root: nn.Module, required: bool = True) -> Optional[TSPLlama]:
    """The single outermost TSPLlama of ``root`` (``root`` itself if it is one).

    None when there is none and ``required`` is False; :class:`~lightning_tsp.checks.TSPConfigError` when there are
    several, or none and ``required``.
    """
    found = named_tsp_models(root)
    if len(found) == 1:
        return found[0][1]
    if not found and not required:
        return None
    from lightning_tsp.checks import TSPConfigError

    names = f" ({', '.join(repr(n) for n, _ in found)})" if found else ""
    raise TSPConfigError(
        f"expected exactly one TSPLlama in {type(root).__name__}, found {len(found)}{names}: pass the TSPLlama itself"
    )
