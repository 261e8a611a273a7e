"""``torch.compile(model)`` on a sharded TSP model: it runs (graph breaks at the schedules' collectives) and computes
the same loss and gradients as the eager model, which equals the unsharded model (tests/test_equivalence.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_tsp import TSPLlama
from lightning_tsp.group import TSPGroup
from tests.dist_utils import run_distributed
from tests.reference import assert_close
from tests.test_equivalence import shapes_for


# aot_eager runs the same aten ops: agreement to fp64 round-off. Inductor generates its own CPU kernels (vectorised
# math functions, fused reductions): its fp64 gradients agree with eager to about 4e-8 relative.
RTOL = {"aot_eager": 1e-10, "inductor": 1e-6}


def _worker(rank, world_size, backend, checkpointing):
    cfg = shapes_for(world_size, gqa=True)
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    full = TSPLlama(cfg, None, dtype=torch.float64)
    model = TSPLlama(cfg, tsp, dtype=torch.float64, activation_checkpointing=checkpointing)
    model.load_full_state_dict(full.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 8 * world_size), generator=torch.Generator().manual_seed(1))
    batch = model.shard_batch(ids)
    eager_loss = model(*batch)
    eager_loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    compiled = torch.compile(model, backend=backend)
    for _ in range(2):  # the second call runs the cached graphs
        loss = compiled(*batch)
        loss.backward()
        assert_close(f"{backend} loss", loss.detach(), eager_loss.detach(), RTOL[backend])
        for name, p in model.named_parameters():
            assert_close(f"{backend} grad {name}", p.grad, eager[name], RTOL[backend], atol=0)
        model.zero_grad()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend,checkpointing", [("aot_eager", "none"), ("inductor", "full"), ("aot_eager", "keep-attention")])
def test_compiled_tsp_model_is_exact(backend, checkpointing):
    run_distributed(_worker, 2, backend, checkpointing, timeout=280.0)
