"""TSP attention: the broadcast schedule (DESIGN.md sections 1 and 2).

For each owner j (same order on every rank) the packed shard [Wq_j; Wk_j; Wv_j; Wo_j] is broadcast; every rank
projects its local tokens, rotates q/k with their global positions, all-gathers k/v over the sequence (KV-head
width only), runs its two zigzag chunks against their causal K/V prefixes and accumulates y += o_j Wo_j^T.
No all-reduce. Backward re-broadcasts the shards, re-gathers K/V (never saved), reduce-scatters dK/dV to the
token owners and reduces the weight-gradient partials onto owner j in fp32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.attention import AttentionKernel, DocumentMask, select_attention_kernel
from lightning_tsp.kernels.fused import fused_on_cuda, rows_heads
from lightning_tsp.layers.rope import apply_rope, apply_rope_backward
from lightning_tsp.planning.grouping import choose_shard_group, step_kv_heads, valid_shard_groups
from lightning_tsp.schedules.broadcast import GroupReduce, gather_shard_groups
from lightning_tsp.kernels.gemm import add_matmul_, matmul_into
from lightning_tsp.kernels.gemv import linear_rows
from lightning_tsp.schedules.comm import (
    all_gather,
    all_reduce_sum,
    local_tensor,
    pack,
    reduce_scatter,
    unpack,
)


# ---- K/V exchange over the sequence ------------------------------------------------------------------------
#
# The gathered K/V buffer [B, S, n, d] holds the 2D chunks of the sequence in GATHER ORDER: every rank's second
# chunk (ranks 0..D-1, i.e. natural chunks 2D-1 .. D), then every rank's first chunk (natural chunks 0..D-1).
# One all-gather per half writes it in place, no reordering; rank p's two zigzag calls then find their keys as
# contiguous slices: chunk p (queries 0..c) owns slot D+p and sees slots D..D+p-1 before it; chunk 2D-1-p
# (queries c..2c) owns slot p and sees slots p+1..2D-1. Keys outside a call's own chunk are fully visible, so
# their order does not matter. dK/dV go back the same way: one reduce-scatter per half.


def gather_slots(d: int) -> list[int]:
    """The natural chunk index held by each slot of the gathered buffer."""
    return [2 * d - 1 - r for r in range(d)] + list(range(d))


def gather_order(t: Tensor, d: int, dim: int) -> Tensor:
    """A full natural-order tensor -> gather order along ``dim`` (for tests and references)."""
    if d == 1:
        return t
    chunks = t.chunk(2 * d, dim=dim)
    return torch.cat([chunks[i] for i in gather_slots(d)], dim=dim)


def zigzag_calls(l: int, tsp: TSPGroup) -> list[tuple[slice, slice, slice | None]]:
    """(query rows of the local block, own-chunk key rows, prefix key rows or None) for this rank's calls, over a
    gathered buffer in gather order. The first call's keys (own chunk, then prefix) run contiguously to the end of
    the buffer and cover the second call's keys."""
    if tsp.size == 1:
        return [(slice(0, l), slice(0, l), None)]
    c, d, p = l // 2, tsp.size, tsp.rank
    prefix_first = slice((d * c), (d + p) * c) if p > 0 else None
    return [(slice(c, 2 * c), slice(p * c, (p + 1) * c), slice((p + 1) * c, 2 * d * c)),
            (slice(0, c), slice((d + p) * c, (d + p + 1) * c), prefix_first)]


class Documents:
    """Packed documents of one forward: per zigzag call of this rank, the :class:`DocumentMask` (the queries'
    document starts, the global index of every key the call reads). Built once per forward from the local tokens'
    document starts [B, L] (global index of each token's first document token, ``zigzag.document_starts``) and
    reused by every layer and head group (kernels cache per-call structures in it)."""

    def __init__(self, doc_starts: Tensor, tsp: TSPGroup):
        b, l = doc_starts.shape
        key_index = gather_order(torch.arange(l * tsp.size, device=doc_starts.device), tsp.size, 0)
        self.masks = [DocumentMask.for_call(doc_starts[:, rows], key_index, own, pre)
                      for rows, own, pre in zigzag_calls(l, tsp)]


class KVGather:
    """All-gather of a local K/V block [B, L, n, d] (this rank's zigzag chunks, K heads then V heads) into the
    gathered buffer [B, S, n, d] in gather order, in flight until :meth:`wait`. Starting it before other local
    work (the q projection, the output-projection gradient) overlaps the exchange with that work."""

    def __init__(self, kv: Tensor, tsp: TSPGroup):
        self.kv, self.tsp = kv, tsp
        d = tsp.size
        if d == 1:
            return
        b, l, n, hd = kv.shape
        c = l // 2
        self.out = kv.new_empty(b, 2 * d * c, n, hd)
        halves = (kv[:, c:], kv[:, :c])  # second chunks fill slots 0..D-1, first chunks slots D..2D-1
        if b == 1:  # the output regions are laid out exactly as the all-gather writes them
            self.recv = [self.out[:, : d * c], self.out[:, d * c :]]
        else:  # [D, B, c, n, d] per half, transposed into place in wait()
            self.recv = [kv.new_empty(d, b, c, n, hd) for _ in range(2)]
        self.works = [all_gather(r.view(-1), h.reshape(-1), tsp, async_op=True) for r, h in zip(self.recv, halves)]

    def wait(self) -> Tensor:
        if self.tsp.size == 1:
            return self.kv
        for w in self.works:
            w.wait()
        b = self.kv.shape[0]
        if b > 1:
            half = self.out.shape[1] // 2
            for i, r in enumerate(self.recv):
                self.out[:, i * half : (i + 1) * half] = r.transpose(0, 1).flatten(1, 2)
        return self.out


def scatter_kv_grad(dkv: Tensor, tsp: TSPGroup) -> Tensor:
    """Gathered dK/dV [B, S, n, d] (gather order, fp32) -> summed over the group, this rank's rows [B, L, n, d]."""
    d = tsp.size
    if d == 1:
        return dkv
    b, s, n, hd = dkv.shape
    c = s // (2 * d)
    out = dkv.new_empty(b, 2 * c, n, hd)
    for i, rows in enumerate((slice(c, 2 * c), slice(0, c))):  # slots 0..D-1: second chunks; D..2D-1: first
        region = dkv[:, i * d * c : (i + 1) * d * c]
        if b == 1:
            reduce_scatter(out[:, rows].view(-1), region.reshape(-1), tsp)
        else:
            recv = dkv.new_empty(b, c, n, hd)
            reduce_scatter(recv.view(-1), region.unflatten(1, (d, c)).transpose(0, 1).reshape(-1), tsp)
            out[:, rows] = recv
    return out


# ---- the zigzag attention calls -----------------------------------------------------------------------------


def zigzag_attention(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, tsp: TSPGroup,
                     out: Tensor | None = None, lse_out: Tensor | None = None, documents: Documents | None = None):
    """Local queries q [B, Hq, L, d] against gathered k, v [B, Hkv, S, d] (gather order): one kernel call per
    local chunk (each restricted to its queries' documents with ``documents``). Writes o into ``out`` (default:
    like q) and the log-sum-exp into ``lse_out`` [B, Hq, L] (default: new) when the kernel returns one; returns
    (o, lse or None)."""
    o = torch.empty_like(q) if out is None else out
    lse, got_lse = lse_out, False
    for i, (rows, own, pre) in enumerate(zigzag_calls(q.shape[2], tsp)):
        o_c, lse_c = kernel.forward(q[:, :, rows], k[:, :, own], v[:, :, own],
                                    None if pre is None else k[:, :, pre], None if pre is None else v[:, :, pre],
                                    mask=None if documents is None else documents.masks[i])
        o[:, :, rows] = o_c
        if lse_c is not None:
            if lse is None:
                lse = torch.empty(q.shape[:3], dtype=lse_c.dtype, device=q.device)
            lse[:, :, rows] = lse_c
            got_lse = True
    return o, lse if got_lse else None


@fused_on_cuda(rows_heads)
def store_kv_grad(out: Tensor, gk: Tensor, gv: Tensor, add: bool) -> None:
    """Write (or add) one piece's dK, dV [B, Lk, n, d] into the key rows ``out`` [B, Lk, 2n, d] of a gathered
    gradient buffer (K heads, then V heads, at least fp32): on CUDA one compiled kernel that reads both and writes
    whole contiguous rows, instead of two strided converting copies."""
    g = torch.cat([gk, gv], dim=2).to(out.dtype)
    out.add_(g) if add else out.copy_(g)


def zigzag_attention_backward(kernel: AttentionKernel, do, q, k, v, o, lse, tsp: TSPGroup,
                              dq_out: Tensor | None = None, dk_out: Tensor | None = None,
                              dv_out: Tensor | None = None, documents: Documents | None = None,
                              dkv_out: Tensor | None = None, accumulate: bool = False):
    """Gradients of :func:`zigzag_attention`: dq like q, dK/dV [B, Hkv, S, d] in gather order summed over this
    rank's calls, in (at least) fp32. The first call writes its key rows, the second adds into them (its keys lie
    inside the first's, see :func:`zigzag_calls`); the rows before the first call's keys, which no call reads,
    get zeros.

    ``dkv_out`` [B, S, 2 Hkv, d] (the gathered buffer's layout: K heads, then V heads): dK/dV are written there
    (whole rows at once; ``dk_out``/``dv_out`` unused) and returned as its views; with ``accumulate`` they are added
    to what it holds (the other owners of a replicated KV head) and the unread rows are left as they are."""
    dq = torch.empty_like(q) if dq_out is None else dq_out
    acc = torch.promote_types(k.dtype, torch.float32)
    n = k.shape[1]
    if dkv_out is not None:
        dk, dv = dkv_out[:, :, :n].transpose(1, 2), dkv_out[:, :, n:].transpose(1, 2)
    else:
        dk = torch.empty(k.shape, dtype=acc, device=k.device) if dk_out is None else dk_out
        dv = torch.empty(v.shape, dtype=acc, device=v.device) if dv_out is None else dv_out
    calls = zigzag_calls(q.shape[2], tsp)
    for i, (rows, own, pre) in enumerate(calls):
        k_pre, v_pre = (None, None) if pre is None else (k[:, :, pre], v[:, :, pre])
        lse_c = None if lse is None else lse[:, :, rows]
        dq_c, dk_own, dv_own, dk_pre, dv_pre = kernel.backward(
            do[:, :, rows], q[:, :, rows], k[:, :, own], v[:, :, own], k_pre, v_pre, o[:, :, rows], lse_c,
            mask=None if documents is None else documents.masks[i])
        dq[:, :, rows] = dq_c
        for key_rows, gk, gv in ((own, dk_own, dv_own), (pre, dk_pre, dv_pre)):
            if key_rows is None:
                continue
            add = i > 0 or accumulate
            if dkv_out is not None:
                store_kv_grad(dkv_out[:, key_rows], gk.transpose(1, 2), gv.transpose(1, 2), add)
            elif not add:
                dk[:, :, key_rows] = gk
                dv[:, :, key_rows] = gv
            else:
                dk[:, :, key_rows] += gk
                dv[:, :, key_rows] += gv
    if not accumulate:
        unread = slice(0, calls[0][1].start)
        if dkv_out is not None:
            dkv_out[:, unread] = 0
        else:
            dk[:, :, unread] = 0
            dv[:, :, unread] = 0
    return dq, dk, dv


# ---- the head group: what one owner holds -------------------------------------------------------------------


class ShardView(NamedTuple):
    """Named views of one head group's weights: of a packed shard (or its gradient, same layout), or of the
    owner's own parameters (:meth:`HeadLayout.params_view`, tuples of q/k/v pieces, nothing copied)."""

    w_qkv: Tensor | tuple[Tensor, ...]  # [(nq + 2 nkv) d, h]: q rows, then K rows, then V rows (one GEMM)
    w_o: Tensor  # [nq d, h]: the matching columns of o_proj, transposed (Wo^T)
    b_qkv: Tensor | tuple[Tensor, ...] | None  # [(nq + 2 nkv) d] q/k/v biases (Qwen2), None without


@dataclass(frozen=True)
class HeadLayout:
    """One head group (what one owner holds) and its packed shard, the one message the broadcast schedule sends.

    The shard is ``[Wq; Wk; Wv]``, ``Wo^T`` (o_proj's columns transposed: [nq d, h]), then with biases
    ``[bq; bk; bv]``, flattened in that order (the order of :meth:`TSPAttention.shard_params`; :meth:`pack`). Every
    piece is a block of whole rows, so g owners' shards regroup by stacking each piece owner by owner, which the
    collectives do in place (:meth:`zero_copy_grouping`). With fewer KV heads than ranks, ``kv_replicas`` = D / n_kv consecutive
    owners form one KV group: each holds a copy of the group's KV head (``n_kv_heads`` = 1) and its own query heads.
    """

    hidden: int
    n_heads: int  # query heads of the group (n_q / D)
    n_kv_heads: int  # KV heads of the group (n_kv / D; 1 when replicated)
    head_dim: int
    bias: bool = False
    kv_replicas: int = 1

    @property
    def q_rows(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + 2 * self.kv_rows

    def shapes(self) -> list[tuple[int, ...]]:
        """Shapes of the packed pieces, in packing order (wq, wk, wv, wo[, bq, bk, bv])."""
        h, q, kv = self.hidden, self.q_rows, self.kv_rows
        return [(q, h), (kv, h), (kv, h), (q, h)] + ([(q,), (kv,), (kv,)] if self.bias else [])

    @staticmethod
    def pack(params: list[Tensor], dtype: torch.dtype) -> Tensor:
        """The packed shard of the sharded parameters (``TSPAttention.shard_params`` order) in ``dtype``."""
        return pack([*params[:3], params[3].T, *params[4:]], dtype)

    def unpack_grads(self, d_shard: Tensor, params: list[Tensor]) -> list[Tensor]:
        """A packed shard's gradient -> one gradient per parameter, shaped and typed like it."""
        grads = unpack(d_shard, self.shapes())
        grads[3] = grads[3].T
        return [g.to(w.dtype) for g, w in zip(grads, params)]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes())

    def view(self, buf: Tensor) -> ShardView:
        h, rows, o = self.hidden, self.qkv_rows, self.hidden * self.q_rows
        return ShardView(buf[: rows * h].view(rows, h), buf[rows * h : rows * h + o].view(self.q_rows, h),
                         buf[rows * h + o : rows * h + o + rows] if self.bias else None)

    def params_view(self, params: list[Tensor]) -> ShardView:
        """A view of the sharded parameters themselves (``TSPAttention.shard_params`` order), without packing."""
        return ShardView(tuple(params[:3]), params[3].T, tuple(params[4:7]) if self.bias else None)

    def kv_view(self, buf: Tensor) -> tuple[Tensor, Tensor | None]:
        """The K/V rows of a shard-shaped buffer: (weights [2 kv d, h], biases [2 kv d] or None)."""
        v = self.view(buf)
        return v.w_qkv[self.q_rows :], None if v.b_qkv is None else v.b_qkv[self.q_rows :]

    @property
    def kv_numel(self) -> int:
        """Elements of one KV group's own parameters (K/V rows and biases): what replicas sum over the group."""
        return 2 * self.kv_rows * (self.hidden + int(self.bias))

    def kv_group(self, owner: int) -> int:
        return owner // self.kv_replicas

    def starts_group(self, owner: int) -> bool:
        """Owner ``owner`` is the first of its KV group: its K/V are projected and exchanged."""
        return owner % self.kv_replicas == 0

    def ends_group(self, owner: int) -> bool:
        """The last owner of its KV group: the group's K/V gradients are complete after its queries."""
        return owner % self.kv_replicas == self.kv_replicas - 1

    # ---- shard grouping: g consecutive owners run as one owner of a g times larger head group ----------------

    def _kv_step(self, g: int) -> int:
        return min(g, self.kv_replicas)  # consecutive owners of a group that hold the same KV head

    def grouped(self, g: int) -> "HeadLayout":
        """The head group of g consecutive owners: their query heads in owner order, each distinct KV head once
        (a replicated KV head is read from the first of its owners; the copies are equal)."""
        if g == 1:
            return self
        return HeadLayout(self.hidden, g * self.n_heads, step_kv_heads(g, self.n_kv_heads, self.kv_replicas),
                          self.head_dim, self.bias, max(1, self.kv_replicas // g))

    def _piece_kinds(self) -> list[str]:
        return ["q", "kv", "kv", "q"] + (["q", "kv", "kv"] if self.bias else [])

    def zero_copy_grouping(self, g: int) -> bool:
        """Whether g owners' shards become the grouped shard by stacking each piece owner by owner (every owner's
        KV heads distinct): the collectives then deliver each owner's pieces in place (:meth:`group_pieces`)."""
        return g > 1 and self._kv_step(g) == 1

    def group_pieces(self, g: int) -> list[tuple[slice, slice]]:
        """Per packed piece: (its slice in an owner's shard, its region in the grouped shard, g times as large,
        owner-major). Only where :meth:`zero_copy_grouping`."""
        return [(src, dst) for _, src, dst in self._group_pieces(g)]

    def _group_pieces(self, g: int):
        """Per packed piece: (kind, offset and size in an owner's shard, its view in the grouped shard)."""
        out, a, b = [], 0, 0
        grp = self.grouped(g)
        for kind, own, mine in zip(self._piece_kinds(), self.shapes(), grp.shapes()):
            n, m = math.prod(own), math.prod(mine)
            out.append((kind, slice(a, a + n), slice(b, b + m)))
            a, b = a + n, b + m
        return out

    def regroup(self, shards: Tensor, g: int) -> Tensor:
        """Owners' packed shards [g, numel] -> the grouped head group's packed shard [grouped(g).numel]."""
        if g == 1:
            return shards[0]
        out = shards.new_empty(self.grouped(g).numel)
        step = self._kv_step(g)
        for kind, src, dst in self._group_pieces(g):
            if kind == "q":  # owner-major rows
                out[dst].view(g, -1).copy_(shards[:, src])
            else:  # one copy per distinct KV head
                out[dst].view(g // step, -1).copy_(shards[::step, src])
        return out

    def ungroup(self, grad: Tensor, g: int) -> Tensor:
        """Transpose of :meth:`regroup` for gradients: the grouped shard's [grouped(g).numel] -> the owners'
        [g, numel]; each replica of a KV head gets that head's whole gradient."""
        if g == 1:
            return grad.view(1, -1)
        out = grad.new_empty(g, self.numel)
        step = self._kv_step(g)
        for kind, src, dst in self._group_pieces(g):
            if kind == "q":
                out[:, src].copy_(grad[dst].view(g, -1))
            else:
                n = src.stop - src.start
                out[:, src].view(g // step, step, n).copy_(grad[dst].view(g // step, 1, n).expand(-1, step, -1))
        return out


@dataclass(frozen=True)
class _AttnSpec:
    """One attention call's settings: the static layout plus what the call runs with."""

    tsp: TSPGroup
    layout: HeadLayout
    kernel: AttentionKernel
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3), replicated weights [head_dim]
    eps: float = 1e-6
    kv_bucket: int | None = None  # local KV heads gathered at once (head bucketing); None: all of them
    stash: AttentionStash | None = None  # attention outputs recorded by a forward / replayed by its recompute
    documents: Documents | None = None  # packed documents: per-document causal attention
    group: int = 1  # shard grouping: owners whose shards the broadcast schedule runs as one step
    rerun: bool = False  # a checkpointed layer's re-run in backward: this forward's backward follows at once

    @property
    def step_layout(self) -> HeadLayout:
        """The head group one step of the broadcast schedule computes (g owners' heads with shard grouping)."""
        return self.layout.grouped(self.group)

    @property
    def steps(self) -> int:
        return self.tsp.size // self.group

    def buckets(self) -> list[tuple[slice, slice]]:
        """(KV-head slice, query-head slice) per bucket of one step's head group."""
        lay = self.step_layout
        nkv = lay.n_kv_heads
        n = self.kv_bucket or nkv
        g = lay.n_heads // nkv
        return [(slice(a, min(a + n, nkv)), slice(a * g, min(a + n, nkv) * g)) for a in range(0, nkv, n)]


# ---- per-shard projection (training, prefill and decode) ----------------------------------------------------


def _head_rms(t: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per-head RMS normalisation in (at least) fp32: (normalised t, 1/rms) for t [..., d]."""
    tf = t.to(torch.promote_types(t.dtype, torch.float32))
    r = torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)
    return tf * r, r


def _head_rms_backward(grad: Tensor, t: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Transpose of :func:`_head_rms` (before the weight): (d t, the normalised t used for the weight grad)."""
    t_hat, r = _head_rms(t, eps)
    g = grad.to(t_hat.dtype)
    return (r * (g - t_hat * (g * t_hat).mean(-1, keepdim=True))).to(t.dtype), t_hat


class Projection(NamedTuple):
    """A head group's projections of the local tokens, [B, L, n, d] views (K/V None when not projected)."""

    q_raw: Tensor  # before the q norm (what its backward needs)
    k_raw: Tensor | None
    q: Tensor  # after the optional q norm, before RoPE
    k: Tensor | None
    v: Tensor | None


def project_qkv(spec: _AttnSpec, view: ShardView, x2: Tensor, norms, b: int, l: int, with_kv: bool = True):
    """q (and k, v) of local tokens x2 [B*L, h] with one head group's weights: one GEMM (biases in its epilogue),
    then the optional per-head q/k norms. ``with_kv=False`` projects q only (a replica owner: its KV group's K/V
    were projected and exchanged by the group's first owner)."""
    lay = spec.step_layout
    nq, nkv = lay.n_heads, lay.n_kv_heads
    if isinstance(view.w_qkv, Tensor):
        rows = lay.qkv_rows if with_kv else lay.q_rows
        w, bias = view.w_qkv[:rows], None if view.b_qkv is None else view.b_qkv[:rows]
        qkv = x2 @ w.T if bias is None else torch.addmm(bias, x2, w.T)
        qkv = qkv.view(b, l, -1, lay.head_dim)
        q_raw = qkv[:, :, :nq]
        k_raw, v = (qkv[:, :, nq : nq + nkv], qkv[:, :, nq + nkv :]) if with_kv else (None, None)
    else:  # the owner's own q/k/v parameters (decoding: a few tokens, the weights stay where they are): one
        # weight-bandwidth-bound product each (lightning_tsp.kernels.gemv), bias included
        n = 3 if with_kv else 1
        biases = (None,) * n if view.b_qkv is None else view.b_qkv[:n]
        parts = [linear_rows(x2, w, bb).view(b, l, -1, lay.head_dim) for w, bb in zip(view.w_qkv[:n], biases)]
        q_raw, k_raw, v = (parts + [None, None])[:3]
    if not spec.qk_norm:
        return Projection(q_raw, k_raw, q_raw, k_raw, v)
    q = norms[0] * _head_rms(q_raw, spec.eps)[0].to(x2.dtype)
    k = None if k_raw is None else norms[1] * _head_rms(k_raw, spec.eps)[0].to(x2.dtype)
    return Projection(q_raw, k_raw, q, k, v)


def kv_blocks(spec: _AttnSpec, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> list[Tensor]:
    """Per head bucket, the block [B, L, 2n, d] that travels (and that a KV cache stores): RoPE'd K heads, then V
    heads. ``cos``/``sin`` broadcast against [B, L, n, d]."""
    return [kv_block(k[:, :, kvs], v[:, :, kvs], cos, sin) for kvs, _ in spec.buckets()]


@fused_on_cuda(rows_heads)
def kv_block(k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """k, v [B, L, n, d] -> [B, L, 2n, d]: the RoPE'd keys, then the values."""
    return torch.cat([apply_rope(k, cos, sin), v], dim=2)


# ---- K/V sources --------------------------------------------------------------------------------------------


class GatheredKV:
    """The broadcast schedule's K/V source: each bucket's local block all-gathered over the sequence (gather
    order), the next bucket in flight while the current one is used. ``keep=True`` holds the gathered buckets for
    the other owners of a replicated KV head, so each KV head crosses the network once."""

    def __init__(self, blocks: list[Tensor], tsp: TSPGroup, keep: bool = False):
        self.blocks, self.tsp, self.keep = blocks, tsp, keep
        self.kept: list[Tensor | None] = [None] * len(blocks)
        self.pending, self.next = KVGather(blocks[0], tsp), 0

    def bucket(self, i: int) -> Tensor:
        if self.kept[i] is not None:
            return self.kept[i]
        assert i == self.next, "buckets are gathered in order"
        g = self.pending.wait()
        self.next += 1
        self.pending = KVGather(self.blocks[self.next], self.tsp) if self.next < len(self.blocks) else None
        if self.keep:
            self.kept[i] = g
        return g


def _bhld(t: Tensor) -> Tensor:
    return t.transpose(1, 2)  # [B, L, H, d] memory -> the kernels' [B, H, L, d] view


def attend(spec: _AttnSpec, q: Tensor, kv: GatheredKV, want_lse: bool = True):
    """Attention of local queries q [B, L, nq, d] over every bucket's gathered K/V. Returns o [B, L, nq, d] and
    lse [B, nq, L] (None when not wanted or the kernel keeps none)."""
    b, l, nq, hd = q.shape
    o = torch.empty_like(q)
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    lse = torch.empty(b, nq, l, dtype=lse_dtype, device=q.device) if want_lse else None
    for i, (kvs, qs) in enumerate(spec.buckets()):
        g = kv.bucket(i)
        n = kvs.stop - kvs.start
        _, lse_b = zigzag_attention(spec.kernel, _bhld(q[:, :, qs]), _bhld(g[:, :, :n]), _bhld(g[:, :, n:]), spec.tsp,
                                    out=_bhld(o[:, :, qs]), lse_out=None if lse is None else lse[:, qs],
                                    documents=spec.documents)
        if lse is not None and lse_b is None:
            lse = None  # the kernel keeps no log-sum-exp: its backward recomputes
        del g
    return o, lse


# ---- the broadcast schedule -----------------------------------------------------------------------------------


class OwnerSaved(NamedTuple):
    """What backward keeps of owner j's forward (local tokens only; gathered K/V are never saved)."""

    q: Tensor  # after norm and RoPE [B, L, nq, d]
    o: Tensor  # attention output [B, L, nq, d]
    lse: Tensor | None  # [B, nq, L]
    q_raw: Tensor | None  # before the q norm (qk_norm only)


class GroupSaved(NamedTuple):
    """What backward keeps of a KV group (projected once, by its first owner)."""

    k_raw: Tensor | None  # before the k norm (qk_norm only)
    blocks: tuple[Tensor, ...]  # per bucket, the local RoPE'd K and V [B, L, 2n, d]


def _flatten_saved(owners: list[OwnerSaved], groups: list[GroupSaved]) -> list[Tensor | None]:
    out: list[Tensor | None] = []
    for s in owners:
        out += list(s)
    for g in groups:
        out += [g.k_raw, *g.blocks]
    return out


def _unflatten_saved(flat, n_owners: int, n_groups: int, n_buckets: int):
    per_owner, per_group = len(OwnerSaved._fields), 1 + n_buckets
    owners = [OwnerSaved(*flat[i * per_owner : (i + 1) * per_owner]) for i in range(n_owners)]
    base = n_owners * per_owner
    groups = []
    for i in range(n_groups):
        chunk = flat[base + i * per_group : base + (i + 1) * per_group]
        groups.append(GroupSaved(chunk[0], tuple(chunk[1:])))
    return owners, groups


def schedule_shards(spec: _AttnSpec, shard: Tensor) -> Iterator[tuple[int, Tensor]]:
    """Per step J of the broadcast schedule, the packed shard of its head group (:attr:`_AttnSpec.step_layout`):
    owner J's shard, or with shard grouping the g owners' shards regrouped into one."""
    lay, g = spec.layout, spec.group
    if lay.zero_copy_grouping(g):  # the collectives write each owner's pieces where the grouped shard has them
        yield from gather_shard_groups(spec.tsp, shard, g, pieces=lay.group_pieces(g))
        return
    for jg, shards in gather_shard_groups(spec.tsp, shard, g):
        yield jg, lay.regroup(shards, g)


def broadcast_attention(spec: _AttnSpec, x: Tensor, cos: Tensor, sin: Tensor, shard: Tensor, norms: list[Tensor], *,
                        kv_sink=None, save: bool = True, steps: list[tuple[int, Tensor]] | None = None):
    """The broadcast schedule's forward: y [B, L, h] for local tokens x [B, L, h].

    ``shard``: this rank's packed head-group shard (:class:`HeadLayout`), in the compute dtype; ``cos``/``sin``
    broadcast against [B, L, n, d]. ``kv_sink(group, blocks)`` receives each KV group's local RoPE'd K/V blocks
    (prefill writes them into its cache). ``steps``: the schedule's (step, shard) pairs, already gathered
    (default: :func:`schedule_shards` of ``shard``). Returns (y, owners, groups): what backward needs when ``save``.
    """
    b, l, h = x.shape
    lay = spec.step_layout
    x2 = x.reshape(b * l, h)
    # every head group's o and Wo_j^T land in one [B*L, D*nq*d] / [D*nq*d, h] pair: one output-projection GEMM
    # at the end (full K, fp32 accumulation inside the GEMM) instead of D thin GEMMs into an accumulator. With one
    # step (every owner's shard at once) the GEMM reads that step's o and Wo^T where they are: nothing is copied
    one_step = spec.steps == 1
    o_all = None if one_step else x.new_empty(b * l, spec.steps * lay.q_rows)
    wo_all = None if one_step else x.new_empty(spec.steps * lay.q_rows, h)
    owners: list[OwnerSaved] = []
    groups: list[GroupSaved] = []
    kv: GatheredKV | None = None
    replaying = spec.stash is not None and spec.stash.replaying  # recompute: the kernels' outputs are known
    for j, buf in schedule_shards(spec, shard) if steps is None else steps:
        view = lay.view(buf)
        if one_step:
            wo_all = view.w_o
        else:
            wo_all[j * lay.q_rows : (j + 1) * lay.q_rows] = view.w_o  # a block of whole rows
        first = lay.starts_group(j)
        p = project_qkv(spec, view, x2, norms, b, l, with_kv=first)
        if first:
            blocks = kv_blocks(spec, p.k, p.v, cos, sin)
            if kv_sink is not None:
                kv_sink(lay.kv_group(j), blocks)
            if save:
                groups.append(GroupSaved(p.k_raw if spec.qk_norm else None, tuple(blocks)))
            if not replaying:  # in flight while q is rotated
                kv = GatheredKV(blocks, spec.tsp, keep=lay.kv_replicas > 1)
        q = apply_rope(p.q, cos, sin)  # [B, L, nq, d]
        if replaying:
            o, lse = spec.stash.replay()
        else:
            o, lse = attend(spec, q, kv, want_lse=save)
            if spec.stash is not None:
                spec.stash.record(o, lse)
        if lay.ends_group(j):
            kv = None  # the group's gathered K/V are not needed any more
        if one_step:
            o_all = o.reshape(b * l, lay.q_rows)
        else:
            o_all[:, j * lay.q_rows : (j + 1) * lay.q_rows] = o.view(b * l, lay.q_rows)
        if save:
            owners.append(OwnerSaved(q, o, lse, p.q_raw if spec.qk_norm else None))
    y = o_all @ wo_all
    return y.view(b, l, h), owners, groups


@fused_on_cuda(rows_heads)
def kv_grad_into(dk: Tensor, dv: Tensor, dkv: Tensor, cos: Tensor | None, sin: Tensor | None) -> None:
    """This rank's dK/dV ``dkv`` [B, L, 2n, d] (fp32, summed over the group: K heads, then V heads) into ``dk``,
    ``dv`` [B, L, n, d] (views of the projections' gradient, compute dtype): dK rounded to that dtype, then with
    ``cos``/``sin`` back through RoPE. On CUDA one compiled kernel instead of two strided converting copies,
    RoPE's pass and a strided copy."""
    n = dk.shape[2]
    if cos is None:
        dk.copy_(dkv[:, :, :n])
    else:
        apply_rope_backward(dkv[:, :, :n].to(dk.dtype), cos, sin, out=dk)
    dv.copy_(dkv[:, :, n:])


def _attention_grads(spec, kv: GatheredKV, s: OwnerSaved, do: Tensor, dg_acc: list[Tensor | None],
                     finish: bool, dk: Tensor | None, dv: Tensor, acc_dtype, rope: tuple[Tensor, Tensor] | None
                     ) -> Tensor:
    """Owner j's attention backward; returns dq [B, L, nq, d]. dK/dV over the gathered buffer accumulate in
    ``dg_acc`` (one fp32 buffer per bucket, shared by the owners of a KV group); with ``finish`` (the group's last
    owner) each bucket's sum is reduce-scattered to the token owners right away, into ``dk``/``dv`` [B, L, nkv, d]
    (dK through RoPE's backward when ``rope`` = (cos, sin) is given; without, as it is, for the k norm's backward)."""
    dq = torch.empty_like(s.q)
    for i, (kvs, qs) in enumerate(spec.buckets()):
        g = kv.bucket(i)
        n = kvs.stop - kvs.start
        earlier = dg_acc[i]  # the KV group's earlier owners' sum: this owner's dK/dV are added into it
        dg = torch.empty(g.shape, dtype=acc_dtype, device=g.device) if earlier is None else earlier
        zigzag_attention_backward(
            spec.kernel, _bhld(do[:, :, qs]), _bhld(s.q[:, :, qs]), _bhld(g[:, :, :n]), _bhld(g[:, :, n:]),
            _bhld(s.o[:, :, qs]), None if s.lse is None else s.lse[:, qs], spec.tsp,
            dq_out=_bhld(dq[:, :, qs]), documents=spec.documents, dkv_out=dg, accumulate=earlier is not None)
        del g
        dg_acc[i] = None
        if finish:
            dkv = scatter_kv_grad(dg, spec.tsp)  # fp32, summed over the group
            del dg
            kv_grad_into(dk[:, :, kvs], dv[:, :, kvs], dkv, *(rope or (None, None)))
        else:
            dg_acc[i] = dg
    return dq


def _rms_backward(spec, grad, raw, weight, d_weight, acc_dtype):
    """Through RoPE's output back to the pre-norm projection: d raw, accumulating the norm weight's gradient."""
    dt, t_hat = _head_rms_backward(grad * weight, raw, spec.eps)
    d_weight += (grad.to(acc_dtype) * t_hat.to(grad.dtype).to(acc_dtype)).sum((0, 1, 2))
    return dt


def broadcast_attention_backward(spec: _AttnSpec, dy: Tensor, x: Tensor, cos: Tensor, sin: Tensor, shard: Tensor | None,
                                 norms: list[Tensor], owners: list[OwnerSaved], groups: list[GroupSaved],
                                 steps: list[tuple[int, Tensor]] | None = None):
    """Backward of :func:`broadcast_attention`: (dx, d shard [layout numel], d norms), all in (at least) fp32.

    Shards are broadcast again; each KV group's K/V are re-gathered once (never saved); dK/dV, summed over the
    group's owners, are reduce-scattered to the token owners. Weight-gradient partials reach owner j with one
    reduce per owner; a replicated KV group's K/V partials are summed over the TSP group in one all-reduce at the
    end, so every replica of a KV head gets the same, complete gradient.
    """
    tsp, lay = spec.tsp, spec.step_layout
    b, l, h = x.shape
    x2, dy2 = x.reshape(b * l, h), dy.reshape(b * l, h).to(x.dtype)
    acc_dtype = torch.promote_types(x.dtype, torch.float32)
    dx = torch.empty(b * l, h, dtype=acc_dtype, device=x.device)  # the first step's GEMM writes it whole
    d_norms = [torch.zeros(lay.head_dim, dtype=acc_dtype, device=x.device) for _ in norms]
    own = spec.layout  # this rank's (owner) layout; ``lay`` is one step's (several owners' with shard grouping)
    replicated = own.kv_replicas > 1
    kv_grads = torch.zeros(tsp.size // own.kv_replicas, own.kv_numel, dtype=acc_dtype, device=x.device) \
        if replicated else None
    nq, nkv = lay.n_heads, lay.n_kv_heads
    zero_copy = own.zero_copy_grouping(spec.group)
    # each step's partial back to its owner(s), in their layout (piece by piece from the grouped layout)
    owner = GroupReduce(tsp, spec.group, pieces=own.group_pieces(spec.group) if zero_copy else None)
    kv: GatheredKV | None = None
    dg_acc: list[Tensor | None] = []
    for j, buf in schedule_shards(spec, shard) if steps is None else steps:
        view = lay.view(buf)
        s, grp = owners[j], groups[lay.kv_group(j)]
        if lay.starts_group(j):  # re-gathered, in flight during the o-projection gradients
            kv = GatheredKV(list(grp.blocks), tsp, keep=replicated)
            dg_acc = [None] * len(grp.blocks)
        partial = torch.empty(lay.numel, dtype=acc_dtype, device=x.device)
        grad = lay.view(partial)
        matmul_into(grad.w_o, s.o.view(b * l, lay.q_rows).T, dy2)  # d Wo_j^T
        do = (dy2 @ view.w_o.T).view(b, l, nq, lay.head_dim)
        dqkv = torch.empty(b, l, nq + 2 * nkv, lay.head_dim, dtype=x.dtype, device=x.device)
        with_kv = lay.ends_group(j)  # the group's dK/dV are complete after this owner's queries
        # without q/k norms RoPE's backward writes dq, dK straight into dqkv; with them they go on through the norms
        dk = torch.empty(b, l, nkv, lay.head_dim, dtype=x.dtype, device=x.device) if with_kv and spec.qk_norm \
            else dqkv[:, :, nq : nq + nkv]
        dq = _attention_grads(spec, kv, s, do, dg_acc, with_kv, dk, dqkv[:, :, nq + nkv :], acc_dtype,
                              rope=None if spec.qk_norm else (cos, sin))
        if spec.qk_norm:
            dq = _rms_backward(spec, apply_rope_backward(dq, cos, sin), s.q_raw, norms[0], d_norms[0], acc_dtype)
            dqkv[:, :, :nq] = dq
        else:
            apply_rope_backward(dq, cos, sin, out=dqkv[:, :, :nq])
        if with_kv:
            kv = None
            if spec.qk_norm:  # dk back through RoPE and the k norm (dv needed no more work)
                dk = _rms_backward(spec, apply_rope_backward(dk, cos, sin), grp.k_raw, norms[1], d_norms[1], acc_dtype)
                dqkv[:, :, nq : nq + nkv] = dk
        rows = lay.qkv_rows if with_kv else lay.q_rows
        dqkv2 = dqkv.view(b * l, lay.qkv_rows)[:, :rows]
        (matmul_into if j == 0 else add_matmul_)(dx, dqkv2, view.w_qkv[:rows])  # q (and k, v) input gradients
        matmul_into(grad.w_qkv[:rows], dqkv2.T, x2)  # d Wq_j (, d Wk_j, d Wv_j)
        if grad.b_qkv is not None:
            torch.sum(dqkv2, 0, dtype=acc_dtype, out=grad.b_qkv[:rows])
        if replicated:  # K/V partials go to the replica sum, not to owner j
            w, bias = lay.kv_view(partial)
            if with_kv:  # the step's KV heads (one, or several whole KV groups with shard grouping)
                m, hd = lay.n_kv_heads, lay.head_dim
                first = j * spec.group // own.kv_replicas
                for i in range(m):
                    heads = [w[i * hd : (i + 1) * hd], w[(m + i) * hd : (m + i + 1) * hd]]
                    if bias is not None:
                        heads += [bias[i * hd : (i + 1) * hd], bias[(m + i) * hd : (m + i + 1) * hd]]
                    torch.cat([t.reshape(-1) for t in heads], out=kv_grads[first + i])
            for t in (w, bias):
                if t is not None:
                    t.zero_()
        owner.submit(j, partial if zero_copy else own.ungroup(partial, spec.group))
    d_shard = owner.result()
    if replicated:  # one all-reduce: every replica of a KV head gets the same bits
        all_reduce_sum(kv_grads, tsp)
        pieces = [t for t in own.kv_view(d_shard) if t is not None]
        for t, g in zip(pieces, unpack(kv_grads[own.kv_group(tsp.rank)], [t.shape for t in pieces])):
            t.copy_(g)
    d_norms = [all_reduce_sum(g, tsp) for g in d_norms]
    return dx.view(b, l, h), d_shard, d_norms


class BroadcastAttention(torch.autograd.Function):
    """Autograd wrapper of the broadcast schedule. ``params``: the sharded tensors in :meth:`HeadLayout.shapes`
    order, then the replicated q/k norm weights."""

    @staticmethod
    def forward(ctx, x_in, cos, sin, spec: _AttnSpec, dtype: torch.dtype, *params):
        # x_in in the residual stream's dtype (the norm's output), cast to the compute dtype here, so its gradient
        # goes back in that dtype straight from the fp32 accumulator (no round trip through the compute dtype)
        x = x_in.to(dtype)
        ctx.in_dtype = x_in.dtype
        n_sharded = len(spec.layout.shapes())
        sharded, norms = params[:n_sharded], [w.to(x.dtype) for w in params[n_sharded:]]
        shard = spec.layout.pack(list(sharded), x.dtype)  # one message per owner, in the compute dtype
        # a checkpointed layer's re-run: its backward follows at once and needs the same weights. With one step
        # (every owner's shard gathered at once) it gets the gathered shards themselves (no second all-gather),
        # otherwise this rank's packed shard (not cast again)
        steps = list(schedule_shards(spec, shard)) if spec.rerun and spec.steps == 1 else None
        y, owners, groups = broadcast_attention(spec, x, cos, sin, shard, norms, steps=steps)
        ctx.steps = steps
        ctx.shard = shard if spec.rerun and steps is None else None
        del shard, steps
        ctx.spec, ctx.n_sharded, ctx.counts = spec, n_sharded, (len(owners), len(groups))
        ctx.save_for_backward(x, cos, sin, *params, *_flatten_saved(owners, groups))
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, n_sharded = ctx.spec, ctx.n_sharded
        x, cos, sin, *rest = ctx.saved_tensors
        n_params = n_sharded + (2 if spec.qk_norm else 0)
        params, flat = rest[:n_params], rest[n_params:]
        sharded, norm_params = params[:n_sharded], params[n_sharded:]
        owners, groups = _unflatten_saved(flat, *ctx.counts, len(spec.buckets()))
        norms = [w.to(x.dtype) for w in norm_params]
        shard, steps = ctx.shard, ctx.steps  # the re-run's handover (freed with this backward)
        ctx.shard = ctx.steps = None
        if shard is None and steps is None:
            shard = spec.layout.pack(list(sharded), x.dtype)
        dx, d_shard, d_norms = broadcast_attention_backward(spec, dy, x, cos, sin, shard, norms, owners, groups,
                                                            steps=steps)
        del shard, steps
        d_sharded = spec.layout.unpack_grads(d_shard, list(sharded))
        d_norm_params = [g.to(w.dtype) for g, w in zip(d_norms, norm_params)]
        return (dx.to(ctx.in_dtype), None, None, None, None, *d_sharded, *d_norm_params)


class AttentionStash:
    """The attention kernels' outputs (o, lse per head group) of a checkpointed layer's forward, handed to its
    recomputation, which then skips the K/V all-gathers and the attention kernels (``checkpointing="offload"``
    keeps them in host memory with the layer input). Exact: the recomputation uses the forward's own outputs."""

    def __init__(self):
        self.items: list[tuple[Tensor, Tensor | None]] = []
        self.replaying = False

    def record(self, o: Tensor, lse: Tensor | None) -> None:
        self.items.append((o, lse))

    def replay(self) -> tuple[Tensor, Tensor | None]:
        return self.items.pop(0)


def check_shard_group(shard_group: int | str, layout: HeadLayout, tsp_size: int) -> int | str:
    """``shard_group`` as given when it can run at this D; a :class:`TSPConfigError` naming the choices otherwise."""
    if shard_group == "auto":
        return shard_group
    valid = valid_shard_groups(tsp_size, layout.kv_replicas)
    bad = isinstance(shard_group, bool) or not isinstance(shard_group, int) or shard_group < 1
    if bad or (tsp_size > 1 and shard_group not in valid):  # (an unsharded model keeps it for its sharded copy)
        raise TSPConfigError(f"shard_group={shard_group!r} at tsp_size={tsp_size}: give 'auto' or one of {valid} "
                             f"(a divisor of the TSP group size that nests with the {layout.kv_replicas} owner(s) per "
                             "KV head)")
    return shard_group


def kv_replicas(n_kv_heads: int, tsp_size: int) -> int:
    """Owners per KV head: 1 when the KV heads split over the ranks, D / n_kv when each is replicated."""
    if n_kv_heads % tsp_size == 0:
        return 1
    if tsp_size % n_kv_heads == 0:
        return tsp_size // n_kv_heads
    raise TSPConfigError(f"n_kv_heads={n_kv_heads} and tsp_size={tsp_size}: D must divide n_kv or be a multiple of it")


class TSPAttention(nn.Module):
    """Causal self-attention (MHA or GQA) whose q/k/v/o weights are sharded by head group over the TSP group.

    Parameter names and layouts follow Hugging Face Llama (``q_proj.weight`` [n_heads*d, h], ...); this rank holds
    rows [rank*n/D, (rank+1)*n/D) of q/k/v (heads) and the matching columns of ``o_proj``. With fewer KV heads than
    ranks (D a multiple of n_kv) each KV head is replicated on D / n_kv consecutive ranks (``tsp_replicas``): their
    copies get the same gradient, summed over every rank's tokens and query heads. Optional: q/k/v biases (Qwen2;
    sharded with their heads) and per-head q/k RMSNorms before RoPE (Qwen3; ``q_norm.weight`` and
    ``k_norm.weight`` [d], replicated, gradients summed over the group).

    Training, prefill (:func:`broadcast_attention` with a ``kv_sink``) and decoding (the owner's own shard, see
    ``lightning_tsp.inference.decode``) all project through :func:`project_qkv` and :func:`kv_blocks`.

    ``shard_group``: owners whose shards one step of the broadcast schedule runs at once in training (an int
    dividing D, or ``"auto"``: chosen per forward from the sequence length, see
    :func:`lightning_tsp.planning.grouping.choose_shard_group`). Exact for any choice; prefill steps one owner.
    """

    tsp_shard_dims = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1,
                      "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0}

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, tsp: TSPGroup, kernel: str = "auto",
                 head_dim: int | None = None, bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6,
                 kv_bucket_heads: int | None = None, shard_group: int | str = "auto", device=None, dtype=None):
        super().__init__()
        d = tsp.size
        self.tsp, self.kernel_name, self.bias, self.qk_norm, self.norm_eps = tsp, kernel, bias, qk_norm, norm_eps
        if kv_bucket_heads is not None and kv_bucket_heads < 1:
            raise TSPConfigError(f"kv_bucket_heads={kv_bucket_heads}: give a positive number of KV heads or None")
        self.kv_bucket_heads = kv_bucket_heads
        self.stash: AttentionStash | None = None  # set by checkpointing="offload" around a forward / recompute
        self.rerun = False  # set while a checkpointed layer is re-run in backward (offload.rerunning)
        self.head_dim = head_dim or hidden_size // n_heads
        replicas = kv_replicas(n_kv_heads, d)
        self.layout = HeadLayout(hidden_size, n_heads // d, n_kv_heads * replicas // d, self.head_dim, bias, replicas)
        self.shard_group = check_shard_group(shard_group, self.layout, d)
        self.n_heads, self.n_kv_heads = self.layout.n_heads, self.layout.n_kv_heads  # local
        # parameters holding one replica of a KV head: their full (Hugging Face) tensor has 1/replicas of the rows
        self.tsp_replicas = {n: replicas for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")}
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, self.n_heads * self.head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden_size, bias=False, **kw)
        if qk_norm:
            self.q_norm = _HeadNorm(self.head_dim, **kw)
            self.k_norm = _HeadNorm(self.head_dim, **kw)

    def shard_params(self) -> list[Tensor]:
        """This rank's sharded tensors in :meth:`HeadLayout.shapes` order (local shards of DTensors)."""
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        params = [local_tensor(m.weight) for m in projections]
        if self.bias:
            params += [local_tensor(m.bias) for m in projections[:3]]
        return params

    def norm_params(self) -> list[Tensor]:
        return [local_tensor(self.q_norm.weight), local_tensor(self.k_norm.weight)] if self.qk_norm else []

    def spec(self, device: torch.device, dtype: torch.dtype, documents: Documents | None = None,
             group: int = 1) -> _AttnSpec:
        kernel = select_attention_kernel(device, self.kernel_name, dtype, documents=documents is not None)
        return _AttnSpec(self.tsp, self.layout, kernel, self.qk_norm, self.norm_eps, self.kv_bucket_heads, self.stash,
                         documents, group, rerun=self.rerun and torch.is_grad_enabled())

    def step_group(self, batch: int, local_len: int, dtype: torch.dtype) -> int:
        """The shard group the broadcast schedule runs with for a [batch, local_len] block of local tokens."""
        if self.tsp.size == 1:
            return 1
        if self.shard_group != "auto":
            return self.shard_group
        lay = self.layout
        return choose_shard_group(self.tsp.size, local_len * self.tsp.size, batch, lay.n_kv_heads, lay.head_dim,
                                  lay.kv_replicas, torch.finfo(dtype).bits // 8)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, documents: Documents | None = None) -> Tensor:
        """x [B, S/D, h] (this rank's zigzag tokens), cos/sin [S/D, d] or [B, S/D, d] of their positions (global,
        or inside their documents); ``documents``: packed documents (attention stays inside each document)."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        spec = self.spec(x.device, dtype, documents, self.step_group(x.shape[0], x.shape[1], dtype))
        params = self.shard_params() + self.norm_params()
        with torch.autocast(x.device.type, enabled=False):
            cos, sin = cos.to(dtype).unsqueeze(-2), sin.to(dtype).unsqueeze(-2)  # broadcast over the heads
            return BroadcastAttention.apply(x, cos, sin, spec, dtype, *params)


class _HeadNorm(nn.Module):
    """Holds a replicated per-head RMSNorm weight (applied inside :class:`BroadcastAttention`)."""

    def __init__(self, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
