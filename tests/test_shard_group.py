"""Shard grouping: g owners' attention shards per broadcast-schedule step compute the same function for every
valid g (loss, every gradient and the input-embedding gradient vs the D = 1 model and Hugging Face, fp64, real
gloo groups), through every attention variant; ``auto`` picks g from the sequence length; bad values are refused
by name. (The other equivalence tests run ``auto``, which at their tiny sequences groups all D owners.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lightning_tsp import TSPConfigError, TSPLlama
from lightning_tsp.layers.attention import HeadLayout, TSPAttention
from lightning_tsp.group import TSPGroup
from lightning_tsp.planning.grouping import choose_shard_group, valid_shard_groups
from tests.dist_utils import run_distributed
from tests.test_equivalence import check_case, replicated, shapes_for


def _worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    d = world_size
    gqa = shapes_for(d, True)
    for g in valid_shard_groups(d):
        check_case(gqa, "full", shard_group=g)
        check_case(shapes_for(d, False), "none", b=1, shard_group=g)
        check_case(gqa, "offload", b=1, shard_group=g)
        check_case(gqa, "keep-attention", shard_group=g)
        bucketed = dataclasses.replace(gqa, n_heads=4 * d, n_kv_heads=2 * d, hidden_size=32 * d)
        check_case(bucketed, "selective", kv_bucket_heads=1, shard_group=g)
        check_case(dataclasses.replace(gqa, attention_bias=True), "none", shard_group=g)
        check_case(dataclasses.replace(gqa, qk_norm=True, head_dim=12), "full", shard_group=g)
    # replicated KV heads: groups smaller than, equal to and larger than the replicas of a KV head
    for n_kv in (1, 2) if d == 4 else (1,):
        for g in valid_shard_groups(d, d // n_kv):
            check_case(replicated(d, n_kv), "full", shard_group=g)
            check_case(replicated(d, n_kv, attention_bias=True), "offload", b=1, shard_group=g)
            check_case(replicated(d, n_kv, qk_norm=True, head_dim=12), "none", shard_group=g)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("d", [2, 4])
def test_every_shard_group_is_exact(d):
    run_distributed(_worker, d, timeout=360)


def test_layout_regroup_and_ungroup():
    """regroup puts every owner's pieces where the grouped layout reads them (each distinct KV head once);
    ungroup sends each piece of a gradient back, every replica of a KV head receiving that head's gradient."""
    for lay, g in ((HeadLayout(16, 2, 1, 4, bias=True), 4), (HeadLayout(16, 2, 1, 4, True, kv_replicas=2), 4),
                   (HeadLayout(16, 2, 1, 4, True, kv_replicas=4), 2)):
        step = min(g, lay.kv_replicas)
        grouped = lay.grouped(g)
        assert grouped.n_heads == g * lay.n_heads and grouped.n_kv_heads == g // step
        shards = torch.randn(g, lay.numel, dtype=torch.float64)
        grad = torch.randn(grouped.numel, dtype=torch.float64)
        for flat, owners, kv_source in ((lay.regroup(shards, g), shards, "owner"),
                                        (grad, lay.ungroup(grad, g), "head")):
            view = grouped.view(flat)
            for i in range(g):
                own, k = lay.view(owners[i]), i // step
                q = slice(i * lay.q_rows, (i + 1) * lay.q_rows)
                assert torch.equal(view.w_qkv[q], own.w_qkv[: lay.q_rows])
                assert torch.equal(view.w_o[q], own.w_o)  # Wo^T: owner-major rows
                assert torch.equal(view.b_qkv[q], own.b_qkv[: lay.q_rows])
                if kv_source == "owner" and i % step:
                    continue  # regroup reads a replicated KV head from its first owner only
                for part in (0, 1):  # K, then V
                    rows = slice(grouped.q_rows + (part * grouped.n_kv_heads + k) * lay.kv_rows,
                                 grouped.q_rows + (part * grouped.n_kv_heads + k + 1) * lay.kv_rows)
                    mine = slice(lay.q_rows + part * lay.kv_rows, lay.q_rows + (part + 1) * lay.kv_rows)
                    assert torch.equal(view.w_qkv[rows], own.w_qkv[mine])
                    assert torch.equal(view.b_qkv[rows], own.b_qkv[mine])


def test_zero_copy_grouping_stacks_each_piece_owner_by_owner():
    """Where every owner's KV heads are distinct, the grouped shard is each packed piece stacked owner by owner:
    what the collectives build in place from ``group_pieces`` equals ``regroup``, and a gradient's pieces are
    ``ungroup``'s rows (the reduces send them back without copies)."""
    for lay, g in ((HeadLayout(16, 2, 1, 4, bias=True), 4), (HeadLayout(16, 2, 2, 4), 2)):
        assert lay.zero_copy_grouping(g) and not lay.zero_copy_grouping(1)
        shards = torch.randn(g, lay.numel, dtype=torch.float64)
        stacked = torch.empty(lay.grouped(g).numel, dtype=torch.float64)
        for src, dst in lay.group_pieces(g):
            stacked[dst].view(g, -1).copy_(shards[:, src])
        assert torch.equal(stacked, lay.regroup(shards, g))
        back = lay.ungroup(stacked, g)
        for src, dst in lay.group_pieces(g):
            assert torch.equal(back[:, src], stacked[dst].view(g, -1))
    assert not HeadLayout(16, 2, 1, 4, kv_replicas=2).zero_copy_grouping(4)  # a replicated KV head: regroup


def test_auto_choice_and_refusals():
    # paper-7b at D = 8 (4 KV heads of 128 per owner, bf16): all owners at 16K, down to one at 128K
    assert [choose_shard_group(8, s, 1, 4, 128) for s in (8192, 16384, 32768, 65536, 131072)] == [8, 8, 4, 2, 1]
    assert choose_shard_group(8, 2**20, 1, 4, 128) == 1  # never below one owner
    assert valid_shard_groups(8, 4) == [1, 2, 4, 8] and valid_shard_groups(6, 3) == [1, 3, 6]
    tsp = TSPGroup(None, 0, 4)  # layer construction only: no collective is issued
    with pytest.raises(TSPConfigError, match=r"shard_group=3 at tsp_size=4.*\[1, 2, 4\]"):
        TSPAttention(32, 4, 4, tsp, shard_group=3, device="meta")
    with pytest.raises(TSPConfigError, match="shard_group='all'"):
        TSPAttention(32, 4, 4, tsp, shard_group="all", device="meta")
    attn = TSPAttention(32, 4, 4, tsp, device="meta")
    assert attn.step_group(1, 8, torch.bfloat16) == 4
    model = TSPLlama(shapes_for(1, True), shard_group=2, device="meta")  # unsharded: kept for its sharded copy
    assert model.shard_group == 2
