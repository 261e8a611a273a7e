"""Packed documents under TSP: per-document causal attention and positions restarting at each document, under
zigzag sharding. Loss and every gradient equal the unsharded model run document by document (fp64, D = 1, 2, 3 on
real gloo groups), with documents that span zigzag chunks and ranks, one-token documents, GQA, replicated KV
heads, q/k norms and every checkpointing mode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_tsp import TSPLlama
from lightning_tsp.models.llama import ModelConfig
from lightning_tsp.zigzag import IGNORE_INDEX
from tests.dist_utils import run_distributed
from tests.reference import assert_close, full_grads, world_tsp
from tests.test_equivalence import randomize_biases_and_norms, replicated, shapes_for

S = 24


def packed_batch(cfg: ModelConfig, seed: int = 0):
    """[2, S] ids and labels, position ids restarting at every document; row 0 has documents crossing every
    chunk boundary for D = 2, 3, a one-token document and ignored labels; row 1 is one whole document."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (2, S), generator=g)
    labels = ids.clone()
    labels[0, 9] = IGNORE_INDEX
    lengths = [[5, 1, 7, 3, 8], [S]]
    pos = torch.cat([torch.cat([torch.arange(n) for n in row])[None] for row in lengths])
    return ids, labels, pos, lengths


def run_tsp(model: TSPLlama, ids, labels, pos):
    loss = model(*model.shard_batch(ids, labels, position_ids=pos))
    loss.backward()
    return loss.detach(), full_grads(model)


def run_by_document(model: TSPLlama, ids, labels, lengths):
    """The unsharded model on every document separately (positions from 0, no target past the document's end)."""
    total, count = 0.0, 0
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            doc_ids, doc_labels = ids[b : b + 1, start : start + n], labels[b : b + 1, start : start + n]
            targets = torch.full_like(doc_labels, IGNORE_INDEX)
            targets[:, :-1] = doc_labels[:, 1:]
            losses = model.token_losses(doc_ids, targets, torch.arange(n))
            total = total + losses.sum()
            count += int((targets != IGNORE_INDEX).sum())
            start += n
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def check(cfg: ModelConfig, checkpointing: str = "none") -> None:
    tag = f"D={world_tsp().size} heads={cfg.n_heads}/{cfg.n_kv_heads} qk_norm={cfg.qk_norm} ckpt={checkpointing}"
    ids, labels, pos, lengths = packed_batch(cfg)
    ref = TSPLlama(cfg, None, dtype=torch.float64)
    randomize_biases_and_norms(ref)
    model = TSPLlama(cfg, world_tsp(), activation_checkpointing=checkpointing, dtype=torch.float64)
    model.load_full_state_dict(ref.state_dict())
    want_loss, want = run_by_document(ref, ids, labels, lengths)
    loss, got = run_tsp(model, ids, labels, pos)
    assert_close(f"{tag} loss", loss, want_loss, 1e-10)
    for name in want:
        assert_close(f"{tag} grad {name}", got[name], want[name], 1e-10)
    # the same batch without document boundaries is a different function: the test can tell them apart
    plain = TSPLlama(cfg, world_tsp(), dtype=torch.float64)
    plain.load_full_state_dict(ref.state_dict())
    crossing = plain(*plain.shard_batch(ids, labels)).detach()
    assert (crossing - want_loss).abs() > 1e-6 * want_loss, f"{tag}: document masking made no difference"


def _worker(rank: int, world_size: int) -> None:
    for ckpt in ("none", "full", "keep-attention", "offload", "full-offload"):
        check(shapes_for(world_size, gqa=True), ckpt)
    check(dataclasses.replace(shapes_for(world_size, gqa=True), qk_norm=True, head_dim=12, attention_bias=True),
          "selective")
    if world_size == 2:
        check(replicated(world_size, 1))


def test_unsharded_packed_documents():
    check(shapes_for(1, gqa=True))
    check(dataclasses.replace(shapes_for(1, gqa=True), qk_norm=True, head_dim=12), "full")


@pytest.mark.parametrize("d", [2, 3])
def test_tsp_packed_documents(d):
    run_distributed(_worker, d)
