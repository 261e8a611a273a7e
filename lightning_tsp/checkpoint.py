"""Checkpoints of :class:`~lightning_tsp.strategy.TSPStrategy`: checks on save / load, and consolidation.

A sharded checkpoint is the directory ``ModelParallelStrategy`` writes with ``torch.distributed.checkpoint`` (DCP):
``.metadata`` + one ``__<rank>_0.distcp`` file per rank + ``meta.pt`` (trainer state) and, written by TSPStrategy,
``tsp_model.json`` (model class, :class:`~lightning_tsp.models.llama.ModelConfig`, Hugging Face config if any,
the full shape and shard dim of every parameter). Every model and optimizer tensor in it is a DTensor, so DCP
stores each TSP rank's shard once and reshards on load (another tsp size, another number of replicas).

:func:`consolidate` turns such a directory into ONE full state dict with the model's own parameter names
(Hugging Face ``model.layers.0.self_attn.q_proj.weight`` ...), written as ``model.safetensors`` plus
``tsp_config.json`` (and ``config.json`` for Hugging Face-converted models). It needs no process group and no
lightning_tsp to read the result::

    from safetensors.torch import load_file
    state = load_file("out/model.safetensors")

Command line: ``lightning-tsp consolidate CKPT_DIR OUT_DIR`` (or ``python -m lightning_tsp.checkpoint``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lightning_tsp.checks import TSPConfigError

TSP_METADATA_FILENAME = "tsp_model.json"  # written next to DCP's .metadata by TSPStrategy.save_checkpoint
DCP_METADATA_FILENAME = ".metadata"
LIGHTNING_METADATA_FILENAME = "meta.pt"
MODEL_FILENAME = "model.safetensors"
CONFIG_FILENAME = "tsp_config.json"
HF_CONFIG_FILENAME = "config.json"
STATE_DICT_KEY = "state_dict"  # ModelParallelStrategy's key of the model state inside the checkpoint
METADATA_KEY = "tsp"  # the same information as tsp_model.json, inside the checkpoint dict (meta.pt / full file)
FORMAT_VERSION = 1

_PathLike = Union[str, Path]


# ---- saving: what may be written ------------------------------------------------------------------------------


def assert_sharded_state(state: Any, what: str) -> None:
    """Raise unless every tensor of ``state`` (nested dicts / lists) is a DTensor or a scalar (e.g. ``step``).

    DCP treats plain tensors under one name as replicated and keeps ONE rank's copy: per-rank shards stored as
    plain tensors would be lost silently. Scalars (0-dim, e.g. Adam's ``step``) are the same on every rank.
    """
    from torch.distributed.tensor import DTensor

    def walk(value: Any, key: str) -> None:
        if isinstance(value, DTensor):
            return
        if isinstance(value, Tensor):
            if value.dim() > 0:
                raise TSPConfigError(
                    f"refusing to save a sharded checkpoint: {what}[{key!r}] is a plain {tuple(value.shape)} tensor, "
                    f"not a DTensor. torch.distributed.checkpoint keeps only one rank's copy of a plain tensor, so "
                    f"per-rank shards would be lost. Keep TSP parameters as DTensors (TSPStrategy does this for "
                    f"TSPLlama) and put other tensors in a TSPLlama or leave them out of the state dict."
                )
            return
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{key}.{i}" if key else str(i))

    walk(state, "")


def _hf_config_dict(module: Any) -> Optional[dict]:
    cfg = getattr(module, "hf_config", None)
    if cfg is None:
        return None
    if isinstance(cfg, Mapping):
        return dict(cfg)
    to_dict = getattr(cfg, "to_dict", None)
    return to_dict() if callable(to_dict) else None


def module_metadata(root: torch.nn.Module, tsp_size: int = 1, data_parallel_size: int = 1) -> dict:
    """JSON-able description of every (outermost) TSPLlama of ``root``, keyed by its attribute path."""
    from lightning_tsp.models.llama import TSPLlama

    modules = []
    prefixes: list[str] = []
    for name, module in root.named_modules():
        if not isinstance(module, TSPLlama) or any(name.startswith(p + ".") for p in prefixes):
            continue
        prefixes.append(name)
        dims = module.shard_dims()
        modules.append({
            "prefix": name,
            "class": f"{type(module).__module__}.{type(module).__qualname__}",
            "model_config": dataclasses.asdict(module.cfg),
            "hf_config": _hf_config_dict(module),
            "parameters": {
                n: {"shape": list(module.get_parameter(n).shape), "shard_dim": dims[n],
                    "replicas": module.replicas(n)} for n in sorted(dims)
            },
        })
    return {
        "format": FORMAT_VERSION,
        "tsp_size": tsp_size,
        "data_parallel_size": data_parallel_size,
        "modules": modules,
    }


def write_module_metadata(path: _PathLike, metadata: dict) -> None:
    Path(path, TSP_METADATA_FILENAME).write_text(json.dumps(metadata, indent=1, sort_keys=True))


# ---- loading: does the checkpoint fit the model? --------------------------------------------------------------


def is_sharded_checkpoint(path: _PathLike) -> bool:
    return Path(path).is_dir() and Path(path, DCP_METADATA_FILENAME).is_file()


def saved_tensor_shapes(path: _PathLike, key: str = STATE_DICT_KEY) -> dict[str, tuple[int, ...]]:
    """Names (below ``key``) -> global shapes of the tensors of a DCP directory: reads ``.metadata`` only."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(path)).read_metadata()
    head = key + "."
    return {
        name[len(head):]: tuple(meta.size)
        for name, meta in metadata.state_dict_metadata.items()
        if name.startswith(head) and isinstance(meta, TensorStorageMetadata)
    }


def saved_top_level_keys(path: _PathLike) -> set[str]:
    from torch.distributed.checkpoint import FileSystemReader

    return {name.split(".", 1)[0] for name in FileSystemReader(str(path)).read_metadata().state_dict_metadata}


_REPLICA_HINT = (
    ", or it holds KV heads replicated over the TSP group (n_kv_heads < tsp_size), whose sharded form depends on "
    "tsp_size: resume with the tsp_size it was saved with, or consolidate it (lightning-tsp consolidate) and start "
    "from the full weights."
)


def check_state_compatible(
    expected: Mapping[str, tuple[int, ...]], saved: Mapping[str, tuple[int, ...]], strict: bool, source: str
) -> None:
    """Raise :class:`TSPConfigError` when a checkpoint cannot fill this model: a shape differs (always), or, with
    ``strict``, a parameter is missing or the checkpoint holds parameters the model does not have."""
    mismatched = [(k, tuple(saved[k]), tuple(v)) for k, v in expected.items() if k in saved and tuple(saved[k]) != tuple(v)]
    if mismatched:
        name, got, want = mismatched[0]
        more = f" ({len(mismatched) - 1} more mismatches)" if len(mismatched) > 1 else ""
        raise TSPConfigError(
            f"checkpoint {source} does not fit this model: parameter {name!r} has shape {got} in the checkpoint but "
            f"{want} in the model{more}. The checkpoint is from another model configuration"
            + (_REPLICA_HINT if any(k in name for k in ("k_proj", "v_proj")) else ".")
        )
    if strict:
        missing = sorted(set(expected) - set(saved))
        if missing:
            raise TSPConfigError(
                f"checkpoint {source} lacks {len(missing)} of the model's tensors, e.g. {missing[:3]}: it is from "
                f"another model (or set LightningModule.strict_loading = False to load a subset)"
            )
        unexpected = sorted(set(saved) - set(expected))
        if unexpected:
            raise TSPConfigError(
                f"checkpoint {source} holds {len(unexpected)} tensors the model does not have, e.g. "
                f"{unexpected[:3]}: it is from another model (or set LightningModule.strict_loading = False)"
            )


def expected_tensor_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The module's state-dict names -> global shapes (a DTensor reports its global shape); no collective."""
    return {k: tuple(v.shape) for k, v in module.state_dict().items() if isinstance(v, Tensor)}


# ---- consolidation --------------------------------------------------------------------------------------------


def read_module_metadata(path: _PathLike) -> Optional[dict]:
    file = Path(path, TSP_METADATA_FILENAME)
    return json.loads(file.read_text()) if file.is_file() else None


def _choose_prefix(keys: list[str], metadata: Optional[dict], prefix: Optional[str]) -> str:
    if prefix is not None:
        return prefix.rstrip(".")
    modules = (metadata or {}).get("modules") or []
    if len(modules) == 1:
        return modules[0]["prefix"]
    if len(modules) > 1:
        raise TSPConfigError(
            f"the checkpoint holds {len(modules)} TSP models ({[m['prefix'] for m in modules]}): pass prefix= "
            f"(--prefix) to choose one"
        )
    # no TSP metadata: find the attribute path in front of the Hugging Face names
    anchor = "model.embed_tokens.weight"
    found = sorted({k[: -len(anchor)].rstrip(".") for k in keys if k.endswith(anchor)})
    if len(found) != 1:
        raise TSPConfigError(
            f"cannot tell which parameters form the model (found {len(found)} '{anchor}' entries): pass prefix="
        )
    return found[0]


def _hf_config_from_hparams(checkpoint_dir: Path) -> Optional[dict]:
    """A Hugging Face config dict among the saved hyper-parameters (``meta.pt``), if loadable without pickle."""
    meta = checkpoint_dir / LIGHTNING_METADATA_FILENAME
    if not meta.is_file():
        return None
    try:
        hparams = torch.load(meta, map_location="cpu", weights_only=True).get("hyper_parameters") or {}
    except Exception:  # arbitrary objects in hparams: not read without trusting the pickle
        return None
    candidates = [hparams, *[v for v in hparams.values() if isinstance(v, Mapping)]]
    for c in candidates:
        if isinstance(c, Mapping) and "model_type" in c and ("architectures" in c or "hidden_size" in c):
            return dict(c)
    return None


def load_full_model_state(checkpoint: _PathLike, prefix: Optional[str] = None) -> tuple[dict[str, Tensor], dict]:
    """Full (unsharded) model tensors of a TSPStrategy checkpoint with the prefix stripped, and its metadata.

    ``checkpoint``: a DCP directory (read with ``no_dist=True``: no process group needed) or a full checkpoint
    file (``save_distributed_checkpoint=False``). Only the model tensors are read (no optimizer state).
    """
    path = Path(checkpoint)
    if is_sharded_checkpoint(path):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        metadata = read_module_metadata(path) or {}
        reader = FileSystemReader(str(path))
        head = STATE_DICT_KEY + "."
        entries = {
            name[len(head):]: meta
            for name, meta in reader.read_metadata().state_dict_metadata.items()
            if name.startswith(head) and isinstance(meta, TensorStorageMetadata)
        }
        pre = _choose_prefix(list(entries), metadata, prefix)
        keep = {k: m for k, m in entries.items() if not pre or k.startswith(pre + ".")}
        template = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in keep.items()}
        with warnings.catch_warnings():  # "torch.distributed is ... uninitialized": intended, no process group
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load({STATE_DICT_KEY: template}, storage_reader=FileSystemReader(str(path)), no_dist=True)
        full = template
    elif path.is_file():
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        metadata = ckpt.get(METADATA_KEY) or {}
        full = {k: v for k, v in ckpt[STATE_DICT_KEY].items() if isinstance(v, Tensor)}
        pre = _choose_prefix(list(full), metadata, prefix)
    else:
        raise FileNotFoundError(f"{path} is neither a DCP checkpoint directory (with {DCP_METADATA_FILENAME}) nor a file")
    cut = len(pre) + 1 if pre else 0
    state = {k[cut:]: v for k, v in full.items() if not pre or k.startswith(pre + ".")}
    module = next((m for m in metadata.get("modules", []) if m["prefix"] == pre), None)
    if module is not None:  # the saved parameter list is the ground truth: complete, same shapes
        want = {n: tuple(p["shape"]) for n, p in module["parameters"].items()}
        check_state_compatible(want, {k: tuple(v.shape) for k, v in state.items()}, strict=True, source=str(path))
        state = _drop_replicas(state, module, metadata.get("tsp_size", 1))
    return state, (module or {})


def _drop_replicas(state: dict[str, Tensor], module: dict, tsp_size: int) -> dict[str, Tensor]:
    """A KV head replicated on r ranks is saved r times (one shard per rank): keep one copy of each."""
    out = dict(state)
    for name, info in module["parameters"].items():
        r, dim = info.get("replicas", 1), info.get("shard_dim")
        if r > 1 and dim is not None and name in out:
            out[name] = torch.cat(out[name].chunk(tsp_size, dim=dim)[::r], dim=dim)
    return out


def consolidate(
    checkpoint_dir: _PathLike,
    out_path_or_dir: _PathLike,
    *,
    prefix: Optional[str] = None,
    dtype: Optional[torch.dtype] = None,
) -> Path:
    """Write the full model of a sharded TSPStrategy checkpoint as one safetensors file; returns its path.

    ``out_path_or_dir``: a directory (gets ``model.safetensors``, ``tsp_config.json`` and, for Hugging Face
    models, ``config.json`` so that ``AutoModelForCausalLM.from_pretrained(dir)`` works) or a ``*.safetensors``
    file path (the JSON files go next to it). Names are the model's own (Hugging Face) parameter names: the
    LightningModule attribute path (e.g. ``model.``) is stripped; ``prefix`` overrides which one. ``dtype``
    casts floating tensors (default: as saved). Bit-exact otherwise. No process group is used.
    """
    from safetensors.torch import save_file

    state, module = load_full_model_state(checkpoint_dir, prefix)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    out = Path(out_path_or_dir)
    if out.suffix == ".safetensors":
        out_dir, model_file = out.parent, out
    else:
        out_dir, model_file = out, out / MODEL_FILENAME
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(state.items())}, str(model_file), metadata={"format": "pt"})

    info = {
        "format": FORMAT_VERSION,
        "model_class": module.get("class"),
        "model_config": module.get("model_config"),
        "source_checkpoint": str(Path(checkpoint_dir).resolve()),
        "weights": model_file.name,
    }
    (out_dir / CONFIG_FILENAME).write_text(json.dumps(info, indent=1, sort_keys=True))
    hf_config = module.get("hf_config")
    if hf_config is None and Path(checkpoint_dir).is_dir():
        hf_config = _hf_config_from_hparams(Path(checkpoint_dir))
    if hf_config is not None:
        hf_config = dict(hf_config)
        if dtype is not None:
            hf_config["torch_dtype"] = str(dtype).removeprefix("torch.")
        (out_dir / HF_CONFIG_FILENAME).write_text(json.dumps(hf_config, indent=1, sort_keys=True))
    return model_file


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def main(argv: Optional[list[str]] = None) -> int:
    """``lightning-tsp consolidate CKPT OUT [--prefix P] [--dtype D]``."""
    parser = argparse.ArgumentParser(
        prog="lightning-tsp consolidate",
        description="Merge a sharded TSPStrategy checkpoint (DCP directory) into one model.safetensors "
        "(+ tsp_config.json, + config.json for Hugging Face models). Runs on one process, no GPU needed.",
    )
    parser.add_argument("checkpoint", help="DCP checkpoint directory (or a full checkpoint file)")
    parser.add_argument("out", help="output directory, or a path ending in .safetensors")
    parser.add_argument("--prefix", default=None, help="attribute path of the model in the LightningModule "
                        "(default: from the checkpoint's tsp_model.json, e.g. 'model')")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="cast floating tensors")
    args = parser.parse_args(argv)
    try:
        path = consolidate(args.checkpoint, args.out, prefix=args.prefix,
                           dtype=_DTYPES[args.dtype] if args.dtype else None)
    except (TSPConfigError, FileNotFoundError) as err:
        print(f"lightning-tsp consolidate: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
