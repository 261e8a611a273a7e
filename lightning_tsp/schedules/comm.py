"""Small communication helpers shared by the schedules.

Every collective goes through ``torch.distributed.<name>`` looked up at call time, so a test can count the bytes
each schedule moves by wrapping those functions.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tsp.group import TSPGroup


def pack(tensors: list[Tensor], dtype: torch.dtype) -> Tensor:
    """Flatten ``tensors`` into one contiguous 1-D buffer of ``dtype`` (one message per shard): each is cast
    straight into its slice (one pass over the weights, no cast temporaries and no concatenation)."""
    out = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    offset = 0
    for t in tensors:
        out[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return out


def unpack(flat: Tensor, shapes: list[torch.Size]) -> list[Tensor]:
    """Views of ``flat`` with the given shapes (inverse of :func:`pack`)."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    return out


def reduce_scatter(output: Tensor, input: Tensor, tsp: TSPGroup, async_op: bool = False):
    """Sum ``input`` ([D * n] elements) over the group; member p keeps slice p in ``output``."""
    # torch >= 2.13 names it reduce_scatter_single and deprecates reduce_scatter_tensor; support both.
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(output, input, group=tsp.group, async_op=async_op)


def all_gather(output: Tensor, input: Tensor, tsp: TSPGroup, async_op: bool = False):
    """Concatenate every member's ``input`` into ``output`` ([D * n] elements), in group-rank order."""
    # torch >= 2.13 names it all_gather_single and deprecates all_gather_into_tensor; support both.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=tsp.group, async_op=async_op)


def all_reduce_sum(t: Tensor, tsp: TSPGroup) -> Tensor:
    if tsp.size > 1:
        dist.all_reduce(t, group=tsp.group)
    return t


class SumOverGroup(torch.autograd.Function):
    """Forward: sum a per-rank partial over the group (every rank gets the total).

    Backward: identity. Each rank differentiates only its own partial; this is what makes the replicated loss
    of every rank have exactly the unsharded model's gradients (an all-reduce in backward would count them D times).
    """

    @staticmethod
    def forward(ctx, x: Tensor, tsp: TSPGroup) -> Tensor:
        return all_reduce_sum(x.clone(), tsp)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad, None


class SumGradOverGroup(torch.autograd.Function):
    """Forward: identity on a replicated parameter. Backward: sum its gradient over the group in fp32."""

    @staticmethod
    def forward(ctx, w: Tensor, tsp: TSPGroup) -> Tensor:
        ctx.tsp = tsp
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad: Tensor):
        g = all_reduce_sum(grad.to(torch.promote_types(grad.dtype, torch.float32)), ctx.tsp)
        return g.to(grad.dtype), None


def local_tensor(p: Tensor) -> Tensor:
    """This rank's shard of a parameter: ``to_local()`` of a DTensor (differentiable), the tensor itself otherwise."""
    to_local = getattr(p, "to_local", None)
    return to_local() if to_local is not None else p
