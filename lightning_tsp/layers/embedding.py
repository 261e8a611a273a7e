"""Vocab-sharded token embedding run as a ring: each vocab shard visits every rank's local tokens.

Rank j owns rows [j*V/D, (j+1)*V/D). Forward moves weight shards (D-1 hops); backward moves only the fp32
gradient accumulator (the lookup's gradient needs no weights).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.schedules.comm import local_tensor
from lightning_tsp.schedules.ring import RingGradPass, ring_shards


def split_ids(ids: Tensor, n: int) -> tuple[Tensor, Tensor]:
    """(vocab shard, row inside it) of every id for shards of ``n`` rows, once per ring (each hop then needs one
    comparison, ``shard == s``), without a host sync. An id no shard holds (``IGNORE_INDEX``, negative) gets a
    shard no rank has and a valid row."""
    shard = torch.div(ids, n, rounding_mode="floor")
    return shard, ids - shard * n


class RingEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight, tsp: TSPGroup, dtype: torch.dtype):
        v_loc, h = weight.shape
        out = torch.zeros(*ids.shape, h, dtype=dtype, device=weight.device)
        shard, rows = split_ids(ids, v_loc)
        for s, w in ring_shards(tsp, weight.to(dtype)):
            out += torch.where((shard == s).unsqueeze(-1), w[rows], 0)
        ctx.tsp = tsp
        ctx.save_for_backward(ids, weight)
        return out

    @staticmethod
    def backward(ctx, dout):
        ids, weight = ctx.saved_tensors
        v_loc, h = weight.shape
        acc_dtype = torch.promote_types(weight.dtype, torch.float32)
        flat_ids, dflat = ids.reshape(-1), dout.reshape(-1, h).to(acc_dtype)
        ring = RingGradPass(ctx.tsp, None, weight.numel(), weight.device, acc_dtype, in_place=True)
        shard, rows = split_ids(flat_ids, v_loc)
        for s, _, take in ring:
            src = dflat * (shard == s).unsqueeze(-1)
            acc, fresh = take()  # the left neighbour's sum for shard s: this rank's rows are added into it
            if fresh:
                acc.zero_()
            acc.view(v_loc, h).index_add_(0, rows, src)
        return None, ring.grad.view(v_loc, h).to(weight.dtype), None, None


class TSPEmbedding(nn.Module):
    tsp_shard_dims = {"weight": 0}

    def __init__(self, vocab_size: int, hidden_size: int, tsp: TSPGroup, device=None, dtype=None):
        super().__init__()
        self.tsp = tsp
        self.weight = nn.Parameter(torch.empty(vocab_size // tsp.size, hidden_size, device=device, dtype=dtype))

    def forward(self, ids: Tensor) -> Tensor:
        """ids [B, S/D] -> embeddings [B, S/D, h] in the weight dtype (like nn.Embedding under autocast)."""
        w = local_tensor(self.weight)
        return RingEmbedding.apply(ids, w, self.tsp, w.dtype)
