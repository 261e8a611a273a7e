"""``sp``: context parallelism with a zigzag (causal-balanced) layout and all-gathered K/V (Llama-3 style):
replicated weights, gradients all-reduced over the group. The attention itself is ``model.zigzag_cp_attention``
(rank r of D holds global chunks r and 2D-1-r; K/V all-gathered forward, reduce-scattered backward; lightning_tsp's
kernel for the prefix calls, so SP and TSP spend the same time per attention FLOP).
"""

from __future__ import annotations

import torch.distributed as dist

from .common import (Runner, all_reduce_grads, autocast_ctx, cross_entropy_sum, make_batch, make_optimizer, n_valid,
                     wrap_blocks, zigzag_inputs)
from .model import enable_cp, materialize, new_model


def build(setup, full_state: dict | None = None):
    """``sp``: replicated weights, zigzag-sharded sequence over all ``setup.world`` ranks, K/V all-gathered,
    gradients all-reduced over the group after backward (what DDP would do)."""
    d = setup.world
    if setup.seq_len % (2 * d):
        raise ValueError(f"sp: sequence length {setup.seq_len} must be a multiple of 2*D={2 * d}")
    group = dist.group.WORLD
    model = new_model(setup, full_state)
    enable_cp(model, group, setup)
    wrap_blocks(model, setup)
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
