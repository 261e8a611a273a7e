"""FLOP counts (2 FLOPs per multiply-add). Norms, RoPE, softmax and other elementwise work are not counted.

Causal attention is counted exactly: a sequence of S tokens has S(S+1)/2 (query, key) pairs, each costing
2*hd FLOPs for QK^T and 2*hd for PV per query head.
A mixture-of-experts layer counts what a token meets: its k experts (3 GEMMs of width F_e each), the shared
expert and the router (2*E*h per token); 2 FLOPs per active weight per token, like a dense layer.
"""

from __future__ import annotations

from .collectives import ATTENTION_RECOMPUTED, RECOMPUTING
from .model import ModelShape

__all__ = [
    "attention_pairs",
    "layer_linear_flops",
    "layer_attention_flops",
    "lm_head_flops",
    "forward_flops",
    "training_flops",
]


def attention_pairs(S: int, causal: bool = True) -> int:
    """(query, key) pairs of one sequence: S(S+1)/2 causal, S^2 otherwise."""
    return S * (S + 1) // 2 if causal else S * S


def layer_linear_flops(shape: ModelShape, tokens: int, moe: bool = False) -> int:
    """Forward FLOPs of one layer's projections for ``tokens`` tokens: Q, K, V, O and SwiGLU gate, up, down
    (``moe``: the router, the k routed experts and the shared expert of each token)."""
    h = shape.hidden_size
    proj = 2 * tokens * h * (2 * shape.q_dim + 2 * shape.kv_dim)
    mlp = 2 * tokens * (shape.moe_active_mlp_params if moe else h * shape.intermediate_size * 3)
    return proj + mlp


def layer_attention_flops(shape: ModelShape, B: int, S: int, causal: bool = True) -> int:
    """Forward FLOPs of QK^T and PV for B sequences of length S (GQA does not change them: every query head
    still attends; only K/V storage shrinks)."""
    return 4 * B * shape.n_heads * shape.hd * attention_pairs(S, causal)


def lm_head_flops(shape: ModelShape, tokens: int) -> int:
    return 2 * tokens * shape.hidden_size * shape.vocab_size


def forward_flops(shape: ModelShape, B: int, S: int, causal: bool = True) -> dict[str, int]:
    """Forward FLOPs of the whole model for one micro-batch (B sequences of S tokens), by part."""
    T = B * S
    return {
        "linear": sum(n * layer_linear_flops(shape, T, moe) for n, moe in shape.layer_kinds()),
        "attention": shape.n_layers * layer_attention_flops(shape, B, S, causal),
        "lm_head": lm_head_flops(shape, T),
    }


def training_flops(
    shape: ModelShape, B: int, S: int, checkpointing: str = "none", causal: bool = True
) -> dict[str, int]:
    """One training step on one micro-batch.

    ``model``: the usual 3x forward (backward = 2x forward for every matmul, attention included).
    ``hardware``: what actually runs: flash-style attention backward recomputes QK^T (2.5x its forward, 5 matmuls
    vs 2), and full checkpointing re-runs every layer's forward (LM head not checkpointed); keep-attention and
    offload re-run the GEMMs but not the attention kernels (full-offload re-runs both, as full). Selective checkpointing recomputes only elementwise ops (not counted).
    """
    f = forward_flops(shape, B, S, causal)
    model = 3 * (f["linear"] + f["attention"] + f["lm_head"])
    recompute = 1 if checkpointing in RECOMPUTING else 0
    recompute_attn = 1 if checkpointing in ATTENTION_RECOMPUTED else 0  # keep-attention, offload replay them
    hw_matmul = f["linear"] * (3 + recompute) + f["lm_head"] * 3
    hw_attn = f["attention"] * (1 + recompute_attn) + f["attention"] * 5 // 2
    return {"forward": sum(f.values()), "model": model, "hardware": hw_matmul + hw_attn,
            "hardware_matmul": hw_matmul, "hardware_attention": hw_attn}
