"""Elementwise pieces of the schedules run as one compiled kernel each on CUDA at long sequences.

RoPE on the projections' strided views, the two-piece log-sum-exp merge, RMSNorm and the SwiGLU backward are
chains of small memory-bound kernels in eager PyTorch (5-8 launches, each reading and writing the whole tensor);
at D = 8 the broadcast and ring schedules run them per owner and per shard, so they add up (docs/benchmarks.md).
:func:`fused_on_cuda` compiles the SAME Python function with ``torch.compile`` (Inductor/Triton: one kernel,
intermediates in registers, fp32 arithmetic inside). There is one implementation of each computation; compiling
only changes where intermediate roundings happen (Inductor computes bf16 chains in fp32 and rounds once).

A compiled call costs more host time than the eager kernels it replaces take to launch, so it pays only where the
GPU, not the host, bounds the step. Measured on an H200 (paper 7B, D = 8, 2 layers): 64K -8% GPU and wall time,
8K and 16K slower (their steps are host-bound). The function therefore runs compiled only when its call covers at
least :data:`MIN_FUSED_TOKENS` tokens (its ``tokens`` rule), and eagerly otherwise: on CPU, for short sequences
and decoding, inside an outer ``torch.compile`` (which traces it itself) and during other CUDA-graph captures.

Inside a CUDA-graphed layer (:mod:`lightning_tsp.graphs`, :func:`compiled_at_any_length`) the host cost is paid
once, at capture, so the pieces run compiled at every length: compiled in the eager warm-up step, then captured
(a capture only reuses a piece compiled before it; a piece never compiled runs eagerly).

``LIGHTNING_TSP_FUSED=0`` turns it off everywhere (the benchmarks' before/after switch).
"""

from __future__ import annotations

import functools
import os
import threading
from contextlib import contextmanager
from typing import Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable)

MIN_FUSED_TOKENS = 4096  # local tokens of one call (32K at D = 8); shorter calls run eagerly
# compiled variants kept per piece: one per (shape class, grad mode, dtype) it meets (forward under no_grad,
# recomputation under grad, fp32 and bf16, layer and q/k norms, several lengths in one process); torch's default
# of 8 is too few and, with fullgraph=True, failing past it would stop the run
RECOMPILE_LIMIT = 64


_ANY_LENGTH = threading.local()


def fusion_enabled() -> bool:
    return os.environ.get("LIGHTNING_TSP_FUSED", "1") != "0"


@contextmanager
def compiled_at_any_length():
    """On this thread, inside the block: pieces run compiled whatever their size (a CUDA-graphed layer)."""
    _ANY_LENGTH.depth = getattr(_ANY_LENGTH, "depth", 0) + 1
    try:
        yield
    finally:
        _ANY_LENGTH.depth -= 1


def _any_length() -> bool:
    return getattr(_ANY_LENGTH, "depth", 0) > 0


def fused_on_cuda(tokens: Callable[[torch.Tensor], int]) -> Callable[[F], F]:
    """Decorator: the function compiled (lazily, once per process) when its first argument is a CUDA tensor of at
    least :data:`MIN_FUSED_TOKENS` tokens (``tokens(first argument)``), eager otherwise."""

    def wrap(fn: F) -> F:
        compiled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal compiled
            x = args[0]
            if not x.is_cuda or not fusion_enabled() or torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            graphed = _any_length()
            if tokens(x) < MIN_FUSED_TOKENS and not graphed:
                return fn(*args, **kwargs)
            if torch.cuda.is_current_stream_capturing() and (compiled is None or not graphed):
                return fn(*args, **kwargs)  # nothing is compiled inside a capture
            if compiled is None:
                compiled = torch.compile(fn, fullgraph=True)
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                return compiled(*args, **kwargs)

        call.eager = fn  # the plain function (tests compare it with the compiled one)
        return call  # type: ignore[return-value]

    return wrap


def compiled_on_cuda(fn: F) -> F:
    """``fn`` compiled by Inductor (static shapes) whenever its first argument is a CUDA tensor, eager otherwise:
    for the decode step's small pieces, which are captured in a CUDA graph after eager warm-up steps (so the host
    cost of a compiled call is paid only then)."""
    compiled = None

    @functools.wraps(fn)
    def call(*args):
        nonlocal compiled
        if not args[0].is_cuda:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False)
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):  # one variant per weight shape
            return compiled(*args)

    call.eager = fn
    return call  # type: ignore[return-value]


def rows(x: torch.Tensor) -> int:
    """Tokens of a [..., features] tensor (every dimension but the last)."""
    return x.numel() // max(x.shape[-1], 1)


def rows_heads(x: torch.Tensor) -> int:
    """Tokens of a [..., n heads, d] tensor (every dimension but the last two)."""
    return x.numel() // max(x.shape[-1] * x.shape[-2], 1)
