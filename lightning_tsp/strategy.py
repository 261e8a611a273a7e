"""``TSPStrategy``: Tensor and Sequence Parallelism as a Lightning strategy (``Trainer(strategy="tsp")``).

Lightning glue only; the parallel math lives in the layers and schedules. What the strategy does:

* builds the ("data_parallel", "tsp") device mesh (``lightning_tsp.mesh``), tsp innermost;
* after ``configure_model`` replaces every unsharded :class:`~lightning_tsp.models.TSPLlama` (built with
  ``tsp=None``, possibly on the meta device) by one holding only this rank's shards, and registers every parameter
  as a DTensor on the "tsp" sub-mesh (``Shard(dim)`` / ``Replicate()``), so optimizers, gradient clipping and
  ``torch.distributed.checkpoint`` see the real sharding;
* turns each global batch ``{"input_ids": [B, S], "labels": [B, S] (optional)}`` into this rank's zigzag slice,
  as the keyword arguments ``TSPLlama.forward`` takes, so ``loss = self.model(**batch)`` trains unchanged;
* averages gradients over the data-parallel axis after backward (skipped on non-final accumulation micro-batches);
* clips gradients by their TSP-aware global norm (``Trainer(gradient_clip_val=...)``): each parameter counted once
  whatever its placement, fp32, one all-reduce over the TSP group;
* saves sharded DCP checkpoints (every model / optimizer tensor checked to be a DTensor, plus ``tsp_model.json``)
  and checks, before any collective, that a checkpoint to load fits the model (see ``docs/checkpoints.md``).

``predict_logprobs(module, batch)`` scores the tokens of a predict batch (natural order, full sequence).

Loss normalisation: the batch carries ``num_valid_tokens = N / dp`` where N is the number of valid target tokens
of the whole global batch (every TSP rank and every data-parallel replica, one all-reduce over the world). Each
rank's loss is then "its replica's token-loss sum / (N / dp)"; averaging gradients over dp gives exactly the
gradient of the global token mean, and averaging the logged loss over ranks (``self.log(..., sync_dist=True)``)
gives exactly the global token-mean loss.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_tsp import _registration
from lightning_tsp import checkpoint as _ckpt
from lightning_tsp.checks import TSPConfigError
from lightning_tsp.convert import convert_modules
from lightning_tsp.group import TSPGroup
from lightning_tsp.mesh import TSP_DIM, SizeArg, Topology, build_mesh, dp_group, resolve_topology, tsp_group
from lightning_tsp.models.llama import TSPLlama
from lightning_tsp.schedules.comm import local_tensor
from lightning_tsp.zigzag import IGNORE_INDEX, shard_batch, zigzag_unshard

if TYPE_CHECKING:
    import lightning.pytorch as pl

STRATEGY_NAME = _registration.STRATEGY_NAME
SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
BATCH_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")

_PL_MESSAGE = _registration.PL_MESSAGE


# ---- precision -------------------------------------------------------------------------------------------------


def _precision_error(requested: str) -> TSPConfigError:
    hint = (
        " fp16 training needs a loss scaler, and TSP has no scaler for its sharded gradients; use 'bf16-mixed' "
        "(or 'bf16-true') instead: same memory, no scaling needed."
        if requested.startswith("16")
        else ""
    )
    return TSPConfigError(
        f"TSPStrategy does not support precision={requested!r}.{hint} Choose one of: "
        f"{', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}."
    )


def _requested_precision_at_trainer_init() -> Optional[str]:
    """The ``precision=`` a Trainer is being built with, read from the Lightning connector's ``__init__`` frame.

    Needed for one case only: on CPU Lightning turns ``precision="16-mixed"`` into a bf16-mixed plugin (with a
    warning) before the strategy ever sees it, so the plugin alone cannot tell that fp16 was asked for. Returns None
    when not called from inside a Trainer's construction.
    """
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _AcceleratorConnector) and frame.f_code.co_name == "__init__":
            value = frame.f_locals.get("precision")
            return None if value is None else str(value)
        frame = frame.f_back
    return None


def _check_precision_plugin(plugin: Precision) -> None:
    precision = str(getattr(plugin, "precision", type(plugin).__name__))
    if getattr(plugin, "scaler", None) is not None or precision not in SUPPORTED_PRECISIONS:
        raise _precision_error(precision)
    if isinstance(plugin, MixedPrecision):
        requested = _requested_precision_at_trainer_init()
        if requested is not None and requested in ("16", "16-mixed"):
            raise _precision_error("16-mixed")


# ---- registration ----------------------------------------------------------------------------------------------


def register_strategy(registry: Any = None) -> None:
    """Register ``"tsp"`` in Lightning's ``StrategyRegistry`` (idempotent; ``import lightning_tsp`` arranges it).

    Also makes ``pytorch_lightning.Trainer(strategy="tsp")`` fail with a message pointing to ``lightning.pytorch``.
    """
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry as registry
    _registration.register_lightning(registry)
    _registration.install()


# ---- the strategy ----------------------------------------------------------------------------------------------


class TSPStrategy(ModelParallelStrategy):
    """Tensor and Sequence Parallelism on a ("data_parallel", "tsp") mesh.

    Arguments:
        tsp_size: ranks per TSP group (D): every weight and every sequence is sharded over them. ``"auto"``: the
            number of devices per node. Must divide the devices per node and the world size.
        data_parallel_size: number of model replicas; ``"auto"`` = world size / tsp_size.
        save_distributed_checkpoint: save a DCP directory of shards (default) or one full file on rank 0.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default from the device type.
        timeout: timeout of the collectives.
        grad_bucket_mb: size of the fp32 buckets in which gradients are averaged over the data-parallel axis.
    """

    def __init__(
        self,
        tsp_size: SizeArg = "auto",
        data_parallel_size: SizeArg = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        grad_bucket_mb: float = 64.0,
    ) -> None:
        for name, value in (("tsp_size", tsp_size), ("data_parallel_size", data_parallel_size)):
            if value != "auto" and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise TSPConfigError(f"{name}={value!r} must be a positive integer or 'auto'")
        if grad_bucket_mb <= 0:
            raise TSPConfigError(f"grad_bucket_mb={grad_bucket_mb} must be > 0")
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tsp_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._tsp_size_arg: SizeArg = tsp_size
        self._dp_size_arg: SizeArg = data_parallel_size
        self._grad_bucket_bytes = int(grad_bucket_mb * 2**20)
        self._topology: Optional[Topology] = None
        self._tsp_group: Optional[TSPGroup] = None
        self._dp_group: Optional[dist.ProcessGroup] = None
        self._grad_sync_blocked = False
        self._replicas: dict[nn.Parameter, int] = {}  # parameters holding one copy of a replicated KV head

    def __repr__(self) -> str:
        # pytorch_lightning.Trainer(strategy=TSPStrategy()) prints this in its "invalid strategy" error.
        return (
            f"TSPStrategy(tsp_size={self._tsp_size_arg!r}, data_parallel_size={self._dp_size_arg!r}) "
            f"[a lightning.pytorch strategy: use lightning.pytorch.Trainer, not pytorch_lightning.Trainer]"
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="Tensor and Sequence Parallelism (TSP) over a ('data_parallel', 'tsp') device mesh",
        )

    # ---- topology ------------------------------------------------------------------------------------------

    def _resolve_topology(self) -> Topology:
        devices = self.num_processes
        if devices < 1:
            raise TSPConfigError("TSPStrategy has no devices: pass Trainer(devices=N) with N >= 1")
        self._topology = resolve_topology(
            world_size=self.num_nodes * devices,
            devices_per_node=devices,
            tsp_size=self._tsp_size_arg,
            data_parallel_size=self._dp_size_arg,
        )
        self._data_parallel_size = self._topology.data_parallel_size
        self._tensor_parallel_size = self._topology.tsp_size
        return self._topology

    @property
    def topology(self) -> Topology:
        return self._topology if self._topology is not None else self._resolve_topology()

    @property
    def tsp_size(self) -> int:
        return self.topology.tsp_size

    @property
    def data_parallel_size(self) -> int:
        return self.topology.data_parallel_size

    @property
    def tsp_group(self) -> TSPGroup:
        if self._tsp_group is None:
            raise RuntimeError("the TSP group exists once the strategy has set up its environment")
        return self._tsp_group

    @property
    def dp_group(self) -> dist.ProcessGroup:
        if self._dp_group is None:
            raise RuntimeError("the data-parallel group exists once the strategy has set up its environment")
        return self._dp_group

    def _configure_launcher(self) -> None:
        # Called at Trainer construction: check the topology now, before any process or collective exists.
        self._resolve_topology()
        # Always install the launcher (unlike ModelParallelStrategy): its launch() runs the cluster environment's
        # validate_settings (e.g. SLURM --ntasks-per-node vs devices) and only spawns when processes are not
        # created externally.
        assert self.cluster_environment is not None
        if _IS_INTERACTIVE and self.cluster_environment.creates_processes_externally:
            return  # a notebook attached to externally started ranks: nothing to launch, and Lightning would refuse
        self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        topology = self._resolve_topology()  # before any collective
        self._setup_distributed()  # device setup + init_process_group
        if dist.get_world_size() != topology.world_size:
            raise TSPConfigError(
                f"{dist.get_world_size()} processes joined, but Trainer(num_nodes={self.num_nodes}, "
                f"devices={self.num_processes}) means {topology.world_size}: check the launcher settings"
            )
        self._device_mesh = build_mesh(topology, self.root_device.type)
        self._tsp_group = tsp_group(self._device_mesh)
        self._dp_group = dp_group(self._device_mesh)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ---- precision -----------------------------------------------------------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        if precision_plugin is not None:
            _check_precision_plugin(precision_plugin)
        self._precision_plugin = precision_plugin

    # ---- model ---------------------------------------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer") -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(mod, FullyShardedDataParallel) for mod in self.model.modules()):
            raise TSPConfigError("TSPStrategy cannot run modules wrapped in FullyShardedDataParallel (FSDP1)")

        convert_modules(self.model)  # Hugging Face / user-registered architectures -> unsharded TSP models
        modules = self._shard_tsp_modules()
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        for module in modules:
            self._distribute_parameters(module)
        self._install_gradient_hooks()
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self._install_gradient_clipping(self.precision_plugin)
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _shard_tsp_modules(self) -> list[TSPLlama]:
        """Replace every unsharded TSPLlama of the LightningModule by this rank's shard of it."""
        assert self.model is not None
        tsp = self.tsp_group
        found: list[tuple[str, TSPLlama]] = []
        for name, module in list(self.model.named_modules()):
            if not isinstance(module, TSPLlama) or any(name.startswith(prefix + ".") for prefix, _ in found):
                continue
            if module.tsp.size == tsp.size:
                if tsp.size > 1 and dist.get_process_group_ranks(module.tsp.group) != dist.get_process_group_ranks(
                    tsp.group
                ):
                    raise TSPConfigError(
                        f"module {name!r} is sharded over ranks {dist.get_process_group_ranks(module.tsp.group)}, "
                        f"not over this rank's TSP group {dist.get_process_group_ranks(tsp.group)}. Build it with "
                        f"tsp=None and let TSPStrategy shard it."
                    )
                sharded = module
            elif module.tsp.size == 1:
                sharded = self._shard_module(module)
                self._replace_module(module, sharded)
            else:
                raise TSPConfigError(
                    f"module {name!r} was built for a TSP group of {module.tsp.size} ranks but the strategy has "
                    f"tsp_size={tsp.size}. Build it with tsp=None (D=1, e.g. on the meta device) and let "
                    f"TSPStrategy shard it."
                )
            found.append((name, sharded))
        if not found:
            raise TSPConfigError(
                "TSPStrategy found no lightning_tsp.models.TSPLlama in the LightningModule. Build the model as a "
                "TSPLlama with tsp=None (in __init__ or configure_model, on the meta device for large models); the "
                "strategy then shards it over the TSP group."
            )
        covered = {id(p) for _, m in found for p in m.parameters()}
        stray = [n for n, p in self.model.named_parameters() if p.requires_grad and id(p) not in covered]
        if stray:
            raise TSPConfigError(
                f"trainable parameters outside a TSPLlama are not supported yet by TSPStrategy: {stray[:5]}"
                f"{' ...' if len(stray) > 5 else ''}. Their tokens are sharded over the TSP group, so their "
                f"gradients would be partial. Freeze them (requires_grad=False) or move them into the model."
            )
        rank_zero_info(
            f"TSPStrategy: mesh (data_parallel={self.data_parallel_size}, tsp={self.tsp_size}); "
            f"TSP modules: {', '.join(repr(n) for n, _ in found)}"
        )
        return [m for _, m in found]

    def _shard_module(self, full: TSPLlama) -> TSPLlama:
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
            self.tsp_group,
            attention_kernel=full.attention_kernel,
            activation_checkpointing=full.activation_checkpointing,
            token_chunk=full.token_chunk,
            kv_bucket_heads=full.kv_bucket_heads,
            device="meta",
            dtype=dtype,
        )
        sharded.to_empty(device=self.root_device)
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

    def _replace_module(self, old: nn.Module, new: nn.Module) -> None:
        """Swap every reference to ``old`` inside the LightningModule (shared submodules included)."""
        assert self.model is not None
        for parent in self.model.modules():
            for key, child in list(parent._modules.items()):
                if child is old:
                    parent._modules[key] = new

    def _distribute_parameters(self, module: TSPLlama) -> None:
        """Register every parameter as a DTensor on the "tsp" sub-mesh: Shard(dim) or Replicate()."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        mesh = self.device_mesh[TSP_DIM]
        for name, dim in module.shard_dims().items():
            owner_name, _, attr = name.rpartition(".")
            owner = module.get_submodule(owner_name)
            param = getattr(owner, attr)
            placements = [Shard(dim) if dim is not None else Replicate()]
            if isinstance(param, DTensor):
                if tuple(param.placements) != tuple(placements):
                    raise TSPConfigError(f"parameter {name!r} is a DTensor with placements {param.placements}, "
                                         f"TSP needs {placements}")
                continue
            dtensor = DTensor.from_local(param.detach(), mesh, placements, run_check=False)
            new = nn.Parameter(dtensor, requires_grad=param.requires_grad)
            setattr(owner, attr, new)
            if module.replicas(name) > 1:  # a replicated KV head: its DTensor holds one copy per rank
                self._replicas[new] = module.replicas(name)

    # ---- data ----------------------------------------------------------------------------------------------

    def shard_batch(self, batch: Any) -> dict[str, Tensor]:
        """Global batch -> this rank's ``{"input_ids", "targets", "position_ids"}`` (zigzag, targets shifted).

        ``batch`` is a mapping with ``input_ids`` [B, S] and optionally ``labels`` [B, S] (Hugging Face convention:
        unshifted, -100 = no loss; default: ``input_ids``), ``attention_mask`` [B, S] (right padding only; masked
        positions get no loss) and ``position_ids`` [B, S] (packed documents, Hugging Face's convention: 0, 1, 2,
        ... inside each document, 0 starts a document). With ``position_ids`` the targets are shifted per document
        and the returned ``position_ids`` are their zigzag slice [B, S/D] (otherwise the global positions [S/D]).
        """
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise TSPConfigError(
                f"TSPStrategy expects every batch to be a dict with 'input_ids' [B, S] and optionally 'labels', "
                f"'attention_mask' and 'position_ids' [B, S]; got {type(batch).__name__}"
                + (f" with keys {sorted(batch)}" if isinstance(batch, Mapping) else "")
            )
        unknown = sorted(set(batch) - set(BATCH_KEYS))
        if unknown:
            raise TSPConfigError(
                f"batch keys {unknown} are not supported by TSPStrategy; a batch holds only {list(BATCH_KEYS)}"
            )
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
                    "batch['attention_mask'] has padding before real tokens (left padding or holes); TSPStrategy "
                    "supports right padding only (padded positions then never influence real tokens)"
                )
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
        tsp = self.tsp_group
        ids, targets, positions = shard_batch(input_ids, labels, tsp.size, tsp.rank, position_ids=position_ids)
        return {"input_ids": ids, "targets": targets, "position_ids": positions}

    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(self.shard_batch(batch), device, dataloader_idx)
        if not isinstance(batch, dict) or "targets" not in batch:
            raise TSPConfigError(
                "a LightningModule batch-transfer hook removed 'targets' from the TSP batch; keep the dict keys"
            )
        batch["num_valid_tokens"] = self.token_normaliser(batch["targets"])
        return batch

    def token_normaliser(self, targets: Tensor) -> Tensor:
        """``N / dp``: N = valid targets of the global batch (all TSP ranks, all replicas; one all-reduce)."""
        count = (targets != IGNORE_INDEX).sum(dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(count)
        return count / self.data_parallel_size

    # ---- gradients -----------------------------------------------------------------------------------------

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        # Strategy.backward with the data-parallel gradient average between the backward pass and
        # precision_plugin.post_backward, so that on_after_backward sees the synchronised gradients (as with DDP).
        self.pre_backward(closure_loss)
        assert self.lightning_module is not None
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.precision_plugin.backward(closure_loss, self.lightning_module, optimizer, *args, **kwargs)
        if not self._grad_sync_blocked:
            self.reduce_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the data-parallel gradient average (non-final micro-batches of gradient accumulation)."""
        previous, self._grad_sync_blocked = self._grad_sync_blocked, True
        try:
            yield
        finally:
            self._grad_sync_blocked = previous

    def _install_gradient_hooks(self) -> None:
        """Bucket the trainable parameters in reverse order (about the order backward finishes them); a bucket's
        data-parallel all-reduce starts as soon as its last gradient is accumulated, overlapping the rest of the
        backward pass. Every replica has the same graph, so the buckets launch in the same order everywhere."""
        self._grad_buckets: list[list[nn.Parameter]] = []
        self._bucket_ready: list[int] = []
        self._in_flight: dict[int, tuple[list[Tensor], Tensor, Any]] = {}
        if self.data_parallel_size == 1:
            return
        assert self.model is not None
        bucket: list[nn.Parameter] = []
        size = 0
        for p in reversed([p for p in self.model.parameters() if p.requires_grad]):
            n = local_tensor(p).numel() * 4
            if bucket and size + n > self._grad_bucket_bytes:
                self._grad_buckets.append(bucket)
                bucket, size = [], 0
            bucket.append(p)
            size += n
        if bucket:
            self._grad_buckets.append(bucket)
        self._bucket_ready = [0] * len(self._grad_buckets)
        for index, params in enumerate(self._grad_buckets):
            for p in params:
                p.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, index))

    def _gradient_ready(self, index: int, _param: Tensor) -> None:
        if self._grad_sync_blocked:  # a non-final micro-batch of gradient accumulation
            return
        self._bucket_ready[index] += 1
        if self._bucket_ready[index] == len(self._grad_buckets[index]):
            self._start_bucket(index)

    @torch.no_grad()
    def _start_bucket(self, index: int) -> None:
        grads = [local_tensor(p.grad) for p in self._grad_buckets[index] if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).to(torch.float32) for g in grads])
        work = dist.all_reduce(flat, group=self.dp_group, async_op=True)
        self._in_flight[index] = (grads, flat, work)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the local gradient shards over the data-parallel axis in fp32 (sum, then / dp): finish the
        buckets started during backward, start those whose gradients did not all arrive, copy the results back."""
        dp = self.data_parallel_size
        if dp == 1:
            return
        for index in range(len(self._grad_buckets)):
            if index not in self._in_flight:
                self._start_bucket(index)
        for index in sorted(self._in_flight):
            grads, flat, work = self._in_flight[index]
            work.wait()
            flat.div_(dp)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        self._in_flight.clear()
        self._bucket_ready = [0] * len(self._grad_buckets)

    # ---- gradient clipping -----------------------------------------------------------------------------------

    def _install_gradient_clipping(self, plugin: Precision) -> None:
        """Route the precision plugin's ``clip_grad_by_norm`` (what ``Trainer(gradient_clip_val=...,
        gradient_clip_algorithm="norm")`` ends in) to :meth:`clip_grad_norm`. Lightning has no strategy hook for
        clipping, so the plugin instance gets an attribute that shadows its method."""
        if self._precision_plugin is None:
            self._precision_plugin = plugin

        def clip_grad_by_norm(optimizer: Any, clip_val: float) -> None:
            self.clip_grad_norm(_optimizer_params(optimizer), clip_val)

        plugin.clip_grad_by_norm = clip_grad_by_norm  # type: ignore[method-assign]

    @torch.no_grad()
    def grad_norm(self, parameters: Iterable[Tensor]) -> Tensor:
        """Global 2-norm of the gradients of ``parameters``, each parameter counted once whatever its placement.

        ``Shard`` gradients: every TSP rank adds the squares of its shard; ``Replicate`` gradients (norms): only
        TSP rank 0 adds them. One all-reduce (sum) over the TSP group, accumulated in fp32 (fp64 for fp64
        gradients). Data-parallel replicas hold identical averaged gradients, so nothing is summed over dp.
        """
        from torch.distributed.tensor import DTensor, Replicate, Shard

        params = [p for p in parameters if p.grad is not None]
        grads = [p.grad for p in params]
        acc_dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
        device = grads[0].device if grads else self.root_device
        total = torch.zeros((), dtype=acc_dtype, device=device)
        tsp = self.tsp_group
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
                if tsp.rank % self._replicas.get(p, 1) != 0:  # count one copy of a replicated KV head
                    continue
                g = g.to_local()
            elif tsp.size > 1:
                raise TSPConfigError(
                    f"gradient clipping: a plain (non-DTensor) gradient of shape {tuple(g.shape)}; TSPStrategy only "
                    f"trains DTensor parameters of TSP models"
                )
            total += g.detach().to(acc_dtype).square().sum()
        if tsp.size > 1:
            dist.all_reduce(total, group=tsp.group)
        return total.sqrt()

    @torch.no_grad()
    def clip_grad_norm(self, parameters: Iterable[Tensor], max_norm: float) -> Tensor:
        """TSP-aware ``torch.nn.utils.clip_grad_norm_`` (2-norm): scales the gradients in place by
        ``min(1, max_norm / (norm + 1e-6))`` and returns the global norm before clipping."""
        params = [p for p in parameters if p.grad is not None]
        total = self.grad_norm(params)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for p in params:
            g = local_tensor(p.grad)
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
        return total

    # ---- checkpoints -----------------------------------------------------------------------------------------

    def checkpoint_metadata(self) -> dict:
        """What ``tsp_model.json`` holds: classes, configs and full shapes of the TSP models (plain JSON)."""
        assert self.model is not None
        return _ckpt.module_metadata(self.model, self.tsp_size, self.data_parallel_size)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        if self._save_distributed_checkpoint:
            # DCP keeps one copy of a plain tensor: per-rank shards saved that way would be lost without a sound
            _ckpt.assert_sharded_state(checkpoint.get("state_dict", {}), "state_dict")
            for i, state in enumerate(checkpoint.get("optimizer_states", [])):
                _ckpt.assert_sharded_state(state, f"optimizer_states[{i}]")
        metadata = self.checkpoint_metadata()
        checkpoint[_ckpt.METADATA_KEY] = metadata
        super().save_checkpoint(checkpoint, filepath, storage_options)
        if self._save_distributed_checkpoint and self.global_rank == 0:
            _ckpt.write_module_metadata(filepath, metadata)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        self.check_checkpoint_fits(checkpoint_path, weights_only)  # before any collective
        return super().load_checkpoint(checkpoint_path, weights_only)

    def check_checkpoint_fits(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> None:
        """Raise :class:`TSPConfigError` (on every rank, no collective) when the checkpoint's tensors do not fit
        the model: a shape differs (the message names the parameter and both shapes), a parameter is missing or
        unexpected (with ``strict_loading``), or optimizer states are missing while fitting."""
        assert self.lightning_module is not None and self.model is not None
        path = Path(checkpoint_path)
        strict = self.lightning_module.strict_loading
        expected = _ckpt.expected_tensor_shapes(self.model)
        if _ckpt.is_sharded_checkpoint(path):
            saved = _ckpt.saved_tensor_shapes(path)
            _ckpt.check_state_compatible(expected, saved, strict, str(path))
            top = _ckpt.saved_top_level_keys(path)
            missing = [f"optimizer_{i}" for i in range(len(self.optimizers)) if f"optimizer_{i}" not in top]
            if missing:
                raise TSPConfigError(
                    f"checkpoint {path} holds no state for {missing} but the run has {len(self.optimizers)} "
                    f"optimizer(s): it was saved by another training setup"
                )
        elif path.is_file():
            ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
            saved = {k: tuple(v.shape) for k, v in ckpt.get("state_dict", {}).items() if isinstance(v, Tensor)}
            _ckpt.check_state_compatible(expected, saved, strict, str(path))


# ---- prediction ------------------------------------------------------------------------------------------------


def _optimizer_params(optimizer: Any) -> list[Tensor]:
    optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
    return [p for group in optimizer.param_groups for p in group["params"]]


def find_tsp_model(module: nn.Module) -> TSPLlama:
    """The (single, outermost) TSPLlama of ``module`` (``module`` itself if it is one)."""
    if isinstance(module, TSPLlama):
        return module
    found = [m for m in module.modules() if isinstance(m, TSPLlama)]
    outer = [m for m in found if not any(m is not o and any(m is s for s in o.modules()) for o in found)]
    if len(outer) != 1:
        raise TSPConfigError(
            f"predict_logprobs needs exactly one TSPLlama in the module, found {len(outer)}: pass the TSPLlama itself"
        )
    return outer[0]


def gather_sequence(local: Tensor, tsp: TSPGroup, dim: int = 1) -> Tensor:
    """All-gather this rank's zigzag slice [.., S/D, ..] over the TSP group -> natural order [.., S, ..]."""
    if tsp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tsp.size)]
    dist.all_gather(parts, local.contiguous(), group=tsp.group)
    return zigzag_unshard(parts, dim=dim)


@torch.no_grad()
def predict_logprobs(module: nn.Module, batch: Mapping[str, Tensor], gather: bool = True) -> Tensor:
    """Per-token log-probabilities for long-context scoring, for ``predict_step`` under TSPStrategy.

    ``batch`` is what the strategy hands to ``predict_step`` (this rank's zigzag slice of the global batch).
    Returns float32 ``[B, S]`` in NATURAL token order on EVERY rank of the TSP group (all-gathered):
    ``out[b, t] = log p(token[t + 1] | tokens[<= t])`` and ``NaN`` where there is no target: the last position,
    ``labels == -100`` and padding (``attention_mask == 0``). ``gather=False`` returns this rank's zigzag slice
    ``[B, S/D]`` instead (no collective). Every rank of the TSP group must call it (collectives inside).
    """
    model = find_tsp_model(module)
    targets = batch["targets"]
    losses = model.token_losses(batch["input_ids"], targets, batch["position_ids"])
    logp = (-losses.to(torch.float32)).masked_fill(targets == IGNORE_INDEX, float("nan"))
    return gather_sequence(logp, model.tsp) if gather else logp
