"""``TSPStrategy``: Tensor and Sequence Parallelism as a Lightning strategy (``Trainer(strategy="tsp")``).

Lightning glue only; the parallel math lives in the layers and schedules, and the sharding of the model, the batch
and the gradients in :mod:`lightning_tsp.sharding` (shared with the Fabric strategy, :mod:`lightning_tsp.fabric`).
What the strategy does:

* builds the ("data_parallel", "tsp") device mesh (``lightning_tsp.mesh``), tsp innermost;
* after ``configure_model`` replaces every unsharded :class:`~lightning_tsp.models.TSPLlama` (built with
  ``tsp=None``, possibly on the meta device) by one holding only this rank's shards, and registers every parameter
  as a DTensor on the "tsp" sub-mesh (``Shard(dim)`` / ``Replicate()``), so optimizers, gradient clipping and
  ``torch.distributed.checkpoint`` see the real sharding;
* turns each global batch ``{"input_ids": [B, S], "labels": [B, S] (optional)}`` into this rank's zigzag slice,
  as the keyword arguments ``TSPLlama.forward`` takes, so ``loss = self.model(**batch)`` trains unchanged;
* averages gradients over the data-parallel axis after backward (skipped on non-final accumulation micro-batches);
* clips gradients by their exact global norm (``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")``):
  each parameter counted once whatever its placement (one copy of a replicated KV head), fp32, one all-reduce over
  the TSP group. The route is public: the strategy's precision plugin is a TSP subclass of Lightning's
  (:class:`TSPPrecision`, :class:`TSPMixedPrecision`, :class:`TSPHalfPrecision`) whose ``clip_grad_by_norm``
  calls :meth:`TSPStrategy.clip_grad_norm`;
* saves sharded DCP checkpoints (every model / optimizer tensor checked to be a DTensor, plus ``tsp_model.json``)
  and checks, before any collective, that a checkpoint to load fits the model (see ``docs/checkpoints.md``).

Loss normalisation: the batch carries ``num_valid_tokens = N / dp`` where N is the number of valid target tokens
of the whole global batch (every TSP rank and every data-parallel replica, one all-reduce over the world). Each
rank's loss is then "its replica's token-loss sum / (N / dp)"; averaging gradients over dp gives exactly the
gradient of the global token mean, and averaging the logged loss over ranks (``self.log(..., sync_dist=True)``)
gives exactly the global token-mean loss.

The name ``"tsp"`` is registered by :mod:`lightning_tsp._registration` (``import lightning_tsp``), the only
registration path.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from typing_extensions import override

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.model_parallel import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_tsp import checkpoint as _ckpt
from lightning_tsp import sharding
from lightning_tsp.checks import TSPConfigError
from lightning_tsp.convert import convert_modules
from lightning_tsp.mesh import TSP_DIM, SizeArg, TSPMeshMixin
from lightning_tsp.sharding import BATCH_KEYS  # noqa: F401

if TYPE_CHECKING:
    import lightning.pytorch as pl

SUPPORTED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")


# ---- precision -------------------------------------------------------------------------------------------------


def precision_error(requested: str) -> TSPConfigError:
    hint = (
        " fp16 training needs a loss scaler, and TSP has no scaler for its sharded gradients; use 'bf16-mixed' "
        "(or 'bf16-true') instead: same memory, no scaling needed."
        if requested.startswith("16")
        else ""
    )
    return TSPConfigError(
        f"the TSP strategy does not support precision={requested!r}.{hint} Choose one of: "
        f"{', '.join(repr(p) for p in SUPPORTED_PRECISIONS)}."
    )


ClipFn = Callable[[Iterable[Tensor], float], Tensor]


class _TSPClipping:
    """``clip_grad_by_norm`` (where ``Trainer(gradient_clip_val=..., gradient_clip_algorithm="norm")`` ends, through
    ``LightningModule.configure_gradient_clipping`` -> ``Precision.clip_gradients``) by the exact TSP global norm.

    ``torch.nn.utils.clip_grad_norm_`` over the DTensor gradients would give the global norm too, except with KV
    heads replicated over the TSP group (n_kv_heads < D): it counts every copy (``tests/test_replicated_kv.py``).
    """

    _clip_norm: ClipFn

    @override
    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        self._clip_norm(sharding.optimizer_params(optimizer), clip_val)


class TSPPrecision(_TSPClipping, Precision):
    """``precision="32-true"`` under TSPStrategy."""

    def __init__(self, clip_norm: ClipFn) -> None:
        super().__init__()
        self._clip_norm = clip_norm


class TSPMixedPrecision(_TSPClipping, MixedPrecision):
    """``precision="bf16-mixed"`` under TSPStrategy (no scaler: fp16 is refused)."""

    def __init__(self, device: str, clip_norm: ClipFn) -> None:
        super().__init__("bf16-mixed", device)
        self._clip_norm = clip_norm


class TSPHalfPrecision(_TSPClipping, HalfPrecision):
    """``precision="bf16-true"`` under TSPStrategy."""

    def __init__(self, clip_norm: ClipFn) -> None:
        super().__init__("bf16-true")
        self._clip_norm = clip_norm


def tsp_precision_plugin(plugin: Precision, clip_norm: ClipFn) -> Precision:
    """The TSP precision plugin equivalent to Lightning's ``plugin`` (raises, naming it, when TSP cannot run it).

    Lightning's CPU fallback of ``precision="16-mixed"`` (to bf16-mixed) is accepted like Lightning does; fp16 with
    a loss scaler (GPU ``"16-mixed"``), ``"16-true"`` and precisions other than 32-true / bf16-mixed / bf16-true are
    refused.
    """
    precision = str(getattr(plugin, "precision", type(plugin).__name__))
    if getattr(plugin, "scaler", None) is not None or precision not in SUPPORTED_PRECISIONS:
        raise precision_error(precision)
    if isinstance(plugin, _TSPClipping):
        plugin._clip_norm = clip_norm  # already a TSP plugin (e.g. a strategy used twice): rebind to this one
        return plugin
    if type(plugin) is Precision:
        return TSPPrecision(clip_norm)
    if type(plugin) is MixedPrecision:
        return TSPMixedPrecision(plugin.device, clip_norm)
    if type(plugin) is HalfPrecision:
        return TSPHalfPrecision(clip_norm)
    raise TSPConfigError(
        f"precision plugin {type(plugin).__name__} ({precision!r}) is not supported by TSPStrategy: its gradient "
        f"clipping would not see the TSP sharding. Pass precision='32-true' / 'bf16-mixed' / 'bf16-true' (or "
        f"lightning_tsp.strategy.TSPPrecision / TSPMixedPrecision / TSPHalfPrecision)."
    )


# ---- the strategy ----------------------------------------------------------------------------------------------


class TSPStrategy(TSPMeshMixin, ModelParallelStrategy):
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
        self._check_size_args(tsp_size, data_parallel_size, grad_bucket_mb)  # before anything else
        super().__init__(
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tsp_size,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_tsp_state(tsp_size, data_parallel_size, grad_bucket_mb)
        self._grad_sync_blocked = False

    def __repr__(self) -> str:
        # pytorch_lightning.Trainer(strategy=TSPStrategy()) prints this in its "invalid strategy" error.
        return (
            f"TSPStrategy(tsp_size={self._tsp_size_arg!r}, data_parallel_size={self._dp_size_arg!r}) "
            f"[a lightning.pytorch strategy: use lightning.pytorch.Trainer, not pytorch_lightning.Trainer]"
        )

    # ---- topology (lightning_tsp.mesh.TSPMeshMixin) -------------------------------------------------------

    @override
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

    @override
    def setup_environment(self) -> None:
        self._setup_tsp_mesh()  # topology checked before any collective; device setup + init_process_group
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    # ---- precision -----------------------------------------------------------------------------------------

    @property
    @override
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        # Lightning's plugin -> its TSP subclass (exact gradient clipping); unsupported precisions raise here, at
        # Trainer construction
        if precision_plugin is not None:
            precision_plugin = tsp_precision_plugin(precision_plugin, self._clip_norm)
        self._precision_plugin = precision_plugin

    def _clip_norm(self, parameters: Iterable[Tensor], max_norm: float) -> Tensor:
        return self.clip_grad_norm(parameters, max_norm)

    # ---- model ---------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        from torch.distributed.fsdp import FullyShardedDataParallel

        assert self.model is not None
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        if any(isinstance(mod, FullyShardedDataParallel) for mod in self.model.modules()):
            raise TSPConfigError("TSPStrategy cannot run modules wrapped in FullyShardedDataParallel (FSDP1)")

        convert_modules(self.model)  # Hugging Face / user-registered architectures -> unsharded TSP models
        found = sharding.shard_tsp_modules(self.model, self.tsp_group, self.root_device, "TSPStrategy")
        rank_zero_info(
            f"TSPStrategy: mesh (data_parallel={self.data_parallel_size}, tsp={self.tsp_size}); "
            f"TSP modules: {', '.join(repr(n) for n, _ in found)}"
        )
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._replicas = {}
        self._aux_loss_coef = sharding.models_aux_loss_coef(found)
        for _, module in found:
            self._replicas.update(sharding.distribute_parameters(module, self.device_mesh[TSP_DIM]))
        self._averager = sharding.GradientAverager(self.dp_group, self.data_parallel_size, self._grad_bucket_bytes)
        self._averager.install(self.model)
        self.barrier()

        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ---- data ----------------------------------------------------------------------------------------------

    def shard_batch(self, batch: Any) -> dict[str, Tensor]:
        """Global batch -> this rank's ``{"input_ids", "targets", "position_ids"}`` (zigzag, targets shifted);
        see :func:`lightning_tsp.sharding.shard_global_batch`. No collective."""
        return sharding.shard_global_batch(batch, self.tsp_group, getattr(self, "_aux_loss_coef", 0.0))

    @override
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
        world = dist.group.WORLD if dist.is_initialized() else None
        return sharding.token_normaliser(targets, self.data_parallel_size, world)

    # ---- gradients -----------------------------------------------------------------------------------------

    @override
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
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the data-parallel gradient average (non-final micro-batches of gradient accumulation)."""
        previous, self._grad_sync_blocked = self._grad_sync_blocked, True
        try:
            if self._averager is None:
                yield
            else:
                with self._averager.blocked():
                    yield
        finally:
            self._grad_sync_blocked = previous

    def reduce_gradients(self) -> None:
        """Average the local gradient shards over the data-parallel axis in fp32 (sum, then / dp)."""
        if self._averager is not None:
            self._averager.reduce()

    # ---- gradient clipping -----------------------------------------------------------------------------------

    def grad_norm(self, parameters: Iterable[Tensor]) -> Tensor:
        """Global 2-norm of the gradients of ``parameters``, each parameter counted once whatever its placement
        (one copy of a replicated KV head); a collective over the TSP group. See
        :func:`lightning_tsp.sharding.grad_norm`."""
        return sharding.grad_norm(parameters, self.tsp_group, self._replicas, self.root_device)

    def clip_grad_norm(self, parameters: Iterable[Tensor], max_norm: float) -> Tensor:
        """TSP-aware ``torch.nn.utils.clip_grad_norm_`` (2-norm): scales the gradients in place by
        ``min(1, max_norm / (norm + 1e-6))`` and returns the global norm before clipping."""
        return sharding.clip_grad_norm(parameters, max_norm, self.tsp_group, self._replicas)

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
        # Atomic (lightning_tsp/checkpoint.py, "atomic saves"): every rank writes a hidden staging sibling, and
        # rank 0 moves it into place only after all ranks wrote theirs; a crash leaves the previous checkpoint.
        def write(staging: Path) -> None:
            super(TSPStrategy, self).save_checkpoint(checkpoint, staging, storage_options)
            if self._save_distributed_checkpoint and self.global_rank == 0:
                _ckpt.write_module_metadata(staging, metadata)

        _ckpt.atomic_save(self, filepath, write)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        # the committed copy (a commit cut between its renames leaves only the previous one); a clear error if
        # the checkpoint is missing or incomplete; then the fit check, all before any collective
        path = _ckpt.checkpoint_for_loading(checkpoint_path)
        self.check_checkpoint_fits(path, weights_only)
        return super().load_checkpoint(path, weights_only)

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
