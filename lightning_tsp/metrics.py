"""Metrics that sync correctly under TSPStrategy.

Under TSP a rank holds 1/D of the tokens of its replica's sequences (the TSP group holds different tokens) and
each data-parallel replica holds different sequences. Token statistics therefore have to be SUMMED over the whole
world (both mesh axes), which is what torchmetrics does with ``dist_reduce_fx="sum"`` over its default process
group (the world).

Feed them this rank's PER-TOKEN losses, not the loss ``TSPLlama.forward`` returns: that one is already the
global mean over the TSP group (the same number on every TSP rank), so summing it over the world would count it D
times::

    losses = self.model.token_losses(batch["input_ids"], batch["targets"], batch["position_ids"])
    self.val_ppl.update(losses, batch["targets"])
    self.log("val_ppl", self.val_ppl)   # computed and synced at epoch end
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_tsp.zigzag import IGNORE_INDEX


class Perplexity(Metric):
    """``exp(sum of token NLL / number of valid tokens)`` over all ranks (sum-reduced states).

    ``update(token_losses, targets)``: ``token_losses`` [B, L] is minus the log-probability of each target
    (``TSPLlama.token_losses``: this rank's zigzag slice), ``targets`` [B, L] the shifted targets, where
    ``ignore_index`` marks positions without a loss (they are not counted). Keep the default ``process_group``
    (the world) so that both TSP ranks and data-parallel replicas are summed.
    """

    is_differentiable = False
    higher_is_better = False
    full_state_update = False

    nll_sum: Tensor
    count: Tensor

    def __init__(self, ignore_index: int = IGNORE_INDEX, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ignore_index = ignore_index
        self.add_state("nll_sum", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", default=torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, token_losses: Tensor, targets: Tensor) -> None:
        if token_losses.dim() == 0 or token_losses.shape != targets.shape:
            raise ValueError(
                f"Perplexity.update takes per-token losses shaped like the targets {tuple(targets.shape)}, got "
                f"{tuple(token_losses.shape)}. Pass TSPLlama.token_losses(...), not the (already group-averaged) "
                f"loss that forward returns."
            )
        valid = targets != self.ignore_index
        if self.nll_sum.dtype != torch.float64:  # a dtype cast of the LightningModule (bf16-true) reached the state
            self.nll_sum = self.nll_sum.to(torch.float64)
        self.nll_sum += torch.where(valid, token_losses.detach().to(torch.float64), 0.0).sum()
        self.count += valid.sum()

    def compute(self) -> Tensor:
        return torch.exp(self.nll_sum / self.count.to(torch.float64))
