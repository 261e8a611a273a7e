"""GEMMs that accumulate bf16 products into fp32 buffers (the schedules' partial sums).

``acc += a @ b`` and ``out = a @ b`` with bf16/fp16 operands and an fp32 ``acc``/``out``: on CUDA cuBLAS writes or
adds the fp32 product in its epilogue (``torch.addmm`` / ``torch.mm`` with ``out_dtype``), so the product is
never rounded to bf16 and never makes a second pass over memory. Elsewhere (CPU, or a torch without those
overloads) the product is formed in the operands' dtype and added.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

_HALF = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def _fp32_epilogue_works(device: torch.device) -> bool:
    """``torch.addmm``/``torch.mm`` with ``out_dtype=float32`` and ``out=`` run here and are right (checked once)."""
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a = torch.randn(64, 32, device=device, generator=g).to(torch.bfloat16)
        b = torch.randn(32, 48, device=device, generator=g).to(torch.bfloat16)
        ref = a.double() @ b.double()
        acc = torch.ones(64, 48, device=device)
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        out = torch.empty(64, 48, device=device)
        torch.mm(a, b, out_dtype=torch.float32, out=out)
        return bool(torch.allclose(acc.double(), ref + 1, atol=1e-3) and torch.allclose(out.double(), ref, atol=1e-3))
    except Exception:  # noqa: BLE001 - any failure means "not available": the portable path is used
        return False


def _fused(acc: Tensor, a: Tensor) -> bool:
    return acc.is_cuda and acc.dtype == torch.float32 and a.dtype in _HALF and _fp32_epilogue_works(acc.device)


def add_matmul_(acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``acc += a @ b`` in place; ``acc`` [M, N] may be wider (fp32) than the operands."""
    if acc.dtype == a.dtype:
        return acc.addmm_(a, b)
    if _fused(acc, a):
        return torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    return acc.add_(a @ b)


def matmul_into(out: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``out = a @ b`` written into ``out`` [M, N] (a view into a packed buffer, say), possibly wider than a/b."""
    if out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    if _fused(out, a):
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return out.copy_(a @ b)
