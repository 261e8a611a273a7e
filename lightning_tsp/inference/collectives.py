"""The few small collectives inference uses; each is a no-op (or a local reshape) when D = 1.

They go through ``torch.distributed.<name>`` at call time, so a test can count bytes by wrapping those.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.schedules.comm import all_gather


def all_gather_stack(t: Tensor, tsp: TSPGroup) -> Tensor:
    """[*shape] on every rank -> [D, *shape], in group-rank order."""
    if tsp.size == 1:
        return t.unsqueeze(0)
    t = t.contiguous()
    out = torch.empty((tsp.size, *t.shape), dtype=t.dtype, device=t.device)
    all_gather(out.view(-1), t.view(-1), tsp)
    return out


def all_to_all(send: Tensor, tsp: TSPGroup) -> Tensor:
    """send [D, ...] (row j goes to rank j) -> recv [D, ...] (row p came from rank p)."""
    if tsp.size == 1:
        return send
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=tsp.group)
    return recv


def all_reduce_(t: Tensor, tsp: TSPGroup) -> Tensor:
    if tsp.size > 1:
        dist.all_reduce(t, group=tsp.group)
    return t
