"""Checkpointed layers whose kept tensors live in pinned host memory, or that replay the attention kernels' outputs
instead of re-running them.

Plain ``full`` checkpointing keeps each layer's input on the GPU and re-runs the whole layer in backward, K/V
all-gathers and attention kernels included: at long contexts the attention forward is the largest part of that
recomputation. Three modes change what is kept or where:

- ``"keep-attention"``: the layer input and the attention kernels' outputs (o and the log-sum-exp of every head
  group, S/D x h x 2 bytes per layer in bf16, half the fp32 layer input) stay on the GPU, so that the re-run issues
  no K/V all-gather and no attention kernel and costs only the GEMMs and the weight traffic (1.5x ``full``'s saved
  activations; no host memory).
- ``"offload"``: the same tensors are copied to pinned host memory on a side stream during the forward
  (overlapping the next layer) and the GPU keeps no per-layer activation. Backward brings the next layer's tensors
  back on the side stream while the current layer is differentiated (:class:`StashChain`), so the copies hide
  behind compute.
- ``"full-offload"``: only the layer input goes to pinned host memory (and comes back as in ``offload``); the
  re-run is ``full``'s, attention included. The longest contexts: ``offload``'s host memory is the layer inputs
  plus the attention outputs, this mode's only the inputs (with ``bf16-true`` half of ``bf16-mixed``'s fp32 ones).

At the start of a layer's backward the layer is re-run under autograd and differentiated in place (a reentrant
checkpoint: parameter gradients accumulate as in any backward). Same function, same gradients as ``full``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.layers.attention import AttentionStash, TSPAttention
from lightning_tsp.layers.mlp import TSPGatedMLP

_COPY_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.cuda.Stream(device)
    return _COPY_STREAMS[device]


class _Kept:
    """A tensor kept where it is (``keep-attention``)."""

    def __init__(self, t: Tensor):
        self.t, self.requires_grad = t.detach(), t.requires_grad

    def prefetch(self) -> None:
        pass

    def restore(self) -> Tensor:
        return self.t


class _HostCopy:
    """A device tensor's copy in (pinned) host memory, made on a side stream without blocking the compute, and
    brought back on that stream ahead of use (:meth:`prefetch`)."""

    def __init__(self, t: Tensor):
        self.device, self.requires_grad = t.device, t.requires_grad
        t = t.detach()
        self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
        self.back: Tensor | None = None
        self.done = None  # the event after which the copy (to host, then back) is complete
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

    def prefetch(self) -> None:
        """Start the copy back to the device (on the side stream, after the copy to host)."""
        if self.back is not None:
            return
        if self.done is None:  # CPU
            self.back = self.host.to(self.device)
            return
        with torch.cuda.stream(_copy_stream(self.device)):
            self.back = self.host.to(self.device, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()

    def restore(self) -> Tensor:
        self.prefetch()
        back, self.back, self.host = self.back, None, None
        if self.done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(self.done)
            back.record_stream(current)  # allocated on the side stream, used (and freed) on the compute stream
        return back


class StashChain:
    """The stashes of one forward pass, in layer order: each layer's input and, with ``attention``, its attention
    outputs, kept on the ``"device"`` or in ``"host"`` memory. A layer's backward prefetches the stash of the layer
    before it (the next backward), so its host-to-device copies overlap this layer's recomputation."""

    MODES = {"full": ("device", False), "keep-attention": ("device", True), "offload": ("host", True),
             "full-offload": ("host", False)}

    def __init__(self, place: str, attention: bool = True):
        if place not in ("device", "host"):
            raise ValueError(f"place={place!r}: choose 'device' or 'host'")
        self.keep = _Kept if place == "device" else _HostCopy
        self.attention = attention
        self.stashes: list[list | None] = []

    @classmethod
    def for_mode(cls, mode: str) -> "StashChain | None":
        """The chain of a checkpointing mode that keeps its tensors in one (None for the other modes)."""
        return cls(*cls.MODES[mode]) if mode in cls.MODES else None


@contextlib.contextmanager
def stashing(layer: nn.Module, stash: AttentionStash | None):
    attn = getattr(layer, "self_attn", None)
    if stash is None or not isinstance(attn, TSPAttention):
        yield
        return
    attn.stash = stash
    try:
        yield
    finally:
        attn.stash = None


@contextlib.contextmanager
def rerunning(layer: nn.Module, stash: AttentionStash | None):
    """A checkpointed layer's re-run in backward: :func:`stashing`, the gated MLP told that only its gradients are
    wanted (its output is never read: :class:`lightning_tsp.layers.mlp.RingMLP` skips the forward ring) and the
    attention that its backward follows at once (it hands its weights to it: :class:`BroadcastAttention`)."""
    told = [m for m in (getattr(layer, "mlp", None), getattr(layer, "self_attn", None))
            if isinstance(m, (TSPGatedMLP, TSPAttention))]
    with stashing(layer, stash):
        for m in told:
            m.rerun = True
        try:
            yield
        finally:
            for m in told:
                m.rerun = False


def _tensors(out) -> tuple[Tensor | None, ...]:
    return out if isinstance(out, tuple) else (out,)


class StashedCheckpoint(torch.autograd.Function):
    """``layer(x, *args)`` keeping only x and the attention outputs (where ``chain`` says); see the module
    docstring. The layer returns a tensor or a tuple of tensors / None (a decoder layer's ``(x, router_stats)``)."""

    @staticmethod
    def forward(ctx, layer: nn.Module, chain: StashChain, x: Tensor, *args: Tensor):
        dev = x.device.type
        ctx.layer, ctx.chain = layer, chain
        ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) if dev in ("cuda", "cpu") \
            else (False, None)
        stash = AttentionStash() if chain.attention else None
        with torch.no_grad(), stashing(layer, stash):
            y = layer(x, *args)
        # [x, then every attention output and log-sum-exp in order]: what the re-run replays
        items = stash.items if stash is not None else []
        kept = [chain.keep(x)] + [None if t is None else chain.keep(t) for item in items for t in item]
        ctx.index = len(chain.stashes)
        chain.stashes.append(kept)
        ctx.tensor_args = [isinstance(a, Tensor) for a in args]  # others (e.g. a Documents) are inputs kept as is
        ctx.other_args = [a for a in args if not isinstance(a, Tensor)]
        ctx.save_for_backward(*[a for a in args if isinstance(a, Tensor)])
        return y

    @staticmethod
    def backward(ctx, *grads: Tensor):
        tensors, others = iter(ctx.saved_tensors), iter(ctx.other_args)
        args = [next(tensors) if is_tensor else next(others) for is_tensor in ctx.tensor_args]
        chain = ctx.chain
        kept, chain.stashes[ctx.index] = chain.stashes[ctx.index], None
        restored = [None if k is None else k.restore() for k in kept]
        if ctx.index > 0 and chain.stashes[ctx.index - 1] is not None:  # the next backward's, in flight now
            for k in chain.stashes[ctx.index - 1]:
                if k is not None:
                    k.prefetch()
        x = restored[0].requires_grad_(kept[0].requires_grad)
        stash = None
        if chain.attention:
            stash = AttentionStash()
            stash.items = list(zip(restored[1::2], restored[2::2]))
            stash.replaying = True
        dev = x.device.type
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=enabled), rerunning(ctx.layer, stash):
            y = ctx.layer(x, *args)
        assert stash is None or not stash.items, "the recomputation did not replay every attention output"
        pairs = [(t, g) for t, g in zip(_tensors(y), grads) if t is not None and g is not None and t.requires_grad]
        torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return (None, None, x.grad if ctx.needs_input_grad[2] else None) + (None,) * len(args)


def stashed_checkpoint(layer: nn.Module, chain: StashChain, x: Tensor, *args: Tensor):
    """``layer(x, *args)``, checkpointed with its input (and attention outputs) kept where ``chain`` keeps them."""
    if not torch.is_grad_enabled():
        return layer(x, *args)
    return StashedCheckpoint.apply(layer, chain, x, *args)
