"""TSP gated MLP (SwiGLU): the ring schedule.

Rank j owns rows j of gate/up (intermediate dim) and the matching columns of down. The packed shard circulates
around the ring; at each step a rank adds silu(x Wg_s^T) * (x Wu_s^T) Wd_s^T for the shard s it holds. Exact
because SwiGLU is elementwise along the intermediate dim. No all-reduce. Backward: the ring runs again with the
fp32 weight-gradient accumulator travelling with the shard (see :class:`RingGradPass`).

The forward adds each shard's down projection into one fp32 output as the shard passes ([B*L, h] fp32, the GEMM's
epilogue). Activations (``activations``): ``"keep"`` saves every shard's gate/up pre-activations ([B*L, 2F] in
all) for backward; ``"recompute"`` saves nothing but the input, and backward re-runs each shard's gate/up GEMM
when the shard comes round again (one more [B*L, h] x [h, 2F/D] GEMM per shard). At long contexts the kept
pre-activations are the largest tensors of a layer (4x the layer input per token for F = 4h).

A checkpointed layer re-run in backward (``full``, ``keep-attention``, ``offload``, ``full-offload``) needs the MLP's
gradients, never its output: there the forward ring does not run at all and backward takes the ``"recompute"``
path (each shard's gate/up GEMM once, in the backward ring). The re-run saves the down-projection GEMM, the
SwiGLU, one cast of the weights and one ring of weight traffic per layer, and keeps no pre-activations.

Weight gradients (``weight_grads``): ``"ring"`` adds each rank's partial into the fp32 accumulator travelling
with its shard (3 F h / D elements a hop); ``"owners"`` sends each shard's gate/up and hidden-activation gradients
of this rank's tokens to the shard's owner ([B*L, 3F/D] a hop), all-gathers the input and the output gradient,
and the owner forms its shard's gradient in one GEMM over all B*L*D tokens (fp32 written once). ``"auto"`` takes
whichever moves fewer bytes for the call: "owners" below about 3.5K local tokens for paper-7b at D = 8 (8K and
16K), where the accumulator GEMMs of the ring are memory-bound. The same sums, in another order.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.fused import fused_on_cuda, rows
from lightning_tsp.kernels.gemm import add_matmul_, matmul_into
from lightning_tsp.planning.grouping import MLP_WEIGHT_GRADS, mlp_grads_by_owners
from lightning_tsp.schedules.comm import all_gather, local_tensor, pack, unpack
from lightning_tsp.schedules.ring import RingGradPass, ring_shards, to_owner


@fused_on_cuda(rows)
def swiglu_into(gu: Tensor, out: Tensor) -> None:
    """out = silu(gate) * up for gu = [gate | up] [n, 2F], written into ``out`` [n, F]: one compiled kernel on
    CUDA, no temporary."""
    f = gu.shape[1] // 2
    torch.mul(F.silu(gu[:, :f]), gu[:, f:], out=out)  # eager: two kernels, the product written in place


@fused_on_cuda(rows)
def swiglu_backward(gu: Tensor, d_hid: Tensor) -> tuple[Tensor, Tensor]:
    """For hid = silu(gate) * up with gu = [gate | up] [n, 2F] and d_hid [n, F]: (d gu [n, 2F], hid [n, F]).
    silu' is aten's silu_backward; on CUDA the whole function is one compiled kernel."""
    f = gu.shape[1] // 2
    gate, up = gu[:, :f], gu[:, f:]
    act = F.silu(gate)
    d_gate = torch.ops.aten.silu_backward(d_hid * up, gate)
    return torch.cat([d_gate, d_hid * act], dim=1), act * up


MLP_ACTIVATIONS = ("keep", "recompute")


def pack_shard(w_gate: Tensor, w_up: Tensor, w_down: Tensor, dtype: torch.dtype) -> Tensor:
    """The ring's message for one shard: ``[Wg; Wu]`` [2F/D, h] (one GEMM), then ``Wd`` [h, F/D] as stored: every
    piece a straight (vectorised) cast, no transposing pass over the weights."""
    return pack([w_gate, w_up, w_down], dtype)


class RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_in, w_gate, w_up, w_down, tsp: TSPGroup, dtype: torch.dtype, recompute: bool = False,
                gradients_only: bool = False, save: bool = True, weight_grads: str = "auto",
                grad_into: Tensor | None = None):
        """``x_in`` in the residual stream's dtype (the norm's output), cast to the compute ``dtype`` here, so its
        gradient goes back in that dtype straight from the fp32 accumulator (no round trip through ``dtype``).
        ``gradients_only``: a checkpointed layer's re-run (see the module docstring); ``save``: False where no
        backward will come (no grad mode: a checkpointed layer's first forward), so "keep" holds no pre-activations.
        ``grad_into``: where backward leaves the shard's weight gradients, packed like the ring's message
        (:attr:`TSPGatedMLP.grad_into`); the returned gradients are then views of it."""
        x = x_in.to(dtype)
        ctx.in_dtype = x_in.dtype
        b, l, h = x.shape
        x2 = x.reshape(b * l, h)
        f = w_gate.shape[0]  # F/D
        ctx.tsp, ctx.recompute, ctx.weight_grads = tsp, recompute or gradients_only, weight_grads
        ctx.grad_into = grad_into
        if gradients_only:
            # a checkpointed layer's re-run in backward: its output is never read, only differentiated, so the
            # forward ring does not run; backward recomputes each shard's gate/up as the shard comes round
            ctx.save_for_backward(x, w_gate, w_up, w_down)
            return x.new_zeros(()).expand(b, l, h)  # in the compute dtype, like the output of the ring
        # each shard's down projection is added into one fp32 output as the shard passes (the GEMM's epilogue,
        # beta = 1): no per-shard output and no copy of the shards' Wd columns into one [h, F] operand
        keep = not recompute and save
        ctx.recompute = not keep
        y = torch.empty(b * l, h, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        act = x.new_empty(b * l, f)
        saved = [None] * tsp.size  # "keep": gate|up pre-activations [B*L, 2F/D], indexed by shard
        for t, (s, buf) in enumerate(ring_shards(tsp, pack_shard(w_gate, w_up, w_down, x.dtype))):
            gu = x2 @ buf[: 2 * f * h].view(2 * f, h).T  # gate and up rows are consecutive: one GEMM
            swiglu_into(gu, act)
            (matmul_into if t == 0 else add_matmul_)(y, act, buf[2 * f * h :].view(h, f).T)
            saved[s] = gu if keep else None
            del gu
        ctx.save_for_backward(x, w_gate, w_up, w_down, *(saved if keep else ()))
        return y.to(x.dtype).view(b, l, h)

    @staticmethod
    def backward(ctx, dy):
        x, w_gate, w_up, w_down, *saved = ctx.saved_tensors
        tsp = ctx.tsp
        b, l, h = x.shape
        f = w_gate.shape[0]
        x2, dy2 = x.reshape(b * l, h), dy.reshape(b * l, h).to(x.dtype)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        local = pack_shard(w_gate, w_up, w_down, x.dtype)
        into = ctx.grad_into if all(w.dtype == acc_dtype for w in (w_gate, w_up, w_down)) else None
        ctx.grad_into = None
        if mlp_grads_by_owners(ctx.weight_grads, b * l, h, f, tsp.size, x.element_size(), acc_dtype.itemsize):
            dx, grad = _backward_by_owners(tsp, x2, dy2, local, saved, ctx.recompute, acc_dtype, into)
        else:
            dx, grad = _backward_ring(tsp, x2, dy2, local, saved, ctx.recompute, acc_dtype, into)
        shapes = [w_gate.shape, w_up.shape, w_down.shape]
        d_w = [g.to(w.dtype) for g, w in zip(unpack(grad, shapes), (w_gate, w_up, w_down))]
        return (dx.view(b, l, h).to(ctx.in_dtype), *d_w, None, None, None, None, None, None, None)


def _shard_step(t, s, buf, x2, dy2, saved, recompute, dx):
    """Step t of the backward on shard s (packed weights ``buf``): the gate/up and hidden gradients of this rank's
    tokens (d[gate|up] [n, 2F/D], hid [n, F/D]); the shard's input gradient written (t = 0) or added into ``dx``."""
    h = x2.shape[1]
    f = buf.numel() // (3 * h)
    w_gu = buf[: 2 * f * h].view(2 * f, h)
    gu = x2 @ w_gu.T if recompute else saved[s]
    d_gu, hid = swiglu_backward(gu, dy2 @ buf[2 * f * h :].view(h, f))  # dy Wd_s
    (matmul_into if t == 0 else add_matmul_)(dx, d_gu, w_gu)  # one GEMM for both input gradients
    return d_gu, hid


def _backward_ring(tsp, x2, dy2, local, saved, recompute, acc_dtype, into=None):
    """(dx, this rank's shard gradient, in ``into`` when given): the accumulator of each shard travels with it
    (:class:`RingGradPass`)."""
    n, h = x2.shape
    f = local.numel() // (3 * h)
    dx = torch.empty(n, h, dtype=acc_dtype, device=x2.device)  # the first step's GEMM writes it whole
    # the accumulator of a shard's gradient travels with it: [dWg; dWu] [2F/D, h], then dWd [h, F/D]
    ring = RingGradPass(tsp, local, local.numel(), x2.device, acc_dtype, in_place=True, into=into)
    for t, (s, buf, take) in enumerate(ring):
        d_gu, hid = _shard_step(t, s, buf, x2, dy2, saved, recompute, dx)
        acc, fresh = take()  # the left neighbour's sum for shard s arrives while the GEMMs above run
        acc_gu, acc_d = acc[: 2 * f * h].view(2 * f, h), acc[2 * f * h :].view(h, f)
        add = matmul_into if fresh else add_matmul_  # first step: the GEMMs write the whole accumulator
        add(acc_gu, d_gu.T, x2)
        add(acc_d, dy2.T, hid)
    return dx, ring.grad


def _backward_by_owners(tsp, x2, dy2, local, saved, recompute, acc_dtype, into=None):
    """(dx, this rank's shard gradient, in ``into`` when given): the weights circulate as in the forward ring; the
    gate/up and hidden gradients of this rank's tokens for shard s go to s's owner, which multiplies the gathered
    inputs and output gradients of all D ranks' tokens by them: one GEMM per weight, K = all tokens, fp32 written
    once."""
    d, r = tsp.size, tsp.rank
    n, h = x2.shape
    f = local.numel() // (3 * h)
    x_all, dy_all = x2.new_empty(d * n, h), x2.new_empty(d * n, h)  # rank q's tokens in rows [q n, (q+1) n)
    works = [all_gather(x_all, x2.contiguous(), tsp, async_op=True),
             all_gather(dy_all, dy2.contiguous(), tsp, async_op=True)]
    d_gu_own, hid_own = x2.new_empty(d, n, 2 * f), x2.new_empty(d, n, f)  # every rank's, for this rank's shard
    in_flight = []  # sent pieces stay alive until their sends are waited
    dx = torch.empty(n, h, dtype=acc_dtype, device=x2.device)
    for t, (s, buf) in enumerate(ring_shards(tsp, local)):
        d_gu, hid = _shard_step(t, s, buf, x2, dy2, saved, recompute, dx)
        if t == 0:  # this rank's own shard
            d_gu_own[r].copy_(d_gu)
            hid_own[r].copy_(hid)
        else:
            q = (r + t) % d
            works += to_owner(tsp, t, [d_gu, hid], [d_gu_own[q], hid_own[q]])
            in_flight.append((d_gu, hid))
    for w in works:
        w.wait()
    del in_flight
    grad = torch.empty(local.numel(), dtype=acc_dtype, device=x2.device) if into is None else into
    matmul_into(grad[: 2 * f * h].view(2 * f, h), d_gu_own.view(d * n, 2 * f).T, x_all)  # [dWg; dWu]
    matmul_into(grad[2 * f * h :].view(h, f), dy_all.T, hid_own.view(d * n, f))  # dWd
    return dx, grad


class TSPGatedMLP(nn.Module):
    """SwiGLU MLP with Hugging Face Llama names; this rank holds intermediate rows [rank*F/D, (rank+1)*F/D)."""

    tsp_shard_dims = {"gate_proj.weight": 0, "up_proj.weight": 0, "down_proj.weight": 1}

    def __init__(self, hidden_size: int, intermediate_size: int, tsp: TSPGroup, device=None, dtype=None,
                 activations: str = "keep", weight_grads: str = "auto"):
        super().__init__()
        if activations not in MLP_ACTIVATIONS:
            raise ValueError(f"activations={activations!r}; choose one of {MLP_ACTIVATIONS}")
        if weight_grads not in MLP_WEIGHT_GRADS:
            raise ValueError(f"weight_grads={weight_grads!r}; choose one of {MLP_WEIGHT_GRADS}")
        self.tsp, self.recompute, self.weight_grads = tsp, activations == "recompute", weight_grads
        # set while a checkpointed layer is re-run in backward (:func:`lightning_tsp.offload.rerunning`)
        self.rerun = False
        # set while a CUDA graph of the layer's backward is captured (:mod:`lightning_tsp.graphs`): the graph's
        # buffer for the gate/up/down gradients, one flat fp32 tensor in the ring message's layout
        self.grad_into: Tensor | None = None
        f = intermediate_size // tsp.size
        kw = dict(bias=False, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(hidden_size, f, **kw)
        self.up_proj = nn.Linear(hidden_size, f, **kw)
        self.down_proj = nn.Linear(f, hidden_size, **kw)

    def forward(self, x: Tensor) -> Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            w = [local_tensor(m.weight) for m in (self.gate_proj, self.up_proj, self.down_proj)]
            grad = torch.is_grad_enabled()
            return RingMLP.apply(x, *w, self.tsp, dtype, self.recompute, self.rerun and grad, grad, self.weight_grads,
                                 self.grad_into if grad else None)
