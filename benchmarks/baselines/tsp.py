"""TSP: lightning_tsp's TSPLlama over a TSPGroup of the whole (fake) world, its parameters DTensors on a "tsp" mesh
as TSPStrategy and the Fabric strategy hold them (``tsp_params="plain"``: local tensors, as the rows before
2026-12-07 ran it)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .common import Runner, Setup, autocast_ctx, make_batch, make_optimizer


def build(setup: Setup, full_state: dict | None = None) -> Runner:
    from lightning_tsp import TSPGroup, TSPLlama

    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    model = TSPLlama(setup.cfg, tsp, attention_kernel=setup.attention_kernel,
                     activation_checkpointing=setup.checkpointing, kv_bucket_heads=setup.kv_bucket_heads,
                     shard_group=setup.shard_group, cuda_graphs=setup.cuda_graphs, device=setup.device,
                     dtype=getattr(torch, setup.param_dtype))
    if setup.tsp_params == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_tsp.sharding import distribute_parameters

        mesh = init_device_mesh(torch.device(setup.device).type, (setup.world,), mesh_dim_names=("tsp",))
        distribute_parameters(model, mesh)
    elif setup.tsp_params != "plain":
        raise ValueError(f"tsp_params={setup.tsp_params!r}: choose 'dtensor' or 'plain'")
    opt = make_optimizer(model.parameters(), setup)
    ids, _ = make_batch(setup)
    inputs = [x.to(setup.device) for x in model.shard_batch(ids)]

    def forward_backward():
        with autocast_ctx(setup):
            loss = model(*inputs)
        loss.backward()
        return loss.detach()

    return Runner(model, opt, forward_backward, f"D={setup.world} zigzag")
