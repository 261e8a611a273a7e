"""Under bf16-mixed, the attention, the MLP ring and the LM head hand their input gradient back in fp32, as their
GEMMs accumulated it: not rounded to bf16 and cast back (docs/design.md, "Precision").

Each consumer takes the norm's fp32 output and casts it to the compute dtype inside, so the gradient reaching
every norm's output is the consumers' fp32 sum over the D shards (two shards at D = 2, with one owner per
broadcast step, so even the CPU's bf16 products are summed in fp32). Had it gone through bf16 on the way, every
element would be a bf16 value: that is what the test rules out.
"""

from __future__ import annotations

import torch

from lightning_tsp import TSPLlama
from lightning_tsp.models.llama import ModelConfig
from tests.dist_utils import run_distributed
from tests.reference import batch, world_tsp


def _worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=1, n_heads=4, n_kv_heads=2)
    model = TSPLlama(cfg, world_tsp(), shard_group=1, dtype=torch.float32)  # two broadcast steps at D = 2
    layer = model.model.layers[0]
    norms = {"attention input": layer.input_layernorm, "MLP input": layer.post_attention_layernorm,
             "LM head input": model.model.norm}
    grads: dict[str, torch.Tensor] = {}

    def keep_grad(name):
        def hook(module, inputs, out):
            assert out.dtype == torch.float32, (name, out.dtype)  # the residual stream's dtype
            out.register_hook(lambda g: grads.__setitem__(name, g))
        return hook

    for name, norm in norms.items():
        norm.register_forward_hook(keep_grad(name))
    ids, labels = batch(cfg, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(*model.shard_batch(ids, labels))
    loss.backward()
    assert set(grads) == set(norms)
    through_bf16 = []
    for name, g in grads.items():
        assert g.dtype == torch.float32, (name, g.dtype)
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
        if torch.equal(g, g.to(torch.bfloat16).float()):
            through_bf16.append(name)
    assert not through_bf16, f"these gradients went through bf16: {sorted(through_bf16)}"


def test_input_gradients_are_not_rounded_to_bf16():
    run_distributed(_worker, 2)
