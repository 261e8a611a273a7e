import pytest
import torch

from lightning_tsp import TSPConfigError
from lightning_tsp.zigzag import IGNORE_INDEX, shard_batch, shift_labels, zigzag_positions, zigzag_shard, zigzag_unshard


@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_shard_unshard_round_trip(d):
    s = 4 * d * 3
    x = torch.randn(2, s, 5)
    parts = [zigzag_shard(x, d, p) for p in range(d)]
    assert all(p.shape == (2, s // d, 5) for p in parts)
    assert torch.equal(zigzag_unshard(parts), x)


def test_chunks_p_and_2d_minus_1_minus_p():
    d, c = 4, 3
    pos = torch.arange(2 * d * c)
    for p in range(d):
        want = torch.cat([pos[p * c : (p + 1) * c], pos[(2 * d - 1 - p) * c : (2 * d - p) * c]])
        assert torch.equal(zigzag_shard(pos[None], d, p)[0], want)
        assert torch.equal(zigzag_positions(2 * d * c, d, p), want)


def test_every_rank_has_the_same_causal_work():
    d, c = 4, 5
    s = 2 * d * c
    work = [zigzag_positions(s, d, p).add(1).sum().item() for p in range(d)]  # keys visible = position + 1
    assert len(set(work)) == 1


def test_labels_shift_on_the_global_sequence_before_sharding():
    d = 2
    ids = torch.arange(8)[None]
    targets = shift_labels(ids)
    assert targets.tolist() == [[1, 2, 3, 4, 5, 6, 7, IGNORE_INDEX]]
    for p in range(d):
        i, t, pos = shard_batch(ids, None, d, p)
        # every local token keeps its own next-token target, even across chunk boundaries
        assert torch.equal(t[0], torch.where(pos + 1 < 8, pos + 1, IGNORE_INDEX))
        assert torch.equal(i[0], pos)


def test_ignored_labels_stay_ignored():
    ids = torch.arange(8)[None]
    labels = ids.clone()
    labels[0, 3] = IGNORE_INDEX
    assert shift_labels(labels)[0, 2] == IGNORE_INDEX


@pytest.mark.parametrize("s,d", [(10, 3), (6, 2), (0, 1)])
def test_sequence_length_not_divisible_by_2d_is_a_clear_error(s, d):
    with pytest.raises(TSPConfigError, match=f"sequence length {s} is not divisible by 2 \\* tsp_size"):
        zigzag_shard(torch.zeros(1, s), d, 0)
