"""A plain Fabric loop over a raw Hugging Face ``LlamaForCausalLM``, with only ``strategy="tsp"`` added, reproduces the
same loop in one process (float32; relative 1e-4 on every step's loss and, in the 2-norm of each tensor, on the
final parameters: see ``_check_params``)::

    model = fabric.setup_module(LlamaForCausalLM(config))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in fabric.setup_dataloaders(DataLoader(samples, batch_size=2)):   # full sequences
        loss = model(**batch).loss
        fabric.backward(loss); optimizer.step(); optimizer.zero_grad()

Two groups of real gloo processes (started like ``tests/test_fabric.py``: ``LOCAL_RANK`` set, Fabric launches
nothing), data right-padded (``attention_mask``, labels -100 there) with a different number of valid tokens per
sample:

* 4 processes, dp = 2 x D = 2, GQA (4 query / 2 KV heads): the plain loop (each TSP group reads the same samples,
  the replicas different ones; the reference runs the global batch); ``fabric.save`` after the second step and
  ``fabric.load`` into a freshly set-up model give the same next losses and weights; ``fabric.clip_gradients``
  against ``torch.nn.utils.clip_grad_norm_`` in the reference (norms and every clipped gradient); gradient
  accumulation over 2 micro-batches with ``fabric.no_backward_sync`` (the replicas' gradients stay their own until
  the last micro-batch); ``fabric.setup(model, optimizer)`` refused with the fix.
* 3 processes, ``strategy="tsp"`` (D = 3), GQA with one KV head replicated on the 3 ranks: the plain loop, the
  clipped loop, and a model built on the meta device (``fabric.init_module(empty_init=True)``) that reads its
  slices of a ``save_pretrained`` directory.
"""

from __future__ import annotations

import copy
import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_tsp  # noqa: F401  (registers "tsp")
from lightning_tsp import TSPConfigError
from lightning_tsp.zigzag import IGNORE_INDEX
from tests.reference import assert_close
from tests.test_strategy import run_ranks

pytest.importorskip("transformers")

B = 2  # samples per replica and step
LR = 1e-2
RTOL = 1e-4
CLIP = 0.05  # below the gradient norms of these models: clipping changes every step


def _config(hidden: int, heads: int, kv_heads: int, intermediate: int, vocab: int, seq: int):
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=seq,
                      rms_norm_eps=1e-5, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def _hf_model(cfg, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def _samples(cfg, n: int, seq: int) -> list[dict[str, torch.Tensor]]:
    """Right-padded sequences (0 to 5 padding tokens, labels -100 there): a different valid-token count per sample."""
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(n):
        ids = torch.randint(0, cfg.vocab_size, (seq,), generator=g)
        mask = torch.ones(seq, dtype=torch.long)
        pad = (5 * i) % 6
        if pad:
            mask[-pad:] = 0
        ids = ids.masked_fill(mask == 0, 0)
        out.append({"input_ids": ids, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX), "attention_mask": mask})
    return out


def _global_batches(samples, global_batch: int) -> list[dict[str, torch.Tensor]]:
    return list(DataLoader(samples, batch_size=global_batch))


def _reference(model, micro_batches, steps: int, accum: int = 1, clip: float | None = None):
    """The single-process loop: (losses of every micro-batch, gradient norms before clipping, final parameters,
    the gradients of every step as the optimizer used them)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, grads = [], [], []
    for step in range(steps):
        for batch in micro_batches[step * accum: (step + 1) * accum]:
            loss = model(**batch).loss
            loss.backward()
            losses.append(loss.detach())
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), norms, {n: p.detach() for n, p in model.named_parameters()}, grads


def _gather(x: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts)


def _full_params(model, grads: bool = False) -> dict[str, torch.Tensor]:
    """The unsharded parameters (or their gradients; one copy of a replicated KV head), under the Hugging Face
    names."""
    from lightning_tsp.models import find_tsp_model
    from lightning_tsp.models.llama import gather_full

    tsp_model = find_tsp_model(model)
    dims = tsp_model.shard_dims()
    return {n: gather_full((p.grad if grads else p).to_local().detach(), dims[n], tsp_model.tsp,
                           tsp_model.replicas(n))
            for n, p in tsp_model.named_parameters()}


def _check_setup(model, hf_reference) -> None:
    """The module Fabric returns: the Hugging Face model's parameters are the TSP model's DTensor shards."""
    from torch.distributed.tensor import DTensor

    from lightning_tsp.models import find_tsp_model

    tsp_model = find_tsp_model(model)
    ours = dict(tsp_model.named_parameters())
    assert set(ours) == {n for n, _ in hf_reference.named_parameters()}
    assert all(p is ours[n] for n, p in model.module.named_parameters())  # model.module: the Hugging Face model
    assert len(list(model.parameters())) == len(ours)  # no full copy left beside the shards
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert set(model.state_dict()) == set(hf_reference.state_dict())


def _loop(fabric, model, optimizer, batches, accum: int = 1, clip: float | None = None, on_micro_batch=None):
    """The Fabric loop over ``batches`` (this rank's, as the loader gave them): losses of every micro-batch, and
    with ``clip`` the norms and the full clipped gradients of every step."""
    losses, norms, grads = [], [], []
    for i, batch in enumerate(batches):
        accumulating = (i + 1) % accum != 0
        with fabric.no_backward_sync(model, enabled=accumulating):
            loss = model(**batch).loss
            fabric.backward(loss)
        if on_micro_batch is not None:
            on_micro_batch(model, accumulating)
        losses.append(loss.detach())
        if accumulating:
            continue
        if clip is not None:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=clip))
            grads.append(_full_params(model, grads=True))
        optimizer.step()
        optimizer.zero_grad()
    return torch.stack(losses), norms, grads


def _check_losses(tag, losses, ref_losses, tsp: int) -> None:
    """Every rank of a TSP group has the same loss; their mean over replicas is the global batch's."""
    every = _gather(losses.double())  # [world, steps]
    groups = every.view(-1, tsp, every.shape[-1])  # [dp, tsp, steps]
    assert torch.equal(groups, groups[:, :1].expand_as(groups)), f"{tag}: ranks of a TSP group differ"
    assert_close(f"{tag} losses", groups[:, 0].mean(0), ref_losses, RTOL)


def _check_clipped(tag, norms, grads, ref_norms, ref_grads) -> None:
    assert all(float(n) > 2 * CLIP for n in ref_norms), "the reference was expected to clip"
    assert_close(f"{tag} norms", torch.stack(norms), torch.stack(ref_norms), RTOL)
    for step, (got, want) in enumerate(zip(grads, ref_grads, strict=True)):
        for name in want:
            assert_close(f"{tag} step {step} gradient {name}", got[name], want[name], RTOL)


def _check_params(tag, model, ref_params, rtol: float = RTOL) -> None:
    """Every final parameter within ``rtol`` of the reference's, relative in the 2-norm of the tensor.

    Not elementwise: AdamW divides each gradient element by its own running magnitude, so an element whose
    gradient is tiny turns float32 rounding into a visible update difference. The Hugging Face model and its
    unsharded conversion (D = 1, one process, no TSP communication) already differ by 1.9e-4 of the largest
    weight elementwise after 3 steps of this loop, and by 1.3e-5 in the 2-norm. AdamW's update does not show a
    gradient wrong by a constant factor either: the clipped loops compare every step's gradients too.
    """
    got = _full_params(model)
    assert set(got) == set(ref_params)
    for name, want in ref_params.items():
        err = float((got[name].double() - want.double()).norm() / want.double().norm())
        assert err <= rtol, f"{tag} final {name}: relative 2-norm error {err:.2e} (rtol {rtol})"


def _fabric(devices: int, strategy):
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true")
    fabric.launch()
    return fabric


def _setup(fabric, cfg, seed: int = 0):
    model = fabric.setup_module(_hf_model(cfg, seed))  # a raw Hugging Face model
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    return model, optimizer


# ---- dp = 2 x D = 2 -------------------------------------------------------------------------------------------


def _worker_dp2_tsp2(rank, world_size, tmp):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    from lightning_tsp.fabric import TSPFabricStrategy

    tsp, steps, seq = 2, 4, 16
    dp = world_size // tsp
    cfg = _config(hidden=32, heads=4, kv_heads=2, intermediate=64, vocab=64, seq=seq)
    samples = _samples(cfg, dp * B * steps, seq)
    reference = _hf_model(cfg, seed=0)
    fabric = _fabric(world_size, TSPFabricStrategy(tsp_size=tsp, timeout=timedelta(seconds=90)))
    ck = os.path.join(tmp, "ckpt")

    with pytest.raises(TSPConfigError, match="setup_module.*setup_optimizers"):
        hf = _hf_model(cfg, seed=0)
        fabric.setup(hf, torch.optim.AdamW(hf.parameters(), lr=LR))

    # ---- the plain loop, saved after step 2
    model = fabric.setup_module(_hf_model(cfg, seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(samples, batch_size=B))
    losses, batches = [], []
    for step, batch in enumerate(loader):
        out = model(**batch)
        loss = out.loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        batches.append(batch)
        if step == 1:
            fabric.save(ck, {"model": model, "optimizer": optimizer, "step": step + 1})
    assert isinstance(out, CausalLMOutputWithPast) and out.logits is None
    assert len(batches) == steps
    _check_setup(model, reference)
    ref_batches = _global_batches(samples, dp * B)
    for step, batch in enumerate(batches):  # a TSP group reads the same samples, the replicas the global batch
        ids = _gather(batch["input_ids"]).view(dp, tsp, B, seq)
        assert torch.equal(ids, ids[:, :1].expand_as(ids)), f"step {step}: ranks of a TSP group read other samples"
        rows = sorted(map(tuple, ids[:, 0].reshape(dp * B, seq).tolist()))
        assert rows == sorted(map(tuple, ref_batches[step]["input_ids"].tolist())), f"step {step}: samples"
    ref_losses, _, ref_params, _ = _reference(reference, ref_batches, steps)
    losses = torch.stack(losses)
    _check_losses("plain loop dp=2 x D=2", losses, ref_losses, tsp)
    _check_params("plain loop dp=2 x D=2", model, ref_params)

    # ---- fabric.load into a fresh model (other weights): the same next losses and weights
    resumed, resumed_optimizer = _setup(fabric, cfg, seed=1)
    state = {"model": resumed, "optimizer": resumed_optimizer, "step": 0}
    fabric.load(ck, state)
    assert state["step"] == 2
    resumed_losses, _, _ = _loop(fabric, resumed, resumed_optimizer, batches[2:])
    assert_close("resumed losses", resumed_losses, losses[2:], 1e-6)
    _check_params("resumed", resumed, _full_params(model), rtol=1e-6)

    # ---- fabric.clip_gradients: the reference clips with torch.nn.utils.clip_grad_norm_
    clipped, clipped_optimizer = _setup(fabric, cfg)
    losses, norms, grads = _loop(fabric, clipped, clipped_optimizer, batches[:2], clip=CLIP)
    ref_losses, ref_norms, ref_params, ref_grads = _reference(reference, ref_batches, 2, clip=CLIP)
    _check_clipped("clip_gradients", norms, grads, ref_norms, ref_grads)
    _check_losses("clipped loop", losses, ref_losses, tsp)
    _check_params("clipped loop", clipped, ref_params)

    # ---- gradient accumulation over 2 micro-batches with fabric.no_backward_sync
    def replicas_own_gradients(model, accumulating: bool) -> None:
        grad = next(iter(model.parameters())).grad.to_local()
        parts = _gather(grad).view(dp, tsp, *grad.shape)
        assert torch.equal(parts[0], parts[1]) != accumulating, (
            "inside no_backward_sync the replicas keep their own gradients; after it they hold the average")

    accumulated, accumulated_optimizer = _setup(fabric, cfg)
    losses, _, _ = _loop(fabric, accumulated, accumulated_optimizer, batches, accum=2,
                         on_micro_batch=replicas_own_gradients)
    ref_losses, _, ref_params, _ = _reference(reference, ref_batches, 2, accum=2)
    _check_losses("accumulated loop", losses, ref_losses, tsp)
    _check_params("accumulated loop", accumulated, ref_params)
    dist.barrier()


# ---- D = 3 ----------------------------------------------------------------------------------------------------


def _worker_tsp3(rank, world_size, tmp):
    steps, seq = 3, 24
    cfg = _config(hidden=48, heads=6, kv_heads=1, intermediate=96, vocab=66, seq=seq)  # the KV head on 3 ranks
    samples = _samples(cfg, B * steps, seq)
    reference = _hf_model(cfg, seed=0)
    fabric = _fabric(world_size, "tsp")  # D = the 3 devices

    model = fabric.setup_module(_hf_model(cfg, seed=0))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    loader = fabric.setup_dataloaders(DataLoader(samples, batch_size=B))
    losses = []
    for batch in loader:
        loss = model(**batch).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    _check_setup(model, reference)
    ref_batches = _global_batches(samples, B)
    ref_losses, _, ref_params, _ = _reference(reference, ref_batches, steps)
    _check_losses("plain loop D=3", torch.stack(losses), ref_losses, world_size)
    _check_params("plain loop D=3", model, ref_params)

    clipped, clipped_optimizer = _setup(fabric, cfg)
    losses, norms, grads = _loop(fabric, clipped, clipped_optimizer, list(loader)[:2], clip=CLIP)
    ref_losses, ref_norms, ref_params, ref_grads = _reference(reference, ref_batches, 2, clip=CLIP)
    _check_clipped("clip_gradients D=3", norms, grads, ref_norms, ref_grads)
    _check_losses("clipped loop D=3", losses, ref_losses, world_size)
    _check_params("clipped loop D=3", clipped, ref_params)

    # ---- a model built on the meta device (fabric.init_module) and pointed at a saved checkpoint: each rank reads
    # only its slices; the first loss is the reference's
    from transformers import LlamaForCausalLM

    from lightning_tsp.convert.hf import set_pretrained_path

    saved = os.path.join(tmp, "hf")
    if rank == 0:
        reference.save_pretrained(saved)
    dist.barrier()
    with fabric.init_module(empty_init=True):
        meta = LlamaForCausalLM(cfg)
    assert all(p.is_meta for p in meta.parameters())
    loaded = fabric.setup_module(set_pretrained_path(meta, saved))
    _check_setup(loaded, reference)
    first = loaded(**next(iter(loader))).loss.detach()
    _check_losses("meta-device model loaded from a checkpoint", first[None], ref_losses[:1], world_size)
    dist.barrier()


@pytest.mark.timeout(300)
def test_plain_fabric_loop_hf_dp2_tsp2(tmp_path):
    run_ranks(_worker_dp2_tsp2, 4, str(tmp_path), timeout=280.0)


@pytest.mark.timeout(240)
def test_plain_fabric_loop_hf_tsp3(tmp_path):
    run_ranks(_worker_tsp3, 3, str(tmp_path), timeout=220.0)
