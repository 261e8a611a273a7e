"""``Fabric(strategy="tsp")``: a Fabric loop equals the Trainer and the unsharded model; checkpoints are shared.

One group of 4 processes (dp = 2 x D = 2, gloo) runs, with the same data, seed and SGD as the Trainer tests:

* the Trainer with ``gradient_clip_val`` (norm) and a sharded checkpoint;
* a Fabric loop (``setup_module`` / ``setup_optimizers`` / ``batch_to_device`` / ``backward`` /
  ``clip_gradients``): its loss curve, global norms and every clipped gradient equal the Trainer's and the fp64
  single-process model's (``torch.nn.utils.clip_grad_norm_``);
* ``fabric.save`` -> ``fabric.load`` (weights, optimizer state, metadata); the Trainer's checkpoint loaded by Fabric
  (weights and optimizer state) and Fabric's loaded by the Trainer (``validate(ckpt_path=...)``);
* replicated KV heads (n_kv = 1 < D): the strategy's norm counts one copy and equals the single-process norm, while
  ``torch.nn.utils.clip_grad_norm_`` over the same DTensor gradients counts every copy (why the strategies keep
  their own norm); without replication both agree;
* bf16-true and bf16-mixed set up and train.

Processes are started like ``tests/test_strategy.py`` does (``LOCAL_RANK`` set: Fabric launches nothing).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning_tsp  # noqa: F401  (registers "tsp")
from lightning_tsp import TSPConfigError, TSPLlama
from tests.reference import assert_close
from tests.test_equivalence import replicated, shapes_for
from tests.test_strategy import B, RTOL, make_dataset, make_optimizer, run_ranks
from tests.test_strategy_eval import CLIP_NORM, lightning_module_class, make_trainer, reference_clipped

STEPS = 2


def _fabric(world_size: int, precision: str = "32-true"):
    from lightning.fabric import Fabric

    from lightning_tsp.fabric import TSPFabricStrategy

    fabric = Fabric(strategy=TSPFabricStrategy(tsp_size=2, timeout=timedelta(seconds=90)), accelerator="cpu",
                    devices=world_size, precision=precision)
    fabric.launch()
    return fabric


def _fabric_model(fabric, cfg):
    model = fabric.setup_module(TSPLlama(cfg, device="meta"))  # the strategy shards and initialises it
    optimizer = fabric.setup_optimizers(make_optimizer("sgd", model.parameters()))
    return model, optimizer


def _train_loader(fabric, data, dp: int):
    # the sampler Lightning injects for training (shuffle, seed 0) over the data-parallel axis only
    kwargs = fabric.strategy.distributed_sampler_kwargs
    assert kwargs == {"num_replicas": dp, "rank": fabric.global_rank // 2}
    sampler = DistributedSampler(data, shuffle=True, seed=0, **kwargs)
    return fabric.setup_dataloaders(DataLoader(data, batch_size=B, sampler=sampler), use_distributed_sampler=False)


def _fabric_fit(fabric, cfg, data, dp: int, clip: bool = True):
    model, optimizer = _fabric_model(fabric, cfg)
    losses, norms, grads = [], [], []
    for step, batch in enumerate(_train_loader(fabric, data, dp)):
        if step == STEPS:
            break
        batch = fabric.strategy.batch_to_device(batch)  # this rank's zigzag slice + N / dp
        loss = model(**batch)
        fabric.backward(loss)  # + the data-parallel average
        if clip:
            norms.append(fabric.clip_gradients(model, optimizer, max_norm=CLIP_NORM))
        grads.append({n: p.grad.full_tensor() for n, p in model.module.named_parameters()})
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return model, optimizer, torch.stack(losses), norms, grads


def _gather_mean(x: torch.Tensor, world_size: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.stack(parts).mean(0)


def _full(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)  # a Fabric model: the module it wraps (Hugging Face parameter names)
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _check_equal(tag, got, want):
    assert set(got) == set(want), (tag, sorted(set(got) ^ set(want)))
    for name in want:
        assert torch.equal(got[name], want[name]), f"{tag}: {name} differs"


def _worker(rank, world_size, tmp):
    from torch.distributed.tensor import DTensor

    from lightning_tsp.fabric import TSPFabricStrategy

    dp = world_size // 2
    cfg = shapes_for(2, gqa=True)
    data = make_dataset(cfg, dp * B * STEPS)
    ck_trainer, ck_fabric = os.path.join(tmp, "trainer"), os.path.join(tmp, "fabric")

    # ---- the Trainer (clipping by norm), then its checkpoint
    trainer = make_trainer(world_size, 2, max_steps=STEPS, gradient_clip_val=CLIP_NORM)
    module = lightning_module_class()(cfg, record_grads=True)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=B))
    trainer.save_checkpoint(ck_trainer)
    trainer_curve = _gather_mean(torch.stack(module.losses).double(), world_size)

    # ---- the Fabric loop
    fabric = _fabric(world_size)
    strategy = fabric.strategy
    assert isinstance(strategy, TSPFabricStrategy) and strategy.tsp_group.size == 2
    model, optimizer, losses, norms, grads = _fabric_fit(fabric, cfg, data, dp)
    assert model.module is not None and isinstance(model.module, TSPLlama) and model.module.tsp.size == 2
    for name, p in model.module.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tsp",), name
    curve = _gather_mean(losses.double(), world_size)
    tag = f"fabric world={world_size} D=2"
    assert_close(f"{tag} loss curve vs Trainer", curve, trainer_curve, RTOL)
    assert len(module.grads) == STEPS
    for step in range(STEPS):  # clipped gradients: Fabric's clip equals the Trainer's
        for name, want in module.grads[step].items():
            assert_close(f"{tag} step {step} clipped grad {name} vs Trainer", grads[step][name], want, RTOL, atol=1e-9)
    if rank == 0:  # ... and the fp64 single-process model's, with torch's clip_grad_norm_
        ref_losses, ref_grads, _, ref_norms = reference_clipped(cfg, data, dp, STEPS, "norm")
        assert_close(f"{tag} loss curve vs D=1", curve, ref_losses, RTOL)
        assert_close(f"{tag} global grad norm vs D=1", torch.stack(norms), torch.stack(ref_norms), RTOL)
        for step in range(STEPS):
            for name, want in ref_grads[step].items():
                assert_close(f"{tag} step {step} grad {name} vs D=1", grads[step][name], want, RTOL, atol=1e-9)

    # ---- fabric.save -> fabric.load: weights, optimizer state, metadata
    fabric.save(ck_fabric, {"model": model, "optimizer": optimizer, "step": STEPS})
    names = set(os.listdir(ck_fabric))
    assert {".metadata", "meta.pt", "tsp_model.json"} <= names, names
    model2, optimizer2 = _fabric_model(fabric, cfg)
    state = {"model": model2, "optimizer": optimizer2, "step": 0}
    rest = fabric.load(ck_fabric, state)
    assert state["step"] == STEPS and "tsp" in rest
    _check_equal("fabric round trip weights", _full(model2), _full(model))
    momentum = {n: optimizer.state[p]["momentum_buffer"].full_tensor() for n, p in model.module.named_parameters()}
    loaded = {n: optimizer2.state[p]["momentum_buffer"].full_tensor() for n, p in model2.module.named_parameters()}
    _check_equal("fabric round trip momentum", loaded, momentum)

    # ---- the Trainer's checkpoint loaded by Fabric (its model is the LightningModule's `model`)
    model3, optimizer3 = _fabric_model(fabric, cfg)
    fabric.load(ck_trainer, {"model": model3, "optimizer": optimizer3})
    _check_equal("Trainer checkpoint in Fabric", _full(model3), _full(module.model))
    trainer_opt = trainer.optimizers[0]
    want = {n: trainer_opt.state[p]["momentum_buffer"].full_tensor() for n, p in module.model.named_parameters()}
    got = {n: optimizer3.state[p]["momentum_buffer"].full_tensor() for n, p in model3.module.named_parameters()}
    _check_equal("Trainer optimizer state in Fabric", got, want)

    # ---- Fabric's checkpoint loaded by the Trainer
    evaluator = lightning_module_class()(cfg)
    make_trainer(world_size, 2).validate(evaluator, dataloaders=DataLoader(data, batch_size=B), ckpt_path=ck_fabric)
    _check_equal("Fabric checkpoint in the Trainer", _full(evaluator.model), _full(model))

    # ---- replicated KV heads: the exact norm counts one copy; torch's clip_grad_norm_ counts D / n_kv
    for rcfg, replicated_heads in ((replicated(2, 1), True), (cfg, False)):
        rdata = make_dataset(rcfg, dp * B)
        rmodel, roptimizer = _fabric_model(fabric, rcfg)
        batch = fabric.strategy.batch_to_device(next(iter(_train_loader(fabric, rdata, dp))))
        fabric.backward(rmodel(**batch))
        params = [p for p in rmodel.parameters() if p.grad is not None]
        ours = fabric.strategy.grad_norm(params)
        torch_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch_norm = torch_norm.full_tensor() if isinstance(torch_norm, DTensor) else torch_norm
        if rank == 0:
            _, _, _, ref = reference_clipped(rcfg, rdata, dp, 1, "norm")
            assert_close(f"grad norm replicated={replicated_heads} vs D=1", ours, ref[0], RTOL)
            if replicated_heads:
                assert float(torch_norm) > float(ref[0]) * (1 + 1e-3), "torch's DTensor norm was expected to overcount"
            else:
                assert_close("torch's DTensor norm without replication", torch_norm, ref[0], RTOL)
        roptimizer.zero_grad()

    # ---- bf16: weights in bf16 (bf16-true) / fp32 with autocast (bf16-mixed); training runs
    for precision, dtype in (("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32)):
        bf = _fabric(world_size, precision)
        bmodel, _, blosses, _, _ = _fabric_fit(bf, cfg, data, dp, clip=False)
        assert all(p.dtype == dtype for p in bmodel.parameters()), precision
        assert torch.isfinite(blosses).all()
        assert_close(f"{precision} first loss vs fp32", blosses[0].double(), losses[0].double(), 5e-2)
    dist.barrier()


@pytest.mark.timeout(300)
def test_fabric_matches_trainer_and_single_process(tmp_path):
    run_ranks(_worker, 4, str(tmp_path), timeout=280.0)


# ---- single process: registration, refused settings (before any collective) -----------------------------------


def test_fabric_strategy_name_and_refusals():
    from lightning.fabric import Fabric

    from lightning_tsp.fabric import TSPFabricStrategy

    fabric = Fabric(strategy="tsp", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is TSPFabricStrategy and fabric.strategy.tsp_size == 2
    assert Fabric(strategy="tsp", accelerator="cpu", devices=4, precision="bf16-mixed").strategy.precision.precision \
        == "bf16-mixed"
    with pytest.raises(TSPConfigError, match="precision='16-true'.*bf16"):
        Fabric(strategy="tsp", accelerator="cpu", devices=2, precision="16-true")
    with pytest.raises(TSPConfigError, match="tsp_size=4 does not divide the world size 2"):
        Fabric(strategy=TSPFabricStrategy(tsp_size=4), accelerator="cpu", devices=2)
    with pytest.raises(TSPConfigError, match="tsp_size"):
        TSPFabricStrategy(tsp_size=0)
    with pytest.raises(TSPConfigError, match="set up the model first"):
        fabric.strategy.setup_module_and_optimizers(torch.nn.Linear(2, 2), [])
    assert not dist.is_initialized()


# ---- mid-epoch resume with Fabric: the data position is part of the checkpoint ----------------------------------

RESUME_STEPS, RESUME_AT = 6, 3


def _resume_fabric(tsp_size: int, world_size: int):
    from lightning.fabric import Fabric

    from lightning_tsp.fabric import TSPFabricStrategy

    fabric = Fabric(strategy=TSPFabricStrategy(tsp_size=tsp_size, timeout=timedelta(seconds=90)), accelerator="cpu",
                    devices=world_size)
    fabric.launch()
    return fabric


def _resume_run(fabric, cfg, data, global_batch: int, steps: range, load: str | None, save: str | None):
    """Train ``steps`` with AdamW over a ResumableDataLoader (shuffled); ``load``/``save`` a checkpoint holding the
    model, the optimizer and the loader. Returns the global token-mean loss of each step (the mean over ranks)."""
    from lightning_tsp.sampler import ResumableDataLoader, ResumableDistributedSampler

    kwargs = fabric.strategy.distributed_sampler_kwargs
    sampler = ResumableDistributedSampler(data, global_batch // kwargs["num_replicas"], shuffle=True, seed=7, **kwargs)
    loader = ResumableDataLoader(data, sampler)
    model = fabric.setup_module(TSPLlama(cfg, device="meta"))
    optimizer = fabric.setup_optimizers(make_optimizer("adamw", model.parameters()))
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if load is not None:
        fabric.load(load, state)
    sampler.set_epoch(0)
    losses, batches = [], iter(loader)
    for step in steps:
        batch = fabric.strategy.batch_to_device(next(batches))
        loss = model(**batch)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(_gather_mean(loss.detach().double(), fabric.world_size))
        if save is not None and step + 1 == RESUME_AT:
            fabric.save(save, state)
            break
    return losses


def _resume_worker(rank, world_size, tmp):
    cfg = shapes_for(2, gqa=True)
    global_batch = 4
    data = make_dataset(cfg, global_batch * (RESUME_STEPS + 2))  # an epoch longer than the run: resume mid-epoch
    ck = os.path.join(tmp, "mid-epoch")
    fabric = _resume_fabric(2, world_size)  # D = 2, dp = 1
    whole = _resume_run(fabric, cfg, data, global_batch, range(RESUME_STEPS), None, None)
    first = _resume_run(fabric, cfg, data, global_batch, range(RESUME_STEPS), None, ck)
    assert len(first) == RESUME_AT
    same = _resume_run(fabric, cfg, data, global_batch, range(RESUME_AT, RESUME_STEPS), ck, None)
    other = _resume_run(_resume_fabric(1, world_size), cfg, data, global_batch,  # D = 1, dp = 2
                        range(RESUME_AT, RESUME_STEPS), ck, None)
    if rank == 0:
        want = torch.stack(whole)
        assert_close("Fabric resumed mid-epoch, same layout", torch.stack(first + same), want, 1e-6)
        assert_close("Fabric resumed mid-epoch at D=1 x dp=2", torch.stack(first + other), want, 1e-6)
        # without the loader's position the resumed run would re-read the first batches of the epoch
        assert not torch.allclose(torch.stack(whole[:RESUME_STEPS - RESUME_AT]), want[RESUME_AT:], rtol=1e-3)
    dist.barrier()


@pytest.mark.timeout(240)
def test_fabric_resumes_mid_epoch_exactly(tmp_path):
    run_ranks(_resume_worker, 2, str(tmp_path), timeout=220.0)
