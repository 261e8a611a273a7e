"""Fewer KV heads than ranks under ``Trainer(strategy="tsp")``: each KV head replicated on D / n_kv ranks.

One D = 2 run of an MQA model (n_kv = 1) with AdamW and gradient clipping by norm (the replicated K/V weights
must count once in the global norm): its loss curve equals an fp64 single-process run clipped by
``torch.nn.utils.clip_grad_norm_``; the sharded checkpoint consolidates to the Hugging Face shapes (one copy of
each KV head) with the trained weights; resuming it at another tsp size is refused by name.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_tsp import TSPConfigError, TSPLlama
from lightning_tsp import checkpoint as ckpt
from lightning_tsp.strategy import TSPStrategy
from tests.reference import assert_close
from tests.test_equivalence import replicated
from tests.test_strategy import B, LR, RTOL, _lightning_module_class, make_dataset, make_optimizer, run_ranks

CFG = replicated(2, 1)  # 4 query heads, 1 KV head, D = 2
STEPS, CLIP = 4, 0.05  # a small clip value: every step is clipped


def _worker(rank, world_size, tmp):
    from lightning.pytorch import Trainer

    trainer = Trainer(
        strategy=TSPStrategy(tsp_size=2, timeout=timedelta(seconds=90)), accelerator="cpu", devices=world_size,
        max_steps=STEPS, gradient_clip_val=CLIP, precision="32-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    module = _lightning_module_class()(CFG, False, "adamw")
    trainer.fit(module, train_dataloaders=DataLoader(make_dataset(CFG, B * STEPS), batch_size=B, shuffle=False))
    trainer.save_checkpoint(os.path.join(tmp, "ck"))
    if rank == 0:
        torch.save(torch.stack(module.losses), os.path.join(tmp, "curve.pt"))


def _reference():
    model = TSPLlama(CFG, dtype=torch.float64)
    opt = make_optimizer("adamw", model.parameters())  # the module's optimizer
    data = make_dataset(CFG, B * STEPS)
    order = list(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    losses, norms = [], []
    for step in range(STEPS):
        idx = order[step * B : (step + 1) * B]
        loss = model(*model.shard_batch(torch.stack([data[i]["input_ids"] for i in idx]),
                                        torch.stack([data[i]["labels"] for i in idx])))
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), torch.stack(norms), {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.timeout(240)
def test_trainer_with_replicated_kv_heads(tmp_path):
    run_ranks(_worker, 2, str(tmp_path), timeout=200.0)
    ref_curve, ref_norms, ref_params = _reference()
    assert bool((ref_norms > CLIP).all()), "clipping never engaged: the test would not see a wrong norm"
    assert_close("loss curve", torch.load(tmp_path / "curve.pt"), ref_curve, RTOL)
    out = ckpt.consolidate(tmp_path / "ck", tmp_path / "full")
    from safetensors.torch import load_file

    state = load_file(str(out))
    assert tuple(state["model.layers.0.self_attn.k_proj.weight"].shape) == (CFG.head_dim, CFG.hidden_size)
    for name, want in ref_params.items():
        assert_close(f"consolidated {name}", state[name], want, RTOL, atol=LR * 1e-2)
    # another tsp size would need another expansion of the replicated K/V weights: refused with its reason
    model = TSPLlama(CFG, dtype=torch.float32)
    with pytest.raises(TSPConfigError, match="k_proj"):
        ckpt.check_state_compatible(ckpt.expected_tensor_shapes(model),
                                    {k.removeprefix("model."): v for k, v in
                                     ckpt.saved_tensor_shapes(tmp_path / "ck").items()}, True, "ck")
