"""Run a function on D real gloo processes inside pytest, with a hard timeout (nothing may hang)."""

from __future__ import annotations

import datetime
import os
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_tsp.teardown import destroy_process_groups


def gloo_threads() -> list[str]:
    """Names of this process's gloo and TCPStore threads still running (Linux; empty elsewhere)."""
    task = "/proc/self/task"
    if not os.path.isdir(task):
        return []
    names = []
    for tid in os.listdir(task):
        try:
            with open(os.path.join(task, tid, "comm")) as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


def exit_after_success() -> None:
    """Tear down a worker whose work is done and checked, and let the interpreter exit normally (its exit status is
    what spawn checks: an abort at exit fails the test). Destroys the process groups still there and releases what
    the registered meshes hold (see :mod:`lightning_tsp.teardown`); call it after the function that held the
    models has returned."""
    destroy_process_groups()


def _entry(rank: int, world_size: int, init_file: str, fn, args) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=90),
    )
    try:
        fn(rank, world_size, *args)
    except BaseException:
        dist.destroy_process_group()  # no barrier: a peer may never reach it; spawn reports the exception
        raise
    exit_after_success()
    # nothing may keep a group (and its gloo threads) alive into the interpreter's finalisation; a thread that is
    # being joined may still be listed for a moment: give them a few seconds, a leak never ends
    deadline = time.monotonic() + 5.0
    while (left := gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"process-group threads outlive the groups {left}: something still references a group"


def spawn_with_timeout(entry, entry_args: tuple, nprocs: int, timeout: float, what: str) -> None:
    """``mp.start_processes(entry, entry_args)``; re-raise the first failure; kill every process past ``timeout``."""
    ctx = mp.start_processes(entry, args=entry_args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"{what} on {nprocs} processes did not finish within {timeout} s")


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; re-raise the first failure."""
    with tempfile.TemporaryDirectory() as tmp:
        entry_args = (world_size, os.path.join(tmp, "store"), fn, args)
        spawn_with_timeout(_entry, entry_args, world_size, timeout, fn.__name__)
