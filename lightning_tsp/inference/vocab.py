"""Vocab-sharded embedding lookup and LM head for a handful of tokens (decode, last prompt token).

Rank j owns vocab rows [j V/D, (j+1) V/D). One token per sequence is tiny, so instead of a weight ring:
the embedding looks up the rows this rank owns (zeros elsewhere) and sums over the group (exact: exactly one
rank contributes a non-zero row); the LM head scores the replicated hidden state against the local shard only,
giving local logits [B, V/D] that :mod:`lightning_tsp.inference.sampling` reduces with a small exchange.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.inference.collectives import all_gather_stack, all_reduce_
from lightning_tsp.kernels.gemv import linear_rows
from lightning_tsp.schedules.comm import local_tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def embed_tokens(model, tokens: Tensor) -> Tensor:
    """tokens [B] (identical on every rank) -> embeddings [B, h] on every rank."""
    w = local_tensor(model.model.embed_tokens.weight)
    v_loc = w.shape[0]
    lo = model.tsp.rank * v_loc
    mask = (tokens >= lo) & (tokens < lo + v_loc)
    rows = (tokens - lo).clamp(0, v_loc - 1)
    out = torch.where(mask[:, None], w[rows], 0).to(w.dtype)
    return all_reduce_(out, model.tsp)


def lm_head_weight(model) -> Tensor:
    if model.cfg.tie_embeddings:
        return local_tensor(model.model.embed_tokens.weight)
    return local_tensor(model.lm_head.weight)


@torch.no_grad()
def local_logits(model, hidden: Tensor) -> Tensor:
    """Final-norm hidden [B, h] (replicated) -> this rank's logits [B, V/D] in fp32 (fp64 stays fp64)."""
    w = lm_head_weight(model)
    return linear_rows(hidden.to(w.dtype), w, out_dtype=acc_dtype(w.dtype))


def vocab_offset(model) -> int:
    return model.tsp.rank * lm_head_weight(model).shape[0]


@torch.no_grad()
def full_log_probs(logits: Tensor, tsp: TSPGroup) -> Tensor:
    """Local logits [B, V/D] -> full-vocab log-probabilities [B, V] on every rank (an all-gather of B*V values:
    for inspection and tests; generation itself only exchanges a few numbers per sequence)."""
    parts = all_gather_stack(logits, tsp)  # [D, B, V/D]
    full = parts.permute(1, 0, 2).reshape(logits.shape[0], -1)
    return torch.log_softmax(full, dim=-1)
