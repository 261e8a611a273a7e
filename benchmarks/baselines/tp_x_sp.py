"""TP x SP on a 2-D mesh (sp, tp), TP innermost: TP with Megatron-style sequence parallelism inside each group of
T ranks (``tp.apply_tp``), zigzag context parallelism with all-gathered K/V across the S groups (``model.enable_cp``).

Each rank sees S_len/S tokens of the zigzag layout (replicated over its TP group at the block inputs, sequence
sharded over it in the residual stream) and 1/T of the heads / MLP columns / vocabulary. Gradients of the
TP-sharded weights are summed over the SP axis after backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel

from .common import (Runner, Setup, all_reduce_grads, autocast_ctx, cross_entropy_sum, make_batch, make_optimizer,
                     n_valid, scalar, wrap_blocks, zigzag_inputs)
from .model import check_tp_shape, enable_cp, materialize, new_model
from .tp import apply_tp


def build(setup: Setup, full_state: dict | None = None) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh

    t, s = setup.tp, setup.sp
    if t * s != setup.world:
        raise ValueError(f"tp_x_sp: T x S = {t} x {s} != world size {setup.world}")
    check_tp_shape(setup.cfg, t)
    if setup.seq_len % (2 * s) or (setup.seq_len // s) % t:
        raise ValueError(f"tp_x_sp: sequence length {setup.seq_len} must be a multiple of 2*S and S*T")
    mesh = init_device_mesh(torch.device(setup.device).type, (s, t), mesh_dim_names=("sp", "tp"))
    sp_group = mesh["sp"].get_group()
    sp_rank = mesh["sp"].get_local_rank()
    model = new_model(setup, full_state)
    apply_tp(model, mesh["tp"], sequence_parallel=True)
    enable_cp(model, sp_group, setup)
    wrap_blocks(model, setup)
    materialize(model, setup, full_state)
    opt = make_optimizer(model.parameters(), setup)
    ids, targets = make_batch(setup)
    denom = n_valid(targets)
    tokens, tgt, pos = zigzag_inputs(setup, ids, targets, s, sp_rank)
    params = list(model.parameters())

    def forward_backward():
        with autocast_ctx(setup):
            logits = model(tokens, pos)
            with loss_parallel():
                loss = cross_entropy_sum(logits, tgt) / denom
        with loss_parallel():
            loss.backward()
        all_reduce_grads(params, sp_group)
        total = scalar(loss.detach()).clone()
        dist.all_reduce(total, group=sp_group)
        return total

    return Runner(model, opt, forward_backward, f"T={t} SP x S={s} zigzag CP")
