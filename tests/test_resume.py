"""Exact mid-epoch resume of ``lightning-tsp fit`` (TextDataModule's resumable sampler and loader).

Every multi-process case runs the console script's module (``python -m lightning_tsp.cli fit``) on 2 CPU processes
(gloo), like tests/test_cli.py. A reference run saves a checkpoint after every few optimizer steps (exactly what an
interrupted run would have left); the resumed run must log the reference's loss at every later step (fp32):

* same layout, in the middle of an epoch;
* another layout (tsp_size 2 x dp 1 -> tsp_size 1 x dp 2, same global batch), in the middle of an epoch;
* shuffled epochs with ``max_epochs`` (which makes TSPLanguageModel read ``trainer.estimated_stepping_batches``
  and so build the train loader before the checkpoint is loaded): at an epoch boundary and in the middle of the
  second epoch, running on into the third.

Before the resumable loader existed, Lightning restarted the interrupted epoch from its first batch, and the
resumed losses differed from the first resumed step on.
"""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.datamodule import TextDataModule
from lightning_tsp.sampler import ResumableDataLoader, ResumableDistributedSampler
from tests.test_cli import ROOT, _env

RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
RTOL = 1e-6  # fp32 (re-reading the epoch's first batches instead gives ~1e-2; another tsp_size rounds ~1e-7)
SEQ_LEN = 64
MID_STEPS = 6  # mid-epoch case: checkpoint after this many steps, reference runs twice as long
RUN_TIMEOUT = 240


def _fit(root: Path, *args: str, callbacks: list | None = None, ckpt_path: Path | None = None) -> dict[int, float]:
    """``lightning-tsp fit`` on 2 processes with the tiny recipe -> {step: train_loss} logged by rank 0."""
    root.mkdir(parents=True, exist_ok=True)
    extra = root / "extra.yaml"
    extra.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks or [],
                                                 "enable_checkpointing": bool(callbacks)}}))
    cmd = [
        sys.executable, "-m", "lightning_tsp.cli", "fit", "--config", str(RECIPE), "--config", str(extra),
        "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0", "--trainer.val_check_interval=1.0",
        f"--trainer.default_root_dir={root}", f"--data.seq_len={SEQ_LEN}", "--model.warmup_steps=2", *args,
    ]
    if ckpt_path is not None:
        cmd.append(f"--ckpt_path={ckpt_path}")
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    (metrics,) = list(root.rglob("metrics.csv"))
    losses = {int(r["step"]): float(r["train_loss"]) for r in csv.DictReader(metrics.open()) if r.get("train_loss")}
    assert losses
    return losses


def _checkpointing(dirpath: Path, every: int) -> list:
    return [{"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(dirpath), "filename": "{step}", "every_n_train_steps": every,
                           "save_top_k": -1}}]


def _ckpt(dirpath: Path, step: int) -> Path:
    path = dirpath / f"step={step}.ckpt"
    assert path.exists(), sorted(p.name for p in dirpath.iterdir())
    return path


def _assert_same_curve(reference: dict[int, float], resumed: dict[int, float], after: int, rtol: float) -> float:
    """The resumed run logs exactly the reference's steps after ``after``, each loss within ``rtol``; returns the
    largest relative difference."""
    expected = {s: v for s, v in reference.items() if s > after}
    assert expected and sorted(resumed) == sorted(expected), (sorted(resumed), sorted(expected))
    rel = {s: abs(resumed[s] - v) / abs(v) for s, v in expected.items()}
    print(f"max relative loss difference after step {after}: {max(rel.values()):.3g}")
    assert max(rel.values()) <= rtol, {s: (expected[s], resumed[s]) for s in sorted(rel) if rel[s] > rtol}
    return max(rel.values())


# ---- in process: the sampler and the loader -------------------------------------------------------------------


def _global_batches(dataset, batch_size: int, dp: int, epoch: int, state: dict | None = None) -> list[list[int]]:
    """Every global batch of ``epoch`` (the dp replicas' micro-batches concatenated), from ``state`` if given."""
    loaders = [ResumableDataLoader(dataset, ResumableDistributedSampler(dataset, batch_size, dp, r, seed=1))
               for r in range(dp)]
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
        if state is not None:
            loader.load_state_dict(state)
    return [torch.cat(parts).tolist() for parts in zip(*loaders)]


def test_global_batches_do_not_depend_on_the_layout():
    dataset = list(range(103))
    global_batch, epoch = 12, 2
    layouts = [(global_batch // dp, dp) for dp in (1, 2, 3, 4, 6, 12)]
    reference = _global_batches(dataset, *layouts[0], epoch)
    assert len(reference) == len(dataset) // global_batch
    for layout in layouts[1:]:
        assert _global_batches(dataset, *layout, epoch) == reference, layout
    # one permutation per epoch: every sample at most once, a different order in another epoch
    flat = [i for b in reference for i in b]
    assert len(set(flat)) == len(flat)
    assert _global_batches(dataset, *layouts[0], epoch + 1) != reference


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_state_counts_batches_taken(num_workers):
    dataset = list(range(50))
    batch_size, dp, taken, epoch = 3, 2, 4, 1
    full = _global_batches(dataset, batch_size * dp, 1, epoch)
    loaders = [ResumableDataLoader(dataset, ResumableDistributedSampler(dataset, batch_size, dp, r, seed=1),
                                   num_workers=num_workers) for r in range(dp)]
    iterators = []
    for loader in loaders:
        loader.sampler.set_epoch(epoch)
        iterators.append(iter(loader))
    for _ in range(taken):
        [next(it) for it in iterators]  # workers have fetched further ahead: not counted
    states = [loader.state_dict() for loader in loaders]
    assert states[0] == states[1]  # global: rank 0's copy is the one Lightning saves
    assert states[0]["samples_consumed"] == taken * batch_size * dp and states[0]["epoch"] == epoch
    # the rest of the epoch, in another layout with the same global batch
    assert _global_batches(dataset, batch_size * dp, 1, epoch, states[0]) == full[taken:]
    # the checkpoint's epoch is over when the loop has moved on: the next epoch starts at its beginning
    assert _global_batches(dataset, batch_size, dp, epoch + 1, states[0]) == \
        _global_batches(dataset, batch_size, dp, epoch + 1)


def test_mid_epoch_resume_refuses_another_global_batch():
    dataset = list(range(40))
    loader = ResumableDataLoader(dataset, ResumableDistributedSampler(dataset, 4, 2, 0, seed=1))
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    other = ResumableDataLoader(dataset, ResumableDistributedSampler(dataset, 4, 1, 0, seed=1))
    with pytest.raises(TSPConfigError, match=r"4 x 1 data-parallel replica\(s\) = 4 .*was 4 x 2 = 8.*batch_size=8"):
        other.load_state_dict(state)
    with pytest.raises(TSPConfigError, match="seed is 2, the checkpoint's was 1"):
        ResumableDataLoader(dataset, ResumableDistributedSampler(dataset, 4, 2, 0, seed=2)).load_state_dict(state)
    # at an epoch boundary there is nothing to skip: any layout is accepted
    list(it)
    other.load_state_dict(loader.state_dict())


def test_datamodule_uses_the_data_parallel_split():
    dm = TextDataModule(seq_len=SEQ_LEN, batch_size=4, max_tokens=2000, val_fraction=0)
    dm.setup("fit")
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader) and isinstance(loader.sampler, ResumableDistributedSampler)
    assert loader.sampler.num_replicas == 1 and len(loader) == len(dm.train_set) // 4
    # the data module's own state (restored even when the loader was built before the checkpoint was loaded)
    assert dm.state_dict() == {"train_loader": loader.state_dict()}


# ---- lightning-tsp fit on 2 processes -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mid_epoch_reference(tmp_path_factory):
    """tsp_size 2, dp 1: 2 * MID_STEPS steps inside the first epoch, a checkpoint every MID_STEPS steps."""
    root = tmp_path_factory.mktemp("mid_reference")
    args = (f"--trainer.max_steps={2 * MID_STEPS}", "--data.max_tokens=100000", "--data.batch_size=8")
    losses = _fit(root, *args, callbacks=_checkpointing(root / "ckpt", MID_STEPS))
    assert sorted(losses) == list(range(2 * MID_STEPS))  # the epoch is longer than the run: mid-epoch
    return root, args, losses


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_resume_mid_epoch_same_layout(mid_epoch_reference, tmp_path):
    root, args, reference = mid_epoch_reference
    resumed = _fit(tmp_path / "resumed", *args, ckpt_path=_ckpt(root / "ckpt", MID_STEPS))
    _assert_same_curve(reference, resumed, MID_STEPS - 1, RTOL)


@pytest.mark.timeout(2 * RUN_TIMEOUT)
def test_resume_mid_epoch_other_layout(mid_epoch_reference, tmp_path):
    """Saved as one TSP group of 2 (dp 1, 8 sequences per micro-batch), resumed as 2 data-parallel replicas of
    tsp_size 1 (4 sequences each): the same global batches in the same order."""
    root, args, reference = mid_epoch_reference
    ckpt = _ckpt(root / "ckpt", MID_STEPS)
    resumed = _fit(tmp_path / "resumed", *args, "--trainer.strategy.tsp_size=1", "--data.batch_size=4",
                   ckpt_path=ckpt)
    _assert_same_curve(reference, resumed, MID_STEPS - 1, RTOL)
    # another global batch in the middle of the epoch is refused on every rank, naming the values and the fix
    cmd_args = (*args, "--trainer.strategy.tsp_size=1", "--data.batch_size=8")
    with pytest.raises(AssertionError, match=r"TSPConfigError.*8 x 2 data-parallel replica\(s\) = 16"):
        _fit(tmp_path / "refused", *cmd_args, ckpt_path=ckpt)


@pytest.mark.timeout(3 * RUN_TIMEOUT)
def test_resume_shuffled_epochs(tmp_path):
    batch_size, epochs = 16, 3
    data = ("--data.max_tokens=2000", "--data.val_fraction=0", f"--data.batch_size={batch_size}",
            "--data.shuffle=true")
    dm = TextDataModule(seq_len=SEQ_LEN, batch_size=batch_size, max_tokens=2000, val_fraction=0)
    dm.setup("fit")
    steps_per_epoch = len(dm.train_set) // batch_size
    assert steps_per_epoch >= 3
    args = (*data, "--trainer.max_steps=-1", f"--trainer.max_epochs={epochs}")
    ckpt_dir = tmp_path / "ckpt"
    reference = _fit(tmp_path / "reference", *args, callbacks=_checkpointing(ckpt_dir, 1))
    assert sorted(reference) == list(range(epochs * steps_per_epoch))
    for step in (steps_per_epoch, steps_per_epoch + steps_per_epoch // 2):  # epoch boundary, middle of epoch 2
        resumed = _fit(tmp_path / f"resumed-{step}", *args, ckpt_path=_ckpt(ckpt_dir, step))
        _assert_same_curve(reference, resumed, step - 1, RTOL)
