"""Prompt batches: normalisation, validation (before any collective) and right padding to a multiple of 2D."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_tsp.checks import TSPConfigError


def as_prompt_list(input_ids) -> list[list[int]]:
    """A prompt batch in any of the accepted forms -> a list of token-id lists.

    Accepted: a 1-D tensor or a list of ints (one prompt), a 2-D tensor [B, L] (B prompts of length L, no padding),
    a list of lists / 1-D tensors (prompts of different lengths).
    """
    if isinstance(input_ids, Tensor):
        if input_ids.dim() == 1:
            return [input_ids.tolist()]
        if input_ids.dim() == 2:
            return input_ids.tolist()
        raise TSPConfigError(f"input_ids tensor must be 1-D or 2-D, got shape {tuple(input_ids.shape)}")
    if not isinstance(input_ids, Sequence) or isinstance(input_ids, (str, bytes)):
        raise TSPConfigError(f"input_ids must be a tensor or a list of token ids, got {type(input_ids).__name__}")
    if len(input_ids) == 0:
        raise TSPConfigError("empty prompt batch: pass at least one prompt of at least one token")
    if all(isinstance(t, int) for t in input_ids):
        return [list(input_ids)]
    out = []
    for p in input_ids:
        if isinstance(p, Tensor):
            if p.dim() != 1:
                raise TSPConfigError(f"each prompt tensor must be 1-D, got shape {tuple(p.shape)}")
            p = p.tolist()
        out.append([int(t) for t in p])
    return out


def validate_prompts(prompts: list[list[int]], vocab_size: int, max_new_tokens: int,
                     max_seq_len: int | None) -> None:
    """Raise TSPConfigError for inputs that cannot run; every rank sees the same prompts, so every rank raises
    here, before any collective is issued."""
    if not prompts:
        raise TSPConfigError("empty prompt batch: pass at least one prompt of at least one token")
    if max_new_tokens < 1:
        raise TSPConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise TSPConfigError(f"prompt {i} is empty: every prompt needs at least one token")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise TSPConfigError(f"prompt {i} has token ids outside [0, vocab_size={vocab_size}): {bad[:5]}")
        if max_seq_len is not None and len(p) > max_seq_len:
            raise TSPConfigError(
                f"prompt {i} has {len(p)} tokens, more than max_seq_len={max_seq_len}: shorten the prompt or raise "
                f"max_seq_len"
            )
        if max_seq_len is not None and len(p) + max_new_tokens > max_seq_len:
            raise TSPConfigError(
                f"prompt {i} ({len(p)} tokens) plus max_new_tokens={max_new_tokens} exceeds max_seq_len="
                f"{max_seq_len}: lower max_new_tokens to at most {max_seq_len - len(p)} or raise max_seq_len"
            )


def pad_right(prompts: list[list[int]], tsp_size: int, pad_id: int, device=None) -> tuple[Tensor, Tensor]:
    """-> (ids [B, P] right-padded with ``pad_id``, P the longest prompt rounded up to a multiple of 2D;
    lengths [B])."""
    lens = [len(p) for p in prompts]
    mult = 2 * tsp_size
    padded = -(-max(lens) // mult) * mult
    ids = torch.full((len(prompts), padded), pad_id, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
    return ids.to(device), torch.tensor(lens, dtype=torch.long, device=device)
