"""Model shapes for the cost model: a small dataclass, presets, and loaders.

Only the numbers the cost model needs live here (no torch import). Units: element counts.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

__all__ = ["ModelShape", "MODEL_PRESETS", "get_model_shape", "from_config", "from_hf_config"]


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer: RMSNorm, (GQA) attention with RoPE, SwiGLU MLP, untied or tied LM head.

    Linear layers have no biases. ``head_dim`` defaults to ``hidden_size // n_heads``.
    """

    vocab_size: int  # V
    hidden_size: int  # h
    n_layers: int  # L
    n_heads: int  # n_q
    n_kv_heads: int  # n_kv
    intermediate_size: int  # F (SwiGLU width)
    head_dim: int | None = None  # hd
    tie_word_embeddings: bool = False
    name: str = "custom"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape.{f} must be a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads} (GQA needs that)"
            )
        if self.head_dim is None and self.hidden_size % self.n_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}: give head_dim explicitly"
            )

    # ---- derived sizes (elements) ----
    @property
    def hd(self) -> int:
        """Head dimension."""
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.n_heads

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.hd

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.hd

    @property
    def gqa_ratio(self) -> int:
        """g = n_q / n_kv (1 = MHA)."""
        return self.n_heads // self.n_kv_heads

    @property
    def attn_params(self) -> int:
        """Wq [q_dim, h] + Wk, Wv [kv_dim, h] + Wo [h, q_dim]."""
        h = self.hidden_size
        return 2 * self.q_dim * h + 2 * self.kv_dim * h

    @property
    def mlp_params(self) -> int:
        """W_gate, W_up [F, h] + W_down [h, F]."""
        return 3 * self.intermediate_size * self.hidden_size

    @property
    def norm_params(self) -> int:
        """Two RMSNorm weights per layer."""
        return 2 * self.hidden_size

    @property
    def layer_params(self) -> int:
        return self.attn_params + self.mlp_params + self.norm_params

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def non_embedding_params(self) -> int:
        return self.n_layers * self.layer_params + self.hidden_size  # + final norm

    @property
    def total_params(self) -> int:
        return self.non_embedding_params + self.embedding_params + self.lm_head_params


MODEL_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(256, 64, 2, 4, 2, 128, name="tiny"),
    # The TSP paper's "7B" (MHA, SwiGLU with F = 4h; ~8.6B parameters without embeddings).
    "paper-7b": ModelShape(32000, 4096, 32, 32, 32, 16384, name="paper-7b"),
    # Meta Llama 3 8B (config.json of meta-llama/Meta-Llama-3-8B).
    "llama3-8b": ModelShape(128256, 4096, 32, 32, 8, 14336, name="llama3-8b"),
}

_ALIASES = {
    "n_layers": ("n_layers", "num_hidden_layers", "num_layers"),
    "n_heads": ("n_heads", "num_attention_heads"),
    "n_kv_heads": ("n_kv_heads", "num_key_value_heads"),
    "intermediate_size": ("intermediate_size", "ffn_hidden_size"),
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size", "dim"),
    "head_dim": ("head_dim",),
    "tie_word_embeddings": ("tie_word_embeddings", "tie_embeddings"),
}


def _get(obj: Any, names: tuple[str, ...]) -> Any:
    for n in names:
        if isinstance(obj, Mapping):
            if obj.get(n) is not None:
                return obj[n]
        elif getattr(obj, n, None) is not None:
            return getattr(obj, n)
    return None


def from_config(obj: Any, name: str = "custom") -> ModelShape:
    """Build a shape from any config object or mapping.

    Reads ``vocab_size, hidden_size, n_layers|num_hidden_layers, n_heads|num_attention_heads,
    n_kv_heads|num_key_value_heads (default: n_heads), intermediate_size, head_dim (optional),
    tie_word_embeddings (optional)``: works for the built-in model's config and Hugging Face ``LlamaConfig``.
    """
    vals = {k: _get(obj, names) for k, names in _ALIASES.items()}
    missing = [k for k in ("vocab_size", "hidden_size", "n_layers", "n_heads", "intermediate_size") if vals[k] is None]
    if missing:
        raise ValueError(f"config is missing {', '.join(missing)} (accepted names: "
                         + "; ".join("|".join(_ALIASES[k]) for k in missing) + ")")
    if vals["n_kv_heads"] is None:
        vals["n_kv_heads"] = vals["n_heads"]
    hd = vals["head_dim"]
    return ModelShape(
        vocab_size=int(vals["vocab_size"]),
        hidden_size=int(vals["hidden_size"]),
        n_layers=int(vals["n_layers"]),
        n_heads=int(vals["n_heads"]),
        n_kv_heads=int(vals["n_kv_heads"]),
        intermediate_size=int(vals["intermediate_size"]),
        head_dim=int(hd) if hd is not None else None,
        tie_word_embeddings=bool(vals["tie_word_embeddings"] or False),
        name=name,
    )


def from_hf_config(path: str | os.PathLike) -> ModelShape:
    """Read a Hugging Face ``config.json`` (a file, or a directory holding one)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    with open(p, encoding="utf-8") as f:
        cfg = json.load(f)
    if isinstance(cfg.get("text_config"), dict):  # multimodal wrappers keep the LM under text_config
        cfg = {**cfg, **cfg["text_config"]}
    return from_config(cfg, name=os.path.basename(os.path.dirname(os.path.abspath(p))) or "config.json")


def get_model_shape(spec: str | ModelShape | Any) -> ModelShape:
    """A preset name, a path to a config.json (or its directory), a ModelShape, or a config object."""
    if isinstance(spec, ModelShape):
        return spec
    if isinstance(spec, str):
        if spec in MODEL_PRESETS:
            return MODEL_PRESETS[spec]
        if os.path.exists(spec):
            return from_hf_config(spec)
        raise ValueError(
            f"unknown model {spec!r}: use one of {', '.join(MODEL_PRESETS)} or a path to a Hugging Face config.json"
        )
    return from_config(spec)


def with_name(shape: ModelShape, name: str) -> ModelShape:
    return replace(shape, name=name)
