"""Building a model for generation from a checkpoint, each rank reading only its own slices of the weights.

The kind of source is detected from the path (:func:`resolve_checkpoint`):

* ``"dcp"``: a sharded checkpoint directory written by :class:`~lightning_tsp.strategy.TSPStrategy`
  (``.metadata`` + ``__<rank>_0.distcp`` + ``tsp_model.json``). Configuration and model class come from
  ``tsp_model.json``; the weights are read with ``torch.distributed.checkpoint`` into DTensors over a 1-D mesh of
  the TSP group (``Shard(dim)``), so a rank reads only its slices, whatever tsp size wrote the checkpoint. At D = 1
  DCP reads without a process group.
* ``"hf"``: a Hugging Face directory (``config.json`` + ``model.safetensors``, a sharded safetensors index, or
  ``pytorch_model.bin``).
* ``"consolidated"``: a directory written by ``lightning-tsp consolidate`` (``model.safetensors`` +
  ``tsp_config.json``, + ``config.json`` for Hugging Face models, which then wins).
* ``"safetensors"``: one ``.safetensors`` file; ``"torch"``: one ``torch.save`` file holding a full state
  dict with the model's (Hugging Face) parameter names; ``"lightning"``: a full Lightning checkpoint file of a
  TSPStrategy run (``save_distributed_checkpoint=False``: ``state_dict`` + ``tsp`` metadata). For files the
  configuration is ``config=``, else a ``config.json`` / ``tsp_config.json`` beside the file, else ``preset=``.

A Hugging Face configuration is mapped ONLY by :func:`lightning_tsp.convert.hf.model_config_from_hf` (through
the ``transformers`` config class of its ``model_type`` when transformers is installed, so missing keys get
Hugging Face's own defaults) and builds a :class:`~lightning_tsp.convert.hf.TSPCausalLM`; a built-in model's
``model_config`` builds a :class:`~lightning_tsp.models.llama.TSPLlama`. A ``config.json`` without
``model_type`` is refused: Llama, Mistral, Qwen2 and Qwen3 share key names but not the function (q/k/v biases,
q/k norms, head_dim and window defaults), so guessing "llama" could silently compute another model.

Safetensors weights are read by :func:`lightning_tsp.convert.hf.load_pretrained_shards` (this rank's rows or
columns of every tensor, never a full weight); ``torch.save`` files hold full tensors by nature: they are
memory-mapped and each rank copies its slices (:meth:`TSPLlama.load_full_state_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_tsp import checkpoint as ckpt
from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.models.llama import ModelConfig, TSPLlama, get_config
from lightning_tsp.schedules.comm import local_tensor

__all__ = ["CheckpointSource", "resolve_checkpoint", "build_model", "load_weights", "load_model",
           "load_sharded_checkpoint", "model_config_from_json"]

KINDS = ("dcp", "hf", "consolidated", "safetensors", "torch", "lightning")
_SAFETENSORS_INDEX = "model.safetensors.index.json"
_TORCH_FILES = ("pytorch_model.bin.index.json", "pytorch_model.bin")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# model classes whose computation generation reproduces (prefill/decode run the TSPLlama layers directly)
_MODEL_CLASSES = ("lightning_tsp.models.llama.TSPLlama", "lightning_tsp.convert.hf.TSPCausalLM")
# keys whose Hugging Face defaults differ between families: required when transformers is not there to fill them
_REQUIRED_HF_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size")
_REQUIRED_BY_TYPE = {"qwen3": ("head_dim",), "mistral": ("sliding_window",)}


@dataclass
class CheckpointSource:
    """Where a model's configuration and weights are, as found by :func:`resolve_checkpoint`."""

    kind: str  # one of KINDS
    path: str  # the checkpoint as given
    cfg: ModelConfig  # an HFModelConfig (-> TSPCausalLM) for Hugging Face configurations
    weights: str  # dcp: the directory; safetensors: a file or a directory of them; torch / lightning: the file
    prefix: str = ""  # dcp / lightning: attribute path of the model inside the state dict (e.g. "model")
    tokenizer_dir: str | None = None
    saved_tsp_size: int | None = None  # dcp: the tsp size that wrote it (any other is resharded on load)

    @property
    def is_hf(self) -> bool:
        return getattr(self.cfg, "hf_config", None) is not None


# ---- configurations ---------------------------------------------------------------------------------------------


def _hf_model_config(d: Mapping[str, Any], where: str) -> ModelConfig:
    """A Hugging Face config dict -> HFModelConfig, through ``model_config_from_hf`` only."""
    from lightning_tsp.convert.hf import SUPPORTED_CLASSES, model_config_from_hf

    if "model_type" not in d:
        raise TSPConfigError(
            f"{where} has no 'model_type' key: cannot tell which architecture it describes (Llama, Mistral, Qwen2 "
            f"and Qwen3 share the key names but not the computation: q/k/v biases, q/k norms, head_dim and "
            f"sliding-window defaults). Add e.g. \"model_type\": \"llama\" to it."
        )
    model_type = d["model_type"]
    hf: Any = dict(d)
    if model_type in set(SUPPORTED_CLASSES.values()):  # others: model_config_from_hf refuses them by name
        try:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        except ImportError:
            required = _REQUIRED_HF_KEYS + _REQUIRED_BY_TYPE.get(model_type, ())
            missing = [k for k in required if k not in d]
            if missing:
                raise TSPConfigError(
                    f"{where} lacks {missing}: without transformers installed their Hugging Face defaults (which "
                    f"differ between families) are unknown. Install transformers or write the keys out."
                ) from None
        else:
            try:
                hf = CONFIG_MAPPING[model_type].from_dict(dict(d))
            except (TypeError, ValueError, KeyError) as err:
                raise TSPConfigError(f"{where}: transformers refuses this {model_type!r} configuration: {err}") from err
    return model_config_from_hf(hf)


def _builtin_config(d: Mapping[str, Any]) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    try:
        return ModelConfig(**{k: v for k, v in d.items() if k in names})
    except TypeError as err:
        raise TSPConfigError(f"model_config {dict(d)} is not a lightning_tsp ModelConfig: {err}") from err


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _config_from_module_metadata(module: Mapping[str, Any], where: str) -> ModelConfig:
    """A model of ``tsp_model.json`` / ``tsp_config.json``: its Hugging Face config when it has one (checked
    against the ModelConfig it was trained with), else its ModelConfig."""
    cls = module.get("class") or module.get("model_class")
    if cls is not None and cls not in _MODEL_CLASSES:
        raise TSPConfigError(
            f"{where}: the model is a {cls}; generation computes {' / '.join(_MODEL_CLASSES)} only (prefill and "
            f"decode run the TSPLlama layers themselves, so a subclass that changes them would be computed wrongly)"
        )
    saved = module.get("model_config") or {}
    hf = module.get("hf_config") or saved.get("hf_config")
    if not hf:
        if not saved:
            raise TSPConfigError(f"{where} holds no model configuration: pass config= (--config) or preset=")
        return _builtin_config(saved)
    cfg = _hf_model_config(hf, f"{where} (hf_config)")
    for f in dataclasses.fields(ModelConfig):
        if f.name == "init_std" or f.name not in saved:
            continue
        got, want = _jsonable(getattr(cfg, f.name)), _jsonable(saved[f.name])
        if got != want:
            raise TSPConfigError(
                f"{where}: its Hugging Face config gives {f.name}={got!r} but the model was built with "
                f"{f.name}={want!r}; the two configurations disagree"
            )
    return cfg


def model_config_from_json(path: str | os.PathLike) -> ModelConfig:
    """A configuration file -> ModelConfig: a ``tsp_config.json`` (``lightning-tsp consolidate``) or a Hugging Face
    ``config.json`` (an HFModelConfig, mapped by ``model_config_from_hf``)."""
    path = Path(path)
    if not path.is_file():
        raise TSPConfigError(f"no model configuration: {str(path)!r} does not exist (pass --config or --preset)")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise TSPConfigError(f"{str(path)!r} is not valid JSON: {err}") from err
    if not isinstance(d, dict):
        raise TSPConfigError(f"{str(path)!r} does not hold a JSON object")
    if "model_config" in d and "model_type" not in d:  # tsp_config.json
        return _config_from_module_metadata(d, str(path))
    return _hf_model_config(d, str(path))


# ---- finding the source -----------------------------------------------------------------------------------------


def _torch_load(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # not a torch file, or objects that weights_only refuses to unpickle
        raise TSPConfigError(f"cannot read {str(path)!r} as a torch.save'd state dict (weights_only=True): {err}") \
            from err


def _is_lightning_checkpoint(obj: Any) -> bool:
    return isinstance(obj, Mapping) and isinstance(obj.get(ckpt.STATE_DICT_KEY), Mapping)


def _choose_module(metadata: Mapping[str, Any] | None, prefix: str | None, keys: list[str]) -> tuple[str, dict | None]:
    pre = ckpt._choose_prefix(keys, dict(metadata) if metadata else None, prefix)
    module = next((m for m in (metadata or {}).get("modules", []) if m.get("prefix") == pre), None)
    return pre, module


def resolve_checkpoint(path: str | os.PathLike, config: str | os.PathLike | None = None, preset: str | None = None,
                       prefix: str | None = None) -> CheckpointSource:
    """Find the kind, the weights and the configuration of a checkpoint; reads no weight.

    ``config`` (a ``config.json`` or ``tsp_config.json``) or ``preset`` (a built-in preset name), when given, win
    over any configuration found with the weights. ``prefix``: the model's attribute path inside a Lightning
    checkpoint holding several TSP models (default: from ``tsp_model.json``).
    """
    p = Path(path)
    if not p.exists():
        raise TSPConfigError(f"checkpoint {str(path)!r} does not exist")
    given = model_config_from_json(config) if config is not None else get_config(preset) if preset else None
    tok_dir = str(p) if p.is_dir() and any((p / t).is_file() for t in _TOKENIZER_FILES) else None

    if ckpt.is_sharded_checkpoint(p):
        metadata = ckpt.read_module_metadata(p)
        keys = list(ckpt.saved_tensor_shapes(p))
        if not keys:
            raise TSPConfigError(f"{str(p)!r} is a DCP checkpoint without model tensors under "
                                 f"'{ckpt.STATE_DICT_KEY}': not a Lightning checkpoint")
        pre, module = _choose_module(metadata, prefix, keys)
        if given is not None:
            cfg = given
        elif module is not None:
            cfg = _config_from_module_metadata(module, str(p / ckpt.TSP_METADATA_FILENAME))
        else:
            hf = ckpt._hf_config_from_hparams(p)
            if hf is None:
                raise TSPConfigError(f"{str(p)!r} has no {ckpt.TSP_METADATA_FILENAME} (not written by TSPStrategy?) "
                                     f"and no Hugging Face config in its hyper-parameters: pass --config or --preset")
            cfg = _hf_model_config(hf, f"{str(p / ckpt.LIGHTNING_METADATA_FILENAME)} (hyper-parameters)")
        return CheckpointSource("dcp", str(path), cfg, str(p), pre, tok_dir,
                                (metadata or {}).get("tsp_size"))

    if p.is_dir():
        tsp_cfg = p / ckpt.CONFIG_FILENAME
        hf_cfg = p / ckpt.HF_CONFIG_FILENAME
        kind = "consolidated" if tsp_cfg.is_file() else "hf"
        weights: Path | None = None
        if tsp_cfg.is_file():
            named = json.loads(tsp_cfg.read_text()).get("weights")
            if named and (p / named).is_file():
                weights = p / named
        if weights is None:
            if (p / _SAFETENSORS_INDEX).is_file() or any(p.glob("*.safetensors")):
                weights = p
            else:
                weights = next((p / f for f in _TORCH_FILES if (p / f).is_file()), None)
        if weights is None:
            raise TSPConfigError(
                f"{str(p)!r} holds no weights (*.safetensors, {_SAFETENSORS_INDEX}, {' or '.join(_TORCH_FILES)}) and "
                f"no DCP {ckpt.DCP_METADATA_FILENAME}: not a model or checkpoint directory"
            )
        if given is not None:
            cfg = given
        elif hf_cfg.is_file():
            cfg = model_config_from_json(hf_cfg)
        elif tsp_cfg.is_file():
            cfg = model_config_from_json(tsp_cfg)
        else:
            raise TSPConfigError(f"{str(p)!r} has neither config.json nor {ckpt.CONFIG_FILENAME}: pass --config "
                                 f"or --preset")
        return CheckpointSource(kind, str(path), cfg, str(weights), "", tok_dir)

    # a single file
    kind = "safetensors" if p.suffix == ".safetensors" else "torch"
    pre = ""
    cfg = given
    if kind == "torch":
        obj = _torch_load(p)
        if _is_lightning_checkpoint(obj):  # a full Lightning checkpoint: its own metadata describes the model
            kind = "lightning"
            keys = [k for k, v in obj[ckpt.STATE_DICT_KEY].items() if isinstance(v, Tensor)]
            pre, module = _choose_module(obj.get(ckpt.METADATA_KEY), prefix, keys)
            if cfg is None and module is not None:
                cfg = _config_from_module_metadata(module, f"{str(p)} ({ckpt.METADATA_KEY!r} metadata)")
        elif not isinstance(obj, Mapping):
            raise TSPConfigError(f"{str(p)!r} does not hold a state dict (got {type(obj).__name__})")
        del obj
    if cfg is None:
        for beside in (p.parent / ckpt.HF_CONFIG_FILENAME, p.parent / ckpt.CONFIG_FILENAME):
            if beside.is_file():
                cfg = model_config_from_json(beside)
                break
    if cfg is None:
        raise TSPConfigError(f"no configuration for {str(path)!r}: pass --config CONFIG.json or --preset NAME")
    return CheckpointSource(kind, str(path), cfg, str(p), pre, None)


# ---- building and loading ---------------------------------------------------------------------------------------


def build_model(source: CheckpointSource | ModelConfig, tsp: TSPGroup | None = None, *,
                dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> TSPLlama:
    """The empty (uninitialised) model of ``source``'s configuration, sharded over ``tsp``: a TSPCausalLM for a
    Hugging Face configuration (its sliding-window / dropout checks apply), else a TSPLlama."""
    from lightning_tsp.convert.hf import TSPCausalLM

    cfg = source.cfg if isinstance(source, CheckpointSource) else source
    cls = TSPCausalLM if getattr(cfg, "hf_config", None) is not None else TSPLlama
    model = cls(cfg, tsp, device="meta", dtype=dtype or torch.get_default_dtype())
    model.to_empty(device=device if device is not None else "cpu")
    return model


@torch.no_grad()
def _load_torch_files(model: TSPLlama, files: list[Path]) -> None:
    wanted = set(model.shard_dims())
    found: set[str] = set()
    for file in files:
        obj = _torch_load(file)
        if not isinstance(obj, Mapping):
            raise TSPConfigError(f"{str(file)!r} does not hold a state dict (got {type(obj).__name__})")
        state = {k: v for k, v in obj.items() if isinstance(v, Tensor)}
        if not wanted & set(state):  # base-model names (no "model." prefix), as load_pretrained_shards accepts
            state = {f"model.{k}" if f"model.{k}" in wanted else k: v for k, v in state.items()}
        model.load_full_state_dict(state, strict=False)  # copies this rank's slices; shape errors name the parameter
        found |= wanted & set(state)
    missing = sorted(wanted - found)
    if missing:
        raise TSPConfigError(
            f"checkpoint lacks {len(missing)} of the model's parameters, e.g. {missing[:3]}: is it a full "
            f"(consolidated) state dict with Hugging Face names?"
        )


@torch.no_grad()
def load_sharded_checkpoint(model: TSPLlama, path: str | os.PathLike, prefix: str = "model") -> None:
    """Read this rank's shards of ``model``'s parameters from a TSPStrategy DCP directory (any saved tsp size).

    Sharded parameters become DTensors ``Shard(dim)`` over a 1-D DeviceMesh of ``model.tsp`` whose local tensors
    ARE the parameters' storage, so DCP reads each rank's slices straight into place, resharding from whatever tsp
    size wrote the checkpoint. Replicated parameters (norms) are read whole. KV heads replicated over ranks
    (n_kv_heads < tsp_size, when saving or now) are read whole (they are small): a checkpoint saved with r copies
    of each KV head holds every copy (``replicas`` in ``tsp_model.json``), one is kept, then this rank's slice.
    Names are ``state_dict.<prefix>.<parameter>``. With D = 1 DCP reads without any collective (``no_dist``).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    path = Path(path)
    head = f"{prefix}." if prefix else ""
    saved = {k[len(head):]: v for k, v in ckpt.saved_tensor_shapes(path).items() if k.startswith(head)}
    metadata = ckpt.read_module_metadata(path) or {}
    module = next((m for m in metadata.get("modules", []) if m.get("prefix") == prefix), None) or {}
    saved_size = int(metadata.get("tsp_size", 1))
    saved_replicas = {n: int(info.get("replicas", 1)) for n, info in module.get("parameters", {}).items()}
    dims = model.shard_dims()
    want: dict[str, tuple[int, ...]] = {}
    for name, dim in dims.items():  # the shapes in the checkpoint: every saved copy of a replicated KV head
        shape = list(model.full_shape(name))
        if dim is not None:
            shape[dim] *= saved_replicas.get(name, 1)
        want[name] = tuple(shape)
    ckpt.check_state_compatible(want, saved, strict=True, source=str(path))
    tsp = model.tsp
    state: dict[str, Tensor] = {}
    whole: dict[str, Tensor] = {}  # read whole by every rank, then sliced
    mesh = None
    for name, dim in dims.items():
        local = local_tensor(model.get_parameter(name)).detach()
        if dim is None or (tsp.size == 1 and saved_replicas.get(name, 1) == 1):
            state[head + name] = local
        elif model.replicas(name) == 1 and saved_replicas.get(name, 1) == 1:
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor import DTensor, Shard

            mesh = mesh or DeviceMesh.from_group(tsp.group, local.device.type)
            state[head + name] = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False)
        else:
            whole[name] = state[head + name] = torch.empty(want[name], dtype=local.dtype, device=local.device)
    reader = FileSystemReader(str(path))
    if tsp.size == 1:
        with warnings.catch_warnings():  # "torch.distributed is disabled / uninitialized": intended here
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            dcp.load({ckpt.STATE_DICT_KEY: state}, storage_reader=reader, no_dist=True)
    else:
        dcp.load({ckpt.STATE_DICT_KEY: state}, storage_reader=reader, process_group=tsp.group)
    for name, full in whole.items():
        r = saved_replicas.get(name, 1)
        if r > 1:  # saved_size shards, r consecutive copies of each KV group: keep the first of each
            full = torch.cat(full.chunk(saved_size, dim=dims[name])[::r], dim=dims[name])
        local_tensor(model.get_parameter(name)).copy_(model.local_slice(name, full))


@torch.no_grad()
def load_weights(model: TSPLlama, source: CheckpointSource) -> None:
    """Copy this rank's slices of ``source``'s weights into ``model`` (strict: every parameter, full shapes
    checked; errors name the parameter and both shapes)."""
    weights = Path(source.weights)
    if source.kind == "dcp":
        load_sharded_checkpoint(model, weights, source.prefix)
    elif source.kind == "lightning":  # a full Lightning checkpoint file
        state, _ = ckpt.load_full_model_state(weights, source.prefix)
        model.load_full_state_dict(state, strict=True)
    elif weights.name == _TORCH_FILES[0]:  # a sharded pytorch_model.bin
        shards = sorted(set(json.loads(weights.read_text())["weight_map"].values()))
        _load_torch_files(model, [weights.parent / s for s in shards])
    elif weights.is_file() and weights.suffix != ".safetensors":
        _load_torch_files(model, [weights])
    else:
        from lightning_tsp.convert.hf import load_pretrained_shards

        load_pretrained_shards(model, weights)


def load_model(path: str | os.PathLike | CheckpointSource, tsp: TSPGroup | None = None,
               dtype: torch.dtype | None = None, device: torch.device | str | None = None, *,
               config: str | os.PathLike | None = None, preset: str | None = None,
               prefix: str | None = None) -> TSPLlama:
    """A model ready for :func:`lightning_tsp.inference.generate`, sharded over ``tsp`` (None: D = 1), in eval
    mode, from any source kind (see the module docstring): a Hugging Face directory, a ``.safetensors`` file, a
    ``torch.save`` file, a consolidated directory or a sharded TSPStrategy checkpoint directory. Every rank of
    ``tsp`` must call it (a DCP checkpoint is read collectively)."""
    source = path if isinstance(path, CheckpointSource) else resolve_checkpoint(path, config, preset, prefix)
    model = build_model(source, tsp, dtype=dtype, device=device)
    load_weights(model, source)
    return model.eval()
