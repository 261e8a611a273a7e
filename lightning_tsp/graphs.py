"""CUDA graphs of the checkpointed decoder layers: a training step the host does not bound.

At short sequences a TSP step launches thousands of small kernels (per owner of the broadcast schedule, per shard
of the ring schedule, forward, recomputation and backward) and the GPU waits for the host between them. With
``cuda_graphs=True`` each checkpointed layer's forward and its backward (the recomputation and the gradients) are
captured once as two CUDA graphs and replayed every step: the host launches 2 graphs per layer instead of hundreds
of kernels. The schedules inside are unchanged (the same broadcasts, ring hops and all-gathers, captured on the
graph's stream), and so is the arithmetic: a replay runs the kernels the capture recorded.

Life cycle, per step signature (input shapes and dtypes, autocast, checkpointing mode):

1. first step: eager, through the same code (warms up cuBLAS/cuDNN plans, the compiled elementwise pieces and the
   communicators; nothing may be initialised lazily inside a capture);
2. second step: each layer's forward is captured and replayed, in layer order, then each layer's backward in
   reverse order. All graphs share one memory pool and are captured in the order they are replayed, so memory
   is reused across layers as in eager mode;
3. later steps: replays. A new signature releases the graphs and starts again at 1.

Static buffers: layer 0's input and the top layer's output gradient are copied in; every other layer reads the
neighbouring graph's output in place; the rotary tables are copied once per step. What a forward keeps for its
backward (the layer input and, with ``keep-attention``, the attention outputs) stays in the pool until then.
Parameters are read in place (the optimizer updates them in place); their gradients come out of the backward
graph (into buffers shared by the layers of the same shapes; the gated MLP's ring writes its own there directly)
and are handed to autograd, which accumulates them as in any backward.

``cuda_graphs="auto"`` graphs only where it pays and can run (CUDA, ``full`` / ``keep-attention``, dense layers, no
packed documents, at most :data:`GRAPHED_MAX_TOKENS` local tokens) and runs every other step eagerly.

Constraints of ``cuda_graphs=True``: CUDA tensors, dense (non-MoE) layers, no packed documents, and one forward in
flight per layer (a second forward before the first one's backward overwrites the graph's buffers: the stale
backward raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.kernels.fused import compiled_at_any_length as _graphed_region
from lightning_tsp.layers.attention import AttentionStash
from lightning_tsp.layers.mlp import TSPGatedMLP
from lightning_tsp.offload import rerunning, stashing
from lightning_tsp.schedules.comm import local_tensor, unpack

GRAPHED_CHECKPOINTING = ("full", "keep-attention")  # the modes whose layers are graphed
# cuda_graphs="auto" graphs a step of at most this many local tokens (B x S/D): below it the eager step is
# host-bound (paper 7B, D = 8, H200: 0.62 -> 0.27 s at 8K); above it the step is GPU-bound and graphs would only
# add their memory pool to the peak (128K: 62 GB against 30 GB eager, for the same step time)
GRAPHED_MAX_TOKENS = 4096


@dataclass
class _Layer:
    """One layer's graphs and static tensors."""

    fwd: torch.cuda.CUDAGraph | None = None
    bwd: torch.cuda.CUDAGraph | None = None
    x: Tensor | None = None  # the forward graph's input
    y: Tensor | None = None  # its output
    kept: list = field(default_factory=list)  # the attention outputs the forward recorded (keep-attention)
    dy: Tensor | None = None  # the backward graph's output gradient
    grads: Sequence[Tensor | None] = ()  # its results: d x, then d parameter (local shards, fp32)
    generation: int = 0  # forwards run; a backward must belong to the latest
    cos: Tensor | None = None  # the warm-up step's rotary tables (graphs use LayerGraphs' static ones)
    sin: Tensor | None = None


class LayerGraphs:
    """The CUDA graphs of a model's decoder layers for one step signature (see the module docstring)."""

    def __init__(self, layers: Sequence[nn.Module], keep_attention: bool, signature: tuple, capture: bool = True):
        self.layers, self.keep_attention, self.signature = list(layers), keep_attention, signature
        self.capture = capture  # False: every step runs the eager warm-up path (the code the captures record)
        self.eager = True  # this step runs eagerly
        self.entries = [_Layer() for _ in self.layers]
        self.forwards = 0  # forward passes seen with this signature
        self.pool = None
        self.capturing = False
        self.storage: tuple[int, ...] = ()
        self.dx_buffers: list[Tensor] = []  # outside the graphs' pool (allocated before their captures)
        self.grad_buffers: dict[tuple, tuple[Tensor | None, list[Tensor]]] = {}
        self.cos: Tensor | None = None
        self.sin: Tensor | None = None
        self.autocast: tuple[bool, torch.dtype] = (False, torch.float32)

    # ---- per step --------------------------------------------------------------------------------------------

    def _storage(self) -> tuple[int, ...]:
        """Where the parameters' local tensors live (the graphs read them there). Under no_grad: a DTensor's
        differentiable ``to_local`` costs tens of microseconds of host time each, and this runs before every step's
        first graph, while the GPU waits."""
        with torch.no_grad():
            return tuple(t.data_ptr() for i in range(len(self.layers)) for t in self.params(i))

    def begin_step(self, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Start a forward pass: decide eager warm-up / capture / replay; the rotary tables the layers must use."""
        if self.forwards >= 2 and self._storage() != self.storage:  # parameters re-allocated (e.g. a load): re-warm
            self.__init__(self.layers, self.keep_attention, self.signature, self.capture)
        self.forwards += 1
        self.eager = not self.capture or self.forwards == 1
        self.capturing = self.capture and self.forwards == 2
        dev = cos.device.type
        self.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        if self.eager:  # warm-up: the tables of this step
            return cos, sin
        if self.capturing:
            self.storage = self._storage()  # the graphs read the parameters at these addresses
            self.pool = torch.cuda.graph_pool_handle()
            self.cos, self.sin = cos.clone(), sin.clone()
        else:
            self.cos.copy_(cos)
            self.sin.copy_(sin)
        return self.cos, self.sin

    def params(self, i: int) -> list[Tensor]:
        """Layer i's parameters as this rank's local tensors (differentiable: gradients reach the parameters)."""
        return [local_tensor(p) for p in self.layers[i].parameters()]

    def __call__(self, i: int, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return _GraphedLayer.apply(self, i, x, cos, sin, *self.params(i))

    def _dx_buffer(self, i: int, x: Tensor) -> Tensor:
        """Where layer i's backward graph leaves d x: two buffers in turn (layer i-1 reads it, layer i-2 reuses it)."""
        if not self.dx_buffers:
            self.dx_buffers = [torch.empty_like(x) for _ in range(2)]
        return self.dx_buffers[i % 2]

    def _grad_buffers(self, leaves: list[Tensor]) -> tuple[Tensor | None, list[Tensor]]:
        """Where a backward graph leaves its parameter gradients: one set for all layers of the same shapes (each
        backward's gradients are copied out for autograd right after its replay, before the next one runs). With
        one dtype: (one flat buffer, a view of it per parameter), so a run of parameters can be written at once;
        else (None, one buffer per parameter)."""
        key = tuple((tuple(t.shape), t.dtype) for t in leaves)
        if key not in self.grad_buffers:
            if len({t.dtype for t in leaves}) == 1:
                flat = torch.empty(sum(t.numel() for t in leaves), dtype=leaves[0].dtype, device=leaves[0].device)
                self.grad_buffers[key] = flat, unpack(flat, [t.shape for t in leaves])
            else:
                self.grad_buffers[key] = None, [torch.empty_like(t) for t in leaves]
        return self.grad_buffers[key]

    # ---- forward and backward of one layer --------------------------------------------------------------------

    def _graph(self, g: torch.cuda.CUDAGraph | None):
        return nullcontext() if g is None else torch.cuda.graph(g, pool=self.pool)

    def forward(self, i: int, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, int]:
        """Run layer i's forward (no autograd): eagerly in the warm-up, else from its graph. (output, generation)."""
        e, layer = self.entries[i], self.layers[i]
        if self.eager or (self.capturing and e.fwd is None):
            g = torch.cuda.CUDAGraph() if self.capturing else None
            if g is not None:
                prev = self.entries[i - 1].y if i > 0 else None
                # read the previous graph's output in place; layer 0 gets a static copy of its input
                e.x = x if prev is not None and x.data_ptr() == prev.data_ptr() else x.clone()
                x = e.x
            stash = AttentionStash() if self.keep_attention else None
            with torch.no_grad(), stashing(layer, stash), _graphed_region(), self._graph(g):
                y, stats = layer(x, cos, sin, None)
            if stats is not None:
                raise RuntimeError("cuda_graphs: a layer returned router statistics (MoE layers are not graphed)")
            e.y, e.kept = y, [] if stash is None else list(stash.items)
            if g is None:  # warm-up: keep what the backward needs
                e.x = x
            else:
                e.fwd = g
        if e.fwd is not None:
            if x.data_ptr() != e.x.data_ptr():
                e.x.copy_(x)
            e.fwd.replay()
        e.generation += 1
        return e.y, e.generation

    def backward(self, i: int, dy: Tensor, generation: int) -> Sequence[Tensor | None]:
        """Layer i's recomputation and gradients: (d x, d parameters...) for the forward of ``generation``."""
        e, layer = self.entries[i], self.layers[i]
        if generation != e.generation:
            raise RuntimeError(
                f"cuda_graphs: layer {i} ran another forward before this backward (its graph buffers now hold the "
                "newer forward). Run backward after each forward, or build the model with cuda_graphs=False.")
        capture = e.fwd is not None and e.bwd is None
        if e.bwd is None:
            g = torch.cuda.CUDAGraph() if capture else None
            leaves = [t.detach().requires_grad_() for t in self.params(i)]  # the parameters' storage, as leaves
            if g is not None:
                above = self.entries[i + 1].grads[0] if i + 1 < len(self.entries) and self.entries[i + 1].grads \
                    else None
                e.dy = dy if above is not None and dy.data_ptr() == above.data_ptr() else dy.clone()
                dy = e.dy
                flat, bufs = self._grad_buffers(leaves)
                out = [self._dx_buffer(i, e.x)] + bufs
            names = [n for n, _ in layer.named_parameters()]
            x = e.x.detach().requires_grad_()
            stash = None
            if self.keep_attention:
                stash = AttentionStash()
                stash.items, stash.replaying = list(e.kept), True
            enabled, dtype = self.autocast
            cos, sin = (self.cos, self.sin) if self.cos is not None else (e.cos, e.sin)
            into = _gradients_into(layer, flat, leaves) if g is not None else nullcontext()
            with torch.enable_grad(), torch.autocast(x.device.type, dtype=dtype, enabled=enabled), \
                    rerunning(layer, stash), into, _graphed_region(), self._graph(g):
                y, _ = torch.func.functional_call(layer, dict(zip(names, leaves)), (x, cos, sin, None))
                grads = torch.autograd.grad(y, [x] + leaves, dy)
                if g is not None:  # into the shared buffers: the graph's own results are freed for the next captures
                    for buf, grad in zip(out, grads):
                        if not _same(buf, grad):  # (the MLP's gradients are there already)
                            buf.copy_(grad)
            if stash is not None and stash.items:
                raise RuntimeError("cuda_graphs: the recomputation did not replay every attention output")
            if g is None:  # warm-up: nothing is kept
                e.x, e.y, e.kept = None, None, []
                return grads
            del grads
            e.bwd, e.grads = g, out
        if dy.data_ptr() != e.dy.data_ptr():
            e.dy.copy_(dy)
        e.bwd.replay()
        return e.grads


def _same(a: Tensor, b: Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


@contextmanager
def _gradients_into(layer: nn.Module, flat: Tensor | None, leaves: list[Tensor]):
    """While a layer's backward is captured: its gated MLP writes the gate/up/down weight gradients straight into
    their part of the graph's gradient buffer ``flat`` (views per parameter, in ``layer.parameters()`` order), so
    the graph copies none of them (75% of a Llama layer's parameters)."""
    mlp = getattr(layer, "mlp", None)
    params = list(layer.parameters())
    own = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight] if isinstance(mlp, TSPGatedMLP) else []
    at = [next((i for i, p in enumerate(params) if p is q), -1) for q in own]
    if flat is None or not own or at != list(range(at[0], at[0] + 3)):  # not one run in the ring's packed order
        yield
        return
    start = sum(t.numel() for t in leaves[: at[0]])
    mlp.grad_into = flat[start : start + sum(leaves[i].numel() for i in at)]
    try:
        yield
    finally:
        mlp.grad_into = None


class _GraphedLayer(torch.autograd.Function):
    """Autograd node of one graphed layer: inputs (x, cos, sin, parameters' local tensors), output the layer's."""

    @staticmethod
    def forward(ctx, graphs: LayerGraphs, i: int, x: Tensor, cos: Tensor, sin: Tensor, *params: Tensor):
        e = graphs.entries[i]
        if graphs.eager:  # the warm-up's backward reads the tables of its step
            e.cos, e.sin = cos, sin
        y, ctx.generation = graphs.forward(i, x, cos, sin)
        ctx.graphs, ctx.i = graphs, i
        return y.detach()  # an alias of the graph's output (the graph keeps the buffer)

    @staticmethod
    def backward(ctx, dy: Tensor):
        grads = ctx.graphs.backward(ctx.i, dy, ctx.generation)
        dx, dparams = grads[0], grads[1:]
        # the graph overwrites its gradient buffers at the next replay: autograd gets its own copies
        return (None, None, dx, None, None, *[None if g is None else g.clone() for g in dparams])
