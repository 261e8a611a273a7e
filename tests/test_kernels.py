"""Attention backends agree on TSP's zigzag calls (a query block against a longer K/V prefix, bottom-right
causal), forward and backward, with GQA; and the zigzag chunking equals full causal attention."""

import pytest
import torch

from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels import MathAttention, SDPAAttention, select_attention_kernel
from lightning_tsp.layers.attention import gather_order, zigzag_attention, zigzag_attention_backward
from lightning_tsp.zigzag import zigzag_shard, zigzag_unshard
from tests.reference import assert_close


def naive_causal(q, k, v):
    """Textbook attention over the full sequence (top-left == bottom-right when square)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("lq,lk", [(5, 5), (4, 12), (3, 7)])
def test_math_and_sdpa_bottom_right(hq, hkv, lq, lk):
    torch.manual_seed(0)
    q = torch.randn(2, hq, lq, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, lk, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, lk, 8, dtype=torch.float64, requires_grad=True)
    do = torch.randn(2, hq, lq, 8, dtype=torch.float64)
    # reference: the last lq rows of full causal attention over lk tokens (bottom-right alignment)
    qq = torch.cat([torch.zeros(2, hq, lk - lq, 8, dtype=torch.float64), q], 2)
    ref = naive_causal(qq, k, v)[:, :, lk - lq :]
    ref_grads = torch.autograd.grad(ref, (q, k, v), do)
    n_pre = lk - lq
    own, pre = (slice(n_pre, lk), slice(0, n_pre) if n_pre else None)
    for kernel in (MathAttention(), SDPAAttention()):
        o, lse = kernel.forward(q, k[:, :, own], v[:, :, own], *((k[:, :, pre], v[:, :, pre]) if pre else ()))
        assert_close(f"{kernel.name} out", o, ref)
        dq, dk_own, dv_own, dk_pre, dv_pre = kernel.backward(
            do, q, k[:, :, own], v[:, :, own], *((k[:, :, pre], v[:, :, pre]) if pre else (None, None)), o, lse)
        assert (dk_pre is None) == (pre is None)
        dk = dk_own if pre is None else torch.cat([dk_pre, dk_own], 2)
        dv = dv_own if pre is None else torch.cat([dv_pre, dv_own], 2)
        for name, g, r in zip("qkv", (dq, dk, dv), ref_grads):
            assert_close(f"{kernel.name} d{name}", g, r)


def test_prefix_order_does_not_matter():
    """The prefix is fully visible: permuting its chunks (the gathered buffer's order) changes nothing."""
    torch.manual_seed(0)
    q = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 12, 8, dtype=torch.float64) for _ in range(2))
    do = torch.randn(1, 4, 3, 8, dtype=torch.float64)
    perm = torch.cat([torch.arange(6, 9), torch.arange(0, 6)])  # the 9 prefix keys, chunks rotated
    for kernel in (MathAttention(), SDPAAttention()):
        o1, lse1 = kernel.forward(q, k[:, :, 9:], v[:, :, 9:], k[:, :, :9], v[:, :, :9])
        o2, lse2 = kernel.forward(q, k[:, :, 9:], v[:, :, 9:], k[:, :, perm], v[:, :, perm])
        assert_close(f"{kernel.name} permuted prefix", o2, o1)
        g1 = kernel.backward(do, q, k[:, :, 9:], v[:, :, 9:], k[:, :, :9], v[:, :, :9], o1, lse1)
        g2 = kernel.backward(do, q, k[:, :, 9:], v[:, :, 9:], k[:, :, perm], v[:, :, perm], o2, lse2)
        assert_close(f"{kernel.name} dq", g2[0], g1[0])
        assert_close(f"{kernel.name} dk_pre", g2[3], g1[3][:, :, perm])


@pytest.mark.parametrize("d", [2, 3, 4])
def test_zigzag_chunk_calls_equal_full_causal_attention(d):
    """Rank p's two calls over the gathered buffer (gather order) give rows of full attention, and the dK/dV
    they produce, summed over ranks and put back in natural order, are the full gradients."""
    torch.manual_seed(0)
    s = 2 * d * 3
    q = torch.randn(1, 4, s, 8, dtype=torch.float64)
    k = torch.randn(1, 2, s, 8, dtype=torch.float64)
    v = torch.randn(1, 2, s, 8, dtype=torch.float64)
    do = torch.randn(1, 4, s, 8, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = naive_causal(qr, kr, vr)
    dq_ref, dk_ref, dv_ref = torch.autograd.grad(ref, (qr, kr, vr), do)
    outs, dk, dv = [], 0, 0
    for p in range(d):
        tsp = TSPGroup(None, p, d)  # only rank/size are used by the chunk calls
        q_loc, do_loc = zigzag_shard(q, d, p, dim=2), zigzag_shard(do, d, p, dim=2)
        kg, vg = gather_order(k, d, 2), gather_order(v, d, 2)
        for kernel in (MathAttention(), SDPAAttention()):
            o, lse = zigzag_attention(kernel, q_loc, kg, vg, tsp)
            dq_p, dk_p, dv_p = zigzag_attention_backward(kernel, do_loc, q_loc, kg, vg, o, lse, tsp)
            assert_close(f"{kernel.name} rank {p} out", o, zigzag_shard(ref, d, p, dim=2))
            assert_close(f"{kernel.name} rank {p} dq", dq_p, zigzag_shard(dq_ref, d, p, dim=2))
        outs.append(o)
        dk, dv = dk + dk_p, dv + dv_p
    assert_close("unsharded out", zigzag_unshard(outs, dim=2), ref)
    assert_close("dk summed over ranks", dk, gather_order(dk_ref, d, 2))
    assert_close("dv summed over ranks", dv, gather_order(dv_ref, d, 2))


def test_auto_selection_on_cpu_and_unknown_names():
    assert isinstance(select_attention_kernel("cpu"), SDPAAttention)
    assert isinstance(select_attention_kernel("cpu", "math"), MathAttention)
    with pytest.raises(ValueError, match="unknown attention kernel 'nope'"):
        select_attention_kernel("cpu", "nope")
    with pytest.raises(ValueError, match="not available on cpu"):
        select_attention_kernel("cpu", "cudnn-split")
