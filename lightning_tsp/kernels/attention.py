"""Attention kernel backends for TSP's zigzag calls.

Every call is "a block of Lq queries against a K/V prefix of Lk >= Lq keys, causal mask aligned BOTTOM-RIGHT":
query i may see keys j <= i + (Lk - Lq). Layout: q [B, Hq, Lq, d], k/v [B, Hkv, Lk, d], Hq a multiple of Hkv
(GQA: K/V are never expanded before communication; a backend may expand them locally).

Each call is given as the query block, its own chunk's K/V (square causal) and the fully visible prefix K/V
(see :class:`AttentionKernel`). ``forward`` runs without autograd and returns ``(o, lse)`` (lse [B, Hq, Lq] in
fp32, or None when the backend does not expose it). ``backward`` returns ``(dq, dk_own, dv_own, dk_pre,
dv_pre)``; the default recomputes the forward under autograd (kernels without a public backward entry point),
the math and cuDNN backends use the saved log-sum-exp.

Packed documents: every call also takes an optional :class:`DocumentMask` (``mask=``), the per-document causal
mask of that call: on top of the call structure (own chunk square causal, prefix fully visible) query i sees
key j only if key j lies in query i's document. Backends that cannot apply it (``supports_document_mask =
False``) refuse it; none ignores it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.kernels.fused import fused_on_cuda


def _expand_kv(k: Tensor, n_heads: int) -> Tensor:
    g = n_heads // k.shape[1]
    return k if g == 1 else k.repeat_interleave(g, dim=1)


def _lower_right_mask(lq: int, lk: int, device) -> Tensor:
    """Boolean [Lq, Lk] mask, True where query i may attend key j (bottom-right aligned causal)."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


@dataclass(frozen=True, eq=False)
class DocumentMask:
    """The document structure of ONE zigzag call (packed documents, Hugging Face ``position_ids`` convention).

    * ``q_lo`` [B, Lq] int64: for each query, the GLOBAL index of the first token of its document
      (``global_index - position_id``, see :func:`lightning_tsp.zigzag.document_starts`).
    * ``k_own`` [Lq] int64: the global indices of the call's own-chunk keys (the queries' own tokens, in order).
    * ``k_pre`` [Lp] int64 or None: the global indices of the prefix keys, in the order the prefix K/V are
      passed (any order; None when the call has no prefix).

    Query i may see key j only if ``key_index[j] >= q_lo[i]`` (on top of the call's causal structure), so a
    query always sees itself. Build one per call per batch and reuse it across layers and head groups: kernels
    may cache per-call structures (flex-attention block masks) in ``cache``.
    """

    q_lo: Tensor
    k_own: Tensor
    k_pre: Tensor | None = None
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self):
        for name in ("q_lo", "k_own", "k_pre"):
            t = getattr(self, name)
            if t is None:
                continue
            if not isinstance(t, Tensor) or t.dtype != torch.int64:
                raise TSPConfigError(f"DocumentMask.{name} must be an int64 tensor, got "
                                     f"{getattr(t, 'dtype', type(t).__name__)}")
            object.__setattr__(self, name, t.contiguous())
        if self.q_lo.dim() != 2 or self.k_own.dim() != 1 or self.q_lo.shape[1] != self.k_own.shape[0]:
            raise TSPConfigError(f"DocumentMask: q_lo must be [B, Lq] and k_own [Lq], got {tuple(self.q_lo.shape)} "
                                 f"and {tuple(self.k_own.shape)}")
        if self.k_pre is not None and self.k_pre.dim() != 1:
            raise TSPConfigError(f"DocumentMask: k_pre must be [Lp], got {tuple(self.k_pre.shape)}")

    @classmethod
    def for_call(cls, q_lo: Tensor, key_index: Tensor, own: slice, pre: slice | None) -> "DocumentMask":
        """From one call of ``zigzag_calls``: ``q_lo`` = the document starts of the call's query rows [B, Lq],
        ``key_index`` [S] = the global index of every row of the gathered K/V buffer (its gather order)."""
        return cls(q_lo, key_index[own], None if pre is None else key_index[pre])

    @property
    def q_idx(self) -> Tensor:
        """Global index of each query (the own chunk's keys are the queries' own tokens)."""
        return self.k_own

    def key_index(self) -> Tensor:
        """Global indices of cat(prefix, own) [Lk]."""
        return self.k_own if self.k_pre is None else torch.cat([self.k_pre, self.k_own])

    def check(self, q: Tensor, k_own: Tensor, k_pre: Tensor | None) -> None:
        b, _, lq, _ = q.shape
        if tuple(self.q_lo.shape) != (b, lq) or k_own.shape[2] != lq:
            raise TSPConfigError(f"DocumentMask q_lo {tuple(self.q_lo.shape)} does not match the call's "
                                 f"queries [B={b}, Lq={lq}] / own keys ({k_own.shape[2]})")
        lp = 0 if k_pre is None else k_pre.shape[2]
        mp = 0 if self.k_pre is None else self.k_pre.shape[0]
        if lp != mp:
            raise TSPConfigError(f"DocumentMask has {mp} prefix key indices, the call has {lp} prefix keys")

    def allowed(self) -> Tensor:
        """Dense boolean [B, Lq, Lp + Lq] over cat(prefix, own): bottom-right causal AND same document.
        (For the reference kernels; a [Lq, Lk] mask per call, never [S, S].)"""
        keys = self.key_index()
        lq, lk = self.q_lo.shape[1], keys.shape[0]
        doc = keys.to(self.q_lo.device)[None, None, :] >= self.q_lo[:, :, None]
        return doc & _lower_right_mask(lq, lk, self.q_lo.device)


class AttentionKernel:
    """One zigzag call: a block of queries q [B, Hq, Lq, d] against its OWN chunk's keys k_own/v_own [B, Hkv, Lq, d]
    (the square causal block on the diagonal) and, optionally, a PREFIX of earlier keys k_pre/v_pre
    [B, Hkv, Lp, d] that every query sees in full. The prefix may be in any order (it is not masked); that is
    what lets the layer pass slices of the gathered K/V buffer without reordering them. Tensors may be strided
    views (e.g. [B, L, H, d] memory); the math is bottom-right causal attention over cat(prefix, own)."""

    name = "base"
    supports_document_mask = False  # whether ``mask=`` (a :class:`DocumentMask`) is applied

    def forward(self, q, k_own, v_own, k_pre=None, v_pre=None, mask: DocumentMask | None = None
                ) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad():
            return self.differentiable(q, k_own, v_own, k_pre, v_pre, mask)

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None, mask: DocumentMask | None = None
                       ) -> tuple[Tensor, Tensor | None]:
        k, v = _cat_keys(k_pre, k_own), _cat_keys(v_pre, v_own)
        if mask is None:
            return self.bottom_right(q, k, v)
        self._check_mask(mask, q, k_own, k_pre)
        return self.masked(q, k, v, mask.allowed())

    def bottom_right(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
        """q [B, Hq, Lq, d] against k/v [B, Hkv, Lk, d], Lk >= Lq, causal mask aligned bottom-right."""
        raise NotImplementedError

    def masked(self, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor) -> tuple[Tensor, Tensor | None]:
        """q against k/v with an explicit boolean mask ``allowed`` [B, Lq, Lk] (True = visible; every row has a
        True). Kernels with ``supports_document_mask`` and the default ``differentiable`` implement it."""
        raise NotImplementedError

    def _check_mask(self, mask: DocumentMask, q: Tensor, k_own: Tensor, k_pre: Tensor | None) -> None:
        if not self.supports_document_mask:
            raise TSPConfigError(_no_document_mask_message(self.name))
        mask.check(q, k_own, k_pre)

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse, mask: DocumentMask | None = None):
        """(dq, dk_own, dv_own, dk_pre, dv_pre); the prefix gradients are None without a prefix. The default
        differentiates the forward again (kernels without a public backward entry point)."""
        if mask is not None:
            self._check_mask(mask, q, k_own, k_pre)
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k_own, v_own) + ((k_pre, v_pre) if k_pre is not None else ())]
            pre = (leaves[3], leaves[4]) if k_pre is not None else (None, None)
            out, _ = self.differentiable(leaves[0], leaves[1], leaves[2], *pre, mask)
            grads = torch.autograd.grad(out, leaves, do)
        return tuple(grads) + ((None, None) if k_pre is None else ())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _no_document_mask_message(name: str) -> str:
    able = sorted(n for n, k in KERNELS.items() if k.supports_document_mask)
    return (f"attention kernel {name!r} does not support document masks (packed documents: position_ids in the "
            f"batch); it would attend across document boundaries. Use attention_kernel='auto' (flex-doc on CUDA in "
            f"bf16/fp16, SDPA with an explicit mask otherwise) or one of {able}.")


def _cat_keys(pre: Tensor | None, own: Tensor) -> Tensor:
    return own if pre is None else torch.cat([pre, own], dim=2)


def _split_keys(dk: Tensor, n_pre: int) -> tuple[Tensor, Tensor | None]:
    """Gradient of cat(prefix, own) -> (own part, prefix part or None)."""
    return (dk, None) if n_pre == 0 else (dk[:, :, n_pre:], dk[:, :, :n_pre])


class _PieceKernel(AttentionKernel):
    """A kernel run as two pieces (own chunk square causal, prefix fully visible) merged by log-sum-exp: its
    ``differentiable`` takes the pieces; a plain bottom-right call is split into them."""

    def bottom_right(self, q, k, v):
        lq, lk = q.shape[2], k.shape[2]
        pre = (k[:, :, : lk - lq], v[:, :, : lk - lq]) if lk > lq else (None, None)
        return self.differentiable(q, k[:, :, lk - lq :], v[:, :, lk - lq :], *pre)


class MathAttention(AttentionKernel):
    """Reference math in fp32 (fp64 stays fp64), explicit forward and backward, GQA without expanding K/V."""

    name = "math"
    supports_document_mask = True

    @staticmethod
    def _scores(q, k, allowed: Tensor | None = None):
        """Scaled scores [B, Hkv, g, Lq, Lk], -inf where masked: bottom-right causal, or ``allowed`` [B, Lq, Lk]."""
        b, hq, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        dt = torch.promote_types(q.dtype, torch.float32)
        qg = q.to(dt).reshape(b, hkv, hq // hkv, lq, d)  # [B, Hkv, g, Lq, d]
        s = (qg @ k.to(dt).unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, Hkv, g, Lq, Lk]
        keep = _lower_right_mask(lq, lk, q.device) if allowed is None else allowed[:, None, None]
        s = s.masked_fill(~keep, float("-inf"))
        return qg, s

    def bottom_right(self, q, k, v):
        return self.masked(q, k, v, None)

    def masked(self, q, k, v, allowed):
        b, hq, lq, d = q.shape
        _, s = self._scores(q, k, allowed)
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, g, Lq]
        p = torch.exp(s - lse.unsqueeze(-1))
        o = p @ v.to(p.dtype).unsqueeze(2)  # [B, Hkv, g, Lq, d]
        return o.reshape(b, hq, lq, d).to(q.dtype), lse.reshape(b, hq, lq)

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse, mask: DocumentMask | None = None):
        if mask is not None:
            self._check_mask(mask, q, k_own, k_pre)
        k, v = _cat_keys(k_pre, k_own), _cat_keys(v_pre, v_own)
        b, hq, lq, d = q.shape
        hkv = k.shape[1]
        qg, s = self._scores(q, k, None if mask is None else mask.allowed())
        dt = s.dtype
        p = torch.exp(s - lse.reshape(b, hkv, hq // hkv, lq, 1).to(dt))
        dog = do.to(dt).reshape(b, hkv, hq // hkv, lq, d)
        og = o.to(dt).reshape(dog.shape)
        vv = v.to(dt).unsqueeze(2)
        dv = (p.transpose(-1, -2) @ dog).sum(2)  # [B, Hkv, Lk, d]
        dp = dog @ vv.transpose(-1, -2)
        ds = p * (dp - (dog * og).sum(-1, keepdim=True)) * (1.0 / math.sqrt(d))
        dq = ds @ k.to(dt).unsqueeze(2)
        dk = (ds.transpose(-1, -2) @ qg).sum(2)
        n_pre = 0 if k_pre is None else k_pre.shape[2]
        (dk_own, dk_pre), (dv_own, dv_pre) = _split_keys(dk.to(k.dtype), n_pre), _split_keys(dv.to(v.dtype), n_pre)
        return dq.reshape(b, hq, lq, d).to(q.dtype), dk_own, dv_own, dk_pre, dv_pre


class SDPAAttention(AttentionKernel):
    """PyTorch SDPA with an explicit bottom-right causal mask (CPU default; portable CUDA fallback).

    ``is_causal=True`` would be top-left aligned and wrong for a query block against a longer prefix.
    """

    name = "sdpa"
    supports_document_mask = True

    def masked(self, q, k, v, allowed):
        """Explicit boolean mask [B, 1, Lq, Lk] built per call (bottom-right causal AND same document)."""
        hq = q.shape[1]
        o = F.scaled_dot_product_attention(q, _expand_kv(k, hq), _expand_kv(v, hq), attn_mask=allowed[:, None])
        return o, None

    def bottom_right(self, q, k, v):
        lq, lk = q.shape[2], k.shape[2]
        hq = q.shape[1]
        if q.is_cuda:
            from torch.nn.attention.bias import causal_lower_right

            # The fused CUDA paths do not all take enable_gqa with a lower-right bias: expand locally.
            o = F.scaled_dot_product_attention(
                q, _expand_kv(k, hq), _expand_kv(v, hq), attn_mask=causal_lower_right(lq, lk)
            )
        else:
            mask = _lower_right_mask(lq, lk, q.device)
            o = F.scaled_dot_product_attention(q, _expand_kv(k, hq), _expand_kv(v, hq), attn_mask=mask)
        return o, None


def _cudnn_attention(q, k, v, is_causal: bool):
    """cuDNN SDPA returning (out, lse [B, H, L] fp32). Private ATen op: availability is probed once."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False)
    return out[0], out[1].reshape(q.shape[0], q.shape[1], q.shape[2]).float()


def _cudnn_attention_backward(do, q, k, v, o, lse4, is_causal: bool):
    """cuDNN SDPA backward of one piece, given the FINAL (merged) output and log-sum-exp.

    With the merged o and lse, P = exp(S - lse) is the piece's block of the global softmax and
    rowsum(dO * O) the global correction term, so each piece's backward yields its exact share of the
    gradient (the same identity a flash-attention backward relies on). No dropout: seed/offset unused.
    PyTorch caches cuDNN graphs by the q/k/v shapes and strides only, so o and dO must always come in the
    layout q's implies: the layer passes q, o and dO as views of identically shaped [B, L, H, d] buffers.
    """
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do, q, k, v, o, lse4, zero, zero, None, None, None, q.shape[2], k.shape[2], 0.0, is_causal
    )


def _with_strides_of(t: Tensor, ref: Tensor) -> Tensor:
    """``t`` with exactly ``ref``'s strides (copied only if they differ). PyTorch caches cuDNN's backward graph
    by the q/k/v shapes and strides alone, with o's and dO's strides baked in: they must follow q's."""
    if t.stride() == ref.stride():
        return t
    out = torch.empty_strided(ref.size(), ref.stride(), dtype=t.dtype, device=t.device)
    return out.copy_(t)


def _expand_heads(k: Tensor, n_heads: int) -> Tensor:
    """GQA: repeat each KV head for its query heads, keeping the [B, L, H, d] memory order of the layer."""
    b, hkv, l, d = k.shape
    g = n_heads // hkv
    if g == 1:
        return k
    return k.transpose(1, 2).unsqueeze(3).expand(b, l, hkv, g, d).reshape(b, l, n_heads, d).transpose(1, 2)


def _sum_kv_groups(t: Tensor, n_kv: int) -> Tensor:
    """Gradient of expanded K/V heads [B, Hq, L, d] -> [B, Hkv, L, d] (sum over each GQA group)."""
    b, hq, l, d = t.shape
    return t if hq == n_kv else t.unflatten(1, (n_kv, hq // n_kv)).sum(2)


class CudnnSplitAttention(_PieceKernel):
    """Hopper fast path: the own chunk as a square causal call, the prefix as a non-causal call, both on cuDNN,
    merged once with their log-sum-exps in fp32 (not a ring-style chain of merges). Backward calls cuDNN's
    backward per piece with the merged output and log-sum-exp (no forward recompute). Strided views of the
    layer's [B, L, H, d] buffers go to cuDNN as they are (no copies)."""

    name = "cudnn-split"

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None, mask=None):
        if mask is not None:
            self._check_mask(mask, q, k_own, k_pre)  # refuses: no document masks on this path
        hq = q.shape[1]
        own_o, own_lse = _cudnn_attention(q, _expand_heads(k_own, hq), _expand_heads(v_own, hq), True)
        if k_pre is None:
            return own_o, own_lse
        pre_o, pre_lse = _cudnn_attention(q, _expand_heads(k_pre, hq), _expand_heads(v_pre, hq), False)
        return merge_pieces(own_o, own_lse, pre_o, pre_lse, q.dtype)

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse, mask=None):
        if mask is not None:
            self._check_mask(mask, q, k_own, k_pre)  # refuses
        hq, hkv = q.shape[1], k_own.shape[1]
        o, do = _with_strides_of(o, q), _with_strides_of(do, q)
        lse4 = lse.unsqueeze(-1).contiguous()  # the op's own layout: [B, H, Lq, 1]
        dq, dk_own, dv_own = _cudnn_attention_backward(
            do, q, _expand_heads(k_own, hq), _expand_heads(v_own, hq), o, lse4, True
        )
        dk_own, dv_own = _sum_kv_groups(dk_own, hkv), _sum_kv_groups(dv_own, hkv)
        if k_pre is None:
            return dq, dk_own, dv_own, None, None
        dq_pre, dk_pre, dv_pre = _cudnn_attention_backward(
            do, q, _expand_heads(k_pre, hq), _expand_heads(v_pre, hq), o, lse4, False
        )
        return dq + dq_pre, dk_own, dv_own, _sum_kv_groups(dk_pre, hkv), _sum_kv_groups(dv_pre, hkv)


@dataclass(frozen=True)
class FlashLibrary:
    """One installed flash-attn build, called per zigzag piece. ``forward(q, k, v, causal) -> (o, lse)`` and
    ``backward(do, q, k, v, o, lse, causal) -> (dq, dk, dv)`` take and return this module's [B, H, L, d] layout
    (strided views of [B, L, H, d] memory, which is the libraries' own layout: no copies), K/V with Hkv heads
    (native GQA: dK/dV come back with Hkv heads), lse [B, Hq, Lq] fp32 natural log. ``causal`` is square (the
    own chunk, Lq = Lk) or off (the prefix). ``min_capability``: the oldest CUDA architecture it runs on."""

    name: str
    forward: Callable
    backward: Callable
    min_capability: tuple[int, int]


def _bhld(*ts: Tensor) -> list[Tensor]:
    """[B, H, L, d] <-> [B, L, H, d] (a transposed view)."""
    return [t.transpose(1, 2) for t in ts]


def _load_flash_attn_4() -> FlashLibrary:
    """flash-attn 4 (``pip install flash-attn-4``; CuTe DSL, Hopper and Blackwell): ``flash_attn.cute.flash_attn_func
    (q, k, v, softmax_scale=, causal=, return_lse=True) -> (out, lse)``; the backward is the library's own
    ``flash_attn.cute.interface._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal) -> (dq, dk, dv)``
    (what its autograd function calls; there is no public backward entry point)."""
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.interface import _flash_attn_bwd

    def forward(q, k, v, causal):
        o, lse = flash_attn_func(*_bhld(q, k, v), softmax_scale=q.shape[-1] ** -0.5, causal=causal, return_lse=True)
        return o.transpose(1, 2), lse

    def backward(do, q, k, v, o, lse, causal):
        qt, kt, vt, ot, dot = _bhld(q, k, v, o, do)
        dq, dk, dv = _flash_attn_bwd(qt, kt, vt, ot, dot, lse.contiguous(), softmax_scale=q.shape[-1] ** -0.5,
                                     causal=causal)[:3]
        return _bhld(dq, dk, dv)

    return FlashLibrary("flash-attn 4", forward, backward, (9, 0))


def _load_flash_attn_2() -> FlashLibrary:
    """flash-attn 2 (``pip install flash-attn``, >= 2.7; Ampere and newer): ``flash_attn.flash_attn_func(q, k, v,
    softmax_scale=, causal=, return_attn_probs=True) -> (out, softmax_lse, S_dmask)``; the backward is
    ``flash_attn.flash_attn_interface._flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p,
    softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes, deterministic)``, which
    writes dq/dk/dv (the library's autograd drops the log-sum-exp's gradient, so the merge cannot go through it)."""
    from flash_attn import flash_attn_func
    from flash_attn.flash_attn_interface import _flash_attn_backward

    def forward(q, k, v, causal):
        o, lse, _ = flash_attn_func(*_bhld(q, k, v), softmax_scale=q.shape[-1] ** -0.5, causal=causal,
                                    return_attn_probs=True)
        return o.transpose(1, 2), lse[:, :, : q.shape[2]]

    def backward(do, q, k, v, o, lse, causal):
        qt, kt, vt, ot, dot = _bhld(q, k, v, o, do)
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (qt, kt, vt))
        _flash_attn_backward(dot, qt, kt, vt, ot, lse.contiguous(), dq, dk, dv, 0.0, q.shape[-1] ** -0.5, causal,
                             -1, -1, 0.0, None, False)
        return _bhld(dq, dk, dv)

    return FlashLibrary("flash-attn 2", forward, backward, (8, 0))


_FLASH_INSTALL = ("pip install flash-attn-4 on Hopper/Blackwell (sm90+; module flash_attn.cute), pip install "
                  "flash-attn on Ampere (flash-attn 2, flash_attn.flash_attn_func)")


@functools.lru_cache(maxsize=None)
def flash_libraries() -> tuple[dict[str, FlashLibrary], dict[str, str]]:
    """({"fa4": ..., "fa2": ...} for the builds whose entry points import, {key: why not} for the others).
    Availability is "the callable imports": flash-attn 4 alone leaves ``flash_attn`` a namespace package
    without ``flash_attn_func``, which is not flash-attn 2."""
    found, missing = {}, {}
    for key, what, load in (("fa4", "flash-attn 4 (flash_attn.cute.flash_attn_func)", _load_flash_attn_4),
                            ("fa2", "flash-attn 2 (flash_attn.flash_attn_func)", _load_flash_attn_2)):
        try:
            found[key] = load()
        except Exception as e:  # noqa: BLE001 - any failure to import means "not callable here"
            missing[key] = f"{what} does not import ({type(e).__name__}: {e})"
    return found, missing


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def flash_library(device: torch.device | str) -> FlashLibrary:
    """The flash-attn build to run on ``device``: flash-attn 4 on sm90+ when it imports, else flash-attn 2 when it
    imports and runs there. Raises :class:`TSPConfigError` naming what to install."""
    device = torch.device(device)
    if device.type != "cuda":
        raise TSPConfigError(f"attention kernel 'flash-attn' runs on CUDA only, not on {device}; use "
                             f"attention_kernel='auto'")
    found, missing = flash_libraries()
    why = list(missing.values())
    if found:
        cap = _cuda_capability(device)
        for lib in found.values():  # flash-attn 4 first
            if cap >= lib.min_capability:
                return lib
        why += [f"{lib.name} needs sm{lib.min_capability[0]}{lib.min_capability[1]}+, this GPU is sm{cap[0]}{cap[1]}"
                for lib in found.values()]
    raise TSPConfigError(f"attention kernel 'flash-attn' cannot run on {device}: {'; '.join(why)}. Install it: "
                         f"{_FLASH_INSTALL}; or use attention_kernel='auto'.")


class FlashAttention(_PieceKernel):
    """flash-attn (flash-attn 4 or 2, see :class:`FlashLibrary`) run like :class:`CudnnSplitAttention`: the own
    chunk as a square causal call, the prefix as a non-causal call, merged once by their log-sum-exps in fp32
    (:func:`merge_pieces`). Native GQA (K/V never expanded). Backward calls the library's backward per piece with
    the merged output and log-sum-exp (each piece's exact share of the global softmax; no forward recompute).
    No document masks (refused): packed documents use flex-doc. ``library`` None: chosen on the first call by
    :func:`flash_library` for the tensors' device."""

    name = "flash-attn"

    def __init__(self, library: FlashLibrary | None = None):
        self.library = library

    def __repr__(self) -> str:
        return f"{type(self).__name__}({None if self.library is None else self.library.name!r})"

    def _library(self, device: torch.device) -> FlashLibrary:
        if self.library is None:
            self.library = flash_library(device)
        return self.library

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None, mask=None):
        if mask is not None:
            self._check_mask(mask, q, k_own, k_pre)  # refuses
        lib = self._library(q.device)
        own_o, own_lse = lib.forward(q, k_own, v_own, True)
        if k_pre is None:
            return own_o, own_lse
        pre_o, pre_lse = lib.forward(q, k_pre, v_pre, False)
        return merge_pieces(own_o, own_lse, pre_o, pre_lse, q.dtype)

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse, mask=None):
        if mask is not None:
            self._check_mask(mask, q, k_own, k_pre)  # refuses
        if lse is None:
            raise TSPConfigError("flash-attn backward needs the log-sum-exp its forward returned (got None)")
        lib = self._library(q.device)
        dq, dk_own, dv_own = lib.backward(do, q, k_own, v_own, o, lse, True)
        if k_pre is None:
            return dq, dk_own, dv_own, None, None
        dq_pre, dk_pre, dv_pre = lib.backward(do, q, k_pre, v_pre, o, lse, False)
        return dq + dq_pre, dk_own, dv_own, dk_pre, dv_pre


class FlexDocumentAttention(_PieceKernel):
    """Packed documents on the GPU without any dense mask: ``torch.nn.attention.flex_attention`` (compiled) with
    block-sparse masks from ``create_block_mask`` (compiled), run as two pieces like :class:`CudnnSplitAttention`:
    the own chunk with a causal AND same-document ``mask_mod``, the prefix with the same-document ``mask_mod``
    (fully visible without a mask), merged once by their log-sum-exps in fp32. Blocks with no visible key (a
    document that starts after them) are skipped by the kernel. A prefix row may see no key at all (its document
    starts inside the own chunk): flex returns lse = -inf there and the merge gives exactly the own piece.
    Native GQA (``enable_gqa``). Backward: autograd through :meth:`differentiable` (flex's own backward
    kernels, including the log-sum-exp's gradient). ``flex_attention`` is imported lazily; on CPU it runs
    eagerly, forward only (tests).

    ``compiled``: ``None`` compiles on CUDA only (eager flex is a dense reference implementation)."""

    name = "flex-doc"
    supports_document_mask = True

    def __init__(self, compiled: bool | None = None):
        self.compiled = compiled

    def __repr__(self) -> str:
        return f"{type(self).__name__}(compiled={self.compiled})"

    def _use_compile(self, q: Tensor) -> bool:
        return q.is_cuda if self.compiled is None else self.compiled

    def piece(self, kind: str, q: Tensor, k: Tensor, v: Tensor, mask_mod, cache: dict | None
              ) -> tuple[Tensor, Tensor]:
        """One flex call (``kind``: "own" or "prefix"): q [B, Hq, Lq, d] against k/v [B, Hkv, Lk, d] under
        ``mask_mod`` (None: all visible), its block mask taken from / stored in ``cache``. Returns (o, lse
        [B, Hq, Lq], -inf on rows without a visible key)."""
        block_mask = None
        if mask_mod is not None:
            key = (kind, type(self).__name__, str(q.device), q.shape[0], q.shape[2], k.shape[2])
            block_mask = None if cache is None else cache.get(key)
            if block_mask is None:
                block_mask = self.block_mask(kind, mask_mod, q.shape[0], q.shape[2], k.shape[2], q)
                if cache is not None:
                    cache[key] = block_mask
        return self.attend(kind, q, k, v, block_mask)

    def block_mask(self, kind: str, mask_mod, b: int, lq: int, lk: int, q: Tensor):
        """flex's BlockMask of ``mask_mod`` over [B, Lq, Lk] (heads broadcast), on q's device; built by a
        compiled ``create_block_mask`` on CUDA (no dense [Lq, Lk] mask)."""
        return _flex_functions(self._use_compile(q), kind)[1](mask_mod, b, lq, lk, q.device)

    def attend(self, kind: str, q: Tensor, k: Tensor, v: Tensor, block_mask) -> tuple[Tensor, Tensor]:
        return _flex_functions(self._use_compile(q), kind)[0](q, k, v, block_mask, q.shape[1] != k.shape[1])

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None, mask=None):
        if mask is None:
            own_o, own_lse = self.piece("own", q, k_own, v_own, _causal_mask_mod, None)
            if k_pre is None:
                return own_o, own_lse.to(torch.promote_types(own_lse.dtype, torch.float32))
            pre_o, pre_lse = self.piece("prefix", q, k_pre, v_pre, None, None)
            return merge_pieces(own_o, own_lse, pre_o, pre_lse, q.dtype)
        self._check_mask(mask, q, k_own, k_pre)
        q_lo = mask.q_lo.to(q.device)
        own_o, own_lse = self.piece("own", q, k_own, v_own, _own_document_mask_mod(q_lo, mask.k_own.to(q.device)),
                                    mask.cache)
        if k_pre is None:
            return own_o, own_lse.to(torch.promote_types(own_lse.dtype, torch.float32))
        pre_o, pre_lse = self.piece("prefix", q, k_pre, v_pre,
                                    _prefix_document_mask_mod(q_lo, mask.k_pre.to(q.device)), mask.cache)
        return merge_pieces(own_o, own_lse, pre_o, pre_lse, q.dtype)


def _causal_mask_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _own_document_mask_mod(q_lo: Tensor, k_own: Tensor):
    """Own chunk (square): causal, and the key in the query's document (its global index >= the document's
    first token)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (k_own[kv_idx] >= q_lo[b, q_idx])

    return mask_mod


def _prefix_document_mask_mod(q_lo: Tensor, k_pre: Tensor):
    """Prefix (every key precedes every query): the key in the query's document."""

    def mask_mod(b, h, q_idx, kv_idx):
        return k_pre[kv_idx] >= q_lo[b, q_idx]

    return mask_mod


@fused_on_cuda(lambda o: o.shape[0] * o.shape[2])  # o [B, H, Lq, d]: B * Lq query rows
def merge_pieces(own_o: Tensor, own_lse: Tensor, pre_o: Tensor, pre_lse: Tensor, dtype: torch.dtype):
    """One fp32 (fp64 stays fp64) log-sum-exp merge of the own-chunk piece and the prefix piece (one compiled
    kernel on CUDA). The own piece always has a visible key (the diagonal); a prefix row without one (lse -inf)
    gets exactly the own piece, with finite gradients (its weight is selected, not computed, so no inf - inf and
    no 0 * NaN reaches autograd)."""
    acc = torch.promote_types(own_lse.dtype, torch.float32)
    own_lse, pre_lse = own_lse.to(acc), pre_lse.to(acc)
    lse = torch.logaddexp(own_lse, pre_lse)
    seen = pre_lse > float("-inf")
    w_pre = torch.where(seen, torch.exp(pre_lse - lse), 0.0).unsqueeze(-1)
    w_own = torch.exp(own_lse - lse).unsqueeze(-1)
    pre_term = torch.where(seen.unsqueeze(-1), pre_o.to(acc) * w_pre, 0.0)
    return (own_o.to(acc) * w_own + pre_term).to(dtype), lse


_fa = None  # torch.nn.attention.flex_attention, imported on first use


def _flex_call(q, k, v, block_mask, enable_gqa):
    if hasattr(_fa, "AuxRequest"):  # torch >= 2.9
        o, aux = _fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa,
                                    return_aux=_fa.AuxRequest(lse=True))
        return o, aux.lse
    return _fa.flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa, return_lse=True)


# One function (one code object) per piece kind, so that each compiled piece has its own torch.compile cache and
# recompile limit: the own piece (causal mask) and the prefix piece (a key length that differs between the two
# zigzag calls, with and without grad) never evict each other or exhaust a shared limit.
def _flex_own(q, k, v, block_mask, enable_gqa):
    return _flex_call(q, k, v, block_mask, enable_gqa)


def _flex_prefix(q, k, v, block_mask, enable_gqa):
    return _flex_call(q, k, v, block_mask, enable_gqa)


def _block_mask_own(mask_mod, b, lq, lk, device):
    return _fa.create_block_mask(mask_mod, b, None, lq, lk, device=device)


def _block_mask_prefix(mask_mod, b, lq, lk, device):
    return _fa.create_block_mask(mask_mod, b, None, lq, lk, device=device)


@functools.lru_cache(maxsize=None)
def _flex_functions(compiled: bool, kind: str):
    """(attend(q, k, v, block_mask, enable_gqa) -> (o, lse), make_block_mask(mask_mod, B, Lq, Lk, device)) for
    one piece kind ("own" / "prefix"), wrapped in torch.compile when ``compiled``."""
    global _fa
    from torch.nn.attention import flex_attention as fa

    _fa = fa
    attend, make_block_mask = {"own": (_flex_own, _block_mask_own), "prefix": (_flex_prefix, _block_mask_prefix)}[kind]
    if compiled:
        attend, make_block_mask = torch.compile(attend), torch.compile(make_block_mask)
    return attend, make_block_mask


@functools.lru_cache(maxsize=None)
def _flex_importable() -> bool:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False
    return True


KERNELS = {k.name: k for k in (MathAttention, SDPAAttention, CudnnSplitAttention, FlashAttention,
                               FlexDocumentAttention)}


def _flash_runs(device: torch.device) -> bool:
    """A flash-attn build imports and runs on this GPU (see :func:`flash_library`)."""
    try:
        flash_library(device)
        return True
    except TSPConfigError:
        return False


def _cudnn_split_works(device) -> bool:
    """The private cuDNN op exists and runs here (checked once on a tiny bf16 input)."""
    try:
        q = torch.randn(1, 1, 64, 64, device=device, dtype=torch.bfloat16)
        _cudnn_attention(q, q, q, True)
        return True
    except Exception:  # noqa: BLE001 - any failure means "not available", the portable path is used
        return False


@functools.lru_cache(maxsize=None)
def available_kernels(device: torch.device) -> list[str]:
    names = ["math", "sdpa"]
    if device.type == "cuda":
        if _cudnn_split_works(device):
            names.append("cudnn-split")
        if _flash_runs(device):
            names.append("flash-attn")
        if _flex_importable():
            names.append("flex-doc")
    return names


def _auto_half_precision_kernel(device: torch.device) -> AttentionKernel:
    """The fastest kernel that can run here (CUDA, bf16/fp16): flash-attn 4 on sm90+ (measured faster than cuDNN on
    an H200, forward and forward+backward), flash-attn 2 below sm90, else the cuDNN split (also on sm90+ with only
    flash-attn 2 installed: flash-attn 2 was not measured faster than cuDNN there), else flash-attn 2, else SDPA."""
    avail = available_kernels(device)
    lib = flash_library(device) if "flash-attn" in avail else None
    if lib is not None and (lib.min_capability >= (9, 0) or _cuda_capability(device) < (9, 0)):
        return FlashAttention(lib)
    if "cudnn-split" in avail:
        return CudnnSplitAttention()
    if lib is not None:
        return FlashAttention(lib)
    return SDPAAttention()


def select_attention_kernel(
    device: torch.device | str, name: str = "auto", dtype: torch.dtype = torch.bfloat16, documents: bool = False
) -> AttentionKernel:
    """``auto``: on CUDA in bf16/fp16 the fastest kernel that can run there (see
    :func:`_auto_half_precision_kernel`: flash-attn 4 on Hopper/Blackwell, the cuDNN split path otherwise);
    otherwise SDPA with an explicit bottom-right mask (the fused half-precision kernels do not take fp32).
    ``auto`` never picks a kernel that cannot be called; a forced one that cannot be gets an error naming
    what to install.

    ``documents=True`` (packed documents: every call gets a :class:`DocumentMask`): ``auto`` gives flex-doc on
    CUDA in bf16/fp16 and SDPA with an explicit per-call mask otherwise; an explicitly named kernel without
    document-mask support is refused (never a silent fall back to attention across documents). ``flex-doc`` by
    name also runs on CPU (eager, forward only: for tests)."""
    device = torch.device(device)
    if name != "auto":
        if name not in KERNELS:
            raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)} or 'auto'")
        if documents and not KERNELS[name].supports_document_mask:
            raise TSPConfigError(_no_document_mask_message(name))
        if name == "flex-doc" and not _flex_importable():
            raise ValueError(f"attention kernel 'flex-doc' needs torch.nn.attention.flex_attention (torch >= 2.5); "
                             f"this torch {torch.__version__} does not have it")
        if name == "flash-attn":
            if dtype not in (torch.bfloat16, torch.float16):
                raise TSPConfigError(f"attention kernel 'flash-attn' runs in bf16/fp16, not {dtype}: train under "
                                     f"bf16 autocast (bf16-mixed) or use attention_kernel='auto'")
            return FlashAttention(flash_library(device))  # raises naming what to install
        if name == "cudnn-split" and name not in available_kernels(device):
            raise ValueError(f"attention kernel {name!r} is not available on {device}")
        return KERNELS[name]()
    half = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    if documents:
        if half and "flex-doc" in available_kernels(device):
            return FlexDocumentAttention()
        return SDPAAttention()
    if half:
        return _auto_half_precision_kernel(device)
    return SDPAAttention()
