"""Sharding a model, a batch and the gradients over a TSP group: ONE implementation for both strategies.

Used by :class:`~lightning_tsp.strategy.TSPStrategy` (``Trainer(strategy="tsp")``) and
:class:`~lightning_tsp.fabric.TSPFabricStrategy` (``Fabric(strategy="tsp")``); neither has its own copy.

* :func:`shard_tsp_modules`: every unsharded :class:`~lightning_tsp.models.TSPLlama` (``tsp=None``, possibly on the
  meta device) of a module is replaced by one holding only this rank's shards;
* :func:`distribute_parameters`: their parameters become DTensors on the "tsp" sub-mesh (``Shard(dim)`` /
  ``Replicate()``), so optimizers and ``torch.distributed.checkpoint`` see the real sharding;
* :func:`shard_global_batch` / :func:`token_normaliser`: a global batch -> this rank's zigzag slice as the keyword
  arguments of ``TSPLlama.forward``, and ``N / dp`` (the global count of valid targets per replica);
* :func:`grad_norm` / :func:`clip_grad_norm`: the exact global gradient norm, each parameter counted once
  (replicated KV heads too);
* :class:`GradientAverager`: the bucketed fp32 data-parallel gradient average, overlapping backward.

Every collective takes its process group explicitly.
"""

from __future__ import annotations

import functools
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.convert import replace_module
from lightning_tsp.group import TSPGroup
from lightning_tsp.models import named_tsp_models
from lightning_tsp.models.llama import TSPLlama
from lightning_tsp.schedules.comm import local_tensor
from lightning_tsp.zigzag import IGNORE_INDEX, shard_batch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


# ---- the model -------------------------------------------------------------------------------------------------


def shard_tsp_modules(root: nn.Module, tsp: TSPGroup, device: torch.device, owner: str = "TSPStrategy"
                      ) -> list[tuple[str, TSPLlama]]:
    """Replace every unsharded TSPLlama of ``root`` by this rank's shard of it; return ``(name, sharded)`` pairs.

    A TSPLlama already built for this TSP group is kept; one built for another group size is an error, and so are
    trainable parameters outside any TSPLlama (their tokens are sharded, their gradients would be partial). ``root``
    itself may be a TSPLlama: the returned module then replaces it (name ``""``).
    """
    found: list[tuple[str, TSPLlama]] = []
    for name, module in named_tsp_models(root):
        if module.tsp.size == tsp.size:
            if tsp.size > 1 and dist.get_process_group_ranks(module.tsp.group) != dist.get_process_group_ranks(
                tsp.group
            ):
                raise TSPConfigError(
                    f"module {name!r} is sharded over ranks {dist.get_process_group_ranks(module.tsp.group)}, "
                    f"not over this rank's TSP group {dist.get_process_group_ranks(tsp.group)}. Build it with "
                    f"tsp=None and let {owner} shard it."
                )
            sharded = module
        elif module.tsp.size == 1:
            sharded = shard_module(module, tsp, device)
            replace_module(root, module, sharded)
        else:
            raise TSPConfigError(
                f"module {name!r} was built for a TSP group of {module.tsp.size} ranks but the strategy has "
                f"tsp_size={tsp.size}. Build it with tsp=None (D=1, e.g. on the meta device) and let {owner} "
                f"shard it."
            )
        found.append((name, sharded))
    if not found:
        raise TSPConfigError(
            f"{owner} found no lightning_tsp.models.TSPLlama in the {type(root).__name__}. Build the model as a "
            f"TSPLlama with tsp=None (on the meta device for large models, or a Hugging Face model that "
            f"lightning_tsp.convert converts); the strategy then shards it over the TSP group."
        )
    if not (len(found) == 1 and found[0][0] == ""):
        covered = {id(p) for _, m in found for p in m.parameters()}
        stray = [n for n, p in root.named_parameters() if p.requires_grad and id(p) not in covered]
        if stray:
            raise TSPConfigError(
                f"trainable parameters outside a TSPLlama are not supported yet by {owner}: {stray[:5]}"
                f"{' ...' if len(stray) > 5 else ''}. Their tokens are sharded over the TSP group, so their "
                f"gradients would be partial. Freeze them (requires_grad=False) or move them into the model."
            )
    return found


def shard_module(full: TSPLlama, tsp: TSPGroup, device: torch.device) -> TSPLlama:
    """This rank's shard of the unsharded ``full``: ``init_weights`` when ``full`` is on the meta device (the same
    weights as a full initialisation whatever D), else a copy of its slices."""
    params = dict(full.named_parameters())
    on_meta = {n for n, p in params.items() if p.is_meta}
    if on_meta and len(on_meta) != len(params):
        raise TSPConfigError(
            f"TSPLlama is partly on the meta device ({sorted(on_meta)[:3]} ...): build it entirely on meta "
            f"(the strategy then calls init_weights) or entirely materialised (the strategy copies the slices)"
        )
    dtype = next(iter(params.values())).dtype if params else None
    sharded = type(full)(  # the same class: conversion plans subclass TSPLlama
        full.cfg,
        tsp,
        attention_kernel=full.attention_kernel,
        activation_checkpointing=full.activation_checkpointing,
        token_chunk=full.token_chunk,
        kv_bucket_heads=full.kv_bucket_heads,
        shard_group=full.shard_group,
        cuda_graphs=full.cuda_graphs,
        device="meta",
        dtype=dtype,
    )
    sharded.to_empty(device=device)
    if on_meta:
        sharded.init_weights()
    else:
        sharded.load_full_state_dict({n: p.detach() for n, p in params.items()})
    for name, p in sharded.named_parameters():
        p.requires_grad_(params[name].requires_grad)
    sharded.train(full.training)
    if getattr(full, "hf_config", None) is not None and getattr(sharded, "hf_config", None) is None:
        sharded.hf_config = full.hf_config  # consolidation writes it as config.json
    return sharded


def distribute_parameters(module: TSPLlama, tsp_mesh: "DeviceMesh") -> dict[nn.Parameter, int]:
    """Register every parameter of ``module`` as a DTensor on the 1-D ``tsp_mesh``: ``Shard(dim)`` or
    ``Replicate()``. Returns the parameters holding one copy of a replicated KV head -> their number of copies."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    replicas: dict[nn.Parameter, int] = {}
    for name, dim in module.shard_dims().items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        param = getattr(owner, attr)
        placements = [Shard(dim) if dim is not None else Replicate()]
        if isinstance(param, DTensor):
            if tuple(param.placements) != tuple(placements):
                raise TSPConfigError(f"parameter {name!r} is a DTensor with placements {param.placements}, "
                                     f"TSP needs {placements}")
            new = param
        else:
            new = nn.Parameter(DTensor.from_local(param.detach(), tsp_mesh, placements, run_check=False),
                               requires_grad=param.requires_grad)
            setattr(owner, attr, new)
        if module.replicas(name) > 1:  # a replicated KV head: its DTensor holds one copy per rank
            replicas[new] = module.replicas(name)
    return replicas


# ---- the batch -------------------------------------------------------------------------------------------------


def aux_loss_coef(cfg) -> float:
    """The load-balancing loss coefficient a model config trains with (0 without experts)."""
    return float(cfg.router_aux_loss_coef) if cfg.num_experts else 0.0


def models_aux_loss_coef(found: list) -> float:
    """The largest load-balancing coefficient of the ``(name, TSPLlama)`` models a strategy sharded."""
    return max((aux_loss_coef(m.cfg) for _, m in found), default=0.0)


def refuse_padding_with_aux_loss(mask: Tensor, aux_loss_coef: float) -> None:
    """A TSPConfigError when a right-padding ``mask`` [B, S] (bool) pads a model with a load-balancing loss: TSP's
    router statistics count every token, Hugging Face's leave padding out, so the two would differ silently."""
    if aux_loss_coef and not bool(mask.all()):
        raise TSPConfigError(
            f"attention_mask with padding and router_aux_loss_coef={aux_loss_coef}: the TSP load-balancing loss "
            "counts every token (Hugging Face leaves padding out). Pack documents into full sequences "
            "(position_ids) or use equal-length sequences, or set router_aux_loss_coef=0."
        )


def shard_global_batch(batch: Any, tsp: TSPGroup, aux_loss_coef: float = 0.0) -> dict[str, Tensor]:
    """Global batch -> this rank's ``{"input_ids", "targets", "position_ids"}`` (zigzag, targets shifted).

    ``batch`` is a mapping with ``input_ids`` [B, S] and optionally ``labels`` [B, S] (Hugging Face convention:
    unshifted, -100 = no loss; default: ``input_ids``), ``attention_mask`` [B, S] (right padding only; masked
    positions get no loss) and ``position_ids`` [B, S] (packed documents, Hugging Face's convention: 0, 1, 2,
    ... inside each document, 0 starts a document). With ``position_ids`` the targets are shifted per document
    and the returned ``position_ids`` are their zigzag slice [B, S/D] (otherwise the global positions [S/D]).
    ``aux_loss_coef``: the model's MoE load-balancing coefficient (padding is refused where it is not 0, see
    :func:`refuse_padding_with_aux_loss`). No collective.
    """
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TSPConfigError(
            f"TSP expects every batch to be a dict with 'input_ids' [B, S] and optionally 'labels', "
            f"'attention_mask' and 'position_ids' [B, S]; got {type(batch).__name__}"
            + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
        )
    unknown = sorted(set(batch) - set(BATCH_KEYS))
    if unknown:
        raise TSPConfigError(f"batch keys {unknown} are not supported by TSP; a batch holds only {list(BATCH_KEYS)}")
    input_ids = batch["input_ids"]
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        raise TSPConfigError(
            f"batch['input_ids'] must be an integer tensor [B, S], got "
            f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
        )
    labels = batch.get("labels")
    if labels is not None and (not isinstance(labels, Tensor) or labels.shape != input_ids.shape):
        raise TSPConfigError(
            f"batch['labels'] must be a tensor shaped like input_ids {tuple(input_ids.shape)}, got "
            f"{getattr(labels, 'shape', type(labels).__name__)}"
        )
    mask = batch.get("attention_mask")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.shape != input_ids.shape:
            raise TSPConfigError(f"batch['attention_mask'] must be shaped like input_ids {tuple(input_ids.shape)}")
        mask = mask.bool()
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            raise TSPConfigError(
                "batch['attention_mask'] has padding before real tokens (left padding or holes); TSP supports right "
                "padding only (padded positions then never influence real tokens)"
            )
        refuse_padding_with_aux_loss(mask, aux_loss_coef)
        labels = (input_ids if labels is None else labels).masked_fill(~mask, IGNORE_INDEX)
    position_ids = batch.get("position_ids")
    if position_ids is not None and (not isinstance(position_ids, Tensor) or position_ids.shape != input_ids.shape
                                     or position_ids.is_floating_point() or position_ids.dtype == torch.bool):
        raise TSPConfigError(
            f"batch['position_ids'] must be an integer tensor shaped like input_ids {tuple(input_ids.shape)} "
            f"(packed documents: positions restarting at 0 at each document), got "
            f"{getattr(position_ids, 'dtype', type(position_ids).__name__)} "
            f"{tuple(getattr(position_ids, 'shape', ()))}"
        )
    ids, targets, positions = shard_batch(input_ids, labels, tsp.size, tsp.rank, position_ids=position_ids)
    return {"input_ids": ids, "targets": targets, "position_ids": positions}


def token_normaliser(targets: Tensor, data_parallel_size: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """``N / dp``: N = valid targets of the global batch, summed over ``group`` (every TSP rank and every replica:
    the world) with one all-reduce; ``group=None``: no collective (one process)."""
    count = (targets != IGNORE_INDEX).sum(dtype=torch.float64)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(count, group=group)
    return count / data_parallel_size


# ---- gradients -------------------------------------------------------------------------------------------------


def optimizer_params(optimizer: Any) -> list[Tensor]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer / _FabricOptimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)
    return [p for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def grad_norm(parameters: Iterable[Tensor], tsp: TSPGroup, replicas: Mapping[Tensor, int],
              device: Optional[torch.device] = None) -> Tensor:
    """Global 2-norm of the gradients of ``parameters``, each parameter counted once whatever its placement.

    ``Shard`` gradients: every TSP rank adds the squares of its shard, except that of a KV head replicated on
    ``replicas[p]`` ranks only one copy counts; ``Replicate`` gradients (norms): only TSP rank 0 adds them. One
    all-reduce (sum) over the TSP group, accumulated in fp32 (fp64 for fp64 gradients). Data-parallel replicas hold
    identical averaged gradients, so nothing is summed over dp.

    (``torch.nn.utils.clip_grad_norm_`` over these DTensor gradients gives the same norm only without replicated KV
    heads: it counts each replicated copy, D / n_kv times; ``tests/test_fabric.py`` checks both.)
    """
    from torch.distributed.tensor import DTensor, Replicate, Shard

    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    acc_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    if grads:
        device = local_tensor(grads[0]).device
    total = torch.zeros((), dtype=acc_dtype, device=device)
    for p, g in zip(params, grads):
        if isinstance(g, DTensor):
            placements = tuple(g.placements)
            if g.device_mesh.ndim != 1 or not all(isinstance(pl, (Shard, Replicate)) for pl in placements):
                raise TSPConfigError(
                    f"gradient clipping: a gradient with placements {placements} on mesh {g.device_mesh} is not "
                    f"a TSP gradient (Shard/Replicate on the 'tsp' sub-mesh)"
                )
            if isinstance(placements[0], Replicate) and tsp.rank != 0:
                continue
            if tsp.rank % replicas.get(p, 1) != 0:  # count one copy of a replicated KV head
                continue
            g = g.to_local()
        elif tsp.size > 1:
            raise TSPConfigError(
                f"gradient clipping: a plain (non-DTensor) gradient of shape {tuple(g.shape)}; the TSP strategies "
                f"only train DTensor parameters of TSP models"
            )
        total += g.detach().to(acc_dtype).square().sum()
    if tsp.size > 1:
        dist.all_reduce(total, group=tsp.group)
    return total.sqrt()


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[Tensor], max_norm: float, tsp: TSPGroup, replicas: Mapping[Tensor, int],
                   error_if_nonfinite: bool = False) -> Tensor:
    """TSP-aware ``torch.nn.utils.clip_grad_norm_`` (2-norm): scales the gradients in place by
    ``min(1, max_norm / (norm + 1e-6))`` and returns the global norm before clipping."""
    params = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, tsp, replicas)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of gradients is non-finite ({float(total)}), so it cannot be clipped. Set "
            f"error_if_nonfinite=False to clip anyway."
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for p in params:
        g = local_tensor(p.grad)
        g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total


class GradientAverager:
    """The data-parallel gradient average: local gradient shards summed over ``dp_group`` in fp32, then / dp.

    :meth:`install` buckets the trainable parameters in reverse order (about the order backward finishes them); a
    bucket's all-reduce starts as soon as its last gradient is accumulated, overlapping the rest of the backward
    pass. :meth:`reduce` finishes them (and starts any bucket whose gradients did not all arrive). Inside
    :meth:`blocked` (non-final micro-batches of gradient accumulation) nothing is started.
    """

    def __init__(self, dp_group: Optional[dist.ProcessGroup], dp_size: int, bucket_bytes: int) -> None:
        self.dp_group, self.dp_size, self.bucket_bytes = dp_group, dp_size, bucket_bytes
        self.is_blocked = False
        self._buckets: list[list[nn.Parameter]] = []
        self._ready: list[int] = []
        self._in_flight: dict[int, tuple[list[Tensor], Tensor, Any]] = {}

    def install(self, module: nn.Module) -> None:
        self._buckets, self._ready, self._in_flight = [], [], {}
        if self.dp_size == 1:
            return
        bucket: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for p in module.parameters() if p.requires_grad]):
            n = local_tensor(p).numel() * 4
            if bucket and size + n > self.bucket_bytes:
                self._buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += n
        if bucket:
            self._buckets.append(bucket)
        self._ready = [0] * len(self._buckets)
        for index, params in enumerate(self._buckets):
            for p in params:
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, index))

    @contextmanager
    def blocked(self) -> Generator[None, None, None]:
        previous, self.is_blocked = self.is_blocked, True
        try:
            yield
        finally:
            self.is_blocked = previous

    def _gradient_ready(self, index: int, _param: Tensor) -> None:
        if self.is_blocked:  # a non-final micro-batch of gradient accumulation
            return
        self._ready[index] += 1
        if self._ready[index] == len(self._buckets[index]):
            self._start(index)

    @torch.no_grad()
    def _start(self, index: int) -> None:
        grads = [local_tensor(p.grad) for p in self._buckets[index] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        self._in_flight[index] = (grads, flat, work)

    @torch.no_grad()
    def reduce(self) -> None:
        """Finish the buckets started during backward, start the others, copy the averages back."""
        if self.dp_size == 1:
            return
        for index in range(len(self._buckets)):
            if index not in self._in_flight:
                self._start(index)
        for index in sorted(self._in_flight):
            grads, flat, work = self._in_flight[index]
            work.wait()
            flat.div_(self.dp_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._in_flight.clear()
        self._ready = [0] * len(self._buckets)
