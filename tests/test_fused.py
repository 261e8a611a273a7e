"""The elementwise pieces that run compiled on CUDA (lightning_tsp.kernels.fused): the compiled function computes
what the eager one does (Inductor on CPU, fp64, on the strided views the schedules pass), and off CUDA the
wrapper runs the eager function itself."""

import pytest
import torch

from lightning_tsp.kernels.attention import merge_pieces
from lightning_tsp.layers.attention import kv_block, kv_grad_into
from lightning_tsp.layers.mlp import swiglu_backward
from lightning_tsp.layers.norm import rms_norm
from lightning_tsp.layers.rope import apply_rope, apply_rope_backward, rope_cos_sin

B, L, NQ, NKV, D = 2, 24, 4, 2, 8


def _cases():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    qkv = r(B, L, NQ + 2 * NKV, D)  # the fused projection's output: q, k, v are strided views of it
    q, k, v = qkv[:, :, :NQ], qkv[:, :, NQ:NQ + NKV], qkv[:, :, NQ + NKV:]
    cos, sin = rope_cos_sin(torch.arange(L), D, 10000.0, torch.float64)
    cos, sin = cos[:, None], sin[:, None]  # [L, 1, d]: broadcast over heads
    lse = r(B, NQ, L)
    pre_lse = lse.clone()
    pre_lse[:, :, :3] = float("-inf")  # prefix rows that see no key
    gu, d_hid = r(L, 2 * 6), r(L, 6)
    return {
        "apply_rope": (apply_rope, (q, cos, sin)),
        "apply_rope_backward": (apply_rope_backward, (q, cos, sin)),
        "kv_block": (kv_block, (k, v, cos, sin)),
        "merge_pieces": (merge_pieces, (r(B, NQ, L, D), lse, r(B, NQ, L, D), pre_lse, torch.float64)),
        "swiglu_backward": (swiglu_backward, (gu, d_hid)),
    }


def test_compiled_rms_norm_matches_eager_with_gradients():
    """rms_norm runs compiled under autograd (the decoder layers' norms): output and both gradients."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    w = torch.randn(16, generator=g, dtype=torch.float64)
    dy = torch.randn(3, 5, 16, generator=g, dtype=torch.float64)
    results = []
    torch._dynamo.reset()
    for fn in (rms_norm.eager, torch.compile(rms_norm.eager, fullgraph=True)):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xi, wi, 1e-6)
        y.backward(dy)
        results.append((y.detach(), xi.grad, wi.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", sorted(_cases()))
def test_compiled_piece_matches_eager(name):
    fn, args = _cases()[name]
    want = fn.eager(*args)
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(fn(*args)),
                                                  torch.utils._pytree.tree_leaves(want))), "CPU must run eagerly"
    torch._dynamo.reset()
    got = torch.compile(fn.eager, fullgraph=True)(*args)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_compiled_writers_match_eager():
    """The pieces that write into views of the projections' gradient [B, L, nq + 2 nkv, d] (the attention
    backward): dq through RoPE (``apply_rope_backward(out=)``) and the summed dK/dV [B, L, 2 nkv, d] (dK through
    RoPE, ``kv_grad_into``) land in their columns only, compiled as eager; eager kv_grad_into is the rounding to the
    buffer's dtype, then RoPE's backward (bitwise)."""
    g = torch.Generator().manual_seed(2)
    cos, sin = rope_cos_sin(torch.arange(L), D, 10000.0, torch.float64)
    cos, sin = cos[:, None], sin[:, None]
    dq = torch.randn(B, L, NQ, D, generator=g, dtype=torch.float64)
    dkv = torch.randn(B, L, 2 * NKV, D, generator=g, dtype=torch.float64)

    def write(rope_bwd, into):
        buf = torch.full((B, L, NQ + 2 * NKV, D), 7.0, dtype=torch.float64)
        rope_bwd(dq, cos, sin, out=buf[:, :, :NQ])
        into(buf[:, :, NQ:NQ + NKV], buf[:, :, NQ + NKV:], dkv, cos, sin)
        return buf

    want = write(apply_rope_backward.eager, kv_grad_into.eager)
    torch.testing.assert_close(want[:, :, :NQ], apply_rope_backward.eager(dq, cos, sin), rtol=0, atol=0)
    torch.testing.assert_close(want[:, :, NQ:NQ + NKV], apply_rope_backward.eager(dkv[:, :, :NKV], cos, sin),
                               rtol=0, atol=0)
    torch.testing.assert_close(want[:, :, NQ + NKV:], dkv[:, :, NKV:], rtol=0, atol=0)
    torch._dynamo.reset()
    got = write(torch.compile(apply_rope_backward.eager, fullgraph=True),
                torch.compile(kv_grad_into.eager, fullgraph=True))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)

    low = torch.empty(B, L, 2 * NKV, D, dtype=torch.bfloat16)  # fp32 sums into a bf16 buffer: rounded first
    kv_grad_into.eager(low[:, :, :NKV], low[:, :, NKV:], dkv.float(), cos.bfloat16(), sin.bfloat16())
    assert torch.equal(low[:, :, :NKV], apply_rope_backward.eager(dkv[:, :, :NKV].float().bfloat16(), cos.bfloat16(),
                                                                  sin.bfloat16()))
    assert torch.equal(low[:, :, NKV:], dkv[:, :, NKV:].float().bfloat16())


def test_token_rules():
    """The size rule that decides compiled vs eager counts tokens, not elements (grouped steps keep the elements of
    a call constant across lengths; the host-bound short sequences have few tokens)."""
    from lightning_tsp.kernels.fused import MIN_FUSED_TOKENS, rows, rows_heads

    assert rows_heads(torch.empty(2, 24, 4, 8)) == 48 and rows(torch.empty(2, 24, 64)) == 48
    assert rows(torch.empty(4096, 2 * 2048)) == MIN_FUSED_TOKENS  # swiglu's [B*L, 2F] at 32K, D = 8: compiled
    assert rows_heads(torch.empty(1, 2048, 32, 128)) < MIN_FUSED_TOKENS  # RoPE at 16K, g = 8: eager
