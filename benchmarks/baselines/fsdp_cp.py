"""FSDP2 (``fully_shard``) over the context-parallel axis: torchtitan's long-context recipe on one node.

Every rank holds 1/D of every parameter, gradient and AdamW state; each transformer block is gathered just in
time (forward and backward, resharded after forward) and its gradients reduce-scattered; the sequence is
zigzag-sharded over the same D ranks with K/V all-gathered per layer (``model.enable_cp``). Precision: FSDP2's
MixedPrecisionPolicy (bf16 parameters for compute, fp32 master weights and gradient reduction; the residual
stream is then bf16), as torchtitan runs it; ``fsdp_precision='autocast'`` uses bf16 autocast instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import (Runner, Setup, apply_checkpointing, autocast_ctx, cross_entropy_sum, make_batch,
                     make_optimizer, n_valid, zigzag_inputs)
from .model import enable_cp, materialize, new_model


def _fully_shard():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def build(setup: Setup, full_state: dict | None = None) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh

    d = setup.world
    if setup.seq_len % (2 * d):
        raise ValueError(f"fsdp_cp: sequence length {setup.seq_len} must be a multiple of 2*D={2 * d}")
    fully_shard, MixedPrecisionPolicy = _fully_shard()
    mesh = init_device_mesh(torch.device(setup.device).type, (d,), mesh_dim_names=("dp_shard_cp",))
    group = mesh.get_group()
    policy = setup.fsdp_precision == "policy" and setup.autocast
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy \
        else MixedPrecisionPolicy()
    model = new_model(setup, full_state)
    enable_cp(model, group, setup.attention_kernel)
    apply_checkpointing(model, setup.checkpointing)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    materialize(model, setup, full_state)
    opt = make_optimizer(model.parameters(), setup)
    ids, targets = make_batch(setup)
    denom = n_valid(targets)
    tokens, tgt, pos = zigzag_inputs(setup, ids, targets, d, setup.rank)
    use_autocast = setup.autocast and not policy

    def forward_backward():
        if use_autocast:
            with autocast_ctx(setup):
                loss = cross_entropy_sum(model(tokens, pos), tgt) / denom
        else:
            loss = cross_entropy_sum(model(tokens, pos), tgt) / denom
        # each rank's loss is its share of the global token sum, so the gradient is the SUM over the group;
        # FSDP averages: scale by D (exact; a divide factor of 1 would need PREMUL_SUM, which gloo lacks)
        (loss * d).backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        return total

    precision = "FSDP2 MP bf16/fp32" if policy else "bf16 autocast"
    return Runner(model, opt, forward_backward, f"FSDP={d} x CP={d} zigzag ({precision})")
