"""Run a function on D real gloo processes inside pytest, with a hard timeout (nothing may hang)."""

from __future__ import annotations

import datetime
import os
import sys
import tempfile
import time

import torch.distributed as dist
import torch.multiprocessing as mp


def exit_after_success() -> None:
    """End a worker whose work is done and checked without the interpreter's teardown.

    At C++ static destruction, gloo's background threads can abort a process that has already passed
    ("terminate called without an active exception", SIGABRT); the parent would report a crash. Only the success
    path calls this: a failing worker raises before it, and spawn reports the exception.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    finally:
        dist.destroy_process_group()
    exit_after_success()


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
