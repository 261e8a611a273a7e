"""The flash-attn kernel without a GPU: fake ``flash_attn`` packages on ``sys.path`` (a bare namespace package, as
flash-attn 4 alone leaves it; flash-attn 4's ``flash_attn.cute``; flash-attn 2's ``flash_attn``), each with the
library's signatures and layout ([B, L, H, d], lse [B, H, Lq]) around a pure-torch reference, checked by asserts
inside the fakes. They test availability, what ``auto`` picks, the error of a forced kernel that cannot run, and
that the two zigzag pieces merged by log-sum-exp (forward) and the per-piece backward with the merged output and
log-sum-exp equal the fp64 math kernel."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.kernels import attention as attn
from lightning_tsp.kernels.attention import (
    CudnnSplitAttention,
    FlashAttention,
    MathAttention,
    SDPAAttention,
    available_kernels,
    flash_library,
    select_attention_kernel,
)

CUDA = torch.device("cuda")

# Shared by the fakes: reference attention in the libraries' layout, and a log of the calls they received.
_REFERENCE = '''
import math
import torch

CALLS = []


def _check(name, *ts):
    for t in ts:
        assert t.dim() == 4 and t.stride(-1) == 1, f"{name}: [B, L, H, d] with a unit last stride expected"


def _scores(q, k, scale, causal):
    """[B, Hkv, g, Lq, Lk] scores of q [B, Lq, Hq, d] against k [B, Lk, Hkv, d] (GQA: k not expanded)."""
    b, lq, hq, d = q.shape
    lk, hkv = k.shape[1], k.shape[2]
    assert hq % hkv == 0
    qg = q.permute(0, 2, 1, 3).reshape(b, hkv, hq // hkv, lq, d)
    s = qg @ k.permute(0, 2, 3, 1).unsqueeze(2) * scale
    if causal:
        assert lq == lk, "the own piece is square"
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), float("-inf"))
    return qg, s


def _up(*ts):
    """Accumulate in fp32 (fp64 stays fp64), as the kernels do."""
    return [t.to(torch.promote_types(t.dtype, torch.float32)) for t in ts]


def forward(q, k, v, scale, causal):
    _check("forward", q, k, v)
    dtype, (q, k, v) = q.dtype, _up(q, k, v)
    b, lq, hq, d = q.shape
    scale = 1 / math.sqrt(d) if scale is None else scale
    _, s = _scores(q, k, scale, causal)
    lse = torch.logsumexp(s, -1)
    o = torch.exp(s - lse.unsqueeze(-1)) @ v.permute(0, 2, 1, 3).unsqueeze(2)
    CALLS.append(("forward", causal, scale, tuple(q.shape), tuple(k.shape)))
    return o.reshape(b, hq, lq, d).permute(0, 2, 1, 3).to(dtype).contiguous(), lse.reshape(b, hq, lq)


def backward(dout, q, k, v, out, lse, scale, causal):
    """Flash backward: P from the GIVEN lse, the correction rowsum(dO * O) from the GIVEN out."""
    _check("backward", dout, q, k, v, out)
    assert tuple(lse.shape) == (q.shape[0], q.shape[2], q.shape[1]) and lse.is_contiguous()
    dtype, (dout, q, k, v, out, lse) = q.dtype, _up(dout, q, k, v, out, lse)
    b, lq, hq, d = q.shape
    hkv = k.shape[2]
    qg, s = _scores(q, k, scale, causal)
    g = hq // hkv
    p = torch.exp(s - lse.reshape(b, hkv, g, lq, 1))
    dog = dout.permute(0, 2, 1, 3).reshape(b, hkv, g, lq, d)
    og = out.permute(0, 2, 1, 3).reshape(b, hkv, g, lq, d)
    vv = v.permute(0, 2, 1, 3).unsqueeze(2)
    dv = (p.transpose(-1, -2) @ dog).sum(2)
    ds = p * (dog @ vv.transpose(-1, -2) - (dog * og).sum(-1, keepdim=True)) * scale
    dq = ds @ k.permute(0, 2, 1, 3).unsqueeze(2)
    dk = (ds.transpose(-1, -2) @ qg).sum(2)
    CALLS.append(("backward", causal, scale, tuple(q.shape), tuple(k.shape)))
    return [t.to(dtype) for t in (dq.reshape(b, hq, lq, d).permute(0, 2, 1, 3), dk.permute(0, 2, 1, 3),
                                  dv.permute(0, 2, 1, 3))]
'''

# flash-attn 4: flash_attn/ has no __init__.py (a namespace package), flash_attn/cute/ holds the interface.
_FA4_INIT = '''
from flash_attn.cute.interface import flash_attn_func
'''
_FA4_INTERFACE = '''
import fake_flash_reference as ref


def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False,
                    window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None,
                    deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None,
                    aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False,
                    gather_bwd_recompute_p=False, gather_bwd_token_chunk=None, config=None, scales=None):
    assert return_lse, "the merge needs the log-sum-exp"
    return ref.forward(q, k, v, softmax_scale, causal)


def _flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
                    window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False,
                    num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False,
                    AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None,
                    cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None,
                    deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None,
                    mask_mod=None, aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None,
                    learnable_sink=None, *, config=None):
    return ref.backward(dout, q, k, v, out, lse, softmax_scale, causal)
'''

# flash-attn 2: a regular package with flash_attn_func at the top level and the private backward.
_FA2_INIT = '''
from flash_attn.flash_attn_interface import flash_attn_func
'''
_FA2_INTERFACE = '''
import fake_flash_reference as ref


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                    alibi_slopes=None, deterministic=False, return_attn_probs=False):
    assert return_attn_probs and dropout_p == 0.0
    out, lse = ref.forward(q, k, v, softmax_scale, causal)
    return out, lse, None


def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                         window_size_left, window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    assert dropout_p == 0.0 and (window_size_left, window_size_right) == (-1, -1) and softcap == 0.0
    for name, got, want in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert got.shape == want.shape and got.is_contiguous(), f"{name}: a preallocated [B, L, H, d] buffer"
    for buf, grad in zip((dq, dk, dv), ref.backward(dout, q, k, v, out, softmax_lse, softmax_scale, causal)):
        buf.copy_(grad)
    return None
'''


def _write(root, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def _forget_flash_attn() -> None:
    for name in [m for m in sys.modules if m.split(".")[0] in ("flash_attn", "fake_flash_reference")]:
        del sys.modules[name]
    attn.flash_libraries.cache_clear()
    available_kernels.cache_clear()


@pytest.fixture
def flash(tmp_path, monkeypatch):
    """``flash("namespace" | "fa4" | "fa2" | "both", capability=(9, 0), cudnn=True)``: put that fake install on
    sys.path and pretend to be on a CUDA GPU of that capability, with or without the cuDNN split path. Returns
    the fake's call log."""

    def install(kind: str, capability=(9, 0), cudnn=True):
        root = tmp_path / kind
        files = {"fake_flash_reference.py": _REFERENCE, "flash_attn/.keep": ""}
        if kind in ("fa4", "both"):
            files |= {"flash_attn/cute/__init__.py": _FA4_INIT, "flash_attn/cute/interface.py": _FA4_INTERFACE}
        if kind in ("fa2", "both"):
            files |= {"flash_attn/__init__.py": _FA2_INIT, "flash_attn/flash_attn_interface.py": _FA2_INTERFACE}
        _write(root, files)
        monkeypatch.syspath_prepend(str(root))
        monkeypatch.setattr(attn, "_cuda_capability", lambda device: capability)
        monkeypatch.setattr(attn, "_cudnn_split_works", lambda device: cudnn)
        _forget_flash_attn()
        import fake_flash_reference

        return fake_flash_reference.CALLS

    _forget_flash_attn()
    yield install
    _forget_flash_attn()


def test_namespace_package_is_not_flash_attn(flash):
    """flash-attn 4's wheel without its cute module importable (or any bare ``flash_attn`` directory): a namespace
    package without flash_attn_func. Not available, never picked by auto, and a forced choice says what to install
    before anything runs."""
    flash("namespace")
    import flash_attn

    assert not hasattr(flash_attn, "flash_attn_func")  # the situation of the bug
    found, missing = attn.flash_libraries()
    assert found == {} and set(missing) == {"fa4", "fa2"}
    assert "flash-attn" not in available_kernels(CUDA)
    assert isinstance(select_attention_kernel(CUDA, "auto", torch.bfloat16), CudnnSplitAttention)
    with pytest.raises(TSPConfigError, match="pip install flash-attn-4 on Hopper.*pip install flash-attn on Ampere"):
        select_attention_kernel(CUDA, "flash-attn", torch.bfloat16)


def test_auto_without_any_fused_kernel_is_sdpa(flash):
    flash("namespace", cudnn=False)
    assert isinstance(select_attention_kernel(CUDA, "auto", torch.bfloat16), SDPAAttention)


@pytest.mark.parametrize(
    "kind,capability,cudnn,want",
    [
        ("fa4", (9, 0), True, "flash-attn 4"),  # Hopper: FA4 measured faster than cuDNN
        ("fa4", (10, 0), True, "flash-attn 4"),  # Blackwell
        ("both", (9, 0), True, "flash-attn 4"),
        ("fa4", (8, 0), True, "cudnn-split"),  # FA4 cannot run on Ampere: never picked there
        ("fa4", (8, 0), False, "sdpa"),
        ("fa2", (9, 0), True, "cudnn-split"),  # Hopper with only FA2: cuDNN is the faster
        ("fa2", (9, 0), False, "flash-attn 2"),
        ("fa2", (8, 0), True, "flash-attn 2"),  # Ampere: FA2 first, as before
        ("both", (8, 0), True, "flash-attn 2"),
    ],
)
def test_auto_picks_a_kernel_it_can_call(flash, kind, capability, cudnn, want):
    flash(kind, capability, cudnn)
    kernel = select_attention_kernel(CUDA, "auto", torch.bfloat16)
    got = kernel.library.name if isinstance(kernel, FlashAttention) else kernel.name
    assert got == want
    assert isinstance(select_attention_kernel(CUDA, "auto", torch.float32), SDPAAttention)


def test_forced_flash_attn_that_cannot_run_names_what_to_install(flash):
    flash("fa4", capability=(8, 0))
    with pytest.raises(TSPConfigError, match=r"flash-attn 4 needs sm90\+, this GPU is sm80.*pip install flash-attn "):
        select_attention_kernel(CUDA, "flash-attn", torch.bfloat16)
    with pytest.raises(TSPConfigError, match="bf16/fp16, not torch.float32"):
        select_attention_kernel(CUDA, "flash-attn", torch.float32)
    with pytest.raises(TSPConfigError, match="runs on CUDA only"):
        select_attention_kernel("cpu", "flash-attn")
    with pytest.raises(TSPConfigError, match="does not support document masks"):
        select_attention_kernel(CUDA, "flash-attn", documents=True)


def _zigzag_call(b, hq, hkv, lq, lp, d, seed):
    """One zigzag call as the layer passes it: [B, H, L, d] views of [B, L, H, d] buffers; the prefix a slice of a
    gathered buffer in gather order (not the keys' global order)."""
    g = torch.Generator().manual_seed(seed)

    def buf(h, n):
        return torch.randn(b, n, h, d, generator=g, dtype=torch.float64).transpose(1, 2)

    q, do = buf(hq, lq), buf(hq, lq)
    k, v = buf(hkv, lp + lq), buf(hkv, lp + lq)
    pre = (k[:, :, :lp], v[:, :, :lp]) if lp else (None, None)
    return q, k[:, :, lp:], v[:, :, lp:], *pre, do


@pytest.mark.parametrize("kind", ["fa4", "fa2"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("lp", [0, 24])
def test_pieces_merged_equal_the_math_kernel(flash, kind, hq, hkv, lp):
    """Own chunk (square causal) + prefix (non-causal) through the library, merged by log-sum-exp, against the fp64
    math kernel: output, log-sum-exp and all five gradients; the library sees [B, L, H, d] views, Hkv K/V heads
    (native GQA), the 1/sqrt(d) scale, and exactly one call per piece."""
    calls = flash(kind)
    lq, d = 16, 8
    q, k_own, v_own, k_pre, v_pre, do = _zigzag_call(2, hq, hkv, lq, lp, d, seed=hq * 10 + hkv + lp)
    kernel = select_attention_kernel(CUDA, "flash-attn", torch.bfloat16)
    assert kernel.library is flash_library(CUDA) and kernel.library.name == {"fa4": "flash-attn 4",
                                                                                 "fa2": "flash-attn 2"}[kind]
    o, lse = kernel.forward(q, k_own, v_own, k_pre, v_pre)
    want_o, want_lse = MathAttention().forward(q, k_own, v_own, k_pre, v_pre)
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)

    grads = kernel.backward(do, q, k_own, v_own, k_pre, v_pre, o, lse)
    want = MathAttention().backward(do, q, k_own, v_own, k_pre, v_pre, want_o, want_lse)
    for name, got, ref in zip(("dq", "dk_own", "dv_own", "dk_pre", "dv_pre"), grads, want):
        if ref is None:
            assert got is None, name
            continue
        assert got.shape == ref.shape, name
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12, msg=name)

    scale = d**-0.5
    pieces = [(True, (2, lq, hq, d), (2, lq, hkv, d))] + ([(False, (2, lq, hq, d), (2, lp, hkv, d))] if lp else [])
    assert calls == [("forward", c, scale, qs, ks) for c, qs, ks in pieces] + [
        ("backward", c, scale, qs, ks) for c, qs, ks in pieces]


def test_backward_without_lse_is_refused(flash):
    flash("fa4")
    q, k_own, v_own, _, _, do = _zigzag_call(1, 2, 2, 8, 0, 8, seed=0)
    with pytest.raises(TSPConfigError, match="log-sum-exp"):
        FlashAttention(flash_library(CUDA)).backward(do, q, k_own, v_own, None, None, q, None)
