"""Invariant checks (DESIGN.md section 4). Every one raises before any collective is issued."""

from __future__ import annotations


class TSPConfigError(ValueError):
    """A configuration TSP cannot run. The message names the value and what to change."""


def check_seq_len(seq_len: int, tsp_size: int) -> None:
    if seq_len <= 0 or seq_len % (2 * tsp_size) != 0:
        raise TSPConfigError(
            f"sequence length {seq_len} is not divisible by 2 * tsp_size = {2 * tsp_size}: the zigzag layout cuts "
            f"every sequence into 2D equal chunks. Use a sequence length that is a multiple of {2 * tsp_size} "
            f"(pad with ignored labels) or change tsp_size."
        )


def check_model_shape(
    *, tsp_size: int, n_heads: int, n_kv_heads: int, hidden_size: int, intermediate_size: int | None,
    vocab_size: int
) -> None:
    d = tsp_size
    if d < 1:
        raise TSPConfigError(f"tsp_size must be >= 1, got {d}")
    if n_heads % n_kv_heads != 0:
        raise TSPConfigError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads} (GQA groups)")
    if n_heads % d != 0:
        raise TSPConfigError(
            f"n_heads={n_heads} is not divisible by tsp_size={d}: each rank owns n_heads/D query heads. "
            f"Choose a tsp_size that divides {n_heads}."
        )
    if n_kv_heads % d != 0 and d % n_kv_heads != 0:
        raise TSPConfigError(
            f"n_kv_heads={n_kv_heads} and tsp_size={d}: each rank owns n_kv_heads/D key/value heads, or, with fewer KV "
            f"heads than ranks, a copy of one (D a multiple of n_kv_heads). Choose a tsp_size that divides "
            f"{n_kv_heads} or is a multiple of it."
        )
    if intermediate_size is not None and intermediate_size % d != 0:  # None: no dense MLP layer
        raise TSPConfigError(
            f"intermediate_size={intermediate_size} is not divisible by tsp_size={d}: the ring schedule gives each "
            f"rank intermediate_size/D MLP columns. Choose a tsp_size that divides {intermediate_size}."
        )
    if vocab_size % d != 0:
        raise TSPConfigError(
            f"vocab_size={vocab_size} is not divisible by tsp_size={d}: embedding and LM head are vocab-sharded. "
            f"Pad the vocabulary to a multiple of {d} (e.g. {-(-vocab_size // d) * d}) or change tsp_size."
        )
