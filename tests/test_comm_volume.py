"""The bytes every collective of the schedules moves, counted on real gloo groups, equal the cost model's
formulas (docs/cost-model.md) byte for byte and call for call."""

from __future__ import annotations

import contextlib
import itertools
from collections import defaultdict

import pytest
import torch
import torch.distributed as dist

from lightning_tsp import TSPLlama
from lightning_tsp.planning.collectives import tsp_step_collectives
from lightning_tsp.planning.model import ModelShape
from tests.dist_utils import run_distributed
from tests.reference import batch, world_tsp
from tests.test_equivalence import replicated, shapes_for

B, S = 1, 24


class CollectiveCounter:
    """Wraps torch.distributed's collectives; tallies (calls, bytes) per phase and op with the model's convention."""

    WHICH_TENSOR = {  # function name -> (op key, index of the counted tensor argument)
        "broadcast": ("broadcast", 0),
        "all_gather_into_tensor": ("all_gather_into_tensor", 0),  # the output
        "all_gather_single": ("all_gather_into_tensor", 0),
        "reduce_scatter_tensor": ("reduce_scatter_tensor", 1),  # the input
        "reduce_scatter_single": ("reduce_scatter_tensor", 1),
        "reduce": ("reduce", 0),
        "all_reduce": ("all_reduce", 0),
    }

    def __init__(self):
        self.phase = None
        self.calls = defaultdict(lambda: defaultdict(int))
        self.bytes = defaultdict(lambda: defaultdict(int))

    def _record(self, op: str, t: torch.Tensor) -> None:
        if self.phase is not None:
            self.calls[self.phase][op] += 1
            self.bytes[self.phase][op] += t.numel() * t.element_size()

    @contextlib.contextmanager
    def installed(self):
        originals = {}
        for name, (op, idx) in self.WHICH_TENSOR.items():
            if hasattr(dist, name):
                originals[name] = fn = getattr(dist, name)
                setattr(dist, name, self._wrap(fn, op, idx))
        originals["batch_isend_irecv"] = fn = dist.batch_isend_irecv

        def batch(ops, _fn=fn):
            for p2p in ops:
                if p2p.op.__name__ == "isend":
                    self._record("send", p2p.tensor)
            return _fn(ops)

        dist.batch_isend_irecv = batch
        try:
            yield self
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)

    def _wrap(self, fn, op, idx):
        def wrapped(*args, **kwargs):
            self._record(op, args[idx])
            return fn(*args, **kwargs)

        return wrapped

    def as_tally(self, kind: str) -> dict:
        src = self.calls if kind == "calls" else self.bytes
        return {phase: {op: n for op, n in src[phase].items() if n} for phase in ("forward", "backward")}


def _nonzero(tally: dict) -> dict:
    return {phase: {op: n for op, n in ops.items() if n} for phase, ops in tally.items()}


def _worker(rank: int, world_size: int) -> None:
    modes = ("none", "selective", "full", "keep-attention", "offload", "full-offload")
    cases = [(shapes_for(world_size, gqa=True, tie=False), c) for c in modes]
    cases.append((shapes_for(world_size, gqa=True, tie=True), "none"))
    # one KV head replicated on every rank: K/V gathered and reduce-scattered once, one replica all-reduce
    cases += [(replicated(world_size, 1), c) for c in ("none", "offload")]
    # shard grouping: one owner per step, and "auto" (all D owners at this length: one all-gather / reduce-scatter
    # of the attention shards); at D = 4 the in-between group of 2 (broadcasts, half the K/V exchanges)
    groups = (2,) if world_size == 4 else (1, "auto")
    runs = [(cfg, checkpointing, group, S) for (cfg, checkpointing), group in itertools.product(cases, groups)]
    # at S = 24 every MLP sends its activation gradients to the shards' owners (mlp_grads_by_owners); at 96
    # tokens (32-48 per rank) the fp32 accumulator is the smaller message and travels round the ring
    runs += [(shapes_for(world_size, gqa=True, tie=False), c, 1, 96) for c in ("none", "keep-attention")]
    for cfg, checkpointing, group, seq in runs:
        tie = cfg.tie_embeddings
        model = TSPLlama(cfg, world_tsp(), activation_checkpointing=checkpointing, dtype=torch.float32,
                         shard_group=group)
        ids, labels = batch(cfg, B, seq)
        inputs = model.shard_batch(ids, labels)
        counter = CollectiveCounter()
        with counter.installed():
            counter.phase = "forward"
            loss = model(*inputs)
            counter.phase = "backward"
            loss.backward()
            counter.phase = None
        shape = ModelShape(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, n_layers=cfg.n_layers,
                           n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                           intermediate_size=cfg.intermediate_size, tie_word_embeddings=tie)
        for kind in ("calls", "bytes"):
            want = tsp_step_collectives(shape, B, seq, world_size, 4, True, checkpointing, what=kind,
                                        shard_group=group)
            want = _nonzero(want)
            if kind == "bytes":  # the loss all-reduces: a float64 token count and an fp32 loss sum
                want["forward"]["all_reduce"] -= 16 - (8 + 4)
            got = counter.as_tally(kind)
            tag = f"tie={tie} ckpt={checkpointing} g={group} S={seq} {kind}"
            assert got == want, f"{tag}: counted {got} != model {want}"


@pytest.mark.parametrize("d", [2, 3, 4])
def test_counted_collectives_equal_the_cost_model(d):
    run_distributed(_worker, d)
