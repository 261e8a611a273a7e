"""cuda_graphs=True: the graphed layers' code (the eager warm-up path that the CUDA-graph captures record) computes
the same loss and gradients as the plain checkpointed model, on real gloo groups (fp64); bad settings are refused.
The captured graphs themselves are checked on a GPU (tests/test_gpu.py::test_cuda_graphs_match_eager)."""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_tsp import TSPLlama
from lightning_tsp.checks import TSPConfigError
from lightning_tsp.graphs import LayerGraphs, _gradients_into
from lightning_tsp.layers.mlp import TSPGatedMLP
from lightning_tsp.models.llama import ModelConfig
from lightning_tsp.schedules.comm import local_tensor, unpack
from tests.dist_utils import run_distributed
from tests.reference import assert_close, batch, full_grads, world_tsp

S = 24


def _cfg(d: int) -> ModelConfig:
    return ModelConfig(vocab_size=240, hidden_size=48, n_layers=3, n_heads=2 * d, n_kv_heads=d, intermediate_size=96,
                       head_dim=8)


def _graphed_matches_plain(rank: int, world: int, mode: str) -> None:
    torch.manual_seed(0)
    cfg = _cfg(world)
    plain = TSPLlama(cfg, world_tsp(), activation_checkpointing=mode, dtype=torch.float64)
    with pytest.warns(UserWarning, match="no CUDA graphs"):
        graphed = TSPLlama(cfg, world_tsp(), activation_checkpointing=mode, cuda_graphs=True, dtype=torch.float64)
        graphed.load_state_dict(plain.state_dict())
        for step in range(3):  # a new batch each step: nothing of an earlier step may leak into a later one
            ids, labels = batch(cfg, 2, S, seed=step)
            inputs = plain.shard_batch(ids, labels)
            losses, grads = [], []
            for model in (plain, graphed):
                model.zero_grad(set_to_none=True)
                loss = model(*inputs)
                loss.backward()
                losses.append(loss.detach())
                grads.append(full_grads(model))
            tag = f"D={world} {mode} step {step}"
            assert_close(f"{tag} loss", losses[1], losses[0], 1e-12)
            assert grads[0].keys() == grads[1].keys()
            for name in grads[0]:
                assert_close(f"{tag} {name}", grads[1][name], grads[0][name], 1e-10)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["keep-attention", "full"])
def test_graphed_layers_match_plain(world: int, mode: str) -> None:
    run_distributed(_graphed_matches_plain, world, mode, timeout=240)


def test_stale_backward_refused() -> None:
    """A second forward before the first one's backward: the stale backward raises, never silently wrong."""
    cfg = _cfg(1)
    with pytest.warns(UserWarning, match="no CUDA graphs"):
        model = TSPLlama(cfg, activation_checkpointing="keep-attention", cuda_graphs=True, dtype=torch.float64)
        inputs = model.shard_batch(*batch(cfg, 2, S))
        first = model(*inputs)
        model(*inputs)
    with pytest.raises(RuntimeError, match="another forward before this backward"):
        first.backward()
    clone = copy.deepcopy(model)  # (an EMA callback, say): the copy does not share the graphs' buffers
    assert clone._layer_graphs is None and model._layer_graphs is not None


def test_cuda_graphs_settings_refused() -> None:
    cfg = _cfg(1)
    with pytest.raises(TSPConfigError, match="activation_checkpointing='none'"):
        TSPLlama(cfg, cuda_graphs=True)
    with pytest.raises(TSPConfigError, match="give True, False or 'auto'"):
        TSPLlama(cfg, activation_checkpointing="full", cuda_graphs="yes")
    moe = ModelConfig(vocab_size=240, hidden_size=32, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=96,
                      num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    with pytest.raises(TSPConfigError, match="mixture-of-experts"):
        TSPLlama(moe, activation_checkpointing="full", cuda_graphs=True)
    for mode in ("none", "offload"):  # "auto" graphs where it can: never refused, eager here (CPU)
        auto = TSPLlama(cfg, activation_checkpointing=mode, cuda_graphs="auto")
        auto(*auto.shard_batch(*batch(cfg, 1, S))).backward()
        assert auto._layer_graphs is None
    model = TSPLlama(cfg, activation_checkpointing="keep-attention", cuda_graphs=True)
    ids = torch.randint(0, cfg.vocab_size, (1, S))
    packed = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).unsqueeze(0)  # two documents
    with pytest.warns(UserWarning), pytest.raises(TSPConfigError, match="packed documents"):
        model(ids, ids, packed)


def _mlp_gradients_into(rank: int, world: int) -> None:
    """``TSPGatedMLP.grad_into`` (set while a layer's backward is captured): the ring leaves the gate/up/down weight
    gradients in that buffer, bit for bit those of the plain backward, and hands autograd views of it."""
    tsp = world_tsp()
    for weight_grads in ("ring", "owners"):
        for rerun in (False, True):  # a plain forward's backward; a checkpointed layer's re-run (no forward ring)
            torch.manual_seed(0)
            mlp = TSPGatedMLP(12, 6 * world, tsp, dtype=torch.float64, weight_grads=weight_grads)
            x = torch.randn(2, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
            dy = torch.randn(2, 5, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(10 + rank))
            ws = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
            mlp.rerun = rerun
            want = torch.autograd.grad(mlp(x), ws, dy)
            into = torch.full((sum(w.numel() for w in ws),), float("nan"), dtype=torch.float64)
            mlp.grad_into = into
            got = torch.autograd.grad(mlp(x), ws, dy)
            tag = f"D={world} {weight_grads} rerun={rerun}"
            for w, g, piece in zip(want, got, unpack(into, [w.shape for w in ws])):
                assert torch.equal(g, w), tag
                assert g.data_ptr() == piece.data_ptr() and g.stride() == piece.stride(), f"{tag}: not a view of into"


@pytest.mark.parametrize("world", [1, 2, 3])
def test_mlp_gradients_into(world: int) -> None:
    run_distributed(_mlp_gradients_into, world, timeout=120)


def test_gradients_into_covers_the_mlp_run() -> None:
    """While a backward is captured, the MLP's ``grad_into`` is the part of the layer's flat gradient buffer that the
    gate/up/down parameters' views cover, and it is cleared after."""
    model = TSPLlama(_cfg(1), activation_checkpointing="keep-attention", dtype=torch.float64)
    layer = model.model.layers[0]
    leaves = [local_tensor(p).detach() for p in layer.parameters()]
    flat, bufs = LayerGraphs([layer], True, (), capture=False)._grad_buffers(leaves)
    names = [n for n, _ in layer.named_parameters()]
    mine = [bufs[names.index(f"mlp.{p}_proj.weight")] for p in ("gate", "up", "down")]
    with _gradients_into(layer, flat, leaves):
        into = layer.mlp.grad_into
        views = unpack(into, [t.shape for t in mine])
        assert all(v.data_ptr() == b.data_ptr() and v.shape == b.shape for v, b in zip(views, mine))
    assert layer.mlp.grad_into is None
