"""Broadcast schedule: owner j = 0..D-1 broadcasts its packed weight shard, one owner at a time.

The broadcast of shard j+1 is issued before shard j is handed to the caller, so it is in flight while shard j
computes (double buffering: at most two shards alive).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tsp.group import TSPGroup


def broadcast_shards(tsp: TSPGroup, local: Tensor) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(j, shard_j)`` for j = 0..D-1 on every rank; ``local`` is this rank's packed shard."""
    if tsp.size == 1:
        yield 0, local
        return

    def start(j: int):
        buf = local if j == tsp.rank else torch.empty_like(local)
        return buf, dist.broadcast(buf, src=tsp.global_rank(j), group=tsp.group, async_op=True)

    pending = start(0)
    for j in range(tsp.size):
        buf, work = pending
        work.wait()
        if j + 1 < tsp.size:
            pending = start(j + 1)
        yield j, buf


class OwnerReduce:
    """Sums weight-gradient partials onto their owners: ``reduce(dst=j)`` per shard, in fp32.

    At most one reduction is in flight: it overlaps with the next shard's backward; its buffer is freed once
    done unless this rank owns it.
    """

    def __init__(self, tsp: TSPGroup):
        self.tsp = tsp
        self.pending = None
        self.own: Tensor | None = None

    def submit(self, j: int, partial: Tensor) -> None:
        self.wait()
        if j == self.tsp.rank:
            self.own = partial
        if self.tsp.size > 1:
            self.pending = dist.reduce(partial, dst=self.tsp.global_rank(j), group=self.tsp.group, async_op=True)

    def wait(self) -> None:
        if self.pending is not None:
            self.pending.wait()
            self.pending = None

    def result(self) -> Tensor:
        self.wait()
        assert self.own is not None
        return self.own


def reduce_to_owner(tsp: TSPGroup) -> OwnerReduce:
    return OwnerReduce(tsp)
