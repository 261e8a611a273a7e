"""Full activation checkpointing with what it keeps in pinned host memory.

At very long contexts the fp32 layer inputs that full checkpointing keeps are the largest thing on the GPU
(S/D x h x 4 bytes per layer: 137 GB for the paper's 7B at 2M tokens, D = 8). ``checkpointing="offload"`` copies
each layer's input, and the attention kernels' outputs (o and the log-sum-exp of every head group, S/D x h x 2
bytes), to pinned host memory on a side stream during the forward (overlapping the next layer), and brings them
back at the start of that layer's backward, where the layer is re-run under autograd and differentiated in place
(a reentrant checkpoint: parameter gradients accumulate as in any backward). The re-run reuses the attention
outputs, so it issues no K/V all-gather and no attention kernel: the recomputation costs only the GEMMs and the
weight traffic. Same function, same gradients as ``full``; the GPU keeps no per-layer activation.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.layers.attention import AttentionStash, TSPAttention

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class _HostCopy:
    """A device tensor's copy in (pinned) host memory, made on a side stream without blocking the compute."""

    def __init__(self, t: Tensor):
        self.device, self.requires_grad = t.device, t.requires_grad
        t = t.detach()
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        self.done = None
        if t.is_cuda:
            stream = _copy_stream(t.device)
            stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(stream):
                self.host.copy_(t, non_blocking=True)
                self.done = torch.cuda.Event()
                self.done.record(stream)
            t.record_stream(stream)  # the allocator keeps t's memory until the copy has read it
        else:
            self.host.copy_(t)

    def restore(self) -> Tensor:
        if self.done is not None:
            torch.cuda.current_stream(self.device).wait_event(self.done)
        return self.host.to(self.device, non_blocking=True)


@contextlib.contextmanager
def _stashing(layer: nn.Module, stash: AttentionStash | None):
    attn = getattr(layer, "self_attn", None)
    if stash is None or not isinstance(attn, TSPAttention):
        yield
        return
    attn.stash = stash
    try:
        yield
    finally:
        attn.stash = None


def _tensors(out) -> tuple[Tensor | None, ...]:
    return out if isinstance(out, tuple) else (out,)


class OffloadedCheckpoint(torch.autograd.Function):
    """``layer(x, *args)`` without saving anything on the device; see the module docstring. The layer returns a
    tensor or a tuple of tensors / None (a decoder layer's ``(x, router_stats)``)."""

    @staticmethod
    def forward(ctx, layer: nn.Module, x: Tensor, *args: Tensor):
        dev = x.device.type
        ctx.layer = layer
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if dev in ("cuda", "cpu") \
            else (False, None)
        stash = AttentionStash()
        with torch.no_grad(), _stashing(layer, stash):
            y = layer(x, *args)
        ctx.x = _HostCopy(x)
        ctx.stash = [tuple(None if t is None else _HostCopy(t) for t in item) for item in stash.items]
        ctx.tensor_args = [isinstance(a, Tensor) for a in args]  # others (e.g. a Documents) are inputs kept as is
        ctx.other_args = [a for a in args if not isinstance(a, Tensor)]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        return y

    @staticmethod
    def backward(ctx, *grads: Tensor):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.other_args)
        args = [next(tensors) if is_tensor else next(others) for is_tensor in ctx.tensor_args]
        x = ctx.x.restore().requires_grad_(ctx.x.requires_grad)
        stash = AttentionStash()
        stash.items = [tuple(None if t is None else t.restore() for t in item) for item in ctx.stash]
        stash.replaying = True
        ctx.x = ctx.stash = None
        dev = x.device.type
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled), _stashing(ctx.layer, stash):
            y = ctx.layer(x, *args)
        assert not stash.items, "the recomputation did not replay every attention output"
        pairs = [(t, g) for t, g in zip(_tensors(y), grads) if t is not None and g is not None and t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return (None, x.grad if ctx.needs_input_grad[1] else None) + (None,) * len(args)


def offloaded_checkpoint(layer: nn.Module, x: Tensor, *args: Tensor):
    if not torch.is_grad_enabled():
        return layer(x, *args)
    return OffloadedCheckpoint.apply(layer, x, *args)
