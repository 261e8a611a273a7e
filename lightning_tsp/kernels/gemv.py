"""Products of a few rows by a weight matrix: the weight-bandwidth-bound GEMVs of a decode step.

A decode step multiplies each weight w [N, K] by the new tokens' states x [B, K], B a few sequences. It reads every
weight once and does little arithmetic, so its time is the weight bytes over the memory bandwidth. For these
shapes cuBLAS runs split-K kernels plus a reduction kernel per product, about 1.5 TB/s over a paper-7b D = 8 step's
weights on an H200 (docs/results/decode-profile-128k-d8-2026-12-05.txt). On CUDA, for bf16/fp16 operands and at
most :data:`MAX_ROWS` rows, the product is written as a sum over K and compiled by Inductor: one reduction kernel
that reads each weight row once, accumulates in fp32, adds the bias, and for gate and up
applies the SwiGLU in the same kernel. Otherwise (CPU, fp32/fp64, more rows) it is ``torch.mm``/``torch.addmm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.kernels.fused import compiled_on_cuda
from lightning_tsp.kernels.gemm import matmul_into

# One row: a batch of one sequence. More rows read the weights at less than cuBLAS's bandwidth (H100, paper-7b D = 8
# weights: 0.87 TB/s at 4 rows against cuBLAS's 1.26, and 1.98 against 1.25 at one row; docs/inference.md).
MAX_ROWS = 1


def _dot_rows(x: Tensor, w: Tensor) -> Tensor:
    """x [B, K], w [N, K] -> x w^T [B, N] in fp32, as a reduction over K (output [N, B], the B rows innermost, then
    transposed)."""
    return (w[:, None, :].float() * x[None, :, :].float()).sum(-1).T


@compiled_on_cuda
def _linear_reduction(x: Tensor, w: Tensor, bias: Tensor | None, out_dtype: torch.dtype) -> Tensor:
    y = _dot_rows(x, w)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype).contiguous()


@compiled_on_cuda
def _swiglu_reduction(x: Tensor, w_gate: Tensor, w_up: Tensor) -> Tensor:
    return (F.silu(_dot_rows(x, w_gate)) * _dot_rows(x, w_up)).to(x.dtype).contiguous()


@compiled_on_cuda
def _swiglu(gate: Tensor, up: Tensor) -> Tensor:
    return F.silu(gate) * up


def _reduction_runs(x: Tensor, *ws: Tensor) -> bool:
    return (x.is_cuda and x.dim() == 2 and x.shape[0] <= MAX_ROWS and x.dtype in (torch.bfloat16, torch.float16)
            and all(w.dtype == x.dtype for w in ws) and not torch.compiler.is_compiling())


def linear_rows(x: Tensor, w: Tensor, bias: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """``x @ w.T (+ bias)`` for x [B, K] and w [N, K], as [B, N] in ``out_dtype`` (default x's dtype). A wider
    ``out_dtype`` (fp32 partial sums) gets the unrounded fp32 product on the reduction path."""
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if _reduction_runs(x, w):
        return _linear_reduction(x, w, bias, out_dtype)
    if bias is None and out_dtype != x.dtype:  # a wider product, unrounded (fp32 GEMM epilogue on CUDA)
        return matmul_into(x.new_empty(x.shape[0], w.shape[0], dtype=out_dtype), x, w.T)
    return (x @ w.T if bias is None else torch.addmm(bias, x, w.T)).to(out_dtype)


def swiglu_rows(x: Tensor, w_gate: Tensor, w_up: Tensor) -> Tensor:
    """``silu(x @ w_gate.T) * (x @ w_up.T)`` [B, F] in x's dtype (gate and up read by one kernel on CUDA)."""
    if _reduction_runs(x, w_gate, w_up):
        return _swiglu_reduction(x, w_gate, w_up)
    return _swiglu(x @ w_gate.T, x @ w_up.T)
