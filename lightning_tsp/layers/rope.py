"""Rotary position embeddings on GLOBAL positions (Llama's rotate-half convention)."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [..., head_dim] for the given global positions [...] (computed in fp32, then cast)."""
    if scaling is not None:
        raise NotImplementedError("scaled RoPE")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, H, L, d] rotated by the angles of its tokens' positions."""
    return x * cos + _rotate_half(x) * sin


def apply_rope_backward(grad: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The transpose of :func:`apply_rope` (a rotation by the opposite angle)."""
    return grad * cos - _rotate_half(grad * sin)
