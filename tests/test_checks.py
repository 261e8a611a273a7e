"""Invariant checks: clear errors naming the value and the fix, raised before any collective is issued."""

import pytest
import torch

from lightning_tsp import TSPConfigError, TSPGroup, TSPLlama
from lightning_tsp.models.llama import ModelConfig


def group(d: int) -> TSPGroup:
    # No process group exists: any collective would fail, so these errors must come first.
    return TSPGroup(None, 0, d)


@pytest.mark.parametrize(
    "overrides, d, message",
    [
        (dict(n_heads=6, n_kv_heads=6, hidden_size=48), 4, "n_heads=6 is not divisible by tsp_size=4"),
        (dict(n_heads=12, n_kv_heads=3, hidden_size=96), 4, "n_kv_heads=3 and tsp_size=4.*divides 3 or is a multiple"),
        (dict(intermediate_size=90), 4, "intermediate_size=90 is not divisible by tsp_size=4"),
        (dict(vocab_size=250), 4, r"vocab_size=250 is not divisible by tsp_size=4.*\(e.g. 252\)"),
        (dict(n_heads=4, n_kv_heads=3), 1, "n_heads=4 is not a multiple of n_kv_heads=3"),
    ],
)
def test_model_shape_errors(overrides, d, message):
    cfg = ModelConfig(**{**dict(vocab_size=256, hidden_size=64, n_heads=4, n_kv_heads=4, intermediate_size=96),
                         **overrides})
    with pytest.raises(TSPConfigError, match=message):
        TSPLlama(cfg, group(d), device="meta")


def test_head_dim_must_be_given_when_hidden_is_not_a_multiple_of_heads():
    with pytest.raises(TSPConfigError, match="hidden_size=50 is not divisible by n_heads=4: give head_dim"):
        ModelConfig(hidden_size=50, n_heads=4)
    assert ModelConfig(hidden_size=50, n_heads=4, n_kv_heads=4, head_dim=16).head_dim == 16


def test_unknown_checkpointing_mode():
    with pytest.raises(TSPConfigError, match="activation_checkpointing='partial'"):
        TSPLlama(ModelConfig(), activation_checkpointing="partial", device="meta")


def test_badly_sharded_inputs_fail_before_communication():
    model = TSPLlama(ModelConfig(n_kv_heads=4), group(2))
    ids = torch.zeros(1, 5, dtype=torch.long)
    with pytest.raises(TSPConfigError, match="local sequence length 5 is odd"):
        model(ids, ids, torch.arange(5))
    with pytest.raises(TSPConfigError, match="do not match"):
        model(ids, ids[:, :4], torch.arange(5))
    with pytest.raises(TSPConfigError, match="sequence length 6 is not divisible by 2 \\* tsp_size = 4"):
        model.shard_batch(torch.zeros(1, 6, dtype=torch.long))


def test_checkpoint_from_another_model_is_rejected():
    model = TSPLlama(ModelConfig(), None)
    other = TSPLlama(ModelConfig(hidden_size=32, n_heads=4), None)
    with pytest.raises(TSPConfigError, match="expects the full shape"):
        model.load_full_state_dict(other.state_dict())
    with pytest.raises(TSPConfigError, match="lacks"):
        model.load_full_state_dict({})
