"""Elementwise pieces of the schedules run as one compiled kernel each on CUDA.

RoPE on the projections' strided views, the two-piece log-sum-exp merge and the SwiGLU backward are chains of
small memory-bound kernels in eager PyTorch (5-8 launches, each reading and writing the whole tensor); at D = 8
the broadcast and ring schedules run them per owner and per shard, so they add up (docs/benchmarks.md).
:func:`fused_on_cuda` compiles the SAME Python function with ``torch.compile`` (Inductor/Triton: one kernel,
intermediates in registers, fp32 arithmetic inside) when its first argument is a large CUDA tensor, and calls it eagerly
otherwise: on CPU, for small tensors (decoding's few tokens: a compiled call's host overhead would outweigh the
saved launches), inside an outer ``torch.compile`` (which traces it itself) and during CUDA-graph capture. There is one implementation of each computation; compiling only changes where intermediate
roundings happen (Inductor computes bf16 chains in fp32 and rounds once).

``LIGHTNING_TSP_FUSED=0`` turns it off (eager everywhere): the benchmarks' before/after switch.
"""

from __future__ import annotations

import functools
import os
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

MIN_FUSED_NUMEL = 1 << 18  # smaller first arguments run eagerly


def fusion_enabled() -> bool:
    return os.environ.get("LIGHTNING_TSP_FUSED", "1") != "0"


def fused_on_cuda(fn: F) -> F:
    """``fn`` compiled (lazily, once per process) when called with a large CUDA tensor first, eager otherwise."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        x = args[0]
        if (not x.is_cuda or x.numel() < MIN_FUSED_NUMEL or not fusion_enabled() or torch.compiler.is_compiling()
                or torch.cuda.is_current_stream_capturing()):
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn, fullgraph=True)
        return compiled(*args, **kwargs)

    call.eager = fn  # the plain function (tests compare it with the compiled one)
    return call  # type: ignore[return-value]
