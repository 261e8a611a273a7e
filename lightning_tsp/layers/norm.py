"""RMSNorm with a replicated weight whose gradient is summed over the TSP group (tokens are sharded)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.fused import fused_on_cuda, rows
from lightning_tsp.schedules.comm import SumGradOverGroup, local_tensor


@fused_on_cuda(rows)
def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """Hugging Face's LlamaRMSNorm arithmetic: normalise in (at least) fp32, cast back, then scale (on CUDA one
    compiled kernel forward and one backward, instead of five and about eight)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


class TSPRMSNorm(nn.Module):
    tsp_shard_dims: dict[str, int] = {}  # replicated

    def __init__(self, hidden_size: int, tsp: TSPGroup, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.tsp, self.eps = tsp, eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        w = local_tensor(self.weight)
        w = SumGradOverGroup.apply(w, self.tsp) if self.tsp.size > 1 else w
        return rms_norm(x, w, self.eps)
