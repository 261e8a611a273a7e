"""One decode step under TSP: weights never move, the KV cache stays where it is.

The new token's hidden state x [B, h] is replicated on every rank (it is tiny). Per layer:

1. Rank j projects x with its OWN head group (the training layer's projection code: biases, q/k norms, RoPE
   variant): q_j [B, n_q/D, d], k_j, v_j [B, n_kv/D, d] (or its copy of a replicated KV head). One all-gather of
   the packed [q_j, k_j, v_j] gives every rank all heads' q (and k/v; only the rank that stores this step's token
   writes them, one copy per KV head, into its cache slot).
2. Every rank scores ALL query heads against its LOCAL cache slice (all heads, its own tokens), masked to the
   filled slots: a partial output o_p [B, n_q, d] and its log-sum-exp lse_p [B, n_q] (fp32, fp64 stays fp64).
3. One all-to-all sends the partials of head group j to rank j: [B, n_q/D, d+1] per peer.
4. Rank j merges the D partials exactly: lse = logsumexp_p lse_p, o = sum_p exp(lse_p - lse) o_p, and applies
   its own columns of o_proj: a partial [B, h], summed over the group by an all-reduce.
5. MLP on the owned slices: silu(x Wg_j^T) * (x Wu_j^T) @ Wd_j^T, one all-reduce of [B, h]. A mixture of experts
   routes x with the replicated router and runs the rank's own experts (weighted by the combination weights, 0
   where a token is not routed there): the same one all-reduce.

Embedding: owned vocab rows + all-reduce; LM head: local logits [B, V/D] (see ``vocab.py``, ``sampling.py``).

Four collectives per layer is the least this weights-stationary step allows: q must reach the cache slices (1),
the partials must be reduced per head (2), and o_proj and the MLP's down projection are sharded over their input
dimension, so each ends in a sum over the group (3, 4); the norms between them need the full hidden state.

Every step runs the same kernels on tensors of the same shapes and addresses (the slot bookkeeping is done on the
device, see :meth:`KVCache.claim_slot`), so :class:`Decoder` captures one step in a CUDA graph on CUDA and replays
it per token: one launch per token instead of a few hundred.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
import weakref

import torch
from torch import Tensor

from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.collectives import all_gather_stack, all_reduce_, all_to_all
from lightning_tsp.inference.prefill import prefill
from lightning_tsp.inference.vocab import acc_dtype, embed_tokens, local_logits
from lightning_tsp.layers.attention import kv_block, project_qkv
from lightning_tsp.kernels.fused import compiled_on_cuda
from lightning_tsp.kernels.gemv import linear_rows, swiglu_rows
from lightning_tsp.kernels.grouped import ExpertGroups, grouped_gemm_works
from lightning_tsp.layers.moe import TSPMoE, experts_forward
from lightning_tsp.layers.norm import rms_norm
from lightning_tsp.layers.rope import apply_rope
from lightning_tsp.schedules.comm import local_tensor

# a kept decoder replays its prefill from a CUDA graph when the prompt batch has at most this many local tokens
# (B x padded length / D): there the eager prefill is bound by the host (paper-7b, D = 8, a 2K prompt: 256 local
# tokens, about 300 kernels a layer), and the graph's memory pool (the prefill's working set, kept between calls)
# is small; longer prompts are bound by the GPU and run eagerly
PREFILL_GRAPH_MAX_TOKENS = 4096


def partial_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, Hq, d] against k/v [B, Hkv, T, d] where ``valid`` [B, T]: (o [B, Hq, d], lse [B, Hq]) in fp32 or
    fp64, by explicit scores (the reference; CPU and fp32/fp64). A sequence with no valid slot here gets o = 0,
    lse = -inf (it then weighs nothing in the merge)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    dt = acc_dtype(q.dtype)
    qg = q.to(dt).view(b, hkv, hq // hkv, 1, d)
    s = (qg @ k.to(dt).unsqueeze(2).transpose(-1, -2)).squeeze(3) * (1.0 / math.sqrt(d))  # [B, Hkv, g, T]
    s = s.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [B, Hkv, g]
    p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
    o = (p.unsqueeze(3) @ v.to(dt).unsqueeze(2)).squeeze(3)  # [B, Hkv, g, d]
    return o.reshape(b, hq, d), lse.reshape(b, hq)


@compiled_on_cuda
def _softmax_stats(s: Tensor, slot_pos: Tensor, scale: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """fp32 scores [B, Hkv, g, T] -> (probabilities in ``dtype`` normalised by this slice's softmax, lse [B, Hkv, g])."""
    s = (s * scale).masked_fill((slot_pos < 0)[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0, lse).unsqueeze(-1))
    return p.to(dtype), lse


@functools.lru_cache(maxsize=None)
def _fp32_output_bmm() -> bool:
    """cuBLAS bf16 x bf16 -> fp32 batched GEMM (``torch.bmm(..., out_dtype=)``, torch >= 2.8 on CUDA)."""
    try:
        a = torch.ones(1, 1, 8, device="cuda", dtype=torch.bfloat16)
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError):
        return False


def fused_decode_available(t: Tensor) -> bool:
    """The fast cache attention runs for bf16/fp16 CUDA tensors (where fp32-output GEMMs exist)."""
    return t.is_cuda and t.dtype in (torch.bfloat16, torch.float16) and _fp32_output_bmm()


def cache_attention(q: Tensor, k: Tensor, v: Tensor, slot_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Partial attention of the new tokens' q [B, Hq, d] over this rank's cache slice k/v [B, Hkv, T, d], masked to
    the filled slots (``slot_pos >= 0``): (o [B, Hq, d], lse [B, Hq]) in fp32 (fp64 stays fp64).

    bf16/fp16 on CUDA: two batched GEMVs that read the cache once in its own dtype (scores and output accumulated
    and written in fp32; the probabilities cast to the cache dtype for the second product, as flash attention
    does), native GQA (the g query heads of a KV head are the rows of one GEMV), softmax statistics in one
    compiled kernel. A measured alternative, compiled FlexAttention, read the cache at about a tenth of the
    bandwidth at one query token (benchmarks/decode_kernels.py). Otherwise the explicit reference
    :func:`partial_attention`."""
    if not fused_decode_available(q):
        return partial_attention(q, k, v, slot_pos >= 0)
    b, hq, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    s = torch.bmm(q.reshape(b * hkv, g, d), k.view(b * hkv, t, d).transpose(1, 2), out_dtype=torch.float32)
    p, lse = _softmax_stats(s.view(b, hkv, g, t), slot_pos, 1.0 / math.sqrt(d), q.dtype)
    o = torch.bmm(p.view(b * hkv, g, t), v.view(b * hkv, t, d), out_dtype=torch.float32)
    return o.view(b, hq, d), lse.view(b, hq)


def merge_partials(o: Tensor, lse: Tensor) -> Tensor:
    """o [D, B, H, d], lse [D, B, H] -> the exact softmax-weighted combination [B, H, d]."""
    total = torch.logsumexp(lse, dim=0)  # finite: every sequence has a valid slot on some rank
    return (torch.exp(lse - total).unsqueeze(-1) * o).sum(0)


@compiled_on_cuda
def _rope_pack(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """[B, 1, n, d] heads -> [B, nq + 2 nkv, d]: RoPE'd q, then the K/V block a cache stores (RoPE'd k, v)."""
    return torch.cat([apply_rope(q, cos, sin), kv_block(k, v, cos, sin)], dim=2)[:, 0]


@compiled_on_cuda
def _merge_heads(recv: Tensor, dtype: torch.dtype) -> Tensor:
    """[D, B, n, d + 1] partials (o, lse) of my heads from every rank -> merged [B, n d] in ``dtype``."""
    o = merge_partials(recv[..., :-1], recv[..., -1])
    return o.reshape(o.shape[0], -1).to(dtype)


@compiled_on_cuda
def _add_norm(x: Tensor, y: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add (y in the accumulation dtype, cast here) and the next RMSNorm: (x + y, rms_norm(x + y))."""
    x = x + y.to(x.dtype)
    return x, rms_norm(x, w, eps)


def _partial_out(a: Tensor, w: Tensor) -> Tensor:
    """a @ w.T [B, h]: a rank's partial of a sum over the group, in the accumulation dtype (on CUDA the fp32 product
    itself: no cast kernel before the all-reduce, none after it; :func:`_add_norm` casts)."""
    return linear_rows(a, w, out_dtype=acc_dtype(a.dtype))


def _sum_over_group(y: Tensor, tsp) -> Tensor:
    """A partial [B, h] (accumulation dtype) summed over the TSP group."""
    return y if tsp.size == 1 else all_reduce_(y, tsp)


def attention_decode(attn, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                     slot: Tensor, slot_pos: Tensor) -> Tensor:
    """x [B, h] (normed, replicated), cos/sin [B, d] of the new tokens' positions, ``slot`` [1]: where this rank
    writes the new token's K/V (its next slot if it stores this step's token, else the scratch slot). The owner's
    projection is the training layer's (:func:`~lightning_tsp.layers.attention.project_qkv`,
    :func:`~lightning_tsp.layers.attention.kv_block`) on its own parameters; the K/V source is every rank's cache
    slice."""
    tsp, d = attn.tsp, attn.tsp.size
    spec = dataclasses.replace(attn.spec(x.device, x.dtype), kv_bucket=None)  # one token: one bucket
    lay = spec.layout
    nq, nkv, hd, r = lay.n_heads, lay.n_kv_heads, lay.head_dim, lay.kv_replicas
    b = x.shape[0]
    view = lay.params_view([p.to(x.dtype) for p in attn.shard_params()])
    p = project_qkv(spec, view, x, [w.to(x.dtype) for w in attn.norm_params()], b, 1)
    qkv = all_gather_stack(_rope_pack(p.q, p.k, p.v, cos[:, None, None], sin[:, None, None]), tsp)  # [D, B, nq+2nkv, d]
    q_all = qkv[:, :, :nq].transpose(0, 1).reshape(b, d * nq, hd)  # head order = Hugging Face order
    kv_all = qkv[::r, :, nq:].transpose(0, 1)  # [B, n_kv / nkv, 2 nkv, d]: one copy of each KV group
    k_cache.index_copy_(2, slot, kv_all[:, :, :nkv].reshape(b, -1, 1, hd))
    v_cache.index_copy_(2, slot, kv_all[:, :, nkv:].reshape(b, -1, 1, hd))
    o, lse = cache_attention(q_all, k_cache, v_cache, slot_pos)
    send = torch.cat([o, lse.unsqueeze(-1)], dim=-1).view(b, d, nq, hd + 1).transpose(0, 1)  # [D, B, nq, d+1]
    recv = all_to_all(send, tsp)  # row p: rank p's partials for MY heads
    return _sum_over_group(_partial_out(_merge_heads(recv, x.dtype), view.w_o.T), tsp)


def _mlp_partial(mlp, x: Tensor) -> Tensor:
    """The owned columns of a dense SwiGLU on x [B, h]: a partial [B, h] of the output (accumulation dtype)."""
    wg, wu, wd = (local_tensor(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    return _partial_out(swiglu_rows(x, wg, wu), wd)


@functools.lru_cache(maxsize=None)
def _equal_groups(m: int, b: int, device: torch.device, dtype: torch.dtype) -> ExpertGroups:
    """m experts of b rows each; made once (the first eager steps), so a CUDA graph capture creates nothing."""
    return ExpertGroups([b] * m, device, dtype=dtype)


def _moe_partial(moe, x: Tensor) -> Tensor:
    """This rank's experts on x [B, h]: the part of the mixture they own, a partial [B, h] of the output
    (accumulation dtype). The shared expert adds its own columns.

    Routing is the training layer's (:meth:`TSPMoE.route`, replicated, identical on every rank). Where grouped GEMMs
    run (CUDA, bf16/fp16), the B*k (token, slot) rows are sorted by owned expert on the device and only the routed
    experts' weights are read (:func:`_routed_rows`); elsewhere every owned expert runs on all B tokens, weighted by
    its combination weight (0 for a token not routed to it). Both keep fixed shapes and no host synchronisation, so
    the step stays one CUDA graph, and both run the training layer's :func:`experts_forward`."""
    weights, experts, _ = moe.route(x)  # [B, k]
    w_gu, w_d = (local_tensor(p).to(x.dtype) for p in (moe.experts.gate_up_proj, moe.experts.down_proj))
    m, f = w_d.shape[0], w_d.shape[2]
    b, h = x.shape
    local = experts - moe.tsp.rank * m  # [B, k] owned expert index, outside [0, m) when routed elsewhere
    mine = (local >= 0) & (local < m)
    if grouped_gemm_works(x.device, x.dtype):
        y = _routed_rows(x, torch.where(mine, local, m), weights, w_gu, w_d)
    else:
        comb = torch.zeros(b, m, dtype=x.dtype, device=x.device)  # combination weight of owned expert j, [B, m]
        comb.scatter_add_(1, local.clamp(0, m - 1), torch.where(mine, weights, 0))  # a token's k experts differ
        xs = x.unsqueeze(0).expand(m, b, h).reshape(m * b, h)  # expert j's rows: [j B, (j+1) B)
        gu, out = x.new_empty(m * b, 2 * f), x.new_empty(m * b, h)
        experts_forward(_equal_groups(m, b, x.device, x.dtype), xs, w_gu, w_d, gu, out)
        y = (comb.T.reshape(m * b, 1) * out).view(m, b, h).sum(0, dtype=acc_dtype(x.dtype))  # [B, h]
    if moe.shared_expert is not None:
        y += _mlp_partial(moe.shared_expert, x)
    return y


def _routed_rows(x: Tensor, key: Tensor, weights: Tensor, w_gu: Tensor, w_d: Tensor) -> Tensor:
    """x [B, h] through the owned experts it is routed to: ``key`` [B, k] owned expert of each (token, slot), m
    where the slot's expert lives on another rank. Rows sorted by key on the device; the grouped GEMMs cover the
    owned experts' rows only (the others, sorted last, are past the groups' end, then masked), so an expert no row
    is routed to is not read. Combined per token in slot order (deterministic)."""
    b, k = key.shape
    m, h, f = w_d.shape
    order = torch.argsort(key.reshape(-1), stable=True)  # [B*k] sorted row -> (token, slot)
    counts = torch.zeros(m + 1, dtype=torch.int64, device=x.device)  # not bincount: it syncs the host on CUDA
    counts.scatter_add_(0, key.reshape(-1), torch.ones_like(key.reshape(-1)))
    offs = counts[:m].cumsum(0).to(torch.int32)
    gu, out = x.new_empty(b * k, 2 * f), torch.empty(b * k, h, dtype=acc_dtype(x.dtype), device=x.device)
    experts_forward(ExpertGroups.from_device_offsets(offs), x[order // k], w_gu, w_d, gu, out)
    owned = torch.arange(b * k, device=x.device) < offs[-1]  # rows routed to this rank's experts
    rows = torch.zeros_like(out)
    rows[order] = torch.where(owned[:, None], out * weights.reshape(-1)[order, None], 0)
    return rows.view(b, k, h).sum(1)


def mlp_decode(mlp, x: Tensor) -> Tensor:
    """The MLP of one decode step on x [B, h] (normed, replicated): owned slices, then one all-reduce."""
    partial = _moe_partial(mlp, x) if isinstance(mlp, TSPMoE) else _mlp_partial(mlp, x)
    return _sum_over_group(partial, mlp.tsp)


def _norm_args(norm) -> tuple[Tensor, float]:
    return local_tensor(norm.weight), norm.eps


def _step(model, cache: KVCache, tokens: Tensor) -> Tensor:
    """The device work of one decode step (no host synchronisation, fixed shapes): final-norm hidden [B, h]."""
    layers = model.model.layers
    x = embed_tokens(model, tokens)
    h = rms_norm(x, *_norm_args(layers[0].input_layernorm))
    slot, positions = cache.claim_slot()
    cos, sin = model.rope(positions, x.dtype)  # [B, d]
    for i, layer in enumerate(layers):
        y = attention_decode(layer.self_attn, h, cos, sin, cache.k[i], cache.v[i], slot, cache.slot_pos)
        x, h = _add_norm(x, y, *_norm_args(layer.post_attention_layernorm))
        after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.model.norm
        x, h = _add_norm(x, mlp_decode(layer.mlp, h), *_norm_args(after))
    cache.advance()
    return h


@torch.no_grad()
def decode_step(model, cache: KVCache, tokens: Tensor) -> Tensor:
    """Process one new token per sequence (``tokens`` [B], identical on every rank) at position
    ``prompt_len + cache.step``; append its K/V on rank ``cache.step % D``. Returns the final-norm hidden state
    [B, h], replicated on every rank. Updates only ``cache``."""
    cache.check_room()
    hidden = _step(model, cache, tokens)
    cache.step += 1
    return hidden


class Decoder:
    """Runs decode steps and returns this rank's local logits [B, V/D] (fp32; fp64 stays fp64).

    ``graphs=True`` (default on CUDA) captures one step, LM head included, in a CUDA graph after ``warmup`` eager
    steps and replays it for every later token: the same kernels on the same buffers, launched at once. The
    collectives are captured with it (NCCL supports capture; the fake process group issues nothing). The first
    steps run eagerly and are real steps, so the capture itself changes nothing.

    A decoder serves any number of prompt batches of its cache's shapes: refill the same cache with
    :meth:`prefill` (or ``prefill(..., cache=decoder.cache)``, which empties it in place) and call on; the graph
    keeps replaying over the same buffers (this is how ``generate`` keeps decoders across calls, see
    :mod:`lightning_tsp.inference.decoders`). It refers to the model weakly, so a kept decoder does not keep its
    model alive.
    """

    def __init__(self, model, cache: KVCache, graphs: bool | None = None, warmup: int = 2):
        self._model, self.cache = weakref.ref(model), cache
        device = cache.slot_pos.device
        self.graphs = device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, this cache is on {device}")
        self.warmup = warmup
        self.graph = None
        self.tokens = torch.zeros(cache.prompt_lens.shape[0], dtype=torch.long, device=device)
        self.logits: Tensor | None = None
        # the prefill's graph (see :meth:`prefill`) and its static input and output buffers
        self.prefill_graph = None
        self.prefill_graph_error: Exception | None = None  # why a capture failed (then the prefill runs eagerly)
        self._prompt: tuple[Tensor, Tensor] | None = None
        self._hidden: Tensor | None = None

    @property
    def model(self):
        model = self._model()
        if model is None:
            raise RuntimeError("this Decoder's model has been deleted")
        return model

    @property
    def graphs_prefill(self) -> bool:
        """Whether :meth:`prefill` runs from a CUDA graph: graphs on, dense layers (an expert dispatch reads its
        row counts on the host), at most :data:`PREFILL_GRAPH_MAX_TOKENS` local prompt tokens, and no failed
        capture (:attr:`prefill_graph_error`)."""
        local = self.cache.prompt_lens.shape[0] * self.cache.prefill_slots
        return (self.graphs and not self.model.cfg.num_experts and local <= PREFILL_GRAPH_MAX_TOKENS
                and self.prefill_graph_error is None)

    @torch.no_grad()
    def prefill(self, padded_ids: Tensor, prompt_lens: Tensor, decode_steps: int) -> Tensor:
        """Refill this decoder's cache with a new prompt batch of its shapes (:func:`prefill` with ``cache=``);
        returns the final-norm hidden state [B, h] of each sequence's last prompt token. Where
        :attr:`graphs_prefill`, the first refill captures the prefill (the call that built this decoder ran it
        eagerly with these shapes: kernels and plans are initialised) and every later refill copies the prompt
        batch into the graph's input buffers and replays it: the same kernels on the same buffers, launched at
        once. The returned tensor is the graph's output buffer: the next refill overwrites it."""
        if self.prefill_graph is None and self.graphs_prefill:
            self._capture_prefill(padded_ids, prompt_lens, decode_steps)
        if self.prefill_graph is None:
            return prefill(self.model, padded_ids, prompt_lens, decode_steps, cache=self.cache)[1]
        for buf, new in zip(self._prompt, (padded_ids, prompt_lens)):
            buf.copy_(new)
        self.prefill_graph.replay()  # capture records without running: the first replay is the first refill
        self.cache.step = 0  # the host side of the refill (KVCache.reuse), which the replay does not run
        return self._hidden

    def _capture_prefill(self, padded_ids: Tensor, prompt_lens: Tensor, decode_steps: int) -> None:
        """Capture the prefill over static copies of the prompt batch; a capture that raises leaves no graph (it
        computed nothing) and a warning, and this decoder prefills eagerly from then on."""
        self._prompt = (padded_ids.clone(), prompt_lens.to(padded_ids.device, copy=True))
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self._hidden = prefill(self.model, *self._prompt, decode_steps, cache=self.cache)[1]
        except RuntimeError as e:
            self.prefill_graph_error = e
            warnings.warn(f"the prefill could not be captured in a CUDA graph ({type(e).__name__}: {e}); this "
                          f"decoder prefills eagerly (same result)", RuntimeWarning, stacklevel=4)
            return
        self.prefill_graph = graph  # only a complete capture is kept

    def _eager(self) -> Tensor:
        model = self.model
        return local_logits(model, _step(model, self.cache, self.tokens))

    @torch.no_grad()
    def __call__(self, tokens: Tensor) -> Tensor:
        self.cache.check_room()
        self.tokens.copy_(tokens)
        if self.graph is not None:
            self.graph.replay()
        elif self.graphs and self.cache.step >= self.warmup:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.logits = self._eager()
            graph.replay()  # capture records without running: run the step now
            self.graph = graph  # only a complete capture is kept
        else:
            self.logits = self._eager()
        self.cache.step += 1
        return self.logits
