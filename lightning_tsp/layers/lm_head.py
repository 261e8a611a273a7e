"""Vocab-sharded LM head fused with cross-entropy: a ring over vocab shards with an online log-sum-exp.

Each rank scores its local tokens against one vocab shard at a time (and a chunk of tokens at a time), keeping
only a running max / sum-exp / target logit per token: the [tokens, V] logits never exist. Backward runs the
ring again, recomputes each [chunk, V/D] logit block, and the fp32 weight-gradient accumulator travels with the
shard to its owner.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.layers.embedding import split_ids
from lightning_tsp.schedules.comm import local_tensor
from lightning_tsp.kernels.gemm import add_matmul_, matmul_into
from lightning_tsp.schedules.ring import RingGradPass, ring_shards
from lightning_tsp.zigzag import IGNORE_INDEX


class RingCrossEntropy(torch.autograd.Function):
    """Per-token loss [B, L] in fp32 (0 where the target is ``IGNORE_INDEX``) of hidden x [B, L, h] against targets."""

    @staticmethod
    def forward(ctx, x_in, weight, targets, tsp: TSPGroup, token_chunk: int, dtype: torch.dtype):
        """``x_in`` in the residual stream's dtype, cast to the compute ``dtype`` here: its gradient goes back in
        the residual stream's dtype straight from the fp32 accumulator (no round trip through ``dtype``)."""
        x = x_in.to(dtype)
        ctx.in_dtype = x_in.dtype
        b, l, h = x.shape
        v_loc = weight.shape[0]
        x2, t = x.reshape(b * l, h), targets.reshape(-1)
        acc = torch.promote_types(x.dtype, torch.float32)
        run_max = torch.full((b * l,), float("-inf"), dtype=acc, device=x.device)
        run_sum = torch.zeros(b * l, dtype=acc, device=x.device)
        target_logit = torch.zeros(b * l, dtype=acc, device=x.device)
        shard, cols = split_ids(t, v_loc)
        for s, w in ring_shards(tsp, weight.to(x.dtype)):
            mask = shard == s
            for c in range(0, b * l, token_chunk):
                rows = slice(c, c + token_chunk)
                logits = (x2[rows] @ w.T).to(acc)  # [n, V/D]
                new_max = torch.maximum(run_max[rows], logits.max(-1).values)
                run_sum[rows] = run_sum[rows] * torch.exp(run_max[rows] - new_max) + torch.exp(
                    logits - new_max[:, None]
                ).sum(-1)
                run_max[rows] = new_max
                picked = logits.gather(1, cols[rows, None]).squeeze(1)
                target_logit[rows] += torch.where(mask[rows], picked, 0)
        lse = run_max + torch.log(run_sum)
        valid = t != IGNORE_INDEX
        loss = torch.where(valid, lse - target_logit, 0)
        ctx.tsp, ctx.token_chunk = tsp, token_chunk
        ctx.save_for_backward(x, weight, targets, lse)
        return loss.view(b, l)  # fp32 (fp64 stays fp64): per-token losses are not rounded to the compute dtype

    @staticmethod
    def backward(ctx, dloss):
        x, weight, targets, lse = ctx.saved_tensors
        tsp, token_chunk = ctx.tsp, ctx.token_chunk
        b, l, h = x.shape
        v_loc = weight.shape[0]
        x2, t = x.reshape(b * l, h), targets.reshape(-1)
        acc_dtype = lse.dtype
        g = torch.where(t != IGNORE_INDEX, dloss.reshape(-1).to(acc_dtype), 0)
        dx = torch.zeros(b * l, h, dtype=acc_dtype, device=x.device)
        ring = RingGradPass(tsp, weight.to(x.dtype), weight.numel(), x.device, acc_dtype, in_place=True)
        shard, cols = split_ids(t, v_loc)
        for s, w, take in ring:
            mask = shard == s
            acc = None
            for c in range(0, b * l, token_chunk):
                rows = slice(c, c + token_chunk)
                p = torch.exp((x2[rows] @ w.T).to(acc_dtype) - lse[rows, None])  # softmax block [n, V/D]
                p.scatter_add_(1, cols[rows, None], -mask[rows, None].to(acc_dtype))  # minus one-hot
                dlogits = (p * g[rows, None]).to(x.dtype)
                add_matmul_(dx[rows], dlogits, w)  # fp32 epilogue on CUDA
                write = acc is None
                if write:  # the left neighbour's sum for shard s arrives while the first block computes
                    acc, fresh = take()
                    acc, write = acc.view(v_loc, h), fresh
                # fp32 epilogue on CUDA; a fresh accumulator is written whole by the first block's GEMM
                (matmul_into if write else add_matmul_)(acc, dlogits.T, x2[rows])
        return dx.view(b, l, h).to(ctx.in_dtype), ring.grad.view(v_loc, h).to(weight.dtype), None, None, None, None


class TSPLMHead(nn.Module):
    """LM head + loss over this rank's vocab shard [V/D, h]. With ``tied=True`` it owns no weight: the caller
    passes the embedding's shard to ``forward``."""

    tsp_shard_dims = {"weight": 0}

    def __init__(self, vocab_size: int, hidden_size: int, tsp: TSPGroup, token_chunk: int = 4096,
                 tied: bool = False, device=None, dtype=None):
        super().__init__()
        self.tsp, self.token_chunk = tsp, token_chunk
        self.weight = None if tied else nn.Parameter(
            torch.empty(vocab_size // tsp.size, hidden_size, device=device, dtype=dtype)
        )

    def forward(self, x: Tensor, targets: Tensor, weight: Tensor | None = None) -> Tensor:
        """Per-token loss [B, S/D] for hidden states x [B, S/D, h] and already-shifted targets [B, S/D]."""
        weight = local_tensor(self.weight if weight is None else weight)
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            return RingCrossEntropy.apply(x, weight, targets, self.tsp, self.token_chunk, dtype)
