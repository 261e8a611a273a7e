"""Zigzag sequence layout.

A sequence of S tokens is cut into 2D chunks of c = S / (2D) tokens; rank p of a TSP group of D ranks holds
chunks p and 2D-1-p, in that order, so every rank has the same amount of causal attention work.
Labels are shifted on the GLOBAL sequence before sharding (the last position is ignored).

Packed documents follow Hugging Face's convention: ``position_ids`` [B, S] count 0, 1, 2, ... inside every
document and a document starts exactly where ``position_ids == 0``. Targets are then shifted per document (the
last token of a document has no target) and each rank's position ids are the zigzag slice of the given ones;
``global_index - position_id`` is the first token of a token's document, known locally (no communication).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_tsp.checks import TSPConfigError, check_seq_len

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


def check_packed_positions(position_ids: Tensor) -> None:
    """Validate packed-document position ids [B, S] (Hugging Face's convention): position 0 of every sequence is
    0, and every other position is 0 (a new document) or the previous one + 1. Raises :class:`TSPConfigError`
    naming the first offending row and position (one host synchronisation; before any collective)."""
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2:
        raise TSPConfigError(f"position_ids must be a tensor [B, S], got "
                             f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
    if position_ids.is_floating_point() or position_ids.is_complex() or position_ids.dtype == torch.bool:
        raise TSPConfigError(f"position_ids must be an integer tensor, got {position_ids.dtype}")
    if position_ids.numel() == 0:
        return  # nothing to check (an empty sequence is refused by the sequence-length check)
    prev, cur = position_ids[:, :-1], position_ids[:, 1:]
    bad = torch.zeros_like(position_ids, dtype=torch.bool)
    bad[:, 0] = position_ids[:, 0] != 0
    bad[:, 1:] = (cur != 0) & (cur != prev + 1)
    if not bool(bad.any()):
        return
    flat = int(bad.flatten().nonzero()[0])
    row, t = divmod(flat, position_ids.shape[1])
    got = int(position_ids[row, t])
    if t == 0:
        why = f"position_ids[{row}, 0] = {got}: every sequence must start a document (position 0)"
    else:
        before = int(position_ids[row, t - 1])
        why = (f"position_ids[{row}, {t}] = {got} after position_ids[{row}, {t - 1}] = {before}: inside a document "
               f"positions count up by 1, and only 0 starts a new document")
    raise TSPConfigError(
        f"{why}. Packed-document position_ids follow Hugging Face's convention (0, 1, 2, ... per document, "
        f"restarting at 0 at each document start); a document cut by the window boundary restarts at 0 at the "
        f"window start. Fix the collator (e.g. TextDataModule(document_mask=True) builds them), or drop "
        f"position_ids for plain causal attention over the whole sequence."
    )


def document_starts(local_position_ids: Tensor, tsp_size: int, rank: int) -> Tensor:
    """[B, S/D] global index of the first token of each local token's document: zigzag global index minus the
    packed position id (valid because positions restart at 0 at each document start; no communication)."""
    seq_len = local_position_ids.shape[-1] * tsp_size
    glob = zigzag_positions(seq_len, tsp_size, rank, device=local_position_ids.device)
    return glob - local_position_ids.long()


def shard_batch(input_ids: Tensor, labels: Tensor | None, tsp_size: int, rank: int, ignore_index: int = IGNORE_INDEX,
                position_ids: Tensor | None = None):
    """Global [B, S] batch -> this rank's (input_ids, targets, position_ids), targets already shifted.

    ``labels`` follows the Hugging Face convention (unshifted; ``ignore_index`` marks positions without a loss);
    ``None`` means "language modelling on input_ids".

    Without ``position_ids`` the returned position ids are the global positions [S/D] of the local tokens. With
    packed-document ``position_ids`` [B, S] (validated by :func:`check_packed_positions`) the targets are shifted
    per document (the last token of each document, where the next position is 0, gets ``ignore_index``: the
    model run document by document has no target there) and the returned position ids are their zigzag slice
    [B, S/D] (positions inside each document, for RoPE; :func:`document_starts` gives the document starts).
    ``position_ids`` without any document start after position 0 (one document per row, e.g. ``arange``) are the
    plain case: positions [S/D] as without them.
    """
    if labels is None:
        labels = input_ids
    targets = shift_labels(labels, ignore_index)
    seq_len = input_ids.shape[1]
    if position_ids is None:
        positions = zigzag_positions(seq_len, tsp_size, rank, device=input_ids.device)
    else:
        if not isinstance(position_ids, Tensor) or tuple(position_ids.shape) != tuple(input_ids.shape):
            raise TSPConfigError(f"position_ids must be shaped like input_ids {tuple(input_ids.shape)}, got "
                                 f"{getattr(position_ids, 'shape', type(position_ids).__name__)}")
        check_packed_positions(position_ids)
        position_ids = position_ids.to(device=input_ids.device, dtype=torch.long)
        if bool((position_ids[:, 1:] != 0).all()):  # one document per row: plain causal attention (fast kernels)
            positions = zigzag_positions(seq_len, tsp_size, rank, device=input_ids.device)
        else:
            targets[:, :-1] = targets[:, :-1].masked_fill(position_ids[:, 1:] == 0, ignore_index)
            positions = zigzag_shard(position_ids, tsp_size, rank)
    return (
        zigzag_shard(input_ids, tsp_size, rank),
        zigzag_shard(targets, tsp_size, rank),
        positions,
    )
