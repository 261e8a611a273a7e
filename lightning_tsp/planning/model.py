"""Model shapes for the cost model: a small dataclass, presets, and loaders.

Only the numbers the cost model needs live here (no torch import). Units: element counts.
Dense decoders and mixture-of-experts decoders (some or all layers' MLP replaced by E routed SwiGLU experts, top-k
per token, an optional always-on shared expert and a replicated router).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from typing import Any, Mapping

__all__ = ["ModelShape", "MODEL_PRESETS", "get_model_shape", "from_config", "from_hf_config"]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer: RMSNorm, (GQA) attention with RoPE, SwiGLU MLP, untied or tied LM head.

    Linear layers have no biases. ``head_dim`` defaults to ``hidden_size // n_heads``.

    Mixture of experts (``num_experts`` E > 0): the MLP of ``n_layers - n_dense_layers`` layers is E SwiGLU experts
    of width ``moe_intermediate_size`` (F_e, default ``intermediate_size``), ``experts_per_token`` (k) of them per
    token, a replicated router [E, h] and an optional shared expert (a dense SwiGLU of width
    ``shared_expert_intermediate_size``, F_s) every token meets. The other ``n_dense_layers`` keep the dense MLP of
    width ``intermediate_size`` (Qwen3-MoE ``mlp_only_layers``). E = 0: a dense model (the MoE fields are unused).
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
    # mixture of experts (all 0 / None: dense)
    num_experts: int = 0  # E routed experts per MoE layer
    experts_per_token: int = 0  # k (top-k)
    moe_intermediate_size: int | None = None  # F_e, each expert's SwiGLU width (default intermediate_size)
    shared_expert_intermediate_size: int = 0  # F_s, the shared expert's width (0: none)
    n_dense_layers: int = 0  # layers of an MoE model that keep the dense MLP
    # TSP's dense MLP ring: "keep" its gate/up pre-activations for backward, or "recompute" them there
    # (ModelConfig.mlp_activations; other strategies ignore it)
    mlp_activations: str = "keep"
    # TSP: local KV heads whose full-sequence K/V are gathered at once (head bucketing; None: a step's all)
    kv_bucket_heads: int | None = None

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "intermediate_size"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"ModelShape.{f} must be a positive integer, got {v!r}")
        for f in ("num_experts", "experts_per_token", "shared_expert_intermediate_size", "n_dense_layers"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"ModelShape.{f} must be a non-negative integer, got {v!r}")
        if self.num_experts:
            if not 1 <= self.experts_per_token <= self.num_experts:
                raise ValueError(f"experts_per_token={self.experts_per_token} must be between 1 and "
                                 f"num_experts={self.num_experts}")
            if self.moe_intermediate_size is not None and self.moe_intermediate_size <= 0:
                raise ValueError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size!r}")
            if self.n_dense_layers > self.n_layers:
                raise ValueError(f"n_dense_layers={self.n_dense_layers} exceeds n_layers={self.n_layers}")
        elif self.experts_per_token or self.shared_expert_intermediate_size or self.n_dense_layers:
            raise ValueError("experts_per_token, shared_expert_intermediate_size and n_dense_layers need "
                             "num_experts > 0")
        if self.kv_bucket_heads is not None and (not isinstance(self.kv_bucket_heads, int) or self.kv_bucket_heads < 1):
            raise ValueError(f"ModelShape.kv_bucket_heads must be a positive integer or None, got {self.kv_bucket_heads!r}")
        if self.mlp_activations not in ("keep", "recompute"):
            raise ValueError(f"mlp_activations={self.mlp_activations!r}: choose 'keep' or 'recompute'")
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

    # ---- mixture of experts (elements; 0 for a dense model) ----
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def n_moe_layers(self) -> int:
        """Layers whose MLP is the mixture of experts."""
        return self.n_layers - self.n_dense_layers if self.is_moe else 0

    @property
    def expert_intermediate_size(self) -> int:
        """F_e: each routed expert's SwiGLU width."""
        return self.moe_intermediate_size if self.moe_intermediate_size is not None else self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One expert: gate|up [2F_e, h] + down [h, F_e]."""
        return 3 * self.expert_intermediate_size * self.hidden_size

    @property
    def router_params(self) -> int:
        """The replicated router [E, h]."""
        return self.num_experts * self.hidden_size

    @property
    def shared_expert_params(self) -> int:
        return 3 * self.shared_expert_intermediate_size * self.hidden_size

    @property
    def moe_mlp_params(self) -> int:
        """One MoE layer's MLP: E * 3 F_e h + E h (router) + 3 F_s h."""
        return self.num_experts * self.expert_params + self.router_params + self.shared_expert_params

    @property
    def moe_active_mlp_params(self) -> int:
        """What one token meets in an MoE layer: k experts, the router and the shared expert."""
        return self.experts_per_token * self.expert_params + self.router_params + self.shared_expert_params

    # ---- per layer and totals ----
    @property
    def dense_layer_params(self) -> int:
        return self.attn_params + self.mlp_params + self.norm_params

    @property
    def moe_layer_params(self) -> int:
        return self.attn_params + self.moe_mlp_params + self.norm_params

    def layer_kinds(self) -> list[tuple[int, bool]]:
        """[(number of layers, is_moe)] for the kinds present: dense layers, MoE layers."""
        kinds = [(self.n_layers - self.n_moe_layers, False), (self.n_moe_layers, True)]
        return [(n, moe) for n, moe in kinds if n]

    @property
    def layer_params(self) -> int:
        """The largest layer (a dense model's every layer)."""
        return max(self.moe_layer_params if moe else self.dense_layer_params for _, moe in self.layer_kinds())

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def non_embedding_params(self) -> int:
        layers = sum(n * (self.moe_layer_params if moe else self.dense_layer_params) for n, moe in self.layer_kinds())
        return layers + self.hidden_size  # + final norm

    @property
    def total_params(self) -> int:
        return self.non_embedding_params + self.embedding_params + self.lm_head_params

    @property
    def active_params(self) -> int:
        """Parameters one token meets (its top-k experts of each MoE layer): the N of "6 N FLOPs per token".
        Equal to ``total_params`` for a dense model."""
        idle = self.n_moe_layers * (self.num_experts - self.experts_per_token) * self.expert_params
        return self.total_params - idle


MODEL_PRESETS: dict[str, ModelShape] = {
    "tiny": ModelShape(256, 64, 2, 4, 2, 128, name="tiny"),
    # The TSP paper's "7B" (MHA, SwiGLU with F = 4h; ~8.6B parameters without embeddings).
    "paper-7b": ModelShape(32000, 4096, 32, 32, 32, 16384, name="paper-7b"),
    # Meta Llama 3 8B (config.json of meta-llama/Meta-Llama-3-8B).
    "llama3-8b": ModelShape(128256, 4096, 32, 32, 8, 14336, name="llama3-8b"),
    # Mixtral-8x7B (config.json of mistralai/Mixtral-8x7B-v0.1): 8 experts of width 14336, top-2, every layer MoE.
    "mixtral-8x7b": ModelShape(32000, 4096, 32, 32, 8, 14336, name="mixtral-8x7b", num_experts=8,
                               experts_per_token=2),
    # Qwen3-30B-A3B (config.json of Qwen/Qwen3-30B-A3B): 128 experts of width 768, top-8, head_dim 128, every
    # layer MoE (mlp_only_layers empty, decoder_sparse_step 1: the dense intermediate_size 6144 is unused).
    # Its q/k RMSNorms (2 x 128 per layer) are not modelled.
    "qwen3-30b-a3b": ModelShape(151936, 2048, 48, 32, 4, 6144, head_dim=128, name="qwen3-30b-a3b", num_experts=128,
                                experts_per_token=8, moe_intermediate_size=768),
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
    # mixture of experts: the built-in config's names, Qwen3-MoE / Qwen2-MoE's and Mixtral's (num_local_experts)
    "num_experts": ("num_experts", "num_local_experts"),
    "experts_per_token": ("num_experts_per_tok", "experts_per_token"),
    "moe_intermediate_size": ("moe_intermediate_size",),
    "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
}


def _get(obj: Any, names: tuple[str, ...]) -> Any:
    for n in names:
        if isinstance(obj, Mapping):
            if obj.get(n) is not None:
                return obj[n]
        elif getattr(obj, n, None) is not None:
            return getattr(obj, n)
    return None


def _n_dense_layers(obj: Any, n_layers: int) -> int:
    """Layers of an MoE config that keep the dense MLP: the built-in ``dense_layers`` (indices), or Hugging Face
    Qwen-MoE's rule: layer i is sparse iff i not in ``mlp_only_layers`` and (i+1) % ``decoder_sparse_step`` == 0."""
    dense = set(int(i) for i in (_get(obj, ("dense_layers", "mlp_only_layers")) or ()))
    step = int(_get(obj, ("decoder_sparse_step",)) or 1)
    return sum(1 for i in range(n_layers) if i in dense or (i + 1) % step)


def from_config(obj: Any, name: str = "custom") -> ModelShape:
    """Build a shape from any config object or mapping.

    Reads ``vocab_size, hidden_size, n_layers|num_hidden_layers, n_heads|num_attention_heads,
    n_kv_heads|num_key_value_heads (default: n_heads), intermediate_size, head_dim (optional),
    tie_word_embeddings (optional)``: works for the built-in model's config and Hugging Face ``LlamaConfig``.
    Mixture of experts (optional): ``num_experts|num_local_experts`` (Mixtral), ``num_experts_per_tok``,
    ``moe_intermediate_size`` (default: ``intermediate_size``, Mixtral's experts), ``shared_expert_intermediate_size``,
    and the dense layers: ``dense_layers`` (built-in) or ``mlp_only_layers`` + ``decoder_sparse_step`` (Qwen3-MoE).
    """
    vals = {k: _get(obj, names) for k, names in _ALIASES.items()}
    missing = [k for k in ("vocab_size", "hidden_size", "n_layers", "n_heads", "intermediate_size") if vals[k] is None]
    if missing:
        raise ValueError(f"config is missing {', '.join(missing)} (accepted names: "
                         + "; ".join("|".join(_ALIASES[k]) for k in missing) + ")")
    if vals["n_kv_heads"] is None:
        vals["n_kv_heads"] = vals["n_heads"]
    hd = vals["head_dim"]
    n_layers = int(vals["n_layers"])
    experts = int(vals["num_experts"] or 0)
    moe = {}
    if experts:  # a dense config may still carry a default top-k (the built-in config does): ignored then
        if vals["experts_per_token"] is None:
            raise ValueError(f"config has {experts} experts but no num_experts_per_tok (top-k)")
        f_e = vals["moe_intermediate_size"]
        moe = dict(num_experts=experts, experts_per_token=int(vals["experts_per_token"]),
                   moe_intermediate_size=int(f_e) if f_e is not None else None,
                   shared_expert_intermediate_size=int(vals["shared_expert_intermediate_size"] or 0),
                   n_dense_layers=_n_dense_layers(obj, n_layers))
    return ModelShape(
        vocab_size=int(vals["vocab_size"]),
        hidden_size=int(vals["hidden_size"]),
        n_layers=n_layers,
        n_heads=int(vals["n_heads"]),
        n_kv_heads=int(vals["n_kv_heads"]),
        intermediate_size=int(vals["intermediate_size"]),
        head_dim=int(hd) if hd is not None else None,
        tie_word_embeddings=bool(vals["tie_word_embeddings"] or False),
        name=name,
        **moe,
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
