"""TSPStrategy beyond plain training: gradient clipping, validate / test / predict, the Perplexity metric.

Every distributed result is compared with a single-process fp64 reference on the unsharded model:

* ``gradient_clip_val`` (norm): the clipped gradients of every step and the loss curve match
  ``torch.nn.utils.clip_grad_norm_``; (value) match ``clip_grad_value_``. The references assert that clipping is
  active, so a missing or wrong clip fails.
* ``validate`` / ``test``: the logged losses (``sync_dist=True``) and perplexities equal the single-process values.
* ``predict`` with ``predict_logprobs``: per-token log-probs [B, S] in natural order, NaN without a target.

Ranks are started like ``tests/test_strategy.py`` does (its helpers are reused).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler

from lightning_tsp import TSPLlama
from lightning_tsp.zigzag import IGNORE_INDEX
from tests.reference import assert_close
from tests.test_equivalence import shapes_for
from tests.test_strategy import B, RTOL, make_dataset, make_optimizer, run_ranks

CLIP_NORM = 0.05  # well below the tiny model's gradient norms: clipping acts at every step
CLIP_VALUE = 2e-3


# ---- the LightningModule used by the distributed workers (and by tests/test_checkpoint.py) -------------------


def lightning_module_class():
    from lightning.pytorch import LightningModule

    from lightning_tsp.metrics import Perplexity
    from lightning_tsp import predict_logprobs

    class EvalLM(LightningModule):
        def __init__(self, cfg, optimizer: str = "sgd", record_grads: bool = False, hf_config=None):
            super().__init__()
            self.cfg, self.optimizer_name, self.record_grads, self.hf_config = cfg, optimizer, record_grads, hf_config
            self.model = None
            self.losses: list[torch.Tensor] = []
            self.grads: list[dict[str, torch.Tensor]] = []
            self.val_ppl, self.test_ppl = Perplexity(), Perplexity()

        def configure_model(self):
            if self.model is None:
                self.model = TSPLlama(self.cfg, device="meta")
                if self.hf_config is not None:
                    self.model.hf_config = self.hf_config

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch)
            self.losses.append(loss.detach().clone())
            self.log("train_loss", loss, sync_dist=True)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if self.record_grads:  # after clipping and the optimizer step (grads are zeroed at the next step)
                self.grads.append({n: p.grad.full_tensor() for n, p in self.model.named_parameters()})

        def _evaluate(self, batch, name, ppl):
            loss = self.model(**batch)
            self.log(f"{name}_loss", loss, sync_dist=True)
            ppl.update(self.model.token_losses(batch["input_ids"], batch["targets"], batch["position_ids"]),
                       batch["targets"])
            self.log(f"{name}_ppl", ppl)

        def validation_step(self, batch, batch_idx):
            self._evaluate(batch, "val", self.val_ppl)

        def test_step(self, batch, batch_idx):
            self._evaluate(batch, "test", self.test_ppl)

        def predict_step(self, batch, batch_idx):
            return predict_logprobs(self, batch)

        def configure_optimizers(self):
            return make_optimizer(self.optimizer_name, self.parameters())

    return EvalLM


def make_trainer(world_size: int, tsp_size: int, **kwargs):
    from lightning.pytorch import Trainer

    from lightning_tsp.strategy import TSPStrategy

    kwargs.setdefault("enable_checkpointing", False)
    return Trainer(
        strategy=TSPStrategy(tsp_size=tsp_size, timeout=timedelta(seconds=60)), accelerator="cpu",
        devices=world_size, precision="32-true", logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, **kwargs,
    )


# ---- single-process references (fp64) ---------------------------------------------------------------------------


def _global_batches(data, dp: int, steps: int):
    per_rank = [list(DistributedSampler(data, num_replicas=dp, rank=r, shuffle=True, seed=0)) for r in range(dp)]
    for j in range(steps):
        idx = [i for r in range(dp) for i in per_rank[r][j * B : (j + 1) * B]]
        yield torch.stack([data[i]["input_ids"] for i in idx]), torch.stack([data[i]["labels"] for i in idx])


def reference_clipped(cfg, data, dp: int, steps: int, algorithm: str):
    model = TSPLlama(cfg, dtype=torch.float64)
    opt = make_optimizer("sgd", model.parameters())
    losses, grads, scales, norms = [], [], [], []
    for ids, labels in _global_batches(data, dp, steps):
        loss = model(*model.shard_batch(ids, labels))
        loss.backward()
        params = list(model.parameters())
        scales.append(max(p.grad.abs().max() for p in params).item())  # fp32 gradient noise scales with this
        if algorithm == "norm":
            norm = torch.nn.utils.clip_grad_norm_(params, CLIP_NORM)
            norms.append(norm)
            assert norm > 2 * CLIP_NORM, f"gradient norm {norm} barely above the clip: the test would prove nothing"
        else:
            biggest = max(p.grad.abs().max() for p in params)
            assert biggest > 2 * CLIP_VALUE, f"largest |grad| {biggest}: value clipping would not act"
            torch.nn.utils.clip_grad_value_(params, CLIP_VALUE)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    return torch.stack(losses), grads, scales, norms


def reference_eval(cfg, data, dp: int):
    """Per global batch of the eval sampler (shuffle=False): token-mean loss; plus total NLL / count, logprobs."""
    model = TSPLlama(cfg, dtype=torch.float64)
    n_batches = len(data) // (dp * B)
    per_rank = [list(range(len(data)))[r::dp] for r in range(dp)]
    batch_losses, nll, count, logprobs = [], 0.0, 0, {}
    with torch.no_grad():
        for j in range(n_batches):
            idx = [i for r in range(dp) for i in per_rank[r][j * B : (j + 1) * B]]
            ids = torch.stack([data[i]["input_ids"] for i in idx])
            labels = torch.stack([data[i]["labels"] for i in idx])
            inputs = model.shard_batch(ids, labels)
            batch_losses.append(model(*inputs))
            tok = model.token_losses(*inputs)
            valid = inputs[1] != IGNORE_INDEX
            nll += tok[valid].sum().item()
            count += int(valid.sum())
            lp = (-tok).masked_fill(~valid, float("nan"))
            for k, i in enumerate(idx):
                logprobs[i] = lp[k]
    return torch.stack(batch_losses).mean(), torch.tensor(nll / count).exp(), logprobs


def _assert_logprobs(tag, got, want):
    assert got.shape == want.shape, (tag, got.shape, want.shape)
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"{tag}: NaN positions differ"
    assert torch.isnan(got[..., -1]).all(), f"{tag}: the last position has no target and must be NaN"
    ok = ~torch.isnan(want)
    assert_close(tag, got[ok], want[ok], RTOL)


# ---- workers --------------------------------------------------------------------------------------------------


def _clip_case(rank, world_size, tsp_size, algorithm, steps=3):
    dp = world_size // tsp_size
    cfg = shapes_for(tsp_size, gqa=True)
    data = make_dataset(cfg, dp * B * steps)
    trainer = make_trainer(world_size, tsp_size, max_steps=steps, gradient_clip_val=CLIP_NORM if algorithm == "norm"
                           else CLIP_VALUE, gradient_clip_algorithm=algorithm)
    module = lightning_module_class()(cfg, record_grads=True)
    strategy, norms = trainer.strategy, []
    clip_grad_norm = strategy.clip_grad_norm

    def recording_clip(params, max_norm):  # the pre-clip global norm the strategy computed, per step
        norms.append(clip_grad_norm(params, max_norm))
        return norms[-1]

    strategy.clip_grad_norm = recording_clip
    trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=B))
    curve = torch.stack(module.losses).double()
    curves = [torch.empty_like(curve) for _ in range(world_size)]
    dist.all_gather(curves, curve)
    if rank == 0:
        tag = f"clip-{algorithm} world={world_size} D={tsp_size}"
        ref_losses, ref_grads, scales, ref_norms = reference_clipped(cfg, data, dp, steps, algorithm)
        assert_close(f"{tag} loss curve", torch.stack(curves).mean(0), ref_losses, RTOL)
        if algorithm == "norm":
            assert len(norms) == steps, f"the TSP clip ran {len(norms)} times for {steps} steps"
            assert_close(f"{tag} global grad norm", torch.stack(norms), torch.stack(ref_norms), RTOL)
        else:
            assert not norms
        assert len(module.grads) == steps
        for step, (got, want) in enumerate(zip(module.grads, ref_grads)):
            for name in want:
                # value clipping: elementwise, so the error scale is that of the unclipped gradients
                atol = RTOL * scales[step] if algorithm == "value" else 0.0
                assert_close(f"{tag} step {step} clipped grad {name}", got[name], want[name], RTOL, atol=atol)
            clipped = sum(int((want[n].abs() == CLIP_VALUE).sum()) for n in want)
            assert algorithm == "norm" or clipped > 0, "no gradient element was clipped"
        if algorithm == "norm":  # the strategy's norm is the single-process norm of the clipped gradients
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in ref_grads[-1].values()]))
            assert_close(f"{tag} clipped norm", norm, torch.tensor(CLIP_NORM, dtype=torch.float64), 1e-4)
    if algorithm == "norm":  # the TSP norm helper itself: each parameter once, whatever its placement
        full = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in module.grads[-1].values()]))
        assert_close("strategy.grad_norm", strategy.grad_norm(module.model.parameters()), full, 1e-5)
    dist.barrier()


def _eval_case(rank, world_size, tsp_size):
    dp = world_size // tsp_size
    cfg = shapes_for(tsp_size, gqa=True)
    data = make_dataset(cfg, 2 * dp * B)  # two global batches, no sampler padding
    module = lightning_module_class()(cfg)
    trainer = make_trainer(world_size, tsp_size)
    loader = DataLoader(data, batch_size=B)
    val = trainer.validate(module, dataloaders=loader)[0]
    test = trainer.test(module, dataloaders=loader)[0]
    preds = trainer.predict(module, dataloaders=loader)
    ref_loss, ref_ppl, ref_logprobs = reference_eval(cfg, data, dp)
    tag = f"eval world={world_size} D={tsp_size}"
    for name, got in [("val", val), ("test", test)]:
        assert_close(f"{tag} {name}_loss", torch.tensor(got[f"{name}_loss"]), ref_loss, RTOL)
        assert_close(f"{tag} {name}_ppl", torch.tensor(got[f"{name}_ppl"]), ref_ppl, RTOL)
    # predictions: this rank's replica's samples (sampler order), full sequences in natural order, on every rank
    mine = list(range(len(data)))[rank // tsp_size :: dp]
    assert len(preds) == len(mine) // B
    for j, p in enumerate(preds):
        want = torch.stack([ref_logprobs[i] for i in mine[j * B : (j + 1) * B]])
        _assert_logprobs(f"{tag} predict batch {j} rank {rank}", p, want)
    # the metric refuses the already-averaged loss
    from lightning_tsp.metrics import Perplexity

    with pytest.raises(ValueError, match="per-token losses"):
        Perplexity().update(torch.tensor(1.0), torch.zeros(2, 4, dtype=torch.long))
    dist.barrier()


def _worker(rank, world_size):
    # one group of 4 processes (dp=2 x D=2) for every case: process start-up dominates the run time on CPU
    _clip_case(rank, world_size, 2, "norm", steps=2)
    _clip_case(rank, world_size, 2, "value", steps=2)
    _eval_case(rank, world_size, 2)


@pytest.mark.timeout(200)
def test_clipping_and_eval_match_single_process():
    run_ranks(_worker, 4, timeout=180.0)


# ---- single process -------------------------------------------------------------------------------------------


def test_perplexity_single_process():
    from lightning_tsp.metrics import Perplexity

    g = torch.Generator().manual_seed(0)
    losses = torch.rand(3, 8, generator=g)
    targets = torch.randint(0, 10, (3, 8), generator=g)
    targets[0, :3] = IGNORE_INDEX
    losses[0, :3] = 0.0
    metric = Perplexity()
    metric.update(losses[:2], targets[:2])
    metric.update(losses[2:], targets[2:])
    valid = targets != IGNORE_INDEX
    assert_close("perplexity", metric.compute(), losses[valid].double().mean().exp(), 1e-12)
