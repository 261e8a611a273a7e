"""SLURM requeue on the pre-timeout signal, with the checkpoint taken at a step boundary on every rank.

``#SBATCH --signal=SIGUSR1@90`` makes SLURM send SIGUSR1 to every task 90 s before the time limit. Lightning's own
handler (``SLURMEnvironment(auto_requeue=True)``) saves ``hpc_ckpt_N.ckpt`` *inside the signal handler*, i.e. at
whatever point each rank happens to be: one rank may be between two collectives of the forward pass while another
is in a third, and the collective save then pairs with the wrong collective (a hang, or a checkpoint of a
half-updated model: Lightning issues #21406 / PR #21407). With TSP every step is a long sequence of collectives, so
:class:`SLURMRequeue` replaces that handler:

* the signal handler only sets a flag (it installs itself in ``setup``, before Lightning registers its handlers;
  Lightning leaves a signal that already has a handler alone);
* at the end of every optimizer step the ranks agree whether any of them got the signal (one all-reduce of one
  number per step);
* if so, every rank saves the same checkpoint, ``default_root_dir/hpc_ckpt_{N+1}.ckpt`` (atomic, see
  docs/checkpoints.md), then global rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (array jobs:
  ``${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}``) and the Trainer stops at once.

The requeued job resumes from the newest checkpoint with ``lightning-tsp fit ... --ckpt_path auto`` (or Lightning's
own ``ckpt_path=None`` under SLURM, which picks the highest ``hpc_ckpt_N``). Outside a SLURM job (no
``SLURM_JOB_ID``) the callback does nothing.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any, Optional, Union

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_tsp import checkpoint as _ckpt
from lightning_tsp.checks import TSPConfigError


def _parse_signal(value: Union[str, int, signal.Signals, None]) -> Optional[signal.Signals]:
    if value is None or isinstance(value, signal.Signals):
        return value
    if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
        return signal.Signals(int(value))
    name = value.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return signal.Signals[name]
    except KeyError:
        raise TSPConfigError(f"SLURMRequeue(signal={value!r}): unknown signal; use e.g. 'SIGUSR1' or 10") from None


def slurm_job_id(environ: Optional[dict] = None) -> Optional[str]:
    """The id ``scontrol requeue`` takes: ``ARRAYJOB_TASK`` for array jobs, else ``SLURM_JOB_ID``; None outside."""
    env = os.environ if environ is None else environ
    array_job = env.get("SLURM_ARRAY_JOB_ID")
    if array_job is not None and env.get("SLURM_ARRAY_TASK_ID") is not None:
        return f"{array_job}_{env['SLURM_ARRAY_TASK_ID']}"
    return env.get("SLURM_JOB_ID")


class SLURMRequeue(Callback):
    """Checkpoint at the next step boundary and requeue the SLURM job when the requeue signal arrives.

    Args:
        signal: the signal SLURM sends before the time limit (``--signal=SIGUSR1@90``). Default: the
            ``requeue_signal`` of Lightning's ``SLURMEnvironment`` when that is the cluster environment, else
            ``SIGUSR1``.
        requeue: run ``scontrol requeue`` after the checkpoint (``False``: only save and stop, e.g. when the job
            script resubmits itself).
        command: the requeue command; the job id is appended.
    """

    def __init__(self, signal: Union[str, int, None] = None, requeue: bool = True,
                 command: tuple[str, ...] = ("scontrol", "requeue")) -> None:
        self.signal = _parse_signal(signal)
        self.requeue = requeue
        self.command = tuple(command)
        self.received = False
        self.saved_path: Optional[Path] = None
        self._installed: Optional[signal.Signals] = None
        self._previous: Any = None
        self._last_step = -1

    # ---- the signal -------------------------------------------------------------------------------------------

    def _handler(self, signum: int, frame: Any) -> None:
        self.received = True  # nothing else here: the save happens at the next step boundary on every rank
        if callable(self._previous):
            self._previous(signum, frame)

    def _resolve_signal(self, trainer: Trainer) -> signal.Signals:
        if self.signal is not None:
            return self.signal
        from lightning.fabric.plugins.environments import SLURMEnvironment

        env = getattr(trainer.strategy, "cluster_environment", None)
        if isinstance(env, SLURMEnvironment) and env.requeue_signal is not None:
            return signal.Signals(env.requeue_signal)
        return signal.SIGUSR1

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or slurm_job_id() is None:
            return
        if threading.current_thread() is not threading.main_thread():
            rank_zero_warn("SLURMRequeue: not in the main thread, so no signal handler can be installed; disabled")
            return
        sig = self._resolve_signal(trainer)
        self.received, self.saved_path, self._last_step = False, None, -1
        self._previous = signal.getsignal(sig)
        if self._previous is self._handler:
            self._previous = None
        signal.signal(sig, self._handler)
        self._installed = sig
        rank_zero_info(f"SLURMRequeue: on {sig.name}, checkpoint at the next step boundary and requeue job "
                       f"{slurm_job_id()}")

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._installed is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self._installed, self._previous if self._previous is not None else signal.SIG_DFL)
        self._installed, self._previous = None, None

    # ---- the step boundary ------------------------------------------------------------------------------------

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._last_step = trainer.global_step  # (restored on resume) an optimizer step increments it

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if self._installed is None or trainer.global_step == self._last_step:
            return  # not under SLURM, or inside a gradient accumulation (no optimizer step yet: not exact)
        self._last_step = trainer.global_step
        if not trainer.strategy.reduce_boolean_decision(self.received, all=False):  # any rank got it
            return
        path = Path(trainer.strategy.broadcast(str(_ckpt.next_hpc_checkpoint_path(trainer.default_root_dir))))
        rank_zero_info(f"SLURMRequeue: {self._installed.name} received; saving {path} at step {trainer.global_step}")
        trainer.save_checkpoint(path)  # every rank; atomic under TSPStrategy
        self.saved_path = path
        self.received = False
        ok = True
        if self.requeue:
            result: Optional[str] = None
            if trainer.is_global_zero:
                result = self._run_requeue()
            result = trainer.strategy.broadcast(result, src=0)
            ok = result is None
            if not ok:
                rank_zero_warn(f"SLURMRequeue: the checkpoint {path} is saved but requeueing failed ({result}); "
                               f"training continues. Resubmit the job: it resumes from {path} with --ckpt_path auto.")
        if ok:
            trainer.should_stop = True  # SLURM ends the job; stop cleanly meanwhile

    def _run_requeue(self) -> Optional[str]:
        job_id = slurm_job_id()
        if job_id is None or not re.fullmatch(r"[0-9_]+", job_id):
            return f"SLURM job id {job_id!r} is not a job id"
        cmd = [*self.command, job_id]
        try:
            rc = subprocess.call(cmd)
        except OSError as err:
            return f"{' '.join(cmd)}: {err}"
        if rc != 0:
            return f"{' '.join(cmd)} exited with {rc}"
        rank_zero_info(f"SLURMRequeue: requeued SLURM job {job_id}")
        return None
