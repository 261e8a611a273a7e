"""Ring schedule: packed weight shards circulate by point-to-point send/recv, one hop per step.

Forward: rank r sees shards r, r-1, ..., r-D+1 (each received from its left neighbour while the previous one
computes). Backward: rank r sees shards r-1, r-2, ..., r-D (= r); the fp32 gradient accumulator of a shard
travels WITH it, every rank adds its partial, and after D-1 hops the accumulator lands on the owner holding the
sum over the group: a reduce-scatter fused into the ring, with no extra collective.

Where a rank holds few tokens the accumulator is the larger message: each hop moves a whole fp32 shard to add a
product of only T/D tokens into it (and the adding GEMM reads and writes that shard: memory-bound at 1K tokens).
Then the weights still circulate (:func:`ring_shards`) but each rank sends the activation gradients it computed
for shard s to s's owner (:func:`to_owner`), which forms its shard's gradient in one GEMM over all T tokens;
``lightning_tsp.planning.grouping.mlp_grads_by_owners`` says which moves fewer bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tsp.group import TSPGroup


class _Shift:
    """One ring hop in flight: send ``t`` to the right neighbour, receive the left neighbour's into ``recv`` (default:
    a new buffer)."""

    def __init__(self, tsp: TSPGroup, t: Tensor, recv: Tensor | None = None):
        self.recv = torch.empty_like(t) if recv is None else recv
        right = tsp.global_rank((tsp.rank + 1) % tsp.size)
        left = tsp.global_rank((tsp.rank - 1) % tsp.size)
        ops = [dist.P2POp(dist.isend, t, right, tsp.group), dist.P2POp(dist.irecv, self.recv, left, tsp.group)]
        self.works = dist.batch_isend_irecv(ops)

    def result(self) -> Tensor:
        for w in self.works:
            w.wait()
        return self.recv


def ring_shards(tsp: TSPGroup, local: Tensor) -> Iterator[tuple[int, Tensor]]:
    """Forward ring: yield ``(s, shard_s)`` for the D shards; the next hop is in flight during each yield."""
    cur = local
    for t in range(tsp.size):
        nxt = _Shift(tsp, cur) if t + 1 < tsp.size else None
        yield (tsp.rank - t) % tsp.size, cur
        if nxt is not None:
            cur = nxt.result()


def to_owner(tsp: TSPGroup, t: int, send: list[Tensor], recv: list[Tensor]) -> list:
    """Step t of :func:`ring_shards` (rank r on shard r-t): send ``send`` (this rank's pieces for shard r-t) to
    that shard's owner and receive rank r+t's pieces for this rank's own shard into ``recv``. Returns the works;
    the caller keeps ``send`` alive until they are waited."""
    d = tsp.size
    dst, src = tsp.global_rank((tsp.rank - t) % d), tsp.global_rank((tsp.rank + t) % d)
    ops = [dist.P2POp(dist.isend, a, dst, tsp.group) for a in send]
    ops += [dist.P2POp(dist.irecv, b, src, tsp.group) for b in recv]
    return dist.batch_isend_irecv(ops)


class RingGradPass:
    """Backward ring with a travelling fp32 gradient accumulator.

    Iterate to get ``(s, shard_s, part)``; add this rank's partial gradient of shard s into ``part`` (zeros) in
    place, or, with ``overwrite=True``, write every element of ``part`` (uninitialised: no zero fill, e.g. GEMMs
    that write their product). After the loop ``grad`` holds the complete gradient of this rank's own shard.
    ``local=None`` moves only the accumulator (for ops whose backward needs no weights, e.g. the embedding).

    ``in_place=True`` yields ``(s, shard_s, take)`` instead: the caller first issues the work that needs no
    accumulator (input gradients), then ``acc, fresh = take()`` waits for the accumulator of shard s arriving from
    the left neighbour and the caller adds its partial straight into it (GEMMs with beta = 1, fp32 epilogue); on the
    first step ``fresh`` is True and ``acc`` is uninitialised (write every element). No separate partial and no
    fp32 add pass per step: the hop hides behind the input-gradient work of the step instead of the whole step.

    Order on every rank (the same sequence of sends/recvs everywhere), step t on shard s = r-1-t: issue weight hop
    t+1 | yield: the caller issues step t's GEMMs into ``part`` | wait accumulator hop t-1 (issued after step t-1,
    it ran while step t's GEMMs were issued), add ``part`` into what it brought and issue the sum as accumulator hop
    t | wait weight hop t+1. So every hop has one step's compute issued between its issue and its wait (accumulator
    hop t: step t+1's; weight hop t+1: step t's), except the first weight hop, which step 0 waits for (it needs the
    left neighbour's shard). With ``in_place`` the wait of accumulator hop t-1 moves into the step, after the
    caller's input-gradient work. The accumulator of shard s meets the ranks in the order they compute s, one step
    apart, so each hop must land within one step whatever the order, and the last hop (into the owner) has no
    compute after it to hide behind. At most one hop of each kind in flight; at most three accumulators alive.
    ``tests/test_ring_order.py`` pins this order. Traffic: D-1 weight hops and D-1 accumulator hops per rank.

    ``into``: where the complete gradient lands (``grad`` is then ``into``): the last accumulator hop receives into
    it (at D = 1 it is the accumulator itself), so a caller with a destination of its own copies nothing.
    """

    def __init__(self, tsp: TSPGroup, local: Tensor | None, grad_numel: int, device, grad_dtype=torch.float32,
                 overwrite: bool = False, in_place: bool = False, into: Tensor | None = None):
        if into is not None and (into.numel() != grad_numel or into.dtype != grad_dtype or not into.is_contiguous()):
            raise ValueError(f"into: a contiguous {grad_dtype} buffer of {grad_numel} elements, got {into.dtype} "
                             f"{tuple(into.shape)}")
        self.tsp, self.local, self.into = tsp, local, into
        self.grad_numel, self.device, self.grad_dtype = grad_numel, device, grad_dtype
        self.new_part = torch.empty if overwrite or in_place else torch.zeros
        self.in_place = in_place
        self.grad: Tensor | None = None

    def _fresh(self) -> Tensor:
        return self.new_part(self.grad_numel, device=self.device, dtype=self.grad_dtype)

    def __iter__(self) -> Iterator[tuple[int, Tensor | None, Tensor]]:
        d, r = self.tsp.size, self.tsp.rank
        if d == 1:
            self.grad = self._fresh() if self.into is None else self.into
            if self.into is not None and self.new_part is torch.zeros:
                self.grad.zero_()
            yield 0, self.local, (lambda: (self.grad, True)) if self.in_place else self.grad
            return
        # Step t works on shard r-1-t, so the weights need one hop before the first step.
        cur = _Shift(self.tsp, self.local).result() if self.local is not None else None
        incoming: _Shift | None = None  # the left neighbour's accumulator of this step's shard, in flight
        for t in range(d):
            # The last step (t = D-1) is the own shard: no weights need to arrive for it.
            nxt = _Shift(self.tsp, cur) if cur is not None and t + 2 < d else None
            s = (r - 1 - t) % d
            if self.in_place:
                taken: list[Tensor] = []

                def take(arriving=incoming, taken=taken):
                    assert not taken, "take() once per step"
                    taken.append(self._fresh() if arriving is None else arriving.result())
                    return taken[0], arriving is None

                yield s, cur, take
                assert taken, "an in-place RingGradPass step must take() its accumulator"
                acc = taken[0]
            else:
                part = self._fresh()
                yield s, cur, part
                acc = part if incoming is None else incoming.result().add_(part)  # the first step starts the sum
            if t + 1 < d:
                # acc travels on while the next shard computes; the last hop lands in ``into``
                incoming = _Shift(self.tsp, acc, self.into if t + 2 == d else None)
                if cur is not None:
                    cur = nxt.result() if nxt is not None else self.local
        self.grad = acc
