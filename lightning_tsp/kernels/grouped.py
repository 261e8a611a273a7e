"""GEMMs over rows grouped by expert: one launch for a whole group of experts where the hardware allows.

:class:`ExpertGroups` describes rows [n, ...] sorted by expert: expert j owns rows ``[bounds[j], bounds[j+1])``.
Its three products cover an expert MLP's forward and backward (``W`` stacked per expert, [G, ., .]):

    nt(a, w)          a_j @ w_j^T     (the projections: x @ W_gate_up^T, act @ W_down^T)
    nn(a, w)          a_j @ w_j       (input gradients: dy @ W_down, d_gate_up @ W_gate_up)
    tn_add_(acc, a, b) acc_j += a_j^T @ b_j   (weight gradients, accumulated in fp32)

On CUDA with bf16/fp16 rows they run as ``torch.nn.functional.grouped_mm`` (``torch._grouped_mm`` on older torch):
one launch per product for all G experts. Weight gradients accumulate in fp32: in one launch where the kernel can
write fp32 output, else one GEMM per expert with an fp32 epilogue (torch 2.11's grouped kernel writes bf16 only).
Elsewhere (CPU, fp32/fp64, or where the grouped kernel is missing or fails its one-time check) one GEMM per
non-empty expert. Both compute the same products; only the summation order inside a GEMM may differ.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.kernels.gemm import add_matmul_, matmul_into

_HALF = (torch.bfloat16, torch.float16)


def _grouped_mm():
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


@functools.lru_cache(maxsize=None)
def _support(device: torch.device, dtype: torch.dtype) -> tuple[bool, bool]:
    """(the grouped kernel gives the per-expert products here, it can also write fp32 output), checked once per
    device and dtype against the loop, with an empty group. torch 2.11 runs bf16 x bf16 -> bf16 only."""
    mm = _grouped_mm()
    if mm is None or device.type != "cuda" or dtype not in _HALF:
        return False, False
    g = torch.Generator(device=device).manual_seed(0)
    sizes = [16, 0, 24]
    a = torch.randn(40, 32, device=device, generator=g).to(dtype)
    c = torch.randn(40, 48, device=device, generator=g).to(dtype)
    w = torch.randn(3, 48, 32, device=device, generator=g).to(dtype)
    grouped, loop = ExpertGroups(sizes, device, grouped=True), ExpertGroups(sizes, device, grouped=False)
    grouped.fp32_out = False
    try:
        ok = torch.allclose(grouped.nt(a, w).float(), loop.nt(a, w).float(), rtol=2e-2, atol=2e-2)
        ok &= torch.allclose(grouped.nn(c, w).float(), loop.nn(c, w).float(), rtol=2e-2, atol=2e-2)
    except Exception:  # noqa: BLE001 - any failure means "not available": the per-expert loop is used
        return False, False
    try:
        acc_g, acc_l = torch.zeros(3, 32, 48, device=device), torch.zeros(3, 32, 48, device=device)
        mm(a.T, c, offs=grouped.offs, out_dtype=torch.float32)
        grouped.fp32_out = True
        grouped.tn_add_(acc_g, a, c)
        loop.tn_add_(acc_l, a, c)
        fp32 = bool(torch.allclose(acc_g, acc_l, rtol=2e-2, atol=2e-2))
    except Exception:  # noqa: BLE001 - no fp32 output: weight gradients take the loop (fp32 epilogue)
        fp32 = False
    return bool(ok), fp32


def grouped_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """The grouped kernel runs the expert products for ``dtype`` rows on ``device``."""
    return _support(torch.device(device), dtype)[0]


class ExpertGroups:
    """Rows sorted by expert, G experts: expert j's rows are ``[bounds[j], bounds[j+1])`` (``sizes`` host ints).

    ``grouped=None`` picks the grouped kernel when :func:`grouped_gemm_works` for ``dtype`` on ``device``."""

    def __init__(self, sizes: list[int], device: torch.device, grouped: bool | None = None,
                 dtype: torch.dtype | None = None, counts: Tensor | None = None):
        self.bounds = [0]
        for s in sizes:
            self.bounds.append(self.bounds[-1] + s)
        if grouped is None:
            grouped = dtype is not None and grouped_gemm_works(device, dtype)
        # offsets of the groups' ends on the device (int32), as the grouped kernel takes them: from ``counts`` (the
        # same sizes already on the device: no host-to-device copy, which would wait for the stream) if given
        self.offs = None
        if grouped:
            self.offs = (counts.cumsum(0).to(torch.int32) if counts is not None
                         else torch.tensor(self.bounds[1:], dtype=torch.int32, device=device))
        # the kernel writes fp32 (weight gradients in one launch); else they take the loop's fp32 epilogue
        self.fp32_out = bool(grouped) and dtype is not None and _support(torch.device(device), dtype)[1]

    @classmethod
    def from_device_offsets(cls, offs: Tensor) -> "ExpertGroups":
        """Groups whose row counts live on the device only (``offs`` [G] int32, the groups' ends, as
        ``cumsum(counts)``): no host synchronisation, so a CUDA graph can hold it; grouped kernels only. Rows past
        ``offs[-1]`` belong to no group: the products leave them unwritten."""
        groups = cls.__new__(cls)
        groups.bounds, groups.offs, groups.fp32_out = None, offs, False
        return groups

    def ranges(self):
        """(expert j, lo, hi) of every non-empty group."""
        return ((j, lo, hi) for j, (lo, hi) in enumerate(zip(self.bounds, self.bounds[1:])) if hi > lo)

    def nt(self, a: Tensor, w: Tensor, out: Tensor | None = None) -> Tensor:
        """a [n, K], w [G, N, K] -> [n, N] (into ``out`` if given, possibly fp32): row block j times w_j^T."""
        return self._rows(a, w.transpose(1, 2), out)

    def nn(self, a: Tensor, w: Tensor, out: Tensor | None = None) -> Tensor:
        """a [n, N], w [G, N, K] -> [n, K]: row block j times w_j."""
        return self._rows(a, w, out)

    def _rows(self, a: Tensor, b: Tensor, out: Tensor | None) -> Tensor:
        if self.offs is not None:  # an fp32 ``out`` gets the fp32 product where the kernel can write it
            wide = out is not None and out.dtype != a.dtype and self.fp32_out
            y = _grouped_mm()(a, b, offs=self.offs, out_dtype=out.dtype if wide else None)
            return y if out is None else out.copy_(y)
        if out is None:
            out = a.new_empty(a.shape[0], b.shape[2])
        for j, lo, hi in self.ranges():
            matmul_into(out[lo:hi], a[lo:hi], b[j])
        return out

    def tn_add_(self, acc: Tensor, a: Tensor, b: Tensor) -> Tensor:
        """acc [G, P, Q] (fp32) += per group a_j^T @ b_j, with a [n, P], b [n, Q]: one grouped launch where the
        kernel writes fp32, else one GEMM per expert with an fp32 epilogue (never a bf16-rounded gradient)."""
        if self.offs is not None and (self.fp32_out or acc.dtype == a.dtype):
            return acc.add_(_grouped_mm()(a.T, b, offs=self.offs, out_dtype=acc.dtype if self.fp32_out else None))
        for j, lo, hi in self.ranges():
            add_matmul_(acc[j], a[lo:hi].T, b[lo:hi])
        return acc
