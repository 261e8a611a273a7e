"""Helpers shared by the equivalence tests: build a reference and a TSP model with the same weights."""

from __future__ import annotations

import torch
import torch.distributed as dist

from lightning_tsp import TSPGroup, TSPLlama
from lightning_tsp.models.llama import ModelConfig, gather_full


def world_tsp() -> TSPGroup:
    return TSPGroup.from_process_group(dist.group.WORLD) if dist.is_initialized() else TSPGroup.single()


def batch(cfg: ModelConfig, b: int, s: int, seed: int = 0, n_ignored: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = ids.clone()
    labels[0, torch.randperm(s, generator=g)[:n_ignored]] = -100  # some positions without a loss
    return ids, labels


def full_grads(model: TSPLlama) -> dict[str, torch.Tensor]:
    dims = model.shard_dims()
    return {n: gather_full(p.grad, dims[n], model.tsp, model.replicas(n)) for n, p in model.named_parameters()}


def assert_replicas_identical(model: TSPLlama, what: str = "") -> None:
    """Every copy of a replicated shard (a KV head on D / n_kv ranks) is bit-identical, and so is its gradient."""
    dims = model.shard_dims()
    for n, p in model.named_parameters():
        r = model.replicas(n)
        if r == 1 or dims[n] is None:
            continue
        for t, kind in ((p, "value"), (p.grad, "grad")):
            if t is None:
                continue
            parts = [torch.empty_like(t) for _ in range(model.tsp.size)]
            dist.all_gather(parts, t.detach().contiguous(), group=model.tsp.group)
            for i in range(model.tsp.size):
                assert torch.equal(parts[i], parts[i - i % r]), f"{what} {n} {kind}: replica {i} drifted"


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float = 1e-9, atol: float = 1e-12):
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    if not err <= atol + rtol * scale:
        raise AssertionError(f"{name}: max abs err {err:.3e} vs max |ref| {scale:.3e} (rtol {rtol})")
