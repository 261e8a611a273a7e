"""FSDP2 (``fully_shard``) with and without context parallelism.

fsdp_cp: FSDP2 over the context-parallel axis, torchtitan's long-context recipe on one node. Every rank holds 1/D
         of every parameter, gradient and AdamW state; each transformer block is gathered just in time (forward and
         backward, resharded after forward) and its gradients reduce-scattered; the sequence is zigzag-sharded over
         the same D ranks with K/V all-gathered per layer (``model.enable_cp``).
fsdp:    plain FSDP2 data parallelism: the same sharding of the weights, but every rank runs whole sequences of its
         own micro-batch (rank r holds rows [r*B, (r+1)*B) of the global batch of D*B sequences); no TP, no CP.

Precision: FSDP2's MixedPrecisionPolicy (bf16 parameters for compute, fp32 master weights and gradient reduction;
the residual stream is then bf16), as torchtitan runs it; ``fsdp_precision='autocast'`` uses bf16 autocast instead.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from .common import (Runner, Setup, autocast_ctx, cross_entropy_sum, make_batch, make_optimizer, n_valid, wrap_blocks,
                     zigzag_inputs)
from .model import enable_cp, materialize, new_model


def _fully_shard():
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import MixedPrecisionPolicy, fully_shard
    return fully_shard, MixedPrecisionPolicy


def build(setup: Setup, full_state: dict | None = None) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh

    d, cp = setup.world, setup.strategy == "fsdp_cp"
    if cp and setup.seq_len % (2 * d):
        raise ValueError(f"fsdp_cp: sequence length {setup.seq_len} must be a multiple of 2*D={2 * d}")
    fully_shard, MixedPrecisionPolicy = _fully_shard()
    mesh = init_device_mesh(torch.device(setup.device).type, (d,),
                            mesh_dim_names=("dp_shard_cp" if cp else "dp_shard",))
    group = mesh.get_group()
    policy = setup.fsdp_precision == "policy" and setup.autocast
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if policy \
        else MixedPrecisionPolicy()
    model = new_model(setup, full_state)
    if cp:
        enable_cp(model, group, setup)
    wrap_blocks(model, setup)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    materialize(model, setup, full_state)
    opt = make_optimizer(model.parameters(), setup)
    if cp:
        ids, targets = make_batch(setup)
        tokens, tgt, pos = zigzag_inputs(setup, ids, targets, d, setup.rank)
    else:  # the global batch of D micro-batches; this rank's rows
        ids, targets = make_batch(replace(setup, micro_batch=d * setup.micro_batch))
        rows = slice(setup.rank * setup.micro_batch, (setup.rank + 1) * setup.micro_batch)
        tokens, tgt, pos = zigzag_inputs(setup, ids[rows], targets[rows], 1, 0)
    denom = n_valid(targets)
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
    if cp:
        return Runner(model, opt, forward_backward, f"FSDP={d} x CP={d} zigzag ({precision})")
    return Runner(model, opt, forward_backward, f"FSDP={d}, {setup.micro_batch} x S per rank ({precision})")
