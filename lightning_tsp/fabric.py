"""``TSPFabricStrategy``: Tensor and Sequence Parallelism for Lightning Fabric (``Fabric(strategy="tsp")``).

The Fabric counterpart of :class:`~lightning_tsp.strategy.TSPStrategy`, with the same sharding code
(:mod:`lightning_tsp.sharding`). A single-process Fabric loop runs unchanged with ``strategy="tsp"``::

    fabric = Fabric(strategy="tsp", devices=2, precision="bf16-mixed")   # after `import lightning_tsp`
    fabric.launch()
    model = fabric.setup_module(LlamaForCausalLM(config))                # converted, sharded, DTensor parameters
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-4))
    loader = fabric.setup_dataloaders(loader)                            # split over the data-parallel axis only
    for batch in loader:                                                 # full sequences: input_ids, labels, ...
        loss = model(**batch).loss                                       # sharded by the model (GlobalBatchModel)
        fabric.backward(loss)                                            # + data-parallel gradient average
        fabric.clip_gradients(model, optimizer, max_norm=1.0)            # exact global norm
        optimizer.step(); optimizer.zero_grad()
    fabric.save("ckpt", {"model": model, "optimizer": optimizer, "step": step})   # DCP + tsp_model.json

The built-in model (``TSPLlama(cfg, device="meta")``) runs the same way (its forward returns the loss tensor), and
a batch already sharded by ``fabric.strategy.batch_to_device(batch)`` is passed through as is.

Checkpoints have the Trainer's layout (``state_dict.<model prefix>.<name>``, ``optimizer_0`` ..., ``meta.pt``,
``tsp_model.json``): a bare TSPLlama is saved under the prefix ``model`` (the attribute of ``TSPLanguageModel``),
so a Trainer checkpoint's weights load into a Fabric model and a Fabric checkpoint into a LightningModule holding
its TSPLlama as ``self.model``; :func:`lightning_tsp.checkpoint.consolidate` reads both.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies.model_parallel import ModelParallelStrategy
from lightning.fabric.strategies.parallel import ParallelStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.types import _PATH, _Stateful

from lightning_tsp import checkpoint as _ckpt
from lightning_tsp import sharding
from lightning_tsp.checks import TSPConfigError
from lightning_tsp.convert import convert_modules
from lightning_tsp.mesh import TSP_DIM, SizeArg, TSPMeshMixin
from lightning_tsp.models import named_tsp_models
from lightning_tsp.models.llama import TSPLlama
from lightning_tsp.strategy import SUPPORTED_PRECISIONS, precision_error

__all__ = ["TSPFabricStrategy", "GlobalBatchModel", "BARE_MODEL_PREFIX"]

BARE_MODEL_PREFIX = "model"  # a bare TSPLlama is checkpointed as the `model` attribute of a LightningModule
FABRIC_OPTIMIZER_KEYS = "fabric_optimizer_keys"  # meta.pt: the state keys of the optimizers, in DCP order


def _identity(module: nn.Module, _mesh: Any) -> nn.Module:
    return module


class GlobalBatchModel(nn.Module):
    """The module that ``fabric.setup_module`` runs for a TSP model (built-in, or converted from Hugging Face): it
    takes the GLOBAL batch, as the model does in one process.

    ``model(input_ids=..., labels=..., attention_mask=..., position_ids=...)`` (full sequences [B, S]; the Trainer's
    batch contract, :func:`lightning_tsp.sharding.shard_global_batch`) is sharded by the strategy's
    ``batch_to_device`` (this rank's zigzag slice and ``N / dp``: one all-reduce over the world, so every rank calls
    the model) and then runs the TSP model. A batch that ``fabric.strategy.batch_to_device`` already sharded (it has
    ``targets``) runs as is. Returns what the TSP model returns: the loss tensor of a ``TSPLlama``,
    ``CausalLMOutputWithPast`` (``.loss``; ``logits`` is None; ``MoeCausalLMOutputWithPast`` for a mixture of
    experts) of a converted Hugging Face model.
    """

    def __init__(self, model: TSPLlama, shard: Callable[[Mapping[str, Any]], dict[str, Tensor]]) -> None:
        super().__init__()
        self.model = model  # BARE_MODEL_PREFIX: checkpoints keep the layout of a bare model
        self._shard = shard

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) > 1 or "targets" in kwargs:  # this rank's slice already (fabric.strategy.batch_to_device)
            return self.model(*args, **kwargs)
        if args:
            if "input_ids" in kwargs:
                raise TypeError("input_ids given both positionally and as a keyword")
            kwargs["input_ids"] = args[0]
        return self.model(**self._shard(kwargs))


class _TSPBackwardSyncControl(_BackwardSyncControl):
    """``fabric.no_backward_sync(model)``: skip the data-parallel gradient average (gradient accumulation)."""

    def __init__(self, strategy: "TSPFabricStrategy") -> None:
        self.strategy = strategy

    @override
    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        averager = self.strategy._averager
        return averager.blocked() if enabled and averager is not None else nullcontext()


class TSPFabricStrategy(TSPMeshMixin, ModelParallelStrategy):
    """Tensor and Sequence Parallelism on a ("data_parallel", "tsp") mesh, for Fabric.

    Arguments (as :class:`~lightning_tsp.strategy.TSPStrategy`):
        tsp_size: ranks per TSP group (D); ``"auto"``: the devices per node. Must divide the devices per node and
            the world size.
        data_parallel_size: number of model replicas; ``"auto"`` = world size / tsp_size.
        process_group_backend: ``"nccl"`` / ``"gloo"``; default from the device type.
        timeout: timeout of the collectives.
        grad_bucket_mb: size of the fp32 buckets in which gradients are averaged over the data-parallel axis.

    Checkpoints are always sharded (DCP directories).
    """

    _frontend = "Fabric"

    def __init__(
        self,
        tsp_size: SizeArg = "auto",
        data_parallel_size: SizeArg = "auto",
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        grad_bucket_mb: float = 64.0,
    ) -> None:
        self._check_size_args(tsp_size, data_parallel_size, grad_bucket_mb)  # before anything else
        super().__init__(
            parallelize_fn=_identity,  # setup_module shards (below)
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=tsp_size,
            save_distributed_checkpoint=True,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_tsp_state(tsp_size, data_parallel_size, grad_bucket_mb)
        self._backward_sync_control = _TSPBackwardSyncControl(self)

    def __repr__(self) -> str:
        return f"TSPFabricStrategy(tsp_size={self._tsp_size_arg!r}, data_parallel_size={self._dp_size_arg!r})"

    # ---- topology (lightning_tsp.mesh.TSPMeshMixin) -------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        self._resolve_topology()  # at Fabric construction: before any process or collective exists
        super()._configure_launcher()

    @override
    def setup_environment(self) -> None:
        self._resolve_topology()  # before anything else
        ParallelStrategy.setup_environment(self)  # the device (not ModelParallelStrategy's 2-D TP mesh)
        topology = self._setup_tsp_mesh()
        self._averager = sharding.GradientAverager(self._dp_group, topology.data_parallel_size,
                                                   self._grad_bucket_bytes)

    # ---- precision -----------------------------------------------------------------------------------------

    @property
    @override
    def precision(self) -> Precision:
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    @override
    def precision(self, precision: Optional[Precision]) -> None:
        if precision is not None:
            name = str(getattr(precision, "precision", type(precision).__name__))
            if getattr(precision, "scaler", None) is not None or name not in SUPPORTED_PRECISIONS:
                raise precision_error(name)
        self._precision = precision

    # ---- model and optimizers ------------------------------------------------------------------------------

    @override
    def setup_module(self, module: nn.Module) -> nn.Module:
        """Convert (Hugging Face / registered architectures), shard every unsharded TSPLlama over the TSP group,
        register its parameters as DTensors and install the data-parallel gradient hooks.

        ``module`` may be a TSPLlama, a converted architecture (e.g. a Hugging Face ``LlamaForCausalLM``) or a
        module holding such models. For the first two, Fabric runs a :class:`GlobalBatchModel` (it shards full
        batches); Fabric keeps ``module`` for ``state_dict`` and attribute access, so a TSPLlama takes on its shard's
        state, and a converted model's parameters become the TSP model's (the same DTensors, under the same names).
        A holder runs its own forward (shard its batches with ``batch_to_device``)."""
        from torch.distributed.fsdp import FullyShardedDataParallel

        if any(isinstance(mod, FullyShardedDataParallel) for mod in module.modules()):
            raise TSPConfigError("TSPFabricStrategy cannot run modules wrapped in FullyShardedDataParallel (FSDP1)")
        original = dict(module.named_parameters())
        holder = nn.Module()
        holder.add_module(BARE_MODEL_PREFIX, module)
        convert_modules(holder)
        converted = holder.get_submodule(BARE_MODEL_PREFIX)
        if converted is not module:
            names = {n for n, _ in converted.named_parameters()}
            if names != set(original):
                raise TSPConfigError(
                    f"fabric.setup_module got a {type(module).__name__} that lightning_tsp.convert replaces by a "
                    f"{type(converted).__name__} with other parameter names ({sorted(names ^ set(original))[:4]}); "
                    f"Fabric keeps the object it is given, so pass a module that holds it instead, e.g. "
                    f"fabric.setup_module(torch.nn.ModuleDict({{'model': m}}))"
                )
        found = sharding.shard_tsp_modules(holder, self.tsp_group, self.root_device, "TSPFabricStrategy")
        sharded = holder.get_submodule(BARE_MODEL_PREFIX)
        if converted is module and sharded is not module:  # the unsharded TSPLlama: takes on its shard's state
            module.__dict__.update(sharded.__dict__)
            found = [(name, module if m is sharded else m) for name, m in found]
            sharded = module
        forward = GlobalBatchModel(sharded, self.batch_to_device) if isinstance(sharded, TSPLlama) else module
        _materialize_distributed_module(forward, self.root_device)
        forward.to(self.root_device)
        self._replicas = {}
        self._aux_loss_coef = sharding.models_aux_loss_coef(found)
        for _, tsp_model in found:
            self._replicas.update(sharding.distribute_parameters(tsp_model, self.device_mesh[TSP_DIM]))
        if converted is not module:
            _share_parameters(module, original, dict(sharded.named_parameters()))
        assert self._averager is not None
        self._averager.install(forward)
        return forward

    @override
    def setup_module_and_optimizers(self, module: nn.Module, optimizers: list[Optimizer], scheduler: Any = None
                                    ) -> tuple[nn.Module, list[Optimizer], Any]:
        raise TSPConfigError(
            f"fabric.setup(model, optimizer) with the {type(module).__name__}: TSPFabricStrategy replaces the model's "
            f"parameters by their shards, so an optimizer made before cannot hold them: set up the model first, then "
            f"create the optimizer from its parameters (as for Fabric's ModelParallelStrategy): "
            f"`model = fabric.setup_module(model)`, "
            f"`optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters()))`"
        )

    # ---- data ----------------------------------------------------------------------------------------------

    def shard_batch(self, batch: Any) -> dict[str, Tensor]:
        """Global batch -> this rank's ``{"input_ids", "targets", "position_ids"}`` (no collective)."""
        return sharding.shard_global_batch(batch, self.tsp_group, getattr(self, "_aux_loss_coef", 0.0))

    @override
    def batch_to_device(self, batch: Any, device: Optional[torch.device] = None) -> Any:
        """The global batch ``{"input_ids": [B, S], ...}`` -> this rank's keyword arguments of ``TSPLlama.forward``
        on the device: zigzag slice, shifted targets, positions and ``num_valid_tokens = N / dp`` (one all-reduce
        over the world: call it on every rank). Call it yourself: ``batch = fabric.strategy.batch_to_device(batch)``
        (Fabric's loop does not)."""
        local = move_data_to_device(self.shard_batch(batch), device or self.root_device)
        local["num_valid_tokens"] = sharding.token_normaliser(local["targets"], self.data_parallel_size,
                                                              dist.group.WORLD)
        return local

    # ---- gradients -----------------------------------------------------------------------------------------

    @override
    def backward(self, tensor: Tensor, module: Optional[nn.Module], *args: Any, **kwargs: Any) -> None:
        self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        if self._averager is not None and not self._averager.is_blocked:
            self._averager.reduce()  # before post_backward: the gradients are the replicas' average from here on
        self.precision.post_backward(tensor, module)

    def grad_norm(self, parameters: Iterable[Tensor]) -> Tensor:
        """Global 2-norm of the gradients, each parameter counted once (:func:`lightning_tsp.sharding.grad_norm`)."""
        return sharding.grad_norm(parameters, self.tsp_group, self._replicas, self.root_device)

    @override
    def clip_gradients_norm(self, module: nn.Module, optimizer: Optimizer, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)``: clip by the exact global 2-norm (one copy of a
        replicated KV head counted); returns the norm before clipping."""
        if float(norm_type) != 2.0:
            raise TSPConfigError(f"clip_gradients(norm_type={norm_type}): TSP clips by the 2-norm only; drop norm_type")
        self.precision.unscale_gradients(optimizer)
        params = self.precision.main_params(optimizer)
        return sharding.clip_grad_norm(params, float(max_norm), self.tsp_group, self._replicas, error_if_nonfinite)

    # ---- checkpoints ---------------------------------------------------------------------------------------

    @staticmethod
    def _tsp_model_names(module: nn.Module) -> tuple[str, str]:
        """(prefix of the TSP model inside ``module``, its prefix in a checkpoint), each "" or ending with "."."""
        found = named_tsp_models(module)
        if len(found) != 1:
            raise TSPConfigError(
                f"TSPFabricStrategy checkpoints hold exactly one TSPLlama per model, found {len(found)} in "
                f"{type(module).__name__}"
            )
        name = found[0][0]
        return (name + "." if name else ""), (name + "." if name else BARE_MODEL_PREFIX + ".")

    @staticmethod
    def _split_state(state: Mapping[str, Any]) -> tuple[str, nn.Module, list[tuple[str, Optimizer]]]:
        modules = [(k, v) for k, v in state.items() if isinstance(v, nn.Module)]
        if len(modules) != 1:
            raise TSPConfigError(
                f"TSPFabricStrategy saves and loads exactly one model per checkpoint, the state has {len(modules)} "
                f"({[k for k, _ in modules]}): e.g. state={{'model': model, 'optimizer': optimizer, 'step': step}}"
            )
        optimizers = [(k, v) for k, v in state.items() if isinstance(v, Optimizer)]
        return modules[0][0], modules[0][1], optimizers

    @override
    def save_checkpoint(self, path: _PATH, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        """A sharded DCP directory in the Trainer's layout, plus ``meta.pt`` (everything not a model or an
        optimizer) and ``tsp_model.json``; every model / optimizer tensor checked to be a DTensor first. Written
        atomically like the Trainer's checkpoints (a crash leaves the previous checkpoint loadable)."""
        if storage_options is not None or filter is not None:
            raise TSPConfigError("TSPFabricStrategy.save_checkpoint takes no storage_options and no filter")
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
        )

        import lightning

        key, module, optimizers = self._split_state(state)
        inner, saved = self._tsp_model_names(module)
        options = StateDictOptions(cpu_offload=True)
        converted: dict[str, Any] = {
            _ckpt.STATE_DICT_KEY: _rename(get_model_state_dict(module, options=options), inner, saved)
        }
        for i, (_, optimizer) in enumerate(optimizers):
            optim_state = get_optimizer_state_dict(module, optimizer, options=options)
            converted[f"optimizer_{i}"] = _rename_optimizer(optim_state, inner, saved)
        for name, value in converted.items():  # before any collective: DCP would keep one copy of a plain tensor
            _ckpt.assert_sharded_state(value, name)
        tsp_metadata = _ckpt.module_metadata(module, self.tsp_size, self.data_parallel_size)
        for entry in tsp_metadata["modules"]:
            entry["prefix"] = saved[:-1]
        metadata = {k: (v.state_dict() if isinstance(v, _Stateful) else v) for k, v in state.items()
                    if k != key and not isinstance(v, Optimizer)}
        metadata.update({
            _ckpt.METADATA_KEY: tsp_metadata, FABRIC_OPTIMIZER_KEYS: [k for k, _ in optimizers],
            "pytorch-lightning_version": lightning.__version__,
        })
        def write(staging: Path) -> None:  # atomic, as the Trainer's saves (checkpoint.atomic_save)
            staging.mkdir(parents=True, exist_ok=True)
            dcp_save(converted, checkpoint_id=staging)
            if self.global_rank == 0:
                torch.save(metadata, staging / _ckpt.LIGHTNING_METADATA_FILENAME)
                _ckpt.write_module_metadata(staging, tsp_metadata)

        _ckpt.atomic_save(self, path, write)

    @override
    def load_checkpoint(self, path: _PATH, state: Optional[Union[nn.Module, Optimizer, dict[str, Any]]] = None,
                        strict: bool = True, weights_only: Optional[bool] = None) -> dict[str, Any]:
        """Load a TSP checkpoint directory (this strategy's or a Trainer's) into ``state``: the model's tensors
        (resharded for this tsp_size), the optimizers' states, and the other entries from ``meta.pt``. The
        checkpoint's TSP model prefix comes from ``tsp_model.json``. Checked to fit before any collective."""
        from torch.distributed.checkpoint import load as dcp_load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_optimizer_state_dict,
        )

        if isinstance(state, nn.Module):
            state = {"model": state}
        if not state:
            raise TSPConfigError("TSPFabricStrategy.load_checkpoint needs state={'model': model, ...}")
        source = _ckpt.checkpoint_for_loading(path)  # the committed copy; incomplete checkpoints refused
        if not _ckpt.is_sharded_checkpoint(source):
            raise TSPConfigError(
                f"{source} is not a sharded TSP checkpoint directory (no {_ckpt.DCP_METADATA_FILENAME} in it)"
            )
        key, module, optimizers = self._split_state(state)
        inner, _ = self._tsp_model_names(module)
        saved = _saved_model_prefix(source)
        expected = {saved + k[len(inner):]: tuple(v.shape) for k, v in module.state_dict().items()
                    if isinstance(v, Tensor) and k.startswith(inner)}
        shapes = {k: v for k, v in _ckpt.saved_tensor_shapes(source).items() if k.startswith(saved)}
        _ckpt.check_state_compatible(expected, shapes, strict, str(source))
        top = _ckpt.saved_top_level_keys(source)
        meta_path = source / _ckpt.LIGHTNING_METADATA_FILENAME
        metadata = torch.load(meta_path, weights_only=weights_only) if meta_path.is_file() else {}
        opt_keys = metadata.pop(FABRIC_OPTIMIZER_KEYS, None)
        slots = {k: f"optimizer_{opt_keys.index(k) if opt_keys and k in opt_keys else i}"
                 for i, (k, _) in enumerate(optimizers)}
        missing = [k for k, slot in slots.items() if slot not in top]
        if missing:
            raise TSPConfigError(f"checkpoint {source} holds no state for the optimizer(s) {missing}")
        # collectives from here on (every rank passed the same checks)
        model_state = _rename(get_model_state_dict(module), inner, saved)
        model_state = {k: v for k, v in model_state.items() if k in shapes}
        loaded = {_ckpt.STATE_DICT_KEY: model_state}
        dcp_load(loaded, checkpoint_id=source)
        module.load_state_dict(_rename(loaded[_ckpt.STATE_DICT_KEY], saved, inner), strict=False)
        for k, optimizer in optimizers:
            slot = slots[k]
            optim_state = {slot: _rename_optimizer(get_optimizer_state_dict(module, optimizer), inner, saved)}
            dcp_load(optim_state, checkpoint_id=source)
            set_optimizer_state_dict(module, optimizer, _rename_optimizer(optim_state[slot], saved, inner),
                                     options=StateDictOptions(strict=strict))
        requested = [k for k in state if k != key and k not in slots]
        absent = [k for k in requested if k not in metadata]
        if strict and absent:
            raise KeyError(f"The requested state contains keys {absent} that the checkpoint {source} does not hold. "
                           f"To disable strict loading, set `strict=False`.")
        for k in requested:
            if k in metadata:  # a stateful object (e.g. a ResumableDataLoader) is restored in place, as Fabric does
                value = metadata.pop(k)
                if isinstance(state[k], _Stateful):
                    state[k].load_state_dict(value)
                else:
                    state[k] = value
        return metadata


def _share_parameters(module: nn.Module, original: Mapping[str, nn.Parameter],
                      sharded: Mapping[str, nn.Parameter]) -> None:
    """Make every parameter of the converted ``module`` (``original``: its parameters by name, taken before the
    conversion) the TSP model's parameter of the same name (``sharded``), tied parameters included. ``module``'s own
    forward is no longer run; its ``state_dict`` and ``parameters`` are then the TSP model's."""
    new = {id(p): sharded[name] for name, p in original.items()}
    for sub in module.modules():
        for attr, p in list(sub.named_parameters(recurse=False)):
            setattr(sub, attr, new[id(p)])


def _saved_model_prefix(path: Path) -> str:
    """The TSP model's prefix (``"model."``) in a checkpoint: from tsp_model.json, else the only one its keys allow."""
    import json

    meta = path / _ckpt.TSP_METADATA_FILENAME
    if meta.is_file():
        modules = json.loads(meta.read_text()).get("modules", [])
        if len(modules) != 1:
            raise TSPConfigError(f"checkpoint {path} holds {len(modules)} TSP models; Fabric loads exactly one")
        prefix = modules[0]["prefix"]
        return prefix + "." if prefix else ""
    return BARE_MODEL_PREFIX + "."


def _rename(state: Mapping[str, Any], old: str, new: str) -> dict[str, Any]:
    return {new + k[len(old):]: v for k, v in state.items() if k.startswith(old)}


def _rename_optimizer(state: Mapping[str, Any], old: str, new: str) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter names (``get_optimizer_state_dict``) with the prefix changed."""
    def fqn(name: Any) -> Any:
        return new + name[len(old):] if isinstance(name, str) and name.startswith(old) else name

    out = dict(state)
    if "state" in state:
        out["state"] = {fqn(k): v for k, v in state["state"].items()}
    if "param_groups" in state:
        out["param_groups"] = [{**g, "params": [fqn(p) for p in g["params"]]} for g in state["param_groups"]]
    return out
