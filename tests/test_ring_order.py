"""The ring schedules' order of issue and wait, recorded on real gloo groups.

A recorder wraps ``torch.distributed.batch_isend_irecv`` (the schedules look it up at call time) and the works it
returns; the consumer loop writes a marker when it starts each step's compute into the same log. On NCCL a wait
orders the compute stream after the hop, so a hop overlaps compute only if some step's compute is issued between
its issue and its wait. The log must show:

* ``RingGradPass``: each fp32 accumulator hop that leaves after step t's compute is waited only after step t+1's
  compute was issued (so no accumulator hop is waited before a compute it could hide behind, the last included);
  each weight hop overlaps a step, except the first (step 0 needs the left neighbour's shard, and nothing of the
  ring runs before step 0); at most one hop of each kind in flight and at most 3 accumulators alive; the same
  sequence of sends/recvs on every rank; and the owner's gradient exactly the all-reduced sum of the partials.
* ``RingGradPass(in_place=True)`` (the MLP): the same, with the accumulator waited inside the step, after the
  step's input-gradient compute was issued and before the partial is added into it.
* ``ring_shards`` (forward): every weight hop overlaps the step before it is needed.
* ``to_owner`` (the MLP's weight gradients by owner): at step t a rank sends its pieces for shard r-t to that
  shard's owner and receives rank r+t's pieces for its own shard; every piece arrives in its sender's slot, and
  no exchange is waited before the last step has computed (each hides behind all the steps after it).
"""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch
import torch.distributed as dist

from lightning_tsp.group import TSPGroup
from lightning_tsp.schedules import ring
from tests.dist_utils import run_distributed

N_W, N_ACC = 12, 10  # elements of a weight shard (fp32) and of its gradient accumulator (fp64)
WEIGHT, ACC = torch.float32, torch.float64


class _RecordedWork:
    def __init__(self, work, recorder: "HopRecorder", hop: int):
        self.work, self.recorder, self.hop = work, recorder, hop

    def wait(self, *args, **kwargs):
        self.recorder.waited(self.hop)
        return self.work.wait(*args, **kwargs)


class HopRecorder:
    """Log of ("issue", hop, kind, peers), ("wait", hop) and ("compute", t); kind is "acc" for hops of ``ACC``
    tensors (the accumulator), "weight" otherwise. Weak references count the accumulators alive at each step."""

    def __init__(self, tsp: TSPGroup):
        self.tsp, self.log, self.alive_acc = tsp, [], []
        self._acc_refs: dict[int, weakref.ref] = {}
        self._hops = 0

    def _track(self, t: torch.Tensor) -> None:
        if t.dtype == ACC:
            self._acc_refs[id(t)] = weakref.ref(t)

    def compute(self, t: int, part: torch.Tensor | None = None) -> None:
        if part is not None:
            self._track(part)
        self._acc_refs = {k: r for k, r in self._acc_refs.items() if r() is not None}
        self.alive_acc.append(len(self._acc_refs))
        self.log.append(("compute", t))

    def waited(self, hop: int) -> None:
        if ("wait", hop) not in self.log:  # one hop = one batch: its send and its recv are waited together
            self.log.append(("wait", hop))

    @contextlib.contextmanager
    def installed(self):
        original = dist.batch_isend_irecv
        d, r = self.tsp.size, self.tsp.rank

        def batch(ops):
            hop = self._hops
            self._hops += 1
            kinds = {"acc" if op.tensor.dtype == ACC else "weight" for op in ops}
            assert len(kinds) == 1, f"one hop moves one kind of tensor, got {kinds}"
            peers = tuple(sorted((op.op.__name__, (op.group_peer - r) % d) for op in ops))
            for op in ops:
                self._track(op.tensor)
            self.log.append(("issue", hop, kinds.pop(), peers))
            return [_RecordedWork(w, self, hop) for w in original(ops)]

        dist.batch_isend_irecv = batch
        try:
            yield self
        finally:
            dist.batch_isend_irecv = original


def hop_windows(log: list[tuple]) -> dict[int, dict]:
    """For each hop: its kind, the last step computed before its issue (-1: none) and the steps whose compute was
    issued between its issue and its wait (the compute it can hide behind)."""
    hops, step = {}, -1
    for e in log:
        if e[0] == "compute":
            step = e[1]
            for h in hops.values():
                if not h["waited"]:
                    h["overlaps"].append(step)
        elif e[0] == "issue":
            hops[e[1]] = dict(kind=e[2], after_step=step, overlaps=[], waited=False)
        else:
            assert not hops[e[1]]["waited"], f"hop {e[1]} waited twice"
            hops[e[1]]["waited"] = True
    assert all(h["waited"] for h in hops.values()), "every hop must be waited before the ring ends"
    return hops


def max_in_flight(log: list[tuple], kind: str) -> int:
    kinds = {e[1]: e[2] for e in log if e[0] == "issue"}
    n = most = 0
    for e in log:
        if e[0] != "compute" and kinds[e[1]] == kind:
            n += 1 if e[0] == "issue" else -1
            most = max(most, n)
    return most


def weight_shard(s: int) -> torch.Tensor:
    return torch.arange(N_W, dtype=WEIGHT) + 100 * s


def partial(rank: int, s: int) -> torch.Tensor:
    """Rank ``rank``'s partial gradient of shard s: integer-valued fp64, so every summation order is exact."""
    g = torch.Generator().manual_seed(1000 * rank + s)
    return torch.randint(-(2**20), 2**20, (N_ACC,), generator=g).to(ACC)


def _grad_pass_worker(rank: int, world: int, with_weights: bool, in_place: bool = False) -> None:
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    rec = HopRecorder(tsp)
    ring_pass = ring.RingGradPass(tsp, weight_shard(rank) if with_weights else None, N_ACC, "cpu", ACC,
                                  in_place=in_place)
    seen = []
    with rec.installed():
        for t, (s, buf, part) in enumerate(ring_pass):
            if in_place:  # the step's input-gradient work is issued, then the accumulator is waited and added to
                rec.compute(t)
                acc, fresh = part()
                assert fresh == (t == 0), f"rank {rank} step {t}: fresh={fresh}"
                rec._track(acc)
                acc.copy_(partial(rank, s)) if fresh else acc.add_(partial(rank, s))
            else:
                rec.compute(t, part)
                part.add_(partial(rank, s))
            seen.append(s)
            if with_weights:
                assert torch.equal(buf, weight_shard(s)), f"rank {rank} step {t}: not shard {s}'s weights"
            else:
                assert buf is None
    assert seen == [(rank - 1 - t) % world for t in range(world)], seen

    # The owner's gradient is exactly the sum of every rank's partial of its shard.
    ref = torch.stack([partial(rank, s) for s in range(world)])
    dist.all_reduce(ref)
    assert ring_pass.grad.dtype == ACC and torch.equal(ring_pass.grad, ref[rank]), (rank, ring_pass.grad, ref[rank])

    log, hops = rec.log, hop_windows(rec.log)
    acc = {k: h for k, h in hops.items() if h["kind"] == "acc"}
    assert len(acc) == world - 1, f"{len(acc)} accumulator hops for D={world}: {log}"
    for h in acc.values():
        t = h["after_step"]
        assert t >= 0 and t + 1 in h["overlaps"], (
            f"rank {rank}: the accumulator hop issued after step {t}'s compute is waited before step {t + 1}'s "
            f"compute was issued (an exposed wait on NCCL): {log}")
    weight = [h for _, h in sorted(hops.items()) if h["kind"] == "weight"]
    if with_weights:
        assert len(weight) == world - 1, f"{len(weight)} weight hops for D={world}: {log}"
        assert weight[0]["after_step"] == -1 and not weight[0]["overlaps"]  # step 0's shard: nothing to hide behind
        for h in weight[1:]:
            assert h["overlaps"] == [h["after_step"] + 1], f"rank {rank}: a weight hop overlaps no step: {log}"
    else:
        assert not weight, log
    assert max_in_flight(log, "acc") == 1 and max_in_flight(log, "weight") <= 1, log
    assert max(rec.alive_acc) <= 3, f"rank {rank}: {rec.alive_acc} accumulators alive at the steps"

    # Every rank issues the same sequence: a hop sends right and receives from the left, in the same order.
    signature = [(e[0], *e[2:]) if e[0] == "issue" else e[0] for e in log]
    assert all(e[3] == (("irecv", world - 1), ("isend", 1)) for e in log if e[0] == "issue"), log
    signatures = [None] * world
    dist.all_gather_object(signatures, signature)
    assert all(sig == signature for sig in signatures), signatures


def _forward_ring_worker(rank: int, world: int) -> None:
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    rec = HopRecorder(tsp)
    with rec.installed():
        seen = []
        for t, (s, buf) in enumerate(ring.ring_shards(tsp, weight_shard(rank))):
            rec.compute(t)
            assert torch.equal(buf, weight_shard(s)), f"rank {rank} step {t}: not shard {s}'s weights"
            seen.append(s)
    assert seen == [(rank - t) % world for t in range(world)], seen
    hops = hop_windows(rec.log)
    assert len(hops) == world - 1, rec.log
    for h in hops.values():  # the hop for step t+1 is issued before step t computes and waited after
        assert h["kind"] == "weight" and h["overlaps"] == [h["after_step"] + 1], rec.log
    assert max_in_flight(rec.log, "weight") == 1, rec.log


def _owner_exchange_worker(rank: int, world: int) -> None:
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    rec = HopRecorder(tsp)

    def piece(q: int, s: int) -> torch.Tensor:  # rank q's activation gradients for shard s (ACC: told apart)
        return torch.arange(5, dtype=ACC) + 1000 * q + 10 * s

    got = torch.full((world, 5), float("nan"), dtype=ACC)  # every rank's pieces for this rank's shard, by sender
    works, in_flight = [], []
    with rec.installed():
        for t, (s, buf) in enumerate(ring.ring_shards(tsp, weight_shard(rank))):
            rec.compute(t)
            assert torch.equal(buf, weight_shard(s)), f"rank {rank} step {t}: not shard {s}'s weights"
            mine = piece(rank, s)
            if t == 0:
                got[rank] = mine
            else:
                works += ring.to_owner(tsp, t, [mine], [got[(rank + t) % world]])
                in_flight.append(mine)
        rec.compute(world)  # the owner's weight-gradient GEMMs need every piece
        for w in works:
            w.wait()
    assert torch.equal(got, torch.stack([piece(q, rank) for q in range(world)])), got
    exchanges = {h["after_step"]: h for h in hop_windows(rec.log).values() if h["kind"] == "acc"}
    assert sorted(exchanges) == list(range(1, world)), rec.log
    for t, h in exchanges.items():
        assert h["overlaps"] == list(range(t + 1, world + 1)), f"rank {rank}: exchange {t} waited early: {rec.log}"
    peers = [e[3] for e in rec.log if e[0] == "issue" and e[2] == "acc"]  # (peer - rank) mod D
    assert peers == [tuple(sorted((("irecv", t), ("isend", world - t)))) for t in range(1, world)], peers


def _worker(rank: int, world: int) -> None:
    _forward_ring_worker(rank, world)
    _owner_exchange_worker(rank, world)
    _grad_pass_worker(rank, world, with_weights=True)  # the MLP / MoE / LM head ring
    _grad_pass_worker(rank, world, with_weights=False)  # the embedding's: only the accumulator moves
    _grad_pass_worker(rank, world, with_weights=True, in_place=True)  # the MLP's: GEMMs add into the arrived sum


@pytest.mark.parametrize("world", [2, 3])
def test_ring_hops_overlap_the_next_step(world):
    run_distributed(_worker, world, timeout=120)


def test_hop_windows_flags_an_accumulator_hop_waited_before_the_next_step():
    """The check can fail: a hop waited right after its issue has no step to hide behind."""
    waited_at_once = [("compute", 0), ("issue", 0, "acc", ()), ("wait", 0), ("compute", 1)]
    deferred = [("compute", 0), ("issue", 0, "acc", ()), ("compute", 1), ("wait", 0)]
    assert hop_windows(waited_at_once)[0]["overlaps"] == []
    assert hop_windows(deferred)[0] == dict(kind="acc", after_step=0, overlaps=[1], waited=True)
