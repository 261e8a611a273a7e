"""A plain Llama-style decoder for the baseline strategies (module names follow torchtitan's llama3 model).

RMSNorm (``nn.RMSNorm``, or an elementary-op version), rotary embeddings from explicit position ids (so a rank holding zigzag chunks gets
the right positions), grouped-query attention through ``F.scaled_dot_product_attention`` (cuDNN on CUDA when
available), SwiGLU MLP, untied LM head. ``forward`` returns the logits; the strategy computes the loss.

Attention has two modes: local causal attention over the whole sequence it sees (TP, TP-SP), or context
parallel (``attention.cp_group`` set): this rank's zigzag queries against the K/V of the whole sequence,
all-gathered over the context-parallel group (``zigzag_cp_attention`` below).

Also the helpers every baseline uses to build one: ``new_model``, ``materialize``, ``check_tp_shape``, ``enable_cp``.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.layers.rope import rope_cos_sin
from lightning_tsp.zigzag import zigzag_unshard


@functools.lru_cache(maxsize=None)
def _cudnn_sdpa_usable(device_index: int) -> bool:
    """cuDNN SDPA runs here (checked once on a tiny causal bf16 call)."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        q = torch.randn(1, 2, 128, 128, device=f"cuda:{device_index}", dtype=torch.bfloat16, requires_grad=True)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        return True
    except Exception:  # noqa: BLE001 - any failure: fall back to PyTorch's default backend choice
        return False


def resolve_sdpa_backend(backend: str, device) -> str:
    """``auto`` -> ``cudnn`` where cuDNN SDPA runs, else ``default`` (PyTorch's own choice, and on CPU everything but
    ``math``). Resolved when the model is built: the probe runs a backward, which may run neither inside a
    checkpointed forward (its saved tensors would differ from the recomputation's) nor inside a compiled block."""
    device = torch.device(device)
    if device.type != "cuda":
        return "math" if backend == "math" else "default"
    if backend != "auto":
        return backend
    index = device.index if device.index is not None else torch.cuda.current_device()
    return "cudnn" if _cudnn_sdpa_usable(index) else "default"


def sdpa_context(x: Tensor, backend: str = "auto"):
    """The SDPA backend for square causal attention: cuDNN (``'cudnn'``; ``'auto'``: where it runs), flash
    (``'flash'``), the reference kernel (``'math'``, also on CPU) or PyTorch's own choice (``'default'``)."""
    backend = resolve_sdpa_backend(backend, x.device)
    if backend == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
    return sdpa_kernel([chosen[backend]])


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, L, H, hd]; cos/sin [L, hd]."""
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + _rotate_half(x) * sin


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """[B, H_kv, L, hd] -> [B, H_kv * n_rep, L, hd] (GQA: expand K/V heads locally before SDPA)."""
    if n_rep == 1:
        return x
    b, h, l, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, l, d).reshape(b, h * n_rep, l, d)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, sdpa_backend: str = "auto"):
        super().__init__()
        self.head_dim = dim // n_heads
        self.n_rep = n_heads // n_kv_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        self.sdpa_backend = sdpa_backend
        self.cp_group = None  # set by the context-parallel strategies
        self.cp_kernel = None

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, l, _ = x.shape
        # -1: the local head count under tensor parallelism (column-sharded projections)
        q = apply_rope(self.wq(x).view(b, l, -1, self.head_dim), cos, sin).transpose(1, 2)
        k = apply_rope(self.wk(x).view(b, l, -1, self.head_dim), cos, sin).transpose(1, 2)
        v = self.wv(x).view(b, l, -1, self.head_dim).transpose(1, 2)
        if self.cp_group is None:
            k, v = repeat_kv(k, self.n_rep), repeat_kv(v, self.n_rep)
            with sdpa_context(q, self.sdpa_backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = zigzag_cp_attention(q, k, v, self.cp_group, self.cp_kernel)
        return self.wo(o.transpose(1, 2).reshape(b, l, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ManualRMSNorm(nn.Module):
    """RMSNorm from elementary ops in fp32 (a fallback where ``nn.RMSNorm``'s fused kernel lacks DTensor support)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(cfg, kind: str = "torch") -> nn.Module:
    if kind == "manual":
        return ManualRMSNorm(cfg.hidden_size, cfg.norm_eps)
    return nn.RMSNorm(cfg.hidden_size, eps=cfg.norm_eps)


def to_compute_dtype(x: Tensor) -> Tensor:
    """A norm's fp32 output cast once to the autocast dtype (as Megatron's bf16 activations are): the projections
    then need no casts of their own, and a sequence-parallel all-gather moves bf16, not fp32."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return x.to(torch.get_autocast_dtype(dev))
    return x


class TransformerBlock(nn.Module):
    def __init__(self, cfg, sdpa_backend: str = "auto", norm: str = "torch"):
        super().__init__()
        self.attention_norm = make_norm(cfg, norm)
        self.attention = Attention(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, sdpa_backend)
        self.ffn_norm = make_norm(cfg, norm)
        self.feed_forward = FeedForward(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h = x + self.attention(to_compute_dtype(self.attention_norm(x)), cos, sin)
        return h + self.feed_forward(to_compute_dtype(self.ffn_norm(h)))


class _Settled(torch.autograd.Function):
    """An AsyncCollectiveTensor waited for, as a plain tensor on the autograd graph (its ``wait()`` alone would drop
    the gradient); the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.wait()

    @staticmethod
    def backward(ctx, g: Tensor) -> Tensor:
        return g


def settled(x: Tensor) -> Tensor:
    """A TP embedding's output is an AsyncCollectiveTensor (DTensor redistributes it asynchronously): waited here,
    where eager code would wait at its first use anyway, so that a compiled block receives a plain tensor (torch
    2.13 hands such an input's gradient to the embedding's redistribute as a plain tensor, which then fails)."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return _Settled.apply(x) if isinstance(x, AsyncCollectiveTensor) else x


class Transformer(nn.Module):
    """``cfg``: a lightning_tsp ModelConfig (hidden_size, n_layers, n_heads, n_kv_heads, intermediate_size,
    vocab_size, rope_theta, norm_eps, init_std)."""

    def __init__(self, cfg, sdpa_backend: str = "auto", norm: str = "torch"):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, sdpa_backend, norm) for i in range(cfg.n_layers)})
        self.norm = make_norm(cfg, norm)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens [B, L_in]; positions [L_att]: the position ids of the tokens attention sees (L_att = L_in, or
        the sequence gathered inside a TP-SP group)."""
        h = settled(self.tok_embeddings(tokens))
        dev = positions.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else self.norm.weight.dtype
        if isinstance(dtype, torch.dtype) and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin)
        return self.output(to_compute_dtype(self.norm(h)))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, init_std) for matrices, ones for norms. Works on plain tensors and on DTensors (each rank
        fills its local shard: the benchmark needs sane values, not a particular model)."""
        from torch.distributed.tensor import DTensor

        g = torch.Generator(device="cpu").manual_seed(seed)
        for name, p in self.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            if name.endswith("norm.weight"):
                local.fill_(1.0)
            elif local.device.type == "cpu":
                local.normal_(0.0, self.cfg.init_std, generator=g)
            else:
                local.normal_(0.0, self.cfg.init_std)


# -----------------------------------------------------------------------------------------------------------------
# zigzag context-parallel attention (sp, tp_x_sp, fsdp_cp)
# -----------------------------------------------------------------------------------------------------------------

def _cp_rank_size(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


class _GatherZigzagSeq(torch.autograd.Function):
    """[B, H, L_loc, d] zigzag-local -> [B, H, S, d] in natural order (all-gather); backward reduce-scatters."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        _, size = _cp_rank_size(group)
        seq_first = x.permute(2, 0, 1, 3).contiguous()  # [L_loc, B, H, d]
        out = torch.empty((size * seq_first.shape[0],) + seq_first.shape[1:], dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, seq_first, group=group)
        parts = list(out.chunk(size, dim=0))  # rank order, each [chunk r, chunk 2D-1-r]
        return zigzag_unshard(parts, dim=0).permute(1, 2, 0, 3)  # [B, H, S, d]

    @staticmethod
    def backward(ctx, g: Tensor):
        rank, size = _cp_rank_size(ctx.group)
        g = g.permute(2, 0, 1, 3)  # [S, B, H, d] natural order
        chunks = g.chunk(2 * size, dim=0)
        # back to rank order: rank p's block is [chunk p, chunk 2D-1-p]
        stacked = torch.cat([torch.cat([chunks[p], chunks[2 * size - 1 - p]], dim=0) for p in range(size)], dim=0)
        out = torch.empty((stacked.shape[0] // size,) + stacked.shape[1:], dtype=g.dtype, device=g.device)
        dist.reduce_scatter_tensor(out, stacked.contiguous(), group=ctx.group)
        return out.permute(1, 2, 0, 3), None


def _own_and_prefix(k: Tensor, v: Tensor, g: int, c: int):
    """Natural-order K/V -> ((own chunk g's k, v), (prefix k, v) or (None, None)): the kernels' call form."""
    n = (g + 1) * c
    own = (k[:, :, n - c:n], v[:, :, n - c:n])
    return own, ((k[:, :, :n - c], v[:, :, :n - c]) if g > 0 else (None, None))


class _ZigzagAttention(torch.autograd.Function):
    """Local zigzag queries q [B, H, 2c, d] against the full K/V [B, Hkv, S, d]: chunk g attends keys
    [0, (g+1)c) bottom-right causal. Saves q, k, v and the outputs/log-sum-exps (no S x S scores)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, rank: int, size: int, kernel) -> Tensor:
        c = q.shape[2] // 2
        outs, lses = [], []
        for i, g in enumerate((rank, 2 * size - 1 - rank)):
            own, pre = _own_and_prefix(k, v, g, c)
            o, lse = kernel.forward(q[:, :, i * c:(i + 1) * c], *own, *pre)
            outs.append(o)
            lses.append(lse)
        o = torch.cat(outs, dim=2)
        ctx.kernel, ctx.rank, ctx.size, ctx.has_lse = kernel, rank, size, lses[0] is not None
        ctx.save_for_backward(q, k, v, *outs, *(lses if ctx.has_lse else ()))
        return o

    @staticmethod
    def backward(ctx, do: Tensor):
        q, k, v, o0, o1, *lses = ctx.saved_tensors
        c = q.shape[2] // 2
        dq = torch.empty_like(q)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        for i, (g, o) in enumerate(zip((ctx.rank, 2 * ctx.size - 1 - ctx.rank), (o0, o1))):
            n = (g + 1) * c
            lse = lses[i] if ctx.has_lse else None
            own, pre = _own_and_prefix(k, v, g, c)
            dqi, dko, dvo, dkp, dvp = ctx.kernel.backward(do[:, :, i * c:(i + 1) * c], q[:, :, i * c:(i + 1) * c],
                                                          *own, *pre, o, lse)
            dq[:, :, i * c:(i + 1) * c] = dqi
            dk[:, :, n - c:n] += dko
            dv[:, :, n - c:n] += dvo
            if dkp is not None:
                dk[:, :, :n - c] += dkp
                dv[:, :, :n - c] += dvp
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None, None


@torch.compiler.disable
def zigzag_cp_attention(q: Tensor, k: Tensor, v: Tensor, group, kernel=None) -> Tensor:
    """q [B, H, 2c, d], k/v [B, Hkv, 2c, d] of this rank's zigzag tokens -> o [B, H, 2c, d]. Eager inside a
    compiled block (a graph break: the K/V all-gather and the lightning_tsp kernel run as they do uncompiled)."""
    from lightning_tsp.kernels.attention import select_attention_kernel

    if kernel is None:
        kernel = select_attention_kernel(q.device, "auto", q.dtype)
    rank, size = _cp_rank_size(group)
    k_full = _GatherZigzagSeq.apply(k, group)
    v_full = _GatherZigzagSeq.apply(v, group)
    return _ZigzagAttention.apply(q, k_full, v_full, rank, size, kernel)


def enable_cp(model, group, setup) -> None:
    """Switch every attention layer of ``model`` (before checkpointing and compile wrap its blocks) to zigzag
    context parallelism over ``group``, with the kernel ``setup.attention_kernel`` resolves to for the compute
    dtype (chosen here, not inside a compiled block)."""
    kernel = cp_kernel(setup)
    for block in model.layers.values():
        block.attention.cp_group = group
        block.attention.cp_kernel = kernel


def cp_kernel(setup):
    """The lightning_tsp attention kernel of the zigzag calls: ``setup.attention_kernel`` on ``setup.device`` for
    bf16 (bf16-mixed: autocast or FSDP2's bf16 parameters; bf16-true: bf16 weights and activations) or fp32 inputs."""
    from lightning_tsp.kernels.attention import select_attention_kernel

    dtype = torch.bfloat16 if setup.autocast or setup.param_dtype == "bfloat16" else torch.float32
    return select_attention_kernel(setup.device, setup.attention_kernel, dtype)


# -----------------------------------------------------------------------------------------------------------------
# building a baseline
# -----------------------------------------------------------------------------------------------------------------

def check_tp_shape(cfg, t: int) -> None:
    if cfg.n_heads % t or cfg.n_kv_heads % t:
        raise ValueError(f"TP={t} must divide the query heads ({cfg.n_heads}) and the K/V heads ({cfg.n_kv_heads})")
    if cfg.intermediate_size % t or cfg.vocab_size % t:
        raise ValueError(f"TP={t} must divide the MLP width {cfg.intermediate_size} and the vocabulary {cfg.vocab_size}")


def materialize(model, setup, full_state: dict | None) -> None:
    """Meta-initialised model -> real storage on the device, weights initialised (or loaded from a full state
    dict, for the equivalence tests)."""
    if full_state is None:
        model.to_empty(device=setup.device)
        model.init_weights(setup.seed)


def new_model(setup, full_state: dict | None) -> Transformer:
    """On meta (benchmark) or loaded from ``full_state`` on the device (tests: parallelize then slices it)."""
    backend = resolve_sdpa_backend(setup.sdpa_backend, setup.device)
    if full_state is None:
        with torch.device("meta"):
            return Transformer(setup.cfg, backend, setup.norm)
    model = Transformer(setup.cfg, backend, setup.norm).to(setup.device)
    model.load_state_dict(full_state)
    return model
