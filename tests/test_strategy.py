"""``Trainer(strategy=TSPStrategy(...))`` trains the built-in model exactly like single-process training.

Multi-process cases start every rank with ``torch.multiprocessing`` and the environment variables Lightning's
``LightningEnvironment`` reads (``LOCAL_RANK`` set = processes created externally), so each rank builds its own
Trainer, as under torchrun or SLURM. The reference is a plain fp64 loop over the unsharded model that reproduces
the sampler's data order, the global token normalisation and Lightning's accumulation (loss / k).
"""

from __future__ import annotations

import dataclasses
import os
import socket
import warnings
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

import lightning_tsp  # noqa: F401  (registers "tsp")
from lightning_tsp import TSPConfigError, TSPGroup, TSPLlama
from lightning_tsp.strategy import TSPStrategy
from lightning_tsp.zigzag import IGNORE_INDEX, zigzag_positions
from tests.dist_utils import exit_after_success, spawn_with_timeout
from tests.reference import assert_close
from tests.test_equivalence import shapes_for

B, S = 2, 24  # per-replica micro-batch and sequence length (S divisible by 2D for D = 2, 3)
# AdamW. Its update divides each gradient element by its running magnitude + eps, so an element whose gradient is
# ~0 moves by lr * (its fp32 rounding error) / eps. eps = 1e-6 (not the default 1e-8) bounds that amplification to
# 1e4 (fp32 training against the fp64 reference; the final parameters' atol is lr * 1e-2, see _check_case)
LR, WD, EPS = 1e-2, 0.1, 1e-6
SGD_LR = 0.5  # SGD + momentum: updates proportional to the gradients, so a wrong gradient scale shows
RTOL = 1e-5


# ---- data, module, reference ----------------------------------------------------------------------------------


def make_dataset(cfg, n: int) -> list[dict[str, torch.Tensor]]:
    """n sequences; a varying number of ignored labels so replicas hold different valid-token counts."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for i in range(n):
        ids = torch.randint(0, 16, (S,), generator=g)  # a small sub-vocabulary: the loss falls within a few steps
        labels = ids.clone()
        labels[torch.randperm(S, generator=g)[: (3 * i) % 11]] = IGNORE_INDEX
        out.append({"input_ids": ids, "labels": labels})
    return out


def _lightning_module_class():
    # imported lazily: the module is pickled by name into every spawned rank
    from lightning.pytorch import LightningModule

    class TSPLanguageModel(LightningModule):
        def __init__(self, cfg, on_meta: bool, optimizer: str, checkpointing: str = "none"):
            super().__init__()
            self.cfg, self.on_meta, self.optimizer, self.checkpointing = cfg, on_meta, optimizer, checkpointing
            self.model = None
            self.losses: list[torch.Tensor] = []

        def configure_model(self):
            if self.model is not None:
                return
            ckpt = self.checkpointing
            if self.on_meta:  # the strategy calls init_weights on the shards
                self.model = TSPLlama(self.cfg, activation_checkpointing=ckpt, device="meta")
            else:  # materialised full model: the strategy copies the slices
                self.model = TSPLlama(self.cfg, activation_checkpointing=ckpt)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch)  # unchanged single-device code
            self.losses.append(loss.detach().clone())
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return make_optimizer(self.optimizer, self.parameters())

    return TSPLanguageModel


def make_optimizer(name: str, params):
    if name == "adamw":
        return torch.optim.AdamW(params, lr=LR, weight_decay=WD, eps=EPS)
    return torch.optim.SGD(params, lr=SGD_LR, momentum=0.9)


def reference_run(cfg, data, dp: int, steps: int, accum: int, optimizer: str):
    """fp64 single-process training on the same global micro-batches -> (losses per micro-step, final params)."""
    model = TSPLlama(cfg, dtype=torch.float64)
    opt = make_optimizer(optimizer, model.parameters())
    # Lightning injects DistributedSampler(num_replicas=dp, rank=dp_rank, shuffle=True, seed=0) for training
    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    losses = []
    for step in range(steps):
        for micro in range(accum):
            j = step * accum + micro
            idx = [i for r in range(dp) for i in per_rank[r][j * B : (j + 1) * B]]
            ids = torch.stack([data[i]["input_ids"] for i in idx])
            labels = torch.stack([data[i]["labels"] for i in idx])
            loss = model(*model.shard_batch(ids, labels))
            (loss / accum).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), {n: p.detach() for n, p in model.named_parameters()}


# ---- multi-process launcher -----------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(local_rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local_rank), NODE_RANK="0",
        WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    try:
        fn(local_rank, world_size, *args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_after_success()


def run_ranks(fn, world_size: int, *args, timeout: float = 150.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh processes; kill them all past ``timeout``."""
    spawn_with_timeout(_entry, (world_size, _free_port(), fn, args), world_size, timeout, fn.__name__)


# ---- the distributed worker -----------------------------------------------------------------------------------


def _fit(cfg, data, tsp_size, world_size, steps, accum, on_meta, optimizer, ckpt_dir=None, checkpointing="none"):
    from lightning.pytorch import Trainer

    strategy = TSPStrategy(tsp_size=tsp_size, timeout=timedelta(seconds=90))
    calls = {"reduce": 0}
    reduce_gradients = strategy.reduce_gradients

    def counting_reduce():
        calls["reduce"] += 1
        reduce_gradients()

    strategy.reduce_gradients = counting_reduce
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=world_size, max_steps=steps, accumulate_grad_batches=accum,
        precision="32-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
    )
    module = _lightning_module_class()(cfg, on_meta, optimizer, checkpointing)
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=B, shuffle=False))
    assert trainer.strategy.launcher is not None and trainer.global_step == steps
    assert calls["reduce"] == steps, f"dp gradient sync ran {calls['reduce']} times for {steps} optimizer steps"
    if ckpt_dir is not None:
        trainer.save_checkpoint(ckpt_dir)
    return trainer, module


def _check_case(rank, world_size, tsp_size, steps, accum, on_meta, optimizer="sgd", ckpt_dir=None,
                checkpointing="none", moe=False):
    dp = world_size // tsp_size
    cfg = shapes_for(tsp_size, gqa=True)
    if moe:  # a mixture of experts (a dense layer, a shared expert, the load-balancing loss); dp = 1: the aux
        # loss of a replica's micro-batch is the reference's
        cfg = dataclasses.replace(cfg, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                  shared_expert_intermediate_size=16, dense_layers=(0,), n_layers=2,
                                  router_aux_loss_coef=0.05, expert_schedule="dispatch")
    data = make_dataset(cfg, dp * B * steps * accum)
    trainer, module = _fit(cfg, data, tsp_size, world_size, steps, accum, on_meta, optimizer, ckpt_dir, checkpointing)
    tag = (f"world={world_size} D={tsp_size} dp={dp} accum={accum} meta={on_meta} {optimizer} ckpt={checkpointing} "
           f"moe={moe}")

    # every parameter is a DTensor on the "tsp" sub-mesh with the layer's placement; only this rank's shard held
    from torch.distributed.tensor import DTensor, Replicate, Shard

    strategy = trainer.strategy
    assert strategy.tsp_group.size == tsp_size and strategy.tsp_group.rank == rank % tsp_size
    assert strategy.distributed_sampler_kwargs == {"num_replicas": dp, "rank": rank // tsp_size}
    model = module.model
    assert isinstance(model, TSPLlama) and model.tsp.size == tsp_size
    for name, dim in model.shard_dims().items():
        p = model.get_parameter(name)
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("tsp",), name
        assert p.placements == ((Shard(dim),) if dim is not None else (Replicate(),)), (name, p.placements)
        assert p.grad is None or isinstance(p.grad, DTensor)
        local = list(p.to_local().shape)
        if dim is not None:
            local[dim] *= tsp_size
        assert list(p.shape) == local, (name, p.shape)  # a DTensor reports the global shape, holds its shard
    full = {n: p.full_tensor() for n, p in model.named_parameters()}  # collective over the TSP group

    # losses: identical inside a TSP group; their mean over ranks is the global token-mean loss
    curve = torch.stack(module.losses).to(torch.float64)
    curves = [torch.empty_like(curve) for _ in range(world_size)]
    dist.all_gather(curves, curve)
    for r in range(world_size):
        assert torch.equal(curves[r], curves[r - r % tsp_size]), f"{tag}: ranks of one TSP group disagree"
    # replicas stay bitwise identical (same averaged gradients, same updates)
    check = torch.stack([full[n].double().sum() for n in sorted(full)])
    checks = [torch.empty_like(check) for _ in range(world_size)]
    dist.all_gather(checks, check)
    assert all(torch.equal(c, checks[0]) for c in checks), f"{tag}: data-parallel replicas diverged"

    if rank == 0:
        ref_curve, ref_params = reference_run(cfg, data, dp, steps, accum, optimizer)
        assert_close(f"{tag} loss curve", torch.stack(curves).mean(0), ref_curve, RTOL)
        assert ref_curve[-accum:].mean() < ref_curve[:accum].mean(), "reference did not learn: the test proves nothing"
        # self.log(..., sync_dist=True) of the per-rank loss is exactly the global token-mean loss
        assert_close(f"{tag} logged train_loss", trainer.callback_metrics["train_loss"], ref_curve[-1], RTOL)
        atol = LR * 1e-2 if optimizer == "adamw" else 1e-6  # see EPS
        for name, want in ref_params.items():
            assert_close(f"{tag} final {name}", full[name], want, RTOL, atol=atol)

        if ckpt_dir is not None:  # the DCP checkpoint holds every rank's shard, not one deduplicated copy
            from lightning.fabric.utilities.load import _load_distributed_checkpoint

            names = sorted(os.listdir(ckpt_dir))
            assert ".metadata" in names and "meta.pt" in names, names
            saved = _load_distributed_checkpoint(Path(ckpt_dir))["state_dict"]
            for name, want in full.items():
                assert torch.equal(saved[f"model.{name}"], want), f"checkpoint lost shards of {name}"
    dist.barrier()


def _worker_tsp2(rank, world_size, tmp):
    _check_case(rank, world_size, tsp_size=2, steps=4, accum=1, on_meta=False, ckpt_dir=os.path.join(tmp, "ck"))
    _check_case(rank, world_size, tsp_size=2, steps=2, accum=2, on_meta=True)
    _check_case(rank, world_size, tsp_size=2, steps=3, accum=1, on_meta=True, optimizer="adamw", moe=True,
                ckpt_dir=os.path.join(tmp, "ck-moe"))


def _worker_tsp2_dp2(rank, world_size, tmp):
    _check_case(rank, world_size, tsp_size=2, steps=3, accum=1, on_meta=True, ckpt_dir=os.path.join(tmp, "ck"))
    # offloaded checkpointing (a reentrant backward): the dp all-reduce hooks and accumulation still line up
    _check_case(rank, world_size, tsp_size=2, steps=2, accum=2, on_meta=False, checkpointing="offload")


def _worker_tsp3(rank, world_size, tmp):
    _check_case(rank, world_size, tsp_size=3, steps=3, accum=1, on_meta=False, optimizer="adamw")


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "world_size,worker",
    [(2, _worker_tsp2), (4, _worker_tsp2_dp2), (3, _worker_tsp3)],
    ids=["D2", "D2-dp2", "D3"],
)
def test_fit_matches_single_process(world_size, worker, tmp_path):
    run_ranks(worker, world_size, str(tmp_path), timeout=200.0)


# ---- single-process checks: registration, invalid settings (raised before any collective), batches -----------


def _trainer(**kwargs):
    from lightning.pytorch import Trainer

    kwargs.setdefault("accelerator", "cpu")
    return Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs)


def test_registered_name_and_defaults():
    from lightning.fabric.strategies import STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_tsp import _registration

    _registration.install()  # idempotent: the one registration path (import lightning_tsp calls it)
    _registration.install()
    assert "tsp" in StrategyRegistry and "tsp" in STRATEGY_REGISTRY
    assert not hasattr(lightning_tsp.strategy, "register_strategy")
    assert "register_strategies" not in vars(TSPStrategy)  # no second path through Lightning's class hook
    trainer = _trainer(strategy="tsp", devices=2)
    strategy = trainer.strategy
    assert type(strategy) is TSPStrategy and strategy.tsp_size == 2 and strategy.data_parallel_size == 1
    assert strategy.launcher is not None  # validate_settings runs under SLURM/torchrun too
    assert _trainer(strategy="TSP", devices=4, num_nodes=2).strategy.topology.mesh_shape == (2, 4)
    assert _trainer(strategy=TSPStrategy(tsp_size=2), devices=4).strategy.topology.mesh_shape == (2, 2)
    assert not dist.is_initialized()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_supported_precisions(precision):
    from lightning_tsp.strategy import TSPHalfPrecision, TSPMixedPrecision, TSPPrecision

    plugin = _trainer(strategy="tsp", devices=2, precision=precision).strategy.precision_plugin
    assert plugin.precision == precision
    # the TSP subclass of Lightning's plugin: its clip_grad_by_norm is the exact TSP norm (a public override)
    want = {"32-true": TSPPrecision, "bf16-mixed": TSPMixedPrecision, "bf16-true": TSPHalfPrecision}[precision]
    assert type(plugin) is want and "clip_grad_by_norm" not in vars(plugin)


@pytest.mark.parametrize("precision", ["16-mixed", 16])
def test_cpu_16_mixed_runs_as_bf16_mixed_like_lightning(precision):
    # Lightning itself runs CPU "16-mixed" as bf16-mixed (with a warning): a supported precision, accepted as is
    with pytest.warns(UserWarning, match="bf16-mixed"):
        plugin = _trainer(strategy="tsp", devices=2, precision=precision).strategy.precision_plugin
    assert plugin.precision == "bf16-mixed" and plugin.scaler is None


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(strategy=TSPStrategy(tsp_size=2), devices=3), "tsp_size=2 does not divide the world size 3"),
        (dict(strategy=TSPStrategy(tsp_size=4), devices=2), "tsp_size=4 does not divide the world size 2"),
        (dict(strategy=TSPStrategy(tsp_size=2), devices=3, num_nodes=2), "does not divide the 3 devices per node"),
        (dict(strategy=TSPStrategy(tsp_size=2, data_parallel_size=3), devices=4), "data_parallel_size=3"),
        (dict(strategy="tsp", devices=2, precision="16-true"), "precision='16-true'.*bf16-mixed"),
        (dict(strategy="tsp", devices=2, precision="64-true"), "precision='64-true'"),
        (dict(strategy=TSPStrategy(), devices=2, precision="16-mixed"), "16-mixed"),
        (dict(strategy="tsp", devices=2, plugins="MIXED16"), "precision='16-mixed'"),
    ],
    ids=["not-dividing-world", "larger-than-world", "straddles-nodes", "bad-dp", "16-true", "64-true",
         "16-mixed-instance", "16-mixed-gpu-plugin"],
)
def test_invalid_settings_raise_before_any_collective(kwargs, match):
    if kwargs.get("plugins") == "MIXED16":
        from lightning.pytorch.plugins.precision import MixedPrecision

        kwargs["plugins"] = [MixedPrecision("16-mixed", "cuda", scaler=torch.amp.GradScaler("cuda", enabled=False))]
    with pytest.raises(ValueError, match=match):  # TSPConfigError is a ValueError (Lightning's own for one case)
        _trainer(**kwargs)
    assert not dist.is_initialized()


@pytest.mark.parametrize("value", [0, -2, 1.5, "two"])
def test_invalid_tsp_size_argument(value):
    with pytest.raises(TSPConfigError, match="tsp_size"):
        TSPStrategy(tsp_size=value)


def test_pytorch_lightning_trainer_gets_a_clear_error():
    import pytorch_lightning as pl  # imported after lightning_tsp: the import hook registers the refusing stub

    with pytest.raises(TSPConfigError, match="lightning.pytorch"):
        pl.Trainer(strategy="tsp", accelerator="cpu", devices=2)
    with pytest.raises(ValueError, match="use lightning.pytorch.Trainer"):
        pl.Trainer(strategy=TSPStrategy(), accelerator="cpu", devices=2)


def test_batch_sharding_and_validation():
    strategy = TSPStrategy(tsp_size=2)
    strategy._tsp_group = TSPGroup(None, 1, 2)  # rank 1 of D=2 (shard_batch issues no collective)
    ids = torch.arange(16).view(2, 8)
    out = strategy.shard_batch({"input_ids": ids})
    assert set(out) == {"input_ids", "targets", "position_ids"}
    assert torch.equal(out["position_ids"], zigzag_positions(8, 2, 1))
    assert torch.equal(out["input_ids"], ids[:, out["position_ids"]])
    # targets: the next token on the global sequence, the last position ignored
    assert out["targets"][0].tolist() == [3, 4, 5, 6]  # positions 2, 3, 4, 5
    # right padding through attention_mask -> no loss on padded targets
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 6:] = 0
    out = strategy.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": mask})
    assert out["targets"][0].tolist() == [3, 4, 5, IGNORE_INDEX]  # label 6 is padding
    for bad, match in [
        ((ids, ids), "dict with 'input_ids'"),
        ({"labels": ids}, "dict with 'input_ids'"),
        ({"input_ids": ids, "pixel_values": ids}, "pixel_values"),
        ({"input_ids": ids.float()}, "integer tensor"),
        ({"input_ids": ids, "labels": ids[:, :4]}, "shaped like input_ids"),
        ({"input_ids": ids, "attention_mask": 1 - mask}, "right padding"),
        ({"input_ids": ids[:, :6]}, "sequence length 6 is not divisible by 2 \\* tsp_size = 4"),
    ]:
        with pytest.raises(TSPConfigError, match=match):
            strategy.shard_batch(bad)
