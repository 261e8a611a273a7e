"""Zigzag sequence layout.

A sequence of S tokens is cut into 2D chunks of c = S / (2D) tokens; rank p of a TSP group of D ranks holds
chunks p and 2D-1-p, in that order, so every rank has the same amount of causal attention work.
Labels are shifted on the GLOBAL sequence before sharding (the last position is ignored).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_tsp.checks import check_seq_len

IGNORE_INDEX = -100


def chunk_ids(tsp_size: int, rank: int) -> tuple[int, int]:
    """The two global chunk indices rank ``rank`` holds."""
    return rank, 2 * tsp_size - 1 - rank


def zigzag_positions(seq_len: int, tsp_size: int, rank: int, device=None) -> Tensor:
    """Global position ids [S/D] of the tokens rank ``rank`` holds."""
    check_seq_len(seq_len, tsp_size)
    c = seq_len // (2 * tsp_size)
    first, second = chunk_ids(tsp_size, rank)
    return torch.cat(
        [torch.arange(first * c, (first + 1) * c, device=device), torch.arange(second * c, (second + 1) * c, device=device)]
    )


def zigzag_shard(x: Tensor, tsp_size: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's zigzag slice of ``x`` along the sequence dimension ``dim``: [.., S, ..] -> [.., S/D, ..]."""
    seq_len = x.shape[dim]
    check_seq_len(seq_len, tsp_size)
    chunks = x.chunk(2 * tsp_size, dim=dim)
    first, second = chunk_ids(tsp_size, rank)
    return torch.cat([chunks[first], chunks[second]], dim=dim)


def zigzag_unshard(parts: list[Tensor], dim: int = 1) -> Tensor:
    """Inverse of :func:`zigzag_shard`: the D local slices (in rank order) -> the natural-order sequence."""
    d = len(parts)
    halves = [p.chunk(2, dim=dim) for p in parts]
    ordered = [halves[p][0] for p in range(d)] + [halves[p][1] for p in reversed(range(d))]
    return torch.cat(ordered, dim=dim)


def shift_labels(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Next-token targets on the global sequence: ``out[:, t] = labels[:, t + 1]``, the last position ignored.

    Hugging Face's ``labels`` convention (labels == input_ids, shifted inside the loss) becomes explicit targets,
    so that sharding the sequence afterwards keeps every (token, target) pair on one rank.
    """
    out = torch.full_like(labels, ignore_index)
    out[..., :-1] = labels[..., 1:]
    return out


def shard_batch(input_ids: Tensor, labels: Tensor | None, tsp_size: int, rank: int, ignore_index: int = IGNORE_INDEX):
    """Global [B, S] batch -> this rank's (input_ids, targets, position_ids), targets already shifted.

    ``labels`` follows the Hugging Face convention (unshifted; ``ignore_index`` marks positions without a loss);
    ``None`` means "language modelling on input_ids".
    """
    if labels is None:
        labels = input_ids
    targets = shift_labels(labels, ignore_index)
    seq_len = input_ids.shape[1]
    return (
        zigzag_shard(input_ids, tsp_size, rank),
        zigzag_shard(targets, tsp_size, rank),
        zigzag_positions(seq_len, tsp_size, rank, device=input_ids.device),
    )
