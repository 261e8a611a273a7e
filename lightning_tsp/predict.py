"""Long-context scoring under TSP: per-token log-probabilities in natural order (``predict_logprobs``).

Used in ``predict_step`` under ``Trainer(strategy="tsp")`` (the batch the strategy hands over is this rank's zigzag
slice) and in a Fabric loop after ``fabric.strategy.batch_to_device(batch)``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.models import find_tsp_model
from lightning_tsp.zigzag import IGNORE_INDEX, zigzag_unshard

__all__ = ["gather_sequence", "predict_logprobs"]


def gather_sequence(local: Tensor, tsp: TSPGroup, dim: int = 1) -> Tensor:
    """All-gather this rank's zigzag slice [.., S/D, ..] over the TSP group -> natural order [.., S, ..]."""
    if tsp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tsp.size)]
    dist.all_gather(parts, local.contiguous(), group=tsp.group)
    return zigzag_unshard(parts, dim=dim)


@torch.no_grad()
def predict_logprobs(module: nn.Module, batch: Mapping[str, Tensor], gather: bool = True) -> Tensor:
    """Per-token log-probabilities for long-context scoring.

    ``batch`` is this rank's zigzag slice of the global batch (what TSPStrategy hands to ``predict_step``).
    Returns float32 ``[B, S]`` in NATURAL token order on EVERY rank of the TSP group (all-gathered):
    ``out[b, t] = log p(token[t + 1] | tokens[<= t])`` and ``NaN`` where there is no target: the last position,
    ``labels == -100`` and padding (``attention_mask == 0``). ``gather=False`` returns this rank's zigzag slice
    ``[B, S/D]`` instead (no collective). Every rank of the TSP group must call it (collectives inside).
    """
    model = find_tsp_model(module)
    assert model is not None
    targets = batch["targets"]
    losses = model.token_losses(batch["input_ids"], targets, batch["position_ids"])
    logp = (-losses.to(torch.float32)).masked_fill(targets == IGNORE_INDEX, float("nan"))
    return gather_sequence(logp, model.tsp) if gather else logp
