"""Tensor parallelism with DTensor plans (``tp``), and with Megatron-style sequence parallelism (``tp_sp``).

tp:    embedding row-parallel over the vocabulary (output all-reduced), Q/K/V and SwiGLU gate/up column-parallel,
       O and down row-parallel (output all-reduced), norms and the residual stream replicated, LM head
       column-parallel with vocab-parallel cross-entropy.
tp_sp: the same projections, but norms and the residual stream sharded over the sequence: the embedding output is
       reduce-scattered, each block all-gathers its normed input before attention / MLP and reduce-scatters their
       outputs; the LM head all-gathers the final-norm output (torchtitan's TP plan).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from .common import (Runner, Setup, autocast_ctx, cross_entropy_sum, make_batch, make_optimizer, n_valid, scalar,
                     wrap_blocks)
from .model import Transformer, check_tp_shape, materialize, new_model


def apply_tp(model: Transformer, tp_mesh, sequence_parallel: bool) -> None:
    """Parallelize ``model`` in place over the 1-D ``tp_mesh``."""
    if sequence_parallel:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        }
    else:
        top = {
            "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "output": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
        }
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
        }
        if sequence_parallel:
            plan.update({
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                desired_input_layouts=(Replicate(), None, None),
                                                use_local_output=True),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                                   use_local_output=True),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            })
        else:
            plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        parallelize_module(block, tp_mesh, plan)


def build(setup: Setup, full_state: dict | None = None) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh

    t = setup.world
    check_tp_shape(setup.cfg, t)
    sp = setup.strategy == "tp_sp"
    if sp and setup.seq_len % t:
        raise ValueError(f"tp_sp: sequence length {setup.seq_len} must be a multiple of T={t}")
    mesh = init_device_mesh(torch.device(setup.device).type, (t,), mesh_dim_names=("tp",))
    model = new_model(setup, full_state)
    apply_tp(model, mesh, sequence_parallel=sp)
    return tp_runner(model, setup, full_state, f"T={t}" + (" SP" if sp else ""))


def tp_runner(model: Transformer, setup: Setup, full_state: dict | None, layout: str) -> Runner:
    """A TP-parallelised model's training step: checkpointing and compile, materialised weights, optimizer, batch,
    vocab-parallel loss (also used by benchmarks.moe's TP-SP + expert-parallel rival)."""
    wrap_blocks(model, setup)
    materialize(model, setup, full_state)
    opt = make_optimizer(model.parameters(), setup)
    ids, targets = make_batch(setup)
    ids, targets = ids.to(setup.device), targets.to(setup.device)
    positions = torch.arange(setup.seq_len, device=setup.device)
    denom = n_valid(targets)

    def forward_backward():
        with autocast_ctx(setup):
            logits = model(ids, positions)
            with loss_parallel():
                loss = cross_entropy_sum(logits, targets) / denom
        with loss_parallel():
            loss.backward()
        return scalar(loss.detach())

    return Runner(model, opt, forward_backward, layout)
