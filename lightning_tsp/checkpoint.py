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
import errno
import json
import os
import re
import shutil
import sys
import time
import warnings
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Callable, Optional, Union

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


# ---- atomic saves ---------------------------------------------------------------------------------------------
#
# TSPStrategy.save_checkpoint writes every checkpoint (DCP directory or single file) to a hidden STAGING sibling and
# moves it into place only after every rank has finished writing, so a crash or kill at any moment leaves the
# previous checkpoint of that name loadable and never a half-written one under the real name:
#
#   1. rank 0 prepares (``prepare_atomic_save``): an interrupted commit of an earlier save is undone (its PREVIOUS
#      sibling renamed back), stale staging / trash siblings are removed;
#   2. every rank writes into the staging sibling; the ranks agree that all of them succeeded;
#   3. rank 0 commits (``commit_atomic_save``): with ``renameat2(RENAME_EXCHANGE)`` (Linux; ext4, xfs, btrfs, tmpfs)
#      staging and the old checkpoint swap names in one atomic step, else the old checkpoint is renamed to the
#      PREVIOUS sibling and staging to the real name (two renames: between them only PREVIOUS holds the complete
#      older checkpoint, and every reader here falls back to it); the old one is then renamed to a TRASH sibling
#      and deleted, so a PREVIOUS sibling is always complete.
#
# Sibling names start with "." and contain neither "ckpt_" nor end in ".ckpt": Lightning numbers ``hpc_ckpt_N``
# checkpoints by the digits after "ckpt_" in every name of ``default_root_dir`` and ModelCheckpoint finds
# ``last*.ckpt`` by suffix, so a staging or trash sibling is never taken for a checkpoint.

STAGING_SUFFIX = ".tsp-staging"
PREVIOUS_SUFFIX = ".tsp-previous"
TRASH_SUFFIX = ".tsp-trash"
DCP_FILE_SUFFIX = ".distcp"
_CHECKPOINT_FILES = {DCP_METADATA_FILENAME, LIGHTNING_METADATA_FILENAME, TSP_METADATA_FILENAME}


class IncompleteCheckpointError(RuntimeError):
    """A checkpoint directory misses files its DCP ``.metadata`` names (an interrupted non-atomic save)."""


def _encode_name(name: str) -> str:
    # injective, and the result never contains "ckpt_" (see above)
    return name.replace("%", "%25").replace("ckpt_", "ckpt%5F")


def _sibling(path: _PathLike, suffix: str) -> Path:
    path = Path(path)
    return path.parent / f".{_encode_name(path.name)}{suffix}"


def staging_path(path: _PathLike) -> Path:
    """Where a save of ``path`` is written before it is committed (a hidden sibling)."""
    return _sibling(path, STAGING_SUFFIX)


def previous_path(path: _PathLike) -> Path:
    """Where the committed checkpoint ``path`` sits while a newer save is being moved in (fallback commit only)."""
    return _sibling(path, PREVIOUS_SUFFIX)


def _trash_paths(path: Path) -> list[Path]:
    head = _sibling(path, TRASH_SUFFIX).name
    if not path.parent.is_dir():
        return []
    return [p for p in path.parent.iterdir() if p.name == head or p.name.startswith(head + ".")]


def _remove(path: Path) -> None:
    """Delete a file or directory tree; a directory is first renamed to a unique trash name (so it is never seen
    half-deleted under a name a reader looks at)."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
        return
    if not path.exists():
        return
    if TRASH_SUFFIX not in path.name:
        trash = path.parent / f"{_sibling(path, TRASH_SUFFIX).name}.{os.getpid()}.{time.monotonic_ns()}"
        os.rename(path, trash)
        path = trash
    shutil.rmtree(path, ignore_errors=True)


def _fsync(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some file systems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _looks_like_checkpoint_dir(path: Path) -> bool:
    """An (empty or) DCP checkpoint directory, complete or not: only files a checkpoint holds."""
    return all(p.is_file() and (p.name in _CHECKPOINT_FILES or p.name.endswith(DCP_FILE_SUFFIX))
               for p in path.iterdir())


def check_replaceable(path: _PathLike) -> None:
    """Raise ``IsADirectoryError`` if saving to ``path`` would replace a directory that is not a checkpoint.

    Read-only: every rank calls it before any collective, so a refusal never leaves a rank waiting.
    """
    path = Path(path)
    if path.is_dir() and not path.is_symlink() and not _looks_like_checkpoint_dir(path):
        foreign = sorted(p.name for p in path.iterdir()
                         if not (p.name in _CHECKPOINT_FILES or p.name.endswith(DCP_FILE_SUFFIX)))
        raise IsADirectoryError(
            f"refusing to save a checkpoint to {path}: it is a directory that is not a checkpoint (it holds "
            f"{foreign[:5]}), and saving replaces the whole path. Choose another checkpoint path or move it away."
        )


def recover_interrupted_commit(path: _PathLike) -> bool:
    """If a commit of ``path`` was cut between its two renames (only ``previous_path(path)`` exists), rename the
    previous checkpoint back to ``path``. Safe to call from several processes at once (one rename wins, the others
    find ``path`` present). Returns whether it renamed."""
    path, previous = Path(path), previous_path(path)
    if path.exists() or path.is_symlink() or not previous.exists():
        return False
    try:
        os.rename(previous, path)
    except OSError:  # another process was first, or the directory is read-only: readers fall back to `previous`
        return False
    return True


def prepare_atomic_save(path: _PathLike) -> Path:
    """Rank 0, before the ranks write: undo an interrupted commit, remove stale staging / trash siblings, create
    the parent directory. Returns the staging path to write to."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_interrupted_commit(path)
    if previous_path(path).exists():  # both exist: a commit finished its renames but not the deletion
        _remove(previous_path(path))
    for trash in _trash_paths(path):
        _remove(trash)
    staging = staging_path(path)
    if staging.exists() or staging.is_symlink():  # a save that was interrupted while writing
        _remove(staging)
    return staging


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_renameat2: Any = None  # None: not looked up yet; False: unavailable


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (Linux ``renameat2(RENAME_EXCHANGE)``); False if unsupported."""
    global _renameat2
    if _renameat2 is None:
        _renameat2 = False
        if sys.platform.startswith("linux"):
            try:
                import ctypes

                libc = ctypes.CDLL(None, use_errno=True)
                fn = libc.renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2 = fn
            except (OSError, AttributeError):
                pass
    if not _renameat2:
        return False
    import ctypes

    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False  # this file system (NFS, Lustre, ...) cannot swap: the two-rename commit below
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def _step(name: str) -> None:
    """Test seam: ``_save_step_hook`` (None in normal runs) is called at each step of an atomic save on every rank
    that reaches it: "written" (all ranks wrote the staging copy, before the commit), "moved_aside" (fallback
    commit: the old checkpoint is at ``previous_path``, the new one still at ``staging_path``) and "committed"
    (the new checkpoint is in place, the old one not yet deleted)."""
    if _save_step_hook is not None:
        _save_step_hook(name)


_save_step_hook: Optional[Callable[[str], None]] = None


def commit_atomic_save(path: _PathLike) -> None:
    """Rank 0, after every rank wrote ``staging_path(path)``: move it to ``path``, replacing an older checkpoint."""
    path = Path(path)
    staging = staging_path(path)
    if staging.is_dir():
        for f in staging.iterdir():  # DCP fsyncs its shards; meta.pt and tsp_model.json are not
            if f.name in _CHECKPOINT_FILES:
                _fsync(f)
    _fsync(staging)
    if path.exists() or path.is_symlink():
        if path.is_symlink():  # e.g. a former ModelCheckpoint(save_last="link"): replace the link, not its target
            path.unlink()
            os.rename(staging, path)
        elif _exchange(staging, path):
            _step("committed")
            _remove(staging)  # now the old checkpoint
        else:
            previous = previous_path(path)
            os.rename(path, previous)
            _step("moved_aside")
            os.rename(staging, path)
            _step("committed")
            _remove(previous)
    else:
        os.rename(staging, path)
    _fsync(path.parent)


def checkpoint_problem(path: _PathLike) -> Optional[str]:
    """Why ``path`` is not a complete checkpoint (None if it is one): for a DCP directory, ``.metadata`` and
    ``meta.pt`` must exist and every shard file that ``.metadata`` names must be there, at least as long as the
    data it points into. Reads ``.metadata`` only."""
    path = Path(path)
    if path.is_file():  # torch.save writes a zip archive: a truncated one has no end-of-archive record
        return None if zipfile.is_zipfile(path) else "it is not a complete torch.save file"
    if not path.is_dir():
        return "it does not exist"
    if not (path / DCP_METADATA_FILENAME).is_file():
        return f"it has no {DCP_METADATA_FILENAME} file"
    if not (path / LIGHTNING_METADATA_FILENAME).is_file():
        return f"it has no {LIGHTNING_METADATA_FILENAME} file"
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as err:  # truncated or corrupt .metadata
        return f"its {DCP_METADATA_FILENAME} cannot be read ({type(err).__name__}: {err})"
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        rel = getattr(info, "relative_path", None)
        if rel is not None:
            need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel, size in sorted(need.items()):
        file = path / rel
        if not file.is_file():
            return f"its shard file {rel} is missing"
        if file.stat().st_size < size:
            return f"its shard file {rel} is truncated ({file.stat().st_size} of at least {size} bytes)"
    return None


def atomic_save(strategy: Any, path: _PathLike, write: Callable[[Path], None]) -> None:
    """Every rank calls this: ``write(staging)`` writes this rank's part of the checkpoint into the hidden staging
    sibling of ``path``; rank 0 moves it into place only after every rank wrote its part. ``strategy`` is a Trainer
    or Fabric strategy (``broadcast``, ``reduce_boolean_decision``, ``global_rank``). An error on any rank is
    raised on every rank (none waits forever) and leaves ``path`` as it was."""
    path = Path(strategy.broadcast(str(path)))
    check_replaceable(path)  # every rank, before any further collective
    _on_rank_zero(strategy, lambda: prepare_atomic_save(path), f"preparing to save {path}")
    error: Optional[Exception] = None
    try:
        write(staging_path(path))
    except Exception as err:  # every rank must learn of it: the others would wait for the commit
        error = err
    if not strategy.reduce_boolean_decision(error is None, all=True):
        if error is not None:
            raise error
        raise RuntimeError(f"saving checkpoint {path} failed on another rank (see its error); {path} is unchanged")
    _step("written")
    _on_rank_zero(strategy, lambda: commit_atomic_save(path), f"committing checkpoint {path}")


def _on_rank_zero(strategy: Any, fn: Callable[[], Any], what: str) -> None:
    """Run ``fn`` (file operations) on global rank 0 and raise its error on every rank."""
    error: Optional[BaseException] = None
    if strategy.global_rank == 0:
        try:
            fn()
        except Exception as err:
            error = err
    message = strategy.broadcast(None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(f"{what} failed on global rank 0: {message}")


def checkpoint_for_loading(path: _PathLike) -> Path:
    """The complete checkpoint to load for ``path``: ``path`` itself, or its previous copy when a commit was cut
    between its two renames. Raises ``FileNotFoundError`` / :class:`IncompleteCheckpointError` with the reason."""
    path = Path(path)
    if not path.exists():
        previous = previous_path(path)
        if previous.exists() and checkpoint_problem(previous) is None:
            warnings.warn(f"checkpoint {path} is missing: a save to it was interrupted while replacing it; loading "
                          f"the complete previous checkpoint of that name, {previous}", stacklevel=2)
            return previous
        interrupted = staging_path(path).exists()
        raise FileNotFoundError(
            f"checkpoint {path} does not exist"
            + (f" (a save to it was interrupted before it finished: {staging_path(path).name} holds the partial "
               f"write, which is not loadable)" if interrupted else "")
            + ". Pass an existing checkpoint, or ckpt_path='auto' with lightning-tsp (the newest complete one)."
        )
    problem = checkpoint_problem(path)
    if problem is not None:
        raise IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: {problem}. It was written by an interrupted save that was not atomic "
            f"(an older lightning-tsp or another strategy) or files were deleted; resume from another checkpoint."
        )
    return path


# ---- finding the newest checkpoint (ckpt_path="auto") ---------------------------------------------------------

AUTO_CKPT_PATH = "auto"
_HPC_NAME = re.compile(r"^hpc_ckpt_(\d+)\.ckpt$")


def next_hpc_checkpoint_path(root: _PathLike) -> Path:
    """``root/hpc_ckpt_{N+1}.ckpt`` for the largest N present (1 if none): the name Lightning's SLURM resume
    (``ckpt_path="hpc"``, or ``None`` under SLURM) picks up, highest N first."""
    root = Path(root)
    numbers = [int(m.group(1)) for p in (root.iterdir() if root.is_dir() else ()) if (m := _HPC_NAME.match(p.name))]
    return root / f"hpc_ckpt_{max(numbers, default=0) + 1}.ckpt"


def _checkpoint_time(path: Path) -> float:
    if path.is_dir():
        return max((f.stat().st_mtime for f in path.iterdir()), default=path.stat().st_mtime)
    return path.stat().st_mtime


def find_checkpoints(roots: Iterable[_PathLike]) -> list[Path]:
    """Every complete checkpoint below ``roots``: DCP directories and ``*.ckpt`` files, newest first.

    Hidden entries (staging / previous / trash siblings of interrupted saves) and symbolic links (e.g.
    ``ModelCheckpoint(save_last="link")``: their targets are found themselves) are skipped; an interrupted commit
    is undone first (:func:`recover_interrupted_commit`); an incomplete checkpoint directory is skipped with a
    warning.
    """
    found: dict[Path, float] = {}
    for root in dict.fromkeys(Path(r) for r in roots):
        if not root.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            for name in list(dirnames) + list(filenames):
                if name.startswith(".") and name.endswith(PREVIOUS_SUFFIX):
                    original = name[1:-len(PREVIOUS_SUFFIX)].replace("ckpt%5F", "ckpt_").replace("%25", "%")
                    if recover_interrupted_commit(here / original):
                        (dirnames if name in dirnames else filenames).append(original)
            keep = []
            for name in dict.fromkeys(dirnames):
                entry = here / name
                if name.startswith(".") or entry.is_symlink() or not entry.is_dir():
                    continue
                if (entry / DCP_METADATA_FILENAME).exists() or (entry / LIGHTNING_METADATA_FILENAME).exists():
                    problem = checkpoint_problem(entry)
                    if problem is None:
                        found[entry] = _checkpoint_time(entry)
                    else:
                        warnings.warn(f"skipping incomplete checkpoint {entry}: {problem}", stacklevel=2)
                    continue  # never descend into a checkpoint
                keep.append(name)
            dirnames[:] = keep
            for name in dict.fromkeys(filenames):
                entry = here / name
                if name.startswith(".") or not name.endswith(".ckpt") or entry.is_symlink() or not entry.is_file():
                    continue
                if checkpoint_problem(entry) is None:
                    found[entry] = _checkpoint_time(entry)
    return sorted(found, key=lambda p: (found[p], str(p)), reverse=True)


def find_latest_checkpoint(trainer: Any = None, roots: Iterable[_PathLike] = ()) -> Optional[Path]:
    """The newest complete checkpoint (by modification time) of a run, or None: ``ckpt_path="auto"``.

    Looks below ``trainer.default_root_dir`` (hpc_ckpt_N of SLURM requeues, ModelCheckpoint's files in any
    logger version directory) and below the ``dirpath`` of every ``ModelCheckpoint`` callback, plus ``roots``.
    Use it as ``trainer.fit(model, ckpt_path=find_latest_checkpoint(trainer))``: resume if a checkpoint exists,
    else start. Every process computes it from the file system alone (no collective), so all ranks agree as long
    as nothing writes checkpoints meanwhile (true before ``fit`` starts).
    """
    search = [Path(r) for r in roots]
    if trainer is not None:
        search.append(Path(trainer.default_root_dir))
        for callback in getattr(trainer, "checkpoint_callbacks", []):
            dirpath = getattr(callback, "dirpath", None)
            if dirpath:
                search.append(Path(dirpath))
    found = find_checkpoints(search)
    return found[0] if found else None


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
