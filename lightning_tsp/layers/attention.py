"""TSP attention: the broadcast schedule (DESIGN.md sections 1 and 2).

For each owner j (same order on every rank) the packed shard [Wq_j; Wk_j; Wv_j; Wo_j] is broadcast; every rank
projects its local tokens, rotates q/k with their global positions, all-gathers k/v over the sequence (KV-head
width only), runs its two zigzag chunks against their causal K/V prefixes and accumulates y += o_j Wo_j^T.
No all-reduce. Backward re-broadcasts the shards, re-gathers K/V (never saved), reduce-scatters dK/dV to the
token owners and reduces the weight-gradient partials onto owner j in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.attention import AttentionKernel, select_attention_kernel
from lightning_tsp.layers.rope import apply_rope, apply_rope_backward
from lightning_tsp.schedules.broadcast import broadcast_shards, reduce_to_owner
from lightning_tsp.schedules.comm import (
    add_matmul_,
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

    def buckets(self) -> list[tuple[slice, slice]]:
        """(KV-head slice, query-head slice) per bucket of the local head group."""
        n = self.kv_bucket or self.n_kv_heads
        g = self.n_heads // self.n_kv_heads
        return [(slice(a, min(a + n, self.n_kv_heads)), slice(a * g, min(a + n, self.n_kv_heads) * g))
                for a in range(0, self.n_kv_heads, n)]


# ---- K/V exchange over the sequence (zigzag <-> natural order) -------------------------------------------


class KVGather:
    """All-gather of local k, v [B, Hkv, 2c, d] (zigzag chunks p, 2D-1-p) over the sequence, in flight until
    :meth:`wait` returns the full-sequence k, v [B, Hkv, S, d] in natural order. Starting it before other local
    work (the q projection, the output-projection gradient) overlaps the exchange with that work."""

    def __init__(self, k: Tensor, v: Tensor, tsp: TSPGroup):
        self.k, self.v, self.tsp = k, v, tsp
        if tsp.size > 1:
            send = torch.stack([k, v])  # [2, B, Hkv, 2c, d]
            self.out = torch.empty(tsp.size * send.numel(), dtype=send.dtype, device=send.device)
            self.work = all_gather(self.out, send.view(-1), tsp, async_op=True)

    def wait(self) -> tuple[Tensor, Tensor]:
        d = self.tsp.size
        if d == 1:
            return self.k, self.v
        self.work.wait()
        b, h, l, hd = self.k.shape
        out = self.out.view(d, 2, b, h, 2, l // 2, hd)
        # first chunks arrive as 0..D-1, second chunks as 2D-1..D: reverse those
        natural = torch.cat([out[:, :, :, :, 0], out[:, :, :, :, 1].flip(0)], dim=0)  # [2D, 2, B, Hkv, c, d]
        natural = natural.permute(1, 2, 3, 0, 4, 5).reshape(2, b, h, d * l, hd)
        return natural[0], natural[1]


def gather_kv(k: Tensor, v: Tensor, tsp: TSPGroup) -> tuple[Tensor, Tensor]:
    """Local k, v [B, Hkv, 2c, d] -> full-sequence k, v [B, Hkv, S, d], natural order (blocking)."""
    return KVGather(k, v, tsp).wait()


def scatter_kv_grad(dk: Tensor, dv: Tensor, tsp: TSPGroup) -> tuple[Tensor, Tensor]:
    """Full-sequence dK, dV [B, Hkv, S, d] (natural order, fp32) -> summed over the group, this rank's tokens."""
    d = tsp.size
    if d == 1:
        return dk, dv
    b, h, s, hd = dk.shape
    c = s // (2 * d)
    g = torch.stack([dk, dv]).view(2, b, h, 2 * d, c, hd)
    per_rank = torch.stack([g[:, :, :, :d], g[:, :, :, d:].flip(3)], dim=4)  # [2, B, Hkv, D, 2, c, d]
    send = per_rank.permute(3, 0, 1, 2, 4, 5, 6).contiguous()  # [D, 2, B, Hkv, 2, c, d]
    out = torch.empty(send[0].numel(), dtype=send.dtype, device=send.device)
    reduce_scatter(out, send.view(-1), tsp)
    out = out.view(2, b, h, 2 * c, hd)
    return out[0], out[1]


# ---- the zigzag attention calls -------------------------------------------------------------------------


def _chunk_calls(s: int, tsp: TSPGroup):
    """(query slice, key-prefix length) for this rank's two chunks; one call when D == 1."""
    if tsp.size == 1:
        return [(slice(0, s), s)]
    c = s // (2 * tsp.size)
    p = tsp.rank
    return [(slice(0, c), (p + 1) * c), (slice(c, 2 * c), (2 * tsp.size - p) * c)]


def zigzag_attention(kernel: AttentionKernel, q: Tensor, k: Tensor, v: Tensor, tsp: TSPGroup):
    """Local queries q [B, Hq, 2c, d] against full K/V [B, Hkv, S, d]: one call per local chunk."""
    outs, lses = [], []
    for qs, kv_len in _chunk_calls(k.shape[2], tsp):
        o, lse = kernel.forward(q[:, :, qs], k[:, :, :kv_len], v[:, :, :kv_len])
        outs.append(o)
        lses.append(lse)
    lse = None if lses[0] is None else torch.cat(lses, dim=2)
    return torch.cat(outs, dim=2), lse


def zigzag_attention_backward(kernel, do, q, k, v, o, lse, tsp: TSPGroup):
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32 if k.dtype != torch.float64 else k.dtype, device=k.device)
    dv = torch.zeros_like(dk)
    for qs, kv_len in _chunk_calls(k.shape[2], tsp):
        lse_c = None if lse is None else lse[:, :, qs]
        dq_c, dk_c, dv_c = kernel.backward(
            do[:, :, qs], q[:, :, qs], k[:, :, :kv_len], v[:, :, :kv_len], o[:, :, qs], lse_c
        )
        dq[:, :, qs] = dq_c
        dk[:, :, :kv_len] += dk_c
        dv[:, :, :kv_len] += dv_c
    return dq, dk, dv


# ---- autograd function ----------------------------------------------------------------------------------


def _heads(t2d: Tensor, b: int, l: int, n: int, d: int) -> Tensor:
    return t2d.view(b, l, n, d).transpose(1, 2)  # [B*L, n*d] -> [B, n, L, d]


def _flat(t: Tensor) -> Tensor:
    b, n, l, d = t.shape
    return t.transpose(1, 2).reshape(b * l, n * d)  # [B, n, L, d] -> [B*L, n*d]


def _head_rms(t: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Per-head RMS normalisation in (at least) fp32: (normalised t, 1/rms) for t [B, H, L, d]."""
    tf = t.to(torch.promote_types(t.dtype, torch.float32))
    r = torch.rsqrt(tf.pow(2).mean(-1, keepdim=True) + eps)
    return tf * r, r


def _head_rms_backward(grad: Tensor, t: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Transpose of :func:`_head_rms` (before the weight): (d t, the normalised t used for the weight grad)."""
    t_hat, r = _head_rms(t, eps)
    g = grad.to(t_hat.dtype)
    return (r * (g - t_hat * (g * t_hat).mean(-1, keepdim=True))).to(t.dtype), t_hat


class BroadcastAttention(torch.autograd.Function):
    """``params``: the sharded shards (wq, wk, wv, wo[, bq, bk, bv]) then the replicated q/k norm weights."""

    @staticmethod
    def forward(ctx, x, cos, sin, spec: _AttnSpec, *params):
        b, l, h = x.shape
        tsp, nq, nkv, hd = spec.tsp, spec.n_heads, spec.n_kv_heads, spec.head_dim
        n_sharded = 7 if spec.bias else 4
        sharded, norms = params[:n_sharded], params[n_sharded:]
        x2 = x.reshape(b * l, h)
        shapes = [p.shape for p in sharded]
        local = pack(list(sharded), x.dtype)  # one message per owner: weights travel in the compute dtype
        norms = [w.to(x.dtype) for w in norms]
        y = torch.zeros(b * l, h, dtype=torch.promote_types(x.dtype, torch.float32), device=x.device)
        saved = []
        for _, buf in broadcast_shards(tsp, local):
            w_q, w_k, w_v, w_o, *biases = unpack(buf, shapes)

            def project(w, i, n):  # [B, n, L, d] (+ bias, per-head norm, RoPE as configured)
                t = x2 @ w.T
                raw = _heads(t + biases[i] if spec.bias else t, b, l, n, hd)
                if not spec.qk_norm or i == 2:
                    return raw, raw
                return raw, norms[i] * _head_rms(raw, spec.eps)[0].to(x.dtype)

            k_raw, k = project(w_k, 1, nkv)
            v = project(w_v, 2, nkv)[0]
            k = apply_rope(k, cos, sin)  # [B, nkv, L, d]
            buckets = spec.buckets()
            kv = KVGather(k[:, buckets[0][0]], v[:, buckets[0][0]], tsp)  # in flight while q is projected
            q_raw, q = project(w_q, 0, nq)
            q = apply_rope(q, cos, sin)  # [B, nq, L, d]
            outs, lses = [], []
            for i, (kvs, qs) in enumerate(buckets):
                k_full, v_full = kv.wait()  # [B, bucket, S, d]
                if i + 1 < len(buckets):  # the next bucket's exchange overlaps this bucket's attention
                    kv = KVGather(k[:, buckets[i + 1][0]], v[:, buckets[i + 1][0]], tsp)
                o_b, lse_b = zigzag_attention(spec.kernel, q[:, qs], k_full, v_full, tsp)
                outs.append(o_b)
                lses.append(lse_b)
                del k_full, v_full
            o = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
            lse = None if lses[0] is None else torch.cat(lses, dim=1)
            add_matmul_(y, _flat(o), w_o.T)
            saved += [q, k, v, o, lse] + ([q_raw, k_raw] if spec.qk_norm else [])
        ctx.spec, ctx.shapes, ctx.n_sharded = spec, shapes, n_sharded
        ctx.save_for_backward(x, cos, sin, *params, *saved)
        return y.view(b, l, h).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        spec, shapes, n_sharded = ctx.spec, ctx.shapes, ctx.n_sharded
        tsp, nq, nkv, hd = spec.tsp, spec.n_heads, spec.n_kv_heads, spec.head_dim
        x, cos, sin, *rest = ctx.saved_tensors
        n_params = n_sharded + (2 if spec.qk_norm else 0)
        params, saved = rest[:n_params], rest[n_params:]
        sharded, norms = params[:n_sharded], [w.to(x.dtype) for w in params[n_sharded:]]
        per_shard = 7 if spec.qk_norm else 5
        b, l, h = x.shape
        x2, dy2 = x.reshape(b * l, h), dy.reshape(b * l, h).to(x.dtype)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        dx = torch.zeros(b * l, h, dtype=acc_dtype, device=x.device)
        d_norms = [torch.zeros(hd, dtype=acc_dtype, device=x.device) for _ in norms]
        owner = reduce_to_owner(tsp)
        for j, buf in broadcast_shards(tsp, pack(list(sharded), x.dtype)):
            w_q, w_k, w_v, w_o, *_ = unpack(buf, shapes)
            q, k, v, o, lse, *raw = saved[per_shard * j : per_shard * (j + 1)]
            buckets = spec.buckets()
            # re-gathered (never saved), in flight during the output projection's gradients
            kv = KVGather(k[:, buckets[0][0]], v[:, buckets[0][0]], tsp)
            d_wo = dy2.T @ _flat(o)  # [h, nq*d]
            do = _heads(dy2 @ w_o, b, l, nq, hd)
            dq = torch.empty_like(q)
            dks, dvs = [], []
            for i, (kvs, qs) in enumerate(buckets):
                k_full, v_full = kv.wait()
                if i + 1 < len(buckets):
                    kv = KVGather(k[:, buckets[i + 1][0]], v[:, buckets[i + 1][0]], tsp)
                lse_b = None if lse is None else lse[:, qs]
                dq[:, qs], dk_full, dv_full = zigzag_attention_backward(
                    spec.kernel, do[:, qs], q[:, qs], k_full, v_full, o[:, qs], lse_b, tsp
                )
                del k_full, v_full
                dk_b, dv_b = scatter_kv_grad(dk_full, dv_full, tsp)  # to the token owners, fp32
                dks.append(dk_b)
                dvs.append(dv_b)
            dk = torch.cat(dks, dim=1) if len(dks) > 1 else dks[0]
            dv = torch.cat(dvs, dim=1) if len(dvs) > 1 else dvs[0]
            dq, dk = apply_rope_backward(dq, cos, sin), apply_rope_backward(dk.to(x.dtype), cos, sin)
            if spec.qk_norm:
                grads = []
                for i, (g, t_raw) in enumerate(zip((dq, dk), raw)):
                    dt, t_hat = _head_rms_backward(g * norms[i], t_raw, spec.eps)
                    d_norms[i] += (g.to(acc_dtype) * t_hat.to(x.dtype).to(acc_dtype)).sum((0, 1, 2))
                    grads.append(dt)
                dq, dk = grads
            dq2, dk2, dv2 = _flat(dq), _flat(dk), _flat(dv.to(x.dtype))
            for grad_out, w in ((dq2, w_q), (dk2, w_k), (dv2, w_v)):
                add_matmul_(dx, grad_out, w)
            partial = [dq2.T @ x2, dk2.T @ x2, dv2.T @ x2, d_wo]
            if spec.bias:
                partial += [dq2.sum(0), dk2.sum(0), dv2.sum(0)]
            owner.submit(j, pack(partial, acc_dtype))
        grads = unpack(owner.result(), shapes)
        d_sharded = [g.to(w.dtype) for g, w in zip(grads, sharded)]
        d_norm_params = [all_reduce_sum(g, tsp).to(w.dtype) for g, w in zip(d_norms, params[n_sharded:])]
        return (dx.view(b, l, h).to(x.dtype), None, None, None, *d_sharded, *d_norm_params)


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
                         self.norm_eps, self.kv_bucket_heads)
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
