"""TSP: lightning_tsp's TSPLlama over a TSPGroup of the whole (fake) world, its parameters DTensors on a "tsp" mesh
as TSPStrategy and the Fabric strategy hold them (``tsp_params="plain"``: local tensors, as the rows before
2026-12-07 ran it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import Runner, Setup, autocast_ctx, make_batch, make_optimizer


def build(setup: Setup, full_state: dict | None = None) -> Runner:
    from lightning_tsp import TSPGroup, TSPLlama
    from lightning_tsp.mesh import TSP_DIM, Topology, build_mesh, tsp_group
    from lightning_tsp.sharding import distribute_parameters

    if setup.tsp_params not in ("dtensor", "plain"):
        raise ValueError(f"tsp_params={setup.tsp_params!r}: choose 'dtensor' or 'plain'")
    # "dtensor": the group and the parameters' mesh as TSPStrategy builds them (one replica of world ranks)
    mesh = build_mesh(Topology(1, setup.world), torch.device(setup.device).type) \
        if setup.tsp_params == "dtensor" else None
    tsp = tsp_group(mesh) if mesh is not None else TSPGroup.from_process_group(dist.group.WORLD)
    model = TSPLlama(setup.cfg, tsp, attention_kernel=setup.attention_kernel,
                     activation_checkpointing=setup.checkpointing, kv_bucket_heads=setup.kv_bucket_heads,
                     shard_group=setup.shard_group, cuda_graphs=setup.cuda_graphs, device=setup.device,
                     dtype=getattr(torch, setup.param_dtype))
    if mesh is not None:
        distribute_parameters(model, mesh[TSP_DIM])
    opt = make_optimizer(model.parameters(), setup)
    ids, _ = make_batch(setup)
    inputs = [x.to(setup.device) for x in model.shard_batch(ids)]

    def forward_backward():
        with autocast_ctx(setup):
            loss = model(*inputs)
        loss.backward()
        return loss.detach()

    return Runner(model, opt, forward_backward, f"D={setup.world} zigzag")
