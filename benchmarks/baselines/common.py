"""What every strategy shares: the run settings, the batch, activation checkpointing, the optimizer and the
training step (bf16 autocast over fp32 master weights, AdamW, optimizer states primed before measuring)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.zigzag import IGNORE_INDEX, shift_labels, zigzag_positions, zigzag_shard


# strategies whose compiled blocks are one graph each (fullgraph=True); the context-parallel ones break the graph at
# the zigzag attention (an autograd.Function around the K/V all-gather and the lightning_tsp kernel)
FULLGRAPH = ("tp", "tp_sp", "fsdp")


@dataclass
class Setup:
    cfg: object  # lightning_tsp.models.llama.ModelConfig
    strategy: str
    world: int  # ranks of the (fake) group: D, or T * S for tp_x_sp
    rank: int
    seq_len: int
    micro_batch: int = 1
    tp: int = 1  # tp_x_sp: T
    sp: int = 1  # tp_x_sp: S
    checkpointing: str = "full"
    device: str = "cuda"
    autocast: bool = True  # bf16 autocast over fp32 weights (bf16-mixed)
    param_dtype: str = "float32"  # the weights' dtype: bfloat16 with autocast False is bf16-true (TSP only)
    optimizer: str = "fused"  # fused (torchtitan's default; for-loop on CPU) | foreach (torch's CUDA default) | forloop
    norm: str = "torch"  # RMSNorm: torch (nn.RMSNorm) | manual
    sdpa_backend: str = "auto"  # square causal SDPA (TP, TP-SP, FSDP): auto | cudnn | flash | math | default
    attention_kernel: str = "auto"  # zigzag calls (SP, TPxSP, FSDP+CP, TSP): lightning_tsp kernel name
    fsdp_precision: str = "policy"  # fsdp_cp: FSDP2 MixedPrecisionPolicy(bf16, fp32) | autocast
    kv_bucket_heads: int | None = None  # tsp: KV heads gathered at once (head bucketing)
    shard_group: int | str = "auto"  # tsp: owners per broadcast-schedule step
    cuda_graphs: bool | str = False  # tsp: CUDA-graphed layers (TSPLlama(cuda_graphs=...))
    tsp_params: str = "dtensor"  # tsp: DTensor parameters on a "tsp" mesh (as the strategies) | plain
    compile: bool = False  # rivals: each transformer block under torch.compile (apply_compile)
    compile_backend: str = "inductor"  # torch.compile backend (aot_eager: tests on CPU)
    compile_scope: str = "checkpointed-block"  # what torch.compile wraps: see wrap_blocks
    seed: int = 0


@dataclass
class Runner:
    """A built strategy: ``forward_backward()`` runs forward + loss + backward (+ gradient sync) and returns
    the (global) loss; ``optimizer`` steps afterwards."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    forward_backward: Callable[[], Tensor]
    layout: str
    notes: list[str] = field(default_factory=list)

    def step(self) -> Tensor:
        """One training step: forward + loss + backward, optimizer step, gradients released; returns the loss."""
        loss = self.forward_backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss


def make_batch(setup: Setup) -> tuple[Tensor, Tensor]:
    """The global batch [B, S]: random token ids and next-token targets (last position ignored)."""
    g = torch.Generator().manual_seed(setup.seed + 1)
    ids = torch.randint(0, setup.cfg.vocab_size, (setup.micro_batch, setup.seq_len), generator=g)
    return ids, shift_labels(ids)


def zigzag_inputs(setup: Setup, ids: Tensor, targets: Tensor, size: int, rank: int):
    """(tokens, targets, positions) of context-parallel rank ``rank`` of ``size`` (zigzag layout)."""
    dev = setup.device
    if size == 1:
        return ids.to(dev), targets.to(dev), torch.arange(ids.shape[1], device=dev)
    return (zigzag_shard(ids, size, rank).to(dev), zigzag_shard(targets, size, rank).to(dev),
            zigzag_positions(ids.shape[1], size, rank, device=dev))


def n_valid(targets: Tensor) -> int:
    return int((targets != IGNORE_INDEX).sum())


def apply_checkpointing(model: nn.Module, mode: str) -> None:
    """Full activation checkpointing per transformer block (torchtitan's ``full`` AC: non-reentrant wrapper)."""
    if mode == "none":
        return
    if mode != "full":
        raise ValueError(f"checkpointing {mode!r}: use none or full")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    for name, block in list(model.layers.named_children()):
        model.layers[name] = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                                preserve_rng_state=False)


def wrap_blocks(model: nn.Module, setup: Setup) -> None:
    """Activation checkpointing and per-block compile (after TP / CP, before FSDP), in the order
    ``setup.compile_scope`` names: ``checkpointed-block`` (torchtitan's: ``torch.compile(checkpoint_wrapper(block))``,
    the recomputation inside the compiled graph) or ``block`` (``checkpoint_wrapper(torch.compile(block))``, the
    compiled forward re-run by the checkpoint)."""
    if setup.compile_scope == "block":
        apply_compile(model, setup)
        apply_checkpointing(model, setup.checkpointing)
    elif setup.compile_scope == "checkpointed-block":
        apply_checkpointing(model, setup.checkpointing)
        apply_compile(model, setup)
    else:
        raise ValueError(f"compile_scope {setup.compile_scope!r}: use checkpointed-block or block")


def apply_compile(model: nn.Module, setup: Setup) -> None:
    """torchtitan's per-block compile (``--compile``): each transformer block is replaced in ``model.layers`` by
    ``torch.compile(block)``: default mode, ``fullgraph=True`` (one graph per block, torchtitan's default) except for
    the context-parallel strategies, whose zigzag attention (K/V all-gather + lightning_tsp kernel) stays eager
    between two graphs."""
    if not setup.compile:
        return
    fullgraph = setup.strategy in FULLGRAPH
    for name, block in list(model.layers.named_children()):
        model.layers[name] = torch.compile(block, backend=setup.compile_backend, fullgraph=fullgraph)


def make_optimizer(params, setup: Setup) -> torch.optim.Optimizer:
    """AdamW with fp32 states. DTensor and plain parameters go to separate groups (one fused/foreach call per
    group: a call may not mix the two)."""
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.requires_grad]
    dt = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    groups = [{"params": g} for g in (dt, plain) if g]
    kw = {}
    if setup.optimizer == "fused" and setup.device != "cpu":
        kw["fused"] = True
    elif setup.optimizer == "foreach":
        kw["foreach"] = True
    else:
        kw["foreach"] = False
    return torch.optim.AdamW(groups, lr=1e-5, weight_decay=0.0, **kw)


@torch.no_grad()
def prime_optimizer(runner: Runner) -> None:
    """Allocate the AdamW states (zero gradients, one step) so that the first measured step already holds them."""
    for group in runner.optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.zeros_like(p)
    runner.optimizer.step()
    runner.optimizer.zero_grad(set_to_none=True)


def autocast_ctx(setup: Setup):
    if not setup.autocast:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(setup.device).type, dtype=torch.bfloat16)


def cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Sum of token losses, logits upcast to fp32 first (as torchtitan's loss does)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def all_reduce_grads(params, group) -> None:
    """Sum gradients over ``group`` (replicated weights across a context-parallel group)."""
    from torch.distributed.tensor import DTensor

    if dist.get_world_size(group) == 1:
        return
    for p in params:
        if p.grad is not None:
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=group)


def scalar(loss: Tensor) -> Tensor:
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss
