"""Loading a full (consolidated) checkpoint into a TSPLlama over a TSP group, one parameter at a time.

Sources: a Hugging Face Llama directory (config.json + model.safetensors, a sharded safetensors index, or
pytorch_model.bin), a single ``.safetensors`` file, or a ``torch.save`` of a full state dict with Hugging Face
names. Each rank reads every full tensor it needs one at a time and keeps its slice (``TSPLlama.local_slice``
raises ``TSPConfigError`` on a shape mismatch), so the peak extra memory is one full parameter.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.models.llama import ModelConfig, get_config

_WEIGHT_FILES = (
    "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json",
)


def config_from_hf(d: dict) -> ModelConfig:
    """A Hugging Face ``LlamaConfig`` dict -> ModelConfig; unsupported features raise TSPConfigError."""
    try:
        n_heads = d["num_attention_heads"]
        cfg = ModelConfig(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], n_layers=d["num_hidden_layers"],
            n_heads=n_heads, n_kv_heads=d.get("num_key_value_heads") or n_heads,
            intermediate_size=d["intermediate_size"], norm_eps=d.get("rms_norm_eps", 1e-6),
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
        )
    except KeyError as e:
        raise TSPConfigError(f"config.json lacks {e.args[0]!r}: is it a Llama configuration?") from None
    rope = d.get("rope_parameters") or {}
    cfg.rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
    scaling = d.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise TSPConfigError(f"RoPE scaling {scaling} is not supported by TSPLlama (plain RoPE only)")
    if d.get("head_dim") not in (None, cfg.head_dim):
        raise TSPConfigError(f"head_dim={d['head_dim']} != hidden_size/num_attention_heads={cfg.head_dim}: unsupported")
    if d.get("attention_bias") or d.get("mlp_bias"):
        raise TSPConfigError("attention/MLP biases are not supported by TSPLlama")
    if d.get("hidden_act", "silu") != "silu":
        raise TSPConfigError(f"hidden_act={d['hidden_act']!r} is not supported (SwiGLU with silu only)")
    return cfg


@dataclass
class CheckpointSource:
    cfg: ModelConfig
    files: list[str]  # weight files (safetensors or torch)
    tokenizer_dir: str | None = None


def resolve_checkpoint(path: str, config: str | None = None, preset: str | None = None) -> CheckpointSource:
    """Find the weights and the model configuration (``config``: a config.json, else the one beside the
    weights, else ``preset``)."""
    if not os.path.exists(path):
        raise TSPConfigError(f"checkpoint {path!r} does not exist")
    tok_dir = None
    if os.path.isdir(path):
        found = [f for f in _WEIGHT_FILES if os.path.exists(os.path.join(path, f))]
        if not found:
            raise TSPConfigError(f"{path!r} holds none of {_WEIGHT_FILES}: not a Hugging Face model directory")
        first = os.path.join(path, found[0])
        if first.endswith(".index.json"):
            with open(first) as f:
                shards = sorted(set(json.load(f)["weight_map"].values()))
            files = [os.path.join(path, s) for s in shards]
        else:
            files = [first]
        config = config or os.path.join(path, "config.json")
        if any(os.path.exists(os.path.join(path, t)) for t in ("tokenizer.json", "tokenizer_config.json")):
            tok_dir = path
    else:
        files = [path]
        beside = os.path.join(os.path.dirname(os.path.abspath(path)), "config.json")
        if config is None and preset is None and os.path.exists(beside):
            config = beside
    if config is not None:
        if not os.path.exists(config):
            raise TSPConfigError(f"no model configuration: {config!r} does not exist (pass --config or --preset)")
        with open(config) as f:
            cfg = config_from_hf(json.load(f))
    elif preset is not None:
        cfg = get_config(preset)
    else:
        raise TSPConfigError(f"no configuration for {path!r}: pass --config CONFIG.json or --preset NAME")
    return CheckpointSource(cfg, files, tok_dir)


class _TensorReader:
    """name -> full tensor, reading lazily from safetensors (memory-mapped) or torch.save files."""

    def __init__(self, files: list[str]):
        self._where: dict[str, object] = {}
        for path in files:
            if path.endswith(".safetensors"):
                from safetensors import safe_open

                handle = safe_open(path, framework="pt", device="cpu")
                for name in handle.keys():
                    self._where[name] = handle
            else:
                sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
                if not isinstance(sd, dict):
                    raise TSPConfigError(f"{path!r} does not hold a state dict (got {type(sd).__name__})")
                sd = sd.get("state_dict", sd) if "state_dict" in sd and isinstance(sd["state_dict"], dict) else sd
                for name, t in sd.items():
                    if isinstance(t, Tensor):
                        self._where[name] = t

    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> Tensor:
        src = self._where[name]
        return src if isinstance(src, Tensor) else src.get_tensor(name)


@torch.no_grad()
def load_checkpoint_into(model, files: list[str]) -> None:
    """Copy this rank's slice of every parameter from the full checkpoint ``files`` (strict)."""
    reader = _TensorReader(files)
    wanted = model.shard_dims()
    missing = sorted(set(wanted) - reader.names())
    if missing:
        raise TSPConfigError(
            f"checkpoint lacks {len(missing)} of the model's parameters, e.g. {missing[:3]}: is it a full "
            f"(consolidated) state dict with Hugging Face names?"
        )
    for name in wanted:
        full = reader.get(name)
        p = model.get_parameter(name)
        p.copy_(model.local_slice(name, full).to(p.dtype))
