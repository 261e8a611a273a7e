"""Context parallelism with a zigzag (causal-balanced) layout and all-gathered K/V (Llama-3 style).

Rank r of a context-parallel group of size D holds global chunks r and 2D-1-r of the sequence (c = S/(2D) tokens
each). Per layer: K/V of the local tokens are all-gathered (forward) and their gradients reduce-scattered
(backward); queries stay local; each local chunk attends to its causal K/V prefix, bottom-right aligned. The
attention kernel is lightning_tsp's kernel for exactly these calls (on H200: the cuDNN split), so SP and TSP
spend the same time per attention FLOP.

Strategies built here: ``sp`` (replicated weights, gradients all-reduced over the group) and ``fsdp_cp``
(FSDP2 ``fully_shard`` over the same axis: torchtitan's long-context recipe).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tsp.zigzag import zigzag_unshard


def _cp_rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _GatherZigzagSeq(torch.autograd.Function):
    """[B, H, L_loc, d] zigzag-local -> [B, H, S, d] in natural order (all-gather); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        _, size = _cp_rank_size(group)
        seq_first = x.permute(2, 0, 1, 3).contiguous()  # [L_loc, B, H, d]
        out = torch.empty((size * seq_first.shape[0],) + seq_first.shape[1:], dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, seq_first, group=group)
        parts = list(out.chunk(size, dim=0))  # rank order, each [chunk r, chunk 2D-1-r]
        return zigzag_unshard(parts, dim=0).permute(1, 2, 0, 3)  # [B, H, S, d]

    @staticmethod
    def backward(ctx, g: Tensor):
        rank, size = _cp_rank_size(ctx.group)
        g = g.permute(2, 0, 1, 3)  # [S, B, H, d] natural order
        chunks = g.chunk(2 * size, dim=0)
        # back to rank order: rank p's block is [chunk p, chunk 2D-1-p]
        stacked = torch.cat([torch.cat([chunks[p], chunks[2 * size - 1 - p]], dim=0) for p in range(size)], dim=0)
        out = torch.empty((stacked.shape[0] // size,) + stacked.shape[1:], dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, stacked.contiguous(), group=ctx.group)
        return out.permute(1, 2, 0, 3), None


def _own_and_prefix(k: Tensor, v: Tensor, g: int, c: int):
    """Natural-order K/V -> ((own chunk g's k, v), (prefix k, v) or (None, None)): the kernels' call form."""
    n = (g + 1) * c
    own = (k[:, :, n - c:n], v[:, :, n - c:n])
    return own, ((k[:, :, :n - c], v[:, :, :n - c]) if g > 0 else (None, None))


class _ZigzagAttention(torch.autograd.Function):
    """Local zigzag queries q [B, H, 2c, d] against the full K/V [B, Hkv, S, d]: chunk g attends keys
    [0, (g+1)c) bottom-right causal. Saves q, k, v and the outputs/log-sum-exps (no S x S scores)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, rank: int, size: int, kernel) -> Tensor:
        c = q.shape[2] // 2
        outs, lses = [], []
        for i, g in enumerate((rank, 2 * size - 1 - rank)):
            own, pre = _own_and_prefix(k, v, g, c)
            o, lse = kernel.forward(q[:, :, i * c:(i + 1) * c], *own, *pre)
            outs.append(o)
            lses.append(lse)
        o = torch.cat(outs, dim=2)
        ctx.kernel, ctx.rank, ctx.size, ctx.has_lse = kernel, rank, size, lses[0] is not None
        ctx.save_for_backward(q, k, v, *outs, *(lses if ctx.has_lse else ()))
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o0, o1, *lses = ctx.saved_tensors
        c = q.shape[2] // 2
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i, (g, o) in enumerate(zip((ctx.rank, 2 * ctx.size - 1 - ctx.rank), (o0, o1))):
            n = (g + 1) * c
            lse = lses[i] if ctx.has_lse else None
            own, pre = _own_and_prefix(k, v, g, c)
            dqi, dko, dvo, dkp, dvp = ctx.kernel.backward(do[:, :, i * c:(i + 1) * c], q[:, :, i * c:(i + 1) * c],
                                                          *own, *pre, o, lse)
            dq[:, :, i * c:(i + 1) * c] = dqi
            dk[:, :, n - c:n] += dko
            dv[:, :, n - c:n] += dvo
            if dkp is not None:
                dk[:, :, :n - c] += dkp
                dv[:, :, :n - c] += dvp
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


def zigzag_cp_attention(q: Tensor, k: Tensor, v: Tensor, group, kernel=None) -> Tensor:
    """q [B, H, 2c, d], k/v [B, Hkv, 2c, d] of this rank's zigzag tokens -> o [B, H, 2c, d]."""
    from lightning_tsp.kernels.attention import select_attention_kernel

    if kernel is None:
        kernel = select_attention_kernel(q.device, "auto", q.dtype)
    rank, size = _cp_rank_size(group)
    k_full = _GatherZigzagSeq.apply(k, group)
    v_full = _GatherZigzagSeq.apply(v, group)
    return _ZigzagAttention.apply(q, k_full, v_full, rank, size, kernel)


def enable_cp(model, group, kernel_name: str = "auto") -> None:
    """Switch every attention layer of ``model`` to zigzag context parallelism over ``group``."""
    from lightning_tsp.kernels.attention import select_attention_kernel

    for block in model.layers.values():
        attn = getattr(block, "attention", None) or block._checkpoint_wrapped_module.attention
        attn.cp_group = group
        if kernel_name != "auto":
            attn.cp_kernel = select_attention_kernel(next(model.parameters()).device, kernel_name)


def build(setup, full_state: dict | None = None):
    """``sp``: replicated weights, zigzag-sharded sequence over all ``setup.world`` ranks, K/V all-gathered,
    gradients all-reduced over the group after backward (what DDP would do)."""
    from .common import (Runner, all_reduce_grads, apply_checkpointing, autocast_ctx, cross_entropy_sum,
                         make_batch, make_optimizer, n_valid, zigzag_inputs)
    from .tp import materialize, new_model

    d = setup.world
    if setup.seq_len % (2 * d):
        raise ValueError(f"sp: sequence length {setup.seq_len} must be a multiple of 2*D={2 * d}")
    group = dist.group.WORLD
    model = new_model(setup, full_state)
    enable_cp(model, group, setup.attention_kernel)
    apply_checkpointing(model, setup.checkpointing)
    materialize(model, setup, full_state)
    opt = make_optimizer(model.parameters(), setup)
    ids, targets = make_batch(setup)
    denom = n_valid(targets)
    tokens, tgt, pos = zigzag_inputs(setup, ids, targets, d, setup.rank)
    params = [p for p in model.parameters()]

    def forward_backward():
        with autocast_ctx(setup):
            loss = cross_entropy_sum(model(tokens, pos), tgt) / denom
        loss.backward()
        all_reduce_grads(params, group)
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    return Runner(model, opt, forward_backward, f"S={d} zigzag, K/V all-gather")
