"""Attention kernel backends for TSP's zigzag calls.

Every call is "a block of Lq queries against a K/V prefix of Lk >= Lq keys, causal mask aligned BOTTOM-RIGHT":
query i may see keys j <= i + (Lk - Lq). Layout: q [B, Hq, Lq, d], k/v [B, Hkv, Lk, d], Hq a multiple of Hkv
(GQA: K/V are never expanded before communication; a backend may expand them locally).

Each call is given as the query block, its own chunk's K/V (square causal) and the fully visible prefix K/V
(see :class:`AttentionKernel`). ``forward`` runs without autograd and returns ``(o, lse)`` (lse [B, Hq, Lq] in
fp32, or None when the backend does not expose it). ``backward`` returns ``(dq, dk_own, dv_own, dk_pre,
dv_pre)``; the default recomputes the forward under autograd (kernels without a public backward entry point),
the math and cuDNN backends use the saved log-sum-exp.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import Tensor


def _expand_kv(k: Tensor, n_heads: int) -> Tensor:
    g = n_heads // k.shape[1]
    return k if g == 1 else k.repeat_interleave(g, dim=1)


def _lower_right_mask(lq: int, lk: int, device) -> Tensor:
    """Boolean [Lq, Lk] mask, True where query i may attend key j (bottom-right aligned causal)."""
    i = torch.arange(lq, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return j <= i + (lk - lq)


class AttentionKernel:
    """One zigzag call: a block of queries q [B, Hq, Lq, d] against its OWN chunk's keys k_own/v_own [B, Hkv, Lq, d]
    (the square causal block on the diagonal) and, optionally, a PREFIX of earlier keys k_pre/v_pre
    [B, Hkv, Lp, d] that every query sees in full. The prefix may be in any order (it is not masked); that is
    what lets the layer pass slices of the gathered K/V buffer without reordering them. Tensors may be strided
    views (e.g. [B, L, H, d] memory); the math is bottom-right causal attention over cat(prefix, own)."""

    name = "base"

    def forward(self, q, k_own, v_own, k_pre=None, v_pre=None) -> tuple[Tensor, Tensor | None]:
        with torch.no_grad():
            return self.differentiable(q, k_own, v_own, k_pre, v_pre)

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None) -> tuple[Tensor, Tensor | None]:
        return self.bottom_right(q, _cat_keys(k_pre, k_own), _cat_keys(v_pre, v_own))

    def bottom_right(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor | None]:
        """q [B, Hq, Lq, d] against k/v [B, Hkv, Lk, d], Lk >= Lq, causal mask aligned bottom-right."""
        raise NotImplementedError

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse):
        """(dq, dk_own, dv_own, dk_pre, dv_pre); the prefix gradients are None without a prefix. The default
        differentiates the forward again (kernels without a public backward entry point)."""
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k_own, v_own) + ((k_pre, v_pre) if k_pre is not None else ())]
            out, _ = self.differentiable(*leaves)
            grads = torch.autograd.grad(out, leaves, do)
        return tuple(grads) + ((None, None) if k_pre is None else ())

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _cat_keys(pre: Tensor | None, own: Tensor) -> Tensor:
    return own if pre is None else torch.cat([pre, own], dim=2)


def _split_keys(dk: Tensor, n_pre: int) -> tuple[Tensor, Tensor | None]:
    """Gradient of cat(prefix, own) -> (own part, prefix part or None)."""
    return (dk, None) if n_pre == 0 else (dk[:, :, n_pre:], dk[:, :, :n_pre])


class MathAttention(AttentionKernel):
    """Reference math in fp32 (fp64 stays fp64), explicit forward and backward, GQA without expanding K/V."""

    name = "math"

    @staticmethod
    def _scores(q, k):
        b, hq, lq, d = q.shape
        hkv, lk = k.shape[1], k.shape[2]
        dt = torch.promote_types(q.dtype, torch.float32)
        qg = q.to(dt).reshape(b, hkv, hq // hkv, lq, d)  # [B, Hkv, g, Lq, d]
        s = (qg @ k.to(dt).unsqueeze(2).transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [B, Hkv, g, Lq, Lk]
        s = s.masked_fill(~_lower_right_mask(lq, lk, q.device), float("-inf"))
        return qg, s

    def bottom_right(self, q, k, v):
        b, hq, lq, d = q.shape
        _, s = self._scores(q, k)
        lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, g, Lq]
        p = torch.exp(s - lse.unsqueeze(-1))
        o = p @ v.to(p.dtype).unsqueeze(2)  # [B, Hkv, g, Lq, d]
        return o.reshape(b, hq, lq, d).to(q.dtype), lse.reshape(b, hq, lq)

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse):
        k, v = _cat_keys(k_pre, k_own), _cat_keys(v_pre, v_own)
        b, hq, lq, d = q.shape
        hkv = k.shape[1]
        qg, s = self._scores(q, k)
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


class CudnnSplitAttention(AttentionKernel):
    """Hopper fast path: the own chunk as a square causal call, the prefix as a non-causal call, both on cuDNN,
    merged once with their log-sum-exps in fp32 (not a ring-style chain of merges). Backward calls cuDNN's
    backward per piece with the merged output and log-sum-exp (no forward recompute). Strided views of the
    layer's [B, L, H, d] buffers go to cuDNN as they are (no copies)."""

    name = "cudnn-split"

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None):
        hq = q.shape[1]
        own_o, own_lse = _cudnn_attention(q, _expand_heads(k_own, hq), _expand_heads(v_own, hq), True)
        if k_pre is None:
            return own_o, own_lse
        pre_o, pre_lse = _cudnn_attention(q, _expand_heads(k_pre, hq), _expand_heads(v_pre, hq), False)
        lse = torch.logaddexp(own_lse, pre_lse)
        o = own_o.float() * torch.exp(own_lse - lse).unsqueeze(-1) + pre_o.float() * torch.exp(pre_lse - lse).unsqueeze(-1)
        return o.to(q.dtype), lse

    def bottom_right(self, q, k, v):
        lq, lk = q.shape[2], k.shape[2]
        pre = (k[:, :, : lk - lq], v[:, :, : lk - lq]) if lk > lq else (None, None)
        return self.differentiable(q, k[:, :, lk - lq :], v[:, :, lk - lq :], *pre)

    def backward(self, do, q, k_own, v_own, k_pre, v_pre, o, lse):
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


class FlashAttention(AttentionKernel):
    """flash-attn's ``flash_attn_func`` (bottom-right causal, native GQA); imported lazily."""

    name = "flash-attn"

    def bottom_right(self, q, k, v):
        from flash_attn import flash_attn_func

        o = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return o.transpose(1, 2), None


KERNELS = {k.name: k for k in (MathAttention, SDPAAttention, CudnnSplitAttention, FlashAttention)}


def _flash_attn_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("flash_attn") is not None


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
        if _flash_attn_importable():
            names.append("flash-attn")
    return names


def select_attention_kernel(
    device: torch.device | str, name: str = "auto", dtype: torch.dtype = torch.bfloat16
) -> AttentionKernel:
    """``auto``: on CUDA in bf16/fp16, flash-attn when importable, else the cuDNN split; otherwise SDPA with an
    explicit bottom-right mask (the fused half-precision kernels do not take fp32)."""
    device = torch.device(device)
    if name != "auto":
        if name not in KERNELS:
            raise ValueError(f"unknown attention kernel {name!r}; choose one of {sorted(KERNELS)} or 'auto'")
        if name in ("cudnn-split", "flash-attn") and name not in available_kernels(device):
            raise ValueError(f"attention kernel {name!r} is not available on {device}")
        return KERNELS[name]()
    if device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        avail = available_kernels(device)
        for choice in ("flash-attn", "cudnn-split"):
            if choice in avail:
                return KERNELS[choice]()
    return SDPAAttention()
