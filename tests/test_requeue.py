"""Atomic checkpoint saves and SLURM requeue.

* Single process: every crash point of a commit (both commit paths: the atomic ``RENAME_EXCHANGE`` swap and the
  two-rename fallback) leaves a complete checkpoint under the name, or its previous copy that every reader falls
  back to; staging / previous / trash siblings are never taken for checkpoints (Lightning's ``hpc_ckpt_N``
  numbering, ModelCheckpoint's ``last`` search, ``--ckpt_path auto``); incomplete checkpoints are refused by name.
* 2 gloo processes (TSPStrategy): a rank is SIGKILLed in the middle of replacing a checkpoint; the previous
  checkpoint still loads with the old values.
* The CLI under a simulated SLURM job (SLURM_* variables, a fake ``scontrol`` on PATH): SIGUSR1 to both ranks of a
  ``lightning-tsp fit`` run -> checkpoint at a step boundary + ``scontrol requeue``; the same command again (as the
  requeued job runs it, ``--ckpt_path auto``) resumes, and the loss curve equals the uninterrupted run's.
"""

from __future__ import annotations

import csv
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from lightning.pytorch import Callback

from lightning_tsp import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]


# ---- single process: names and crash points ---------------------------------------------------------------------


def _make_checkpoint(path: Path, value: float) -> None:
    """A real (small) DCP checkpoint directory written without a process group, like TSPStrategy's."""
    import torch.distributed.checkpoint as dcp

    path.mkdir(parents=True)
    dcp.save({"state_dict": {"w": torch.full((8,), value)}}, storage_writer=dcp.FileSystemWriter(str(path)),
             no_dist=True)
    torch.save({"global_step": int(value)}, path / ckpt.LIGHTNING_METADATA_FILENAME)
    (path / ckpt.TSP_METADATA_FILENAME).write_text("{}")


def _value(path: Path) -> float:
    import torch.distributed.checkpoint as dcp

    state = {"state_dict": {"w": torch.zeros(8)}}
    dcp.load(state, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    w = state["state_dict"]["w"]
    assert torch.equal(w, torch.full_like(w, w[0].item())), "a checkpoint mixing two saves"
    return w[0].item()


class _Crash(Exception):
    pass


@pytest.fixture
def crash_at(monkeypatch):
    def arm(step: str):
        def hook(name: str) -> None:
            if name == step:
                raise _Crash(name)

        monkeypatch.setattr(ckpt, "_save_step_hook", hook)

    yield arm


@pytest.fixture(params=["exchange", "two-renames"])
def commit_mode(request, monkeypatch):
    if request.param == "two-renames":  # a file system without renameat2(RENAME_EXCHANGE) (NFS, Lustre, ...)
        monkeypatch.setattr(ckpt, "_renameat2", False)
    elif not sys.platform.startswith("linux"):
        pytest.skip("RENAME_EXCHANGE is Linux-only")
    return request.param


def test_sibling_names_are_never_checkpoints(tmp_path):
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector

    for name in ("hpc_ckpt_3.ckpt", "last.ckpt", "last-v1.ckpt", "epoch=0-step=2.ckpt", "a%5Fckpt_.ckpt"):
        for sibling in (ckpt.staging_path(tmp_path / name), ckpt.previous_path(tmp_path / name)):
            assert sibling.parent == tmp_path and sibling.name.startswith(".")
            assert "ckpt_" not in sibling.name and not sibling.name.endswith(".ckpt"), sibling.name
    names = ["ckpt_1", "ckpt%5F1", "ckpt%255F1"]  # the encoding is injective
    assert len({ckpt.staging_path(tmp_path / n) for n in names}) == 3

    # Lightning's SLURM numbering ignores an interrupted hpc save (int("") would raise on a name without digits)
    _make_checkpoint(tmp_path / "hpc_ckpt_1.ckpt", 1.0)
    _make_checkpoint(ckpt.prepare_atomic_save(tmp_path / "hpc_ckpt_2.ckpt"), 2.0)
    assert _CheckpointConnector.hpc_save_path(tmp_path) == str(tmp_path / "hpc_ckpt_2.ckpt")
    assert ckpt.next_hpc_checkpoint_path(tmp_path) == tmp_path / "hpc_ckpt_2.ckpt"
    assert ckpt.find_latest_checkpoint(roots=[tmp_path]) == tmp_path / "hpc_ckpt_1.ckpt"
    # ModelCheckpoint's "last" search ignores staging / previous siblings of last.ckpt
    assert not any(ModelCheckpoint.FILE_EXTENSION == Path(p).suffix for p in
                   (ckpt.staging_path("last.ckpt"), ckpt.previous_path("last.ckpt")))


@pytest.mark.parametrize("step", ["written", "moved_aside", "committed", "done"])
def test_every_crash_point_leaves_a_loadable_checkpoint(tmp_path, crash_at, commit_mode, step):
    # with the atomic swap there is no "moved aside" state: the hook never fires and the commit completes
    path = tmp_path / "ck" / "last.ckpt"
    _make_checkpoint(path, 1.0)
    staging = ckpt.prepare_atomic_save(path)
    _make_checkpoint(staging, 2.0)
    if step == "written":  # killed after writing, before the commit (the strategy calls _step("written") itself)
        pass
    else:
        crash_at(step)
        try:
            ckpt.commit_atomic_save(path)
        except _Crash:
            pass
    # a reader of the name: always one complete checkpoint, the old one or the new one
    loaded = ckpt.checkpoint_for_loading(path) if path.exists() else None
    if step == "moved_aside" and commit_mode == "two-renames":
        assert not path.exists()
        with pytest.warns(UserWarning, match="interrupted while replacing"):
            loaded = ckpt.checkpoint_for_loading(path)
        assert loaded == ckpt.previous_path(path) and _value(loaded) == 1.0
    else:
        want = 1.0 if step == "written" else 2.0
        assert loaded == path and _value(path) == want
    # --ckpt_path auto: recovers the name first, never returns a sibling
    latest = ckpt.find_latest_checkpoint(roots=[tmp_path])
    assert latest == path and ckpt.checkpoint_problem(path) is None
    # the next save of the name cleans every sibling
    ckpt._save_step_hook = None  # (monkeypatch restores it)
    staging = ckpt.prepare_atomic_save(path)
    _make_checkpoint(staging, 3.0)
    ckpt.commit_atomic_save(path)
    assert sorted(os.listdir(path.parent)) == ["last.ckpt"] and _value(path) == 3.0


def test_incomplete_checkpoints_are_refused_by_name(tmp_path):
    path = tmp_path / "epoch=0-step=2.ckpt"
    _make_checkpoint(path, 1.0)
    (path / "__0_0.distcp").unlink()  # what a non-atomic save killed mid-write (or a partial delete) leaves
    with pytest.raises(ckpt.IncompleteCheckpointError, match=r"epoch=0-step=2\.ckpt is incomplete: its shard file "
                                                             r"__0_0\.distcp is missing"):
        ckpt.checkpoint_for_loading(path)
    with pytest.warns(UserWarning, match="skipping incomplete checkpoint"):
        assert ckpt.find_latest_checkpoint(roots=[tmp_path]) is None
    # only a staging copy exists: not loadable, and the error says why
    _make_checkpoint(ckpt.prepare_atomic_save(tmp_path / "new.ckpt"), 2.0)
    with pytest.raises(FileNotFoundError, match=r"new\.ckpt does not exist \(a save to it was interrupted"):
        ckpt.checkpoint_for_loading(tmp_path / "new.ckpt")
    # a truncated single-file checkpoint
    (tmp_path / "full.ckpt").write_bytes(b"PK\x03\x04 truncated")
    assert "not a complete torch.save file" in ckpt.checkpoint_problem(tmp_path / "full.ckpt")
    # a directory that is not a checkpoint is never replaced
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "notes.txt").write_text("x")
    with pytest.raises(IsADirectoryError, match=r"logs: it is a directory that is not a checkpoint .*notes\.txt"):
        ckpt.check_replaceable(tmp_path / "logs")
    ckpt.check_replaceable(path)  # a (even incomplete) checkpoint directory may be replaced


def test_requeue_callback_units(tmp_path):
    from lightning_tsp import TSPConfigError
    from lightning_tsp.requeue import SLURMRequeue, slurm_job_id

    assert slurm_job_id({"SLURM_JOB_ID": "7"}) == "7"
    assert slurm_job_id({"SLURM_JOB_ID": "9", "SLURM_ARRAY_JOB_ID": "7", "SLURM_ARRAY_TASK_ID": "3"}) == "7_3"
    assert slurm_job_id({}) is None
    assert SLURMRequeue(signal="usr2").signal == signal.SIGUSR2 and SLURMRequeue(signal=10).signal == signal.SIGUSR1
    with pytest.raises(TSPConfigError, match="SLURMRequeue\\(signal='SIGFOO'\\): unknown signal"):
        SLURMRequeue(signal="SIGFOO")


# ---- 2 gloo processes: SIGKILL in the middle of replacing a checkpoint --------------------------------------------


def _kill_worker(rank, world_size, tmp, victim, step, commit_mode, check_model_checkpoint):
    import torch.distributed as dist

    from lightning_tsp import checkpoint as ck
    from tests.test_checkpoint import CFG, GLOBAL_BATCH, _data, _full_params
    from tests.test_strategy_eval import lightning_module_class, make_trainer
    from torch.utils.data import DataLoader

    if commit_mode == "two-renames":
        ck._renameat2 = False
    if os.environ.get("TSP_TEST_NON_ATOMIC_SAVE"):  # control: write in place, as before atomic saves (must fail)
        ck.staging_path = Path
        ck.prepare_atomic_save = Path
        ck.commit_atomic_save = lambda path: None
    savers = []
    if check_model_checkpoint:  # directory checkpoints with save_top_k, save_last=True and save_last="link"
        from lightning.pytorch.callbacks import ModelCheckpoint

        savers = [ModelCheckpoint(dirpath=os.path.join(tmp, "topk"), save_top_k=1, save_last=True,
                                  every_n_train_steps=1),
                  ModelCheckpoint(dirpath=os.path.join(tmp, "link"), monitor="train_loss", save_top_k=2,
                                  save_last="link", every_n_train_steps=1)]
    trainer = make_trainer(world_size, 2, max_steps=2, default_root_dir=tmp, callbacks=savers,
                           enable_checkpointing=bool(savers))
    module = lightning_module_class()(CFG, optimizer="adamw")
    trainer.fit(module, train_dataloaders=DataLoader(_data(), batch_size=GLOBAL_BATCH))
    if savers and rank == 0:
        topk, link = Path(tmp, "topk"), Path(tmp, "link")
        # the step-1 checkpoint was removed by strategy.remove_checkpoint; no hidden sibling is left anywhere
        assert sorted(os.listdir(topk)) == ["epoch=0-step=2.ckpt", "last.ckpt"], os.listdir(topk)
        assert sorted(os.listdir(link)) == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]
        assert (link / "last.ckpt").is_symlink() and os.readlink(link / "last.ckpt") == "epoch=0-step=2.ckpt"
        for p in (topk / "epoch=0-step=2.ckpt", topk / "last.ckpt", link / "last.ckpt"):
            assert ck.checkpoint_problem(p) is None, p
        assert ck.find_latest_checkpoint(roots=[link]) == link / "epoch=0-step=2.ckpt"  # links are skipped
        latest = ck.find_latest_checkpoint(trainer)  # both callbacks' dirpaths are searched: a step-2 save
        assert latest in (topk / "epoch=0-step=2.ckpt", topk / "last.ckpt", link / "epoch=0-step=2.ckpt"), latest
    dist.barrier()
    path = os.path.join(tmp, "ck", "last.ckpt")
    trainer.save_checkpoint(path)
    old = _full_params(module)
    if rank == 0:
        torch.save(old, os.path.join(tmp, "old.pt"))
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)  # the "new" checkpoint differs everywhere
    dist.barrier()

    def hook(name):
        if name == step and rank == victim:
            Path(tmp, "killed").write_text(name)
            os.kill(os.getpid(), signal.SIGKILL)

    ck._save_step_hook = hook
    trainer.save_checkpoint(path)
    raise AssertionError("the save should have been killed")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim,step,commit_mode", [(0, "written", "exchange"), (1, "written", "exchange"),
                                                     (0, "moved_aside", "two-renames")],
                         ids=["rank0-before-commit", "rank1-after-write", "rank0-between-renames"])
def test_kill_mid_save_keeps_previous_checkpoint(tmp_path, victim, step, commit_mode):
    from tests.test_strategy import run_ranks

    with pytest.raises(Exception) as failure:  # noqa: B017  (the killed rank, or the survivor's gloo error)
        run_ranks(_kill_worker, 2, str(tmp_path), victim, step, commit_mode, victim == 0 and step == "written",
                  timeout=150.0)
    killed = tmp_path / "killed"
    assert killed.exists() and killed.read_text() == step, f"not killed where intended: {failure.value}"
    path = tmp_path / "ck" / "last.ckpt"
    old = torch.load(tmp_path / "old.pt")
    loadable = ckpt.checkpoint_for_loading(path) if path.exists() else None
    if step == "moved_aside":  # only the previous copy exists; every reader falls back to it
        with pytest.warns(UserWarning, match="interrupted while replacing"):
            loadable = ckpt.checkpoint_for_loading(path)
    state, _ = ckpt.load_full_model_state(loadable)
    if victim == 1:  # rank 1 died after every rank had written: rank 0 committed the complete new checkpoint
        assert all(torch.equal(state[n], old[n] + 1.0) for n in old)
    else:
        assert sorted(state) == sorted(old)
        for name, value in old.items():
            assert torch.equal(state[name], value), f"{name} is not the previous checkpoint's value"
    # the partial write is never mistaken for a checkpoint, and --ckpt_path auto restores the name
    assert ckpt.find_latest_checkpoint(roots=[tmp_path / "ck"]) == path
    assert ckpt.checkpoint_problem(path) is None


# ---- the CLI under a simulated SLURM job: SIGUSR1 -> checkpoint + requeue -> resume ----------------------------

MAX_STEPS = 10
JOB_ID = "4242"


class Progress(Callback):
    """Slows every step a little (so that a signal lands mid-run) and writes rank 0's step count to a file."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(0.3)
        if trainer.is_global_zero:
            Path(trainer.default_root_dir, "progress").write_text(str(trainer.global_step))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(root: Path, bin_dir: Path, log: Path) -> list[subprocess.Popen]:
    """``srun lightning-tsp fit ...`` on one node with 2 tasks: the same command per rank, SLURM's variables."""
    cmd = [
        sys.executable, "-m", "lightning_tsp.cli", "fit", "--config", str(ROOT / "recipes" / "tiny-cpu.yaml"),
        f"--trainer.max_steps={MAX_STEPS}", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0",
        "--trainer.val_check_interval=1.0", f"--trainer.default_root_dir={root}",
        "--trainer.callbacks+=lightning_tsp.requeue.SLURMRequeue", "--trainer.callbacks+=tests.test_requeue.Progress",
        "--data.seq_len=64", "--data.max_tokens=60000", "--model.warmup_steps=2", "--ckpt_path=auto",
    ]
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))
               and k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK", "PL_GLOBAL_SEED")}
        env.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
            SLURM_JOB_ID=JOB_ID, SLURM_JOB_NAME="tsp-requeue-test", SLURM_NTASKS="2", SLURM_NTASKS_PER_NODE="2",
            SLURM_NNODES="1", SLURM_NODEID="0", SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
            SLURM_NODELIST="localhost", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        )
        out = open(log.with_suffix(f".rank{rank}.log"), "w")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], log: Path, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    text = "".join(log.with_suffix(f".rank{r}.log").read_text() for r in range(2))
    assert all(p.returncode == 0 for p in procs), f"exit codes {[p.returncode for p in procs]}:\n{text[-6000:]}"
    return text


def _losses(root: Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for f in sorted(root.rglob("metrics.csv")):
        for row in csv.DictReader(f.open()):
            if row.get("train_loss"):
                step = int(row["step"])
                assert step not in out, f"step {step} logged twice"
                out[step] = float(row["train_loss"])
    return out


@pytest.mark.timeout(300)
def test_sigusr1_requeue_and_resume_through_the_cli(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\nexit 0\n')
    scontrol.chmod(0o755)

    # the uninterrupted run
    whole = tmp_path / "whole"
    _wait(_launch(whole, bin_dir, tmp_path / "whole"), tmp_path / "whole", 150)
    want = _losses(whole)
    assert sorted(want) == list(range(MAX_STEPS))

    # the job: SIGUSR1 reaches both tasks (SLURM's --signal=SIGUSR1@90), a little apart, in the middle of a step
    job = tmp_path / "job"
    procs = _launch(job, bin_dir, tmp_path / "first")
    deadline = time.monotonic() + 120
    while not ((job / "progress").exists() and int((job / "progress").read_text() or 0) >= 3):
        assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the run did not start"
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGUSR1)
    time.sleep(0.07)
    procs[0].send_signal(signal.SIGUSR1)
    first = _wait(procs, tmp_path / "first", 120)
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"], "rank 0 alone runs scontrol requeue, once"
    hpc = job / "hpc_ckpt_1.ckpt"
    assert ckpt.checkpoint_problem(hpc) is None, first[-4000:]
    assert sorted(p.name for p in job.iterdir() if "ckpt" in p.name) == ["hpc_ckpt_1.ckpt"], \
        "exactly one checkpoint (Lightning's in-handler save must not run) and no staging leftover"
    stopped = torch.load(hpc / ckpt.LIGHTNING_METADATA_FILENAME, weights_only=False)["global_step"]
    assert 3 <= stopped < MAX_STEPS, f"saved at step {stopped}"
    part1 = _losses(job)
    assert sorted(part1) == list(range(stopped)), "the run stopped right after the checkpoint"

    # the requeued job: the very same command
    second = _wait(_launch(job, bin_dir, tmp_path / "second"), tmp_path / "second", 150)
    assert f"--ckpt_path auto: resuming from {hpc}" in second, second[-4000:]
    assert f"`max_steps={MAX_STEPS}` reached" in second
    assert calls.read_text().splitlines() == [f"requeue {JOB_ID}"]
    merged = _losses(job)
    assert sorted(merged) == list(range(MAX_STEPS)), "the resumed run continues at the saved step"
    for step in range(stopped):
        assert merged[step] == pytest.approx(want[step], rel=1e-6), f"step {step} before the requeue"
    # the resumed curve: model, optimizer, LR schedule AND the data position (mid-epoch) must continue exactly
    resumed = [merged[s] for s in range(stopped, MAX_STEPS)]
    assert resumed == pytest.approx([want[s] for s in range(stopped, MAX_STEPS)], rel=1e-5), (
        f"loss curve after resuming mid-epoch at step {stopped} differs from the uninterrupted run:\n"
        f"resumed       {resumed}\nuninterrupted {[want[s] for s in range(stopped, MAX_STEPS)]}"
    )
