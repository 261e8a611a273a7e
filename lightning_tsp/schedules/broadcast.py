"""Broadcast schedule: owner j = 0..D-1 broadcasts its packed weight shard, one owner at a time.

The broadcast of shard j+1 is issued before shard j is handed to the caller, so it is in flight while shard j
computes (double buffering: at most two shards alive).

Shard grouping (``g`` of :func:`gather_shard_groups` and :class:`GroupReduce`): g consecutive owners' shards travel
together (g broadcasts, or one all-gather when g = D) and their weight-gradient partials go back together (g
reduces, or one reduce-scatter), so the caller runs D/g larger steps instead of D small ones; g = 1 is one owner
per step.

Pieces (``pieces`` of both): where the caller's grouped layout stacks each piece of the owners' shards owner by
owner (a list of (slice of an owner's shard, region of the grouped shard g times as large)), the collectives move
each piece straight into / out of its region: the caller gets and returns grouped shards [g n] with no
regrouping copies (one collective per piece instead of one per owner / group).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.schedules.comm import all_gather, reduce_scatter


def gather_shard_groups(tsp: TSPGroup, local: Tensor, g: int = 1,
                        pieces: list[tuple[slice, slice]] | None = None) -> Iterator[tuple[int, Tensor]]:
    """Yield ``(J, shards)`` for the D/g owner groups J on every rank: ``shards`` [g, n] holds owners
    Jg..Jg+g-1's packed shards (``local`` is this rank's); with ``pieces``, the grouped shard [g n] they make. The
    next group's collectives are in flight during each yield (double buffering: at most two groups alive). g = 1 is
    the plain broadcast schedule, owner by owner."""
    d = tsp.size
    if d % g:
        raise ValueError(f"shard group g={g} must divide the TSP group size {d}")

    def start_pieces(jg: int):
        buf = local.new_empty(g * local.numel())
        if g == d:
            return buf, [all_gather(buf[dst], local[src], tsp, async_op=True) for src, dst in pieces]
        works = []
        for i in range(g):
            j = jg * g + i
            for src, dst in pieces:
                n = src.stop - src.start
                region = buf[dst][i * n : (i + 1) * n]
                if j == tsp.rank:
                    region.copy_(local[src])
                works.append(dist.broadcast(region, src=tsp.global_rank(j), group=tsp.group, async_op=True))
        return buf, works

    def start(jg: int):
        if pieces is not None and g > 1:
            return start_pieces(jg)
        if g == 1 and jg == tsp.rank:  # this rank's own shard is broadcast in place, not copied
            buf = local.view(1, -1)
        else:
            buf = local.new_empty(g, local.numel())
        if d == 1:
            return buf, []
        if g == d:
            return buf, [all_gather(buf.view(-1), local, tsp, async_op=True)]
        works = []
        for i in range(g):
            j = jg * g + i
            if j == tsp.rank and g > 1:
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
    """Sums each group's weight-gradient partials [g, n] (owner Jg+i's in row i) onto their owners, in fp32: g
    reduces, or one reduce-scatter when g = D. At most one group in flight (it overlaps the next group's
    backward; its buffer is freed once done unless this rank owns a row); :meth:`result` is this rank's sum."""

    def __init__(self, tsp: TSPGroup, g: int = 1, pieces: list[tuple[slice, slice]] | None = None):
        self.tsp, self.g, self.pieces = tsp, g, pieces if g > 1 else None
        self.pending: list = []
        self.own: Tensor | None = None
        self.own_pieces: list[tuple[slice, Tensor]] = []  # (slice of the own shard, reduced region) to assemble

    def submit(self, jg: int, partials: Tensor) -> None:
        """``partials``: [g, n] (owner Jg+i's in row i), or with ``pieces`` the grouped layout [g n]."""
        self.wait()
        tsp, g = self.tsp, self.g
        mine = tsp.rank - jg * g
        if self.pieces is not None:
            self._submit_pieces(jg, partials, mine)
        elif tsp.size == 1:
            self.own = partials[0]
        elif g == tsp.size:
            self.own = partials.new_empty(partials.shape[1])
            self.pending = [reduce_scatter(self.own, partials.view(-1), tsp, async_op=True)]
        else:
            if 0 <= mine < g:
                self.own = partials[mine]
            self.pending = [dist.reduce(partials[i], dst=tsp.global_rank(jg * g + i), group=tsp.group, async_op=True)
                            for i in range(g)]

    def _submit_pieces(self, jg: int, partials: Tensor, mine: int) -> None:
        tsp, g = self.tsp, self.g
        n = sum(src.stop - src.start for src, _ in self.pieces)
        if g == tsp.size:
            self.own = partials.new_empty(n)
            self.pending = [reduce_scatter(self.own[src], partials[dst], tsp, async_op=True) for src, dst in self.pieces]
            return
        for i in range(g):
            for src, dst in self.pieces:
                m = src.stop - src.start
                region = partials[dst][i * m : (i + 1) * m]
                self.pending.append(dist.reduce(region, dst=tsp.global_rank(jg * g + i), group=tsp.group,
                                                async_op=True))
                if i == mine:
                    self.own_pieces.append((src, region))
        if 0 <= mine < g:
            self.own = partials.new_empty(n)

    def wait(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending = []
        for src, region in self.own_pieces:  # this rank's reduced pieces into its own shard's layout
            self.own[src] = region
        self.own_pieces = []

    def result(self) -> Tensor:
        self.wait()
        assert self.own is not None
        return self.own
