"""Broadcast schedule: owner j = 0..D-1 broadcasts its packed weight shard, one owner at a time.

The broadcast of shard j+1 is issued before shard j is handed to the caller, so it is in flight while shard j
computes (double buffering: at most two shards alive).

Shard grouping (:func:`gather_shard_groups`, :class:`GroupReduce`): g consecutive owners' shards travel together
(g broadcasts, or one all-gather when g = D) and their weight-gradient partials go back together (g reduces, or
one reduce-scatter), so the caller runs D/g larger steps instead of D small ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.schedules.comm import all_gather, reduce_scatter


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


def gather_shard_groups(tsp: TSPGroup, local: Tensor, g: int) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(J, shards)`` for the D/g owner groups J: ``shards`` [g, n] holds owners Jg..Jg+g-1's packed
    shards. The next group's collectives are in flight during each yield (at most two groups alive)."""
    d = tsp.size
    if d % g:
        raise ValueError(f"shard group g={g} must divide the TSP group size {d}")

    def start(jg: int):
        buf = local.new_empty(g, local.numel())
        if d == 1:
            buf[0] = local
            return buf, []
        if g == d:
            return buf, [all_gather(buf.view(-1), local, tsp, async_op=True)]
        works = []
        for i in range(g):
            j = jg * g + i
            if j == tsp.rank:
                buf[i] = local
            works.append(dist.broadcast(buf[i], src=tsp.global_rank(j), group=tsp.group, async_op=True))
        return buf, works

    pending = start(0)
    for jg in range(d // g):
        buf, works = pending
        for w in works:
            w.wait()
        if jg + 1 < d // g:
            pending = start(jg + 1)
        yield jg, buf


class GroupReduce:
    """Sums a group's weight-gradient partials [g, n] (owner Jg+i's in row i) onto their owners, in fp32: g
    reduces, or one reduce-scatter when g = D. At most one group in flight; :meth:`result` is this rank's sum."""

    def __init__(self, tsp: TSPGroup, g: int):
        self.tsp, self.g = tsp, g
        self.pending: list = []
        self.own: Tensor | None = None

    def submit(self, jg: int, partials: Tensor) -> None:
        self.wait()
        tsp, g = self.tsp, self.g
        mine = tsp.rank - jg * g
        if tsp.size == 1:
            self.own = partials[0]
        elif g == tsp.size:
            self.own = partials.new_empty(partials.shape[1])
            self.pending = [reduce_scatter(self.own, partials.view(-1), tsp, async_op=True)]
        else:
            if 0 <= mine < g:
                self.own = partials[mine]
            self.pending = [dist.reduce(partials[i], dst=tsp.global_rank(jg * g + i), group=tsp.group, async_op=True)
                            for i in range(g)]

    def wait(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending = []

    def result(self) -> Tensor:
        self.wait()
        assert self.own is not None
        return self.own
