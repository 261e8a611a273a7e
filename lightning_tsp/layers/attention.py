"""TSP attention: the broadcast schedule (DESIGN.md sections 1 and 2).

For each owner j (same order on every rank) the packed shard [Wq_j; Wk_j; Wv_j; Wo_j] is broadcast; every rank
projects its local tokens, rotates q/k with their global positions, all-gathers k/v over the sequence (KV-head
width only), runs its two zigzag chunks against their causal K/V prefixes and accumulates y += o_j Wo_j^T.
No all-reduce. Backward re-broadcasts the shards, re-gathers K/V (never saved), reduce-scatters dK/dV to the
token owners and reduces the weight-gradient partials onto owner j in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.attention import AttentionKernel, select_attention_kernel
from lightning_tsp.layers.rope import apply_rope, apply_rope_backward
from lightning_tsp.schedules.broadcast import broadcast_shards, reduce_to_owner
from lightning_tsp.kernels.gemm import add_matmul_, matmul_into
from lightning_tsp.schedules.comm import (
    all_gather,
    all_reduce_sum,
    local_tensor,
    pack,
    reduce_scatter,
    unpack,
)


@dataclass(frozen=True)
class _AttnSpec:
    tsp: TSPGroup
    n_heads: int  # local query heads
    n_kv_heads: int  # local KV heads
    head_dim: int
    kernel: AttentionKernel
    bias: bool = False  # q/k/v biases (Qwen2), sharded with their heads
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3), replicated weights [head_dim]
    eps: float = 1e-6
    kv_bucket: int | None = None  # local KV heads gathered at once (head bucketing); None: all of them
    stash: AttentionStash | None = None  # attention outputs recorded by a forward / replayed by its recompute

    def buckets(self) -> list[tuple[slice, slice]]:
        """(KV-head slice, query-head slice) per bucket of the local head group."""
        n = self.kv_bucket or self.n_kv_heads
        g = self.n_heads // self.n_kv_heads
        return [(slice(a, min(a + n, self.n_kv_heads)), slice(a * g, min(a + n, self.n_kv_heads) * g))
                for a in range(0, self.n_kv_heads, n)]


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
                     out: Tensor | None = None, lse_out: Tensor | None = None):
    """Local queries q [B, Hq, L, d] against gathered k, v [B, Hkv, S, d] (gather order): one kernel call per
    local chunk. Writes o into ``out`` (default: like q) and the log-sum-exp into ``lse_out`` [B, Hq, L]
    (default: new) when the kernel returns one; returns (o, lse or None)."""
    o = torch.empty_like(q) if out is None else out
    lse, got_lse = lse_out, False
    for rows, own, pre in zigzag_calls(q.shape[2], tsp):
        o_c, lse_c = kernel.forward(q[:, :, rows], k[:, :, own], v[:, :, own],
                                    None if pre is None else k[:, :, pre], None if pre is None else v[:, :, pre])
        o[:, :, rows] = o_c
        if lse_c is not None:
            if lse is None:
                lse = torch.empty(q.shape[:3], dtype=lse_c.dtype, device=q.device)
            lse[:, :, rows] = lse_c
            got_lse = True
    return o, lse if got_lse else None


def zigzag_attention_backward(kernel: AttentionKernel, do, q, k, v, o, lse, tsp: TSPGroup,
                              dq_out: Tensor | None = None, dk_out: Tensor | None = None,
                              dv_out: Tensor | None = None):
    """Gradients of :func:`zigzag_attention`: dq like q, dK/dV [B, Hkv, S, d] in gather order summed over this
    rank's calls, in (at least) fp32. The first call writes its key rows, the second adds into them (its keys lie
    inside the first's, see :func:`zigzag_calls`); the rows before the first call's keys, which no call reads,
    get zeros."""
    dq = torch.empty_like(q) if dq_out is None else dq_out
    acc = torch.promote_types(k.dtype, torch.float32)
    dk = torch.empty(k.shape, dtype=acc, device=k.device) if dk_out is None else dk_out
    dv = torch.empty(v.shape, dtype=acc, device=v.device) if dv_out is None else dv_out
    calls = zigzag_calls(q.shape[2], tsp)
    for i, (rows, own, pre) in enumerate(calls):
        k_pre, v_pre = (None, None) if pre is None else (k[:, :, pre], v[:, :, pre])
        lse_c = None if lse is None else lse[:, :, rows]
        dq_c, dk_own, dv_own, dk_pre, dv_pre = kernel.backward(
            do[:, :, rows], q[:, :, rows], k[:, :, own], v[:, :, own], k_pre, v_pre, o[:, :, rows], lse_c)
        dq[:, :, rows] = dq_c
        for key_rows, gk, gv in ((own, dk_own, dv_own), (pre, dk_pre, dv_pre)):
            if key_rows is None:
                continue
            if i == 0:
                dk[:, :, key_rows] = gk
                dv[:, :, key_rows] = gv
            else:
                dk[:, :, key_rows] += gk
                dv[:, :, key_rows] += gv
    unread = slice(0, calls[0][1].start)
    dk[:, :, unread] = 0
    dv[:, :, unread] = 0
    return dq, dk, dv


# ---- autograd function ----------------------------------------------------------------------------------------


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


def _bhld(t: Tensor) -> Tensor:
    return t.transpose(1, 2)  # [B, L, H, d] memory -> the kernels' [B, H, L, d] view


def project_qkv(spec: _AttnSpec, x2: Tensor, buf: Tensor, shapes, norms, b: int, l: int):
    """One GEMM for q, k, v of head group j (their rows are consecutive in the packed shard ``buf``).
    Returns (q_raw, k_raw, q_in, k_in, v) as [B, L, n, d] views; *_in are after the optional per-head norms."""
    nq, nkv, hd = spec.n_heads, spec.n_kv_heads, spec.head_dim
    rows = (nq + 2 * nkv) * hd
    w_qkv = buf[: rows * x2.shape[1]].view(rows, x2.shape[1])
    if spec.bias:
        off = sum(math.prod(s) for s in shapes[:4])
        qkv = torch.addmm(buf[off : off + rows], x2, w_qkv.T)
    else:
        qkv = x2 @ w_qkv.T
    qkv = qkv.view(b, l, nq + 2 * nkv, hd)
    q_raw, k_raw, v = qkv[:, :, :nq], qkv[:, :, nq : nq + nkv], qkv[:, :, nq + nkv :]
    if not spec.qk_norm:
        return q_raw, k_raw, q_raw, k_raw, v
    q_in = norms[0] * _head_rms(q_raw, spec.eps)[0].to(x2.dtype)
    k_in = norms[1] * _head_rms(k_raw, spec.eps)[0].to(x2.dtype)
    return q_raw, k_raw, q_in, k_in, v


def kv_blocks(spec: _AttnSpec, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> list[Tensor]:
    """Per head bucket, the block [B, L, 2n, d] that travels: RoPE'd K heads, then V heads."""
    out = []
    for kvs, _ in spec.buckets():
        n = kvs.stop - kvs.start
        blk = k.new_empty(k.shape[0], k.shape[1], 2 * n, k.shape[3])
        blk[:, :, :n] = apply_rope(k[:, :, kvs], cos, sin)
        blk[:, :, n:] = v[:, :, kvs]
        out.append(blk)
    return out


def attend(spec: _AttnSpec, q: Tensor, blocks: list[Tensor], first: KVGather, want_lse: bool = True):
    """Attention of local queries q [B, L, nq, d] over every bucket's gathered K/V (``first`` already in flight;
    the next bucket's exchange overlaps this bucket's kernels). Returns o [B, L, nq, d] and lse [B, nq, L]."""
    b, l, nq, hd = q.shape
    o = torch.empty_like(q)
    lse_dtype = torch.promote_types(q.dtype, torch.float32)
    lse = torch.empty(b, nq, l, dtype=lse_dtype, device=q.device) if want_lse else None
    kv = first
    for i, (kvs, qs) in enumerate(spec.buckets()):
        g = kv.wait()
        if i + 1 < len(blocks):
            kv = KVGather(blocks[i + 1], spec.tsp)
        n = kvs.stop - kvs.start
        _, lse_b = zigzag_attention(spec.kernel, _bhld(q[:, :, qs]), _bhld(g[:, :, :n]), _bhld(g[:, :, n:]), spec.tsp,
                                    out=_bhld(o[:, :, qs]), lse_out=None if lse is None else lse[:, qs])
        if lse is not None and lse_b is None:
            lse = None  # the kernel keeps no log-sum-exp: its backward recomputes
        del g
    return o, lse


class BroadcastAttention(torch.autograd.Function):
    """``params``: the sharded shards (wq, wk, wv, wo[, bq, bk, bv]) then the replicated q/k norm weights."""

    @staticmethod
    def forward(ctx, x, cos, sin, spec: _AttnSpec, *params):
        b, l, h = x.shape
        tsp, nq, hd = spec.tsp, spec.n_heads, spec.head_dim
        n_sharded = 7 if spec.bias else 4
        sharded, norms = params[:n_sharded], params[n_sharded:]
        x2 = x.reshape(b * l, h)
        shapes = [p.shape for p in sharded]
        norms = [w.to(x.dtype) for w in norms]
        cos4, sin4 = cos[:, None], sin[:, None]  # [L, 1, d]: broadcast over the heads of [B, L, H, d]
        # every head group's o and Wo_j land in one [B*L, D*nq*d] / [h, D*nq*d] pair: one output-projection GEMM
        # at the end (full K, fp32 accumulation inside the GEMM) instead of D thin GEMMs into an accumulator
        o_all = x.new_empty(b * l, tsp.size * nq * hd)
        wo_all = x.new_empty(h, tsp.size * nq * hd)
        saved = []
        # one message per owner: weights travel in the compute dtype
        for j, buf in broadcast_shards(tsp, pack(list(sharded), x.dtype)):
            cols = slice(j * nq * hd, (j + 1) * nq * hd)
            wo_all[:, cols] = unpack(buf, shapes)[3]
            q_raw, k_raw, q_in, k_in, v = project_qkv(spec, x2, buf, shapes, norms, b, l)
            blocks = kv_blocks(spec, k_in, v, cos4, sin4)
            if spec.stash is not None and spec.stash.replaying:  # recompute: the kernels' outputs are known
                q = apply_rope(q_in, cos4, sin4)
                o, lse = spec.stash.replay()
            else:
                first = KVGather(blocks[0], tsp)  # in flight while q is rotated
                q = apply_rope(q_in, cos4, sin4)  # [B, L, nq, d]
                o, lse = attend(spec, q, blocks, first)
                if spec.stash is not None:
                    spec.stash.record(o, lse)
            o_all[:, cols] = o.view(b * l, nq * hd)
            saved += [q, o, lse, *blocks] + ([q_raw, k_raw] if spec.qk_norm else [])
        y = o_all @ wo_all.T
        del o_all, wo_all
        ctx.spec, ctx.shapes, ctx.n_sharded = spec, shapes, n_sharded
        ctx.save_for_backward(x, cos, sin, *params, *saved)
        return y.view(b, l, h)

    @staticmethod
    def backward(ctx, dy):
        spec, shapes, n_sharded = ctx.spec, ctx.shapes, ctx.n_sharded
        tsp, nq, nkv, hd = spec.tsp, spec.n_heads, spec.n_kv_heads, spec.head_dim
        x, cos, sin, *rest = ctx.saved_tensors
        n_params = n_sharded + (2 if spec.qk_norm else 0)
        params, saved = rest[:n_params], rest[n_params:]
        sharded, norms = params[:n_sharded], [w.to(x.dtype) for w in params[n_sharded:]]
        buckets = spec.buckets()
        per_shard = 3 + len(buckets) + (2 if spec.qk_norm else 0)
        b, l, h = x.shape
        cos4, sin4 = cos[:, None], sin[:, None]
        x2, dy2 = x.reshape(b * l, h), dy.reshape(b * l, h).to(x.dtype)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        dx = torch.zeros(b * l, h, dtype=acc_dtype, device=x.device)
        d_norms = [torch.zeros(hd, dtype=acc_dtype, device=x.device) for _ in norms]
        n_qkv = (nq + 2 * nkv) * hd
        offsets = [0]
        for s in shapes:
            offsets.append(offsets[-1] + math.prod(s))
        owner = reduce_to_owner(tsp)
        for j, buf in broadcast_shards(tsp, pack(list(sharded), x.dtype)):
            w_o = unpack(buf, shapes)[3]
            w_qkv = buf[: n_qkv * h].view(n_qkv, h)
            q, o, lse, *blocks = saved[per_shard * j : per_shard * (j + 1)]
            blocks, raw = blocks[: len(buckets)], blocks[len(buckets) :]
            kv = KVGather(blocks[0], tsp)  # re-gathered (never saved), in flight during the o-projection grads
            partial = torch.empty(offsets[-1], dtype=acc_dtype, device=x.device)
            o2 = o.view(b * l, nq * hd)
            matmul_into(partial[offsets[3] : offsets[4]].view(h, nq * hd), dy2.T, o2)  # d Wo_j
            do = (dy2 @ w_o).view(b, l, nq, hd)
            dq = torch.empty_like(q)
            dk = torch.empty(b, l, nkv, hd, dtype=x.dtype, device=x.device)
            dqkv = torch.empty(b, l, nq + 2 * nkv, hd, dtype=x.dtype, device=x.device)
            for i, (kvs, qs) in enumerate(buckets):
                g = kv.wait()
                if i + 1 < len(buckets):
                    kv = KVGather(blocks[i + 1], tsp)
                n = kvs.stop - kvs.start
                dg = torch.empty(g.shape, dtype=acc_dtype, device=x.device)
                zigzag_attention_backward(
                    spec.kernel, _bhld(do[:, :, qs]), _bhld(q[:, :, qs]), _bhld(g[:, :, :n]), _bhld(g[:, :, n:]),
                    _bhld(o[:, :, qs]), None if lse is None else lse[:, qs], tsp,
                    dq_out=_bhld(dq[:, :, qs]), dk_out=_bhld(dg[:, :, :n]), dv_out=_bhld(dg[:, :, n:]))
                del g
                dkv = scatter_kv_grad(dg, tsp)  # to the token owners, fp32
                del dg
                dk[:, :, kvs] = dkv[:, :, :n]
                dqkv[:, :, nq + nkv + kvs.start : nq + nkv + kvs.stop] = dkv[:, :, n:]  # dv needs no more work
            dq = apply_rope_backward(dq, cos4, sin4)
            dk = apply_rope_backward(dk, cos4, sin4)
            if spec.qk_norm:
                grads = []
                for i, (g, t_raw) in enumerate(zip((dq, dk), raw)):
                    dt, t_hat = _head_rms_backward(g * norms[i], t_raw, spec.eps)
                    d_norms[i] += (g.to(acc_dtype) * t_hat.to(x.dtype).to(acc_dtype)).sum((0, 1, 2))
                    grads.append(dt)
                dq, dk = grads
            dqkv[:, :, :nq] = dq
            dqkv[:, :, nq : nq + nkv] = dk
            dqkv2 = dqkv.view(b * l, n_qkv)
            add_matmul_(dx, dqkv2, w_qkv)  # one GEMM for the q, k and v input gradients
            matmul_into(partial[:n_qkv * h].view(n_qkv, h), dqkv2.T, x2)  # d Wq_j, d Wk_j, d Wv_j
            if spec.bias:
                torch.sum(dqkv2, 0, dtype=acc_dtype, out=partial[offsets[4] : offsets[4] + n_qkv])
            owner.submit(j, partial)
        grads = unpack(owner.result(), shapes)
        d_sharded = [g.to(w.dtype) for g, w in zip(grads, sharded)]
        d_norm_params = [all_reduce_sum(g, tsp).to(w.dtype) for g, w in zip(d_norms, params[n_sharded:])]
        return (dx.view(b, l, h).to(x.dtype), None, None, None, *d_sharded, *d_norm_params)


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


class TSPAttention(nn.Module):
    """Causal self-attention (MHA or GQA) whose q/k/v/o weights are sharded by head group over the TSP group.

    Parameter names and layouts follow Hugging Face Llama (``q_proj.weight`` [n_heads*d, h], ...); this rank holds
    rows [rank*n/D, (rank+1)*n/D) of q/k/v (heads) and the matching columns of ``o_proj``. Optional: q/k/v biases
    (Qwen2; sharded with their heads) and per-head q/k RMSNorms before RoPE (Qwen3; ``q_norm.weight`` and
    ``k_norm.weight`` [d], replicated, gradients summed over the group).
    """

    tsp_shard_dims = {"q_proj.weight": 0, "k_proj.weight": 0, "v_proj.weight": 0, "o_proj.weight": 1,
                      "q_proj.bias": 0, "k_proj.bias": 0, "v_proj.bias": 0}

    def __init__(self, hidden_size: int, n_heads: int, n_kv_heads: int, tsp: TSPGroup, kernel: str = "auto",
                 head_dim: int | None = None, bias: bool = False, qk_norm: bool = False, norm_eps: float = 1e-6,
                 kv_bucket_heads: int | None = None, device=None, dtype=None):
        super().__init__()
        d = tsp.size
        self.tsp, self.kernel_name, self.bias, self.qk_norm, self.norm_eps = tsp, kernel, bias, qk_norm, norm_eps
        if kv_bucket_heads is not None and kv_bucket_heads < 1:
            raise TSPConfigError(f"kv_bucket_heads={kv_bucket_heads}: give a positive number of KV heads or None")
        self.kv_bucket_heads = kv_bucket_heads
        self.stash: AttentionStash | None = None  # set by checkpointing="offload" around a forward / recompute
        self.head_dim = head_dim or hidden_size // n_heads
        self.n_heads, self.n_kv_heads = n_heads // d, n_kv_heads // d  # local
        kw = dict(device=device, dtype=dtype)
        self.q_proj = nn.Linear(hidden_size, self.n_heads * self.head_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(hidden_size, self.n_kv_heads * self.head_dim, bias=bias, **kw)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, hidden_size, bias=False, **kw)
        if qk_norm:
            self.q_norm = _HeadNorm(self.head_dim, **kw)
            self.k_norm = _HeadNorm(self.head_dim, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x [B, S/D, h] (this rank's zigzag tokens), cos/sin [S/D, d] of their global positions."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        kernel = select_attention_kernel(x.device, self.kernel_name, dtype)
        spec = _AttnSpec(self.tsp, self.n_heads, self.n_kv_heads, self.head_dim, kernel, self.bias, self.qk_norm,
                         self.norm_eps, self.kv_bucket_heads, self.stash)
        projections = (self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        params = [local_tensor(m.weight) for m in projections]
        if self.bias:
            params += [local_tensor(m.bias) for m in projections[:3]]
        if self.qk_norm:
            params += [local_tensor(self.q_norm.weight), local_tensor(self.k_norm.weight)]
        with torch.autocast(x.device.type, enabled=False):
            return BroadcastAttention.apply(x.to(dtype), cos.to(dtype), sin.to(dtype), spec, *params)


class _HeadNorm(nn.Module):
    """Holds a replicated per-head RMSNorm weight (applied inside :class:`BroadcastAttention`)."""

    def __init__(self, head_dim: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim, device=device, dtype=dtype))
