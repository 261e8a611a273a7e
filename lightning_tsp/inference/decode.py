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
5. MLP on the owned slices: silu(x Wg_j^T) * (x Wu_j^T) @ Wd_j^T, one all-reduce of [B, h].

Embedding: owned vocab rows + all-reduce; LM head: local logits [B, V/D] (see ``vocab.py``, ``sampling.py``).
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.collectives import all_gather_stack, all_reduce_, all_to_all
from lightning_tsp.inference.vocab import acc_dtype, embed_tokens
from lightning_tsp.layers.attention import kv_blocks, project_qkv
from lightning_tsp.layers.rope import apply_rope
from lightning_tsp.schedules.comm import local_tensor


def partial_attention(q: Tensor, k: Tensor, v: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """q [B, Hq, d] against k/v [B, Hkv, T, d] where ``valid`` [B, T]: (o [B, Hq, d], lse [B, Hq]) in fp32 or
    fp64. A sequence with no valid slot here gets o = 0, lse = -inf (it then weighs nothing in the merge)."""
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


def merge_partials(o: Tensor, lse: Tensor) -> Tensor:
    """o [D, B, H, d], lse [D, B, H] -> the exact softmax-weighted combination [B, H, d]."""
    total = torch.logsumexp(lse, dim=0)  # finite: every sequence has a valid slot on some rank
    return (torch.exp(lse - total).unsqueeze(-1) * o).sum(0)


def attention_decode(attn, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                     cache: KVCache, slot: int | None) -> Tensor:
    """x [B, h] (replicated), cos/sin [B, d] of the new tokens' positions. The owner's projection is the training
    layer's (:func:`~lightning_tsp.layers.attention.project_qkv`, :func:`~lightning_tsp.layers.attention.kv_blocks`)
    on its own parameters; the K/V source is every rank's cache slice."""
    tsp, d = attn.tsp, attn.tsp.size
    spec = dataclasses.replace(attn.spec(x.device, x.dtype), kv_bucket=None)  # one token: one bucket
    lay = spec.layout
    nq, nkv, hd, r = lay.n_heads, lay.n_kv_heads, lay.head_dim, lay.kv_replicas
    b = x.shape[0]
    cos, sin = cos[:, None, None, :], sin[:, None, None, :]  # broadcast against [B, 1, n, d]
    view = lay.params_view([p.to(x.dtype) for p in attn.shard_params()])
    p = project_qkv(spec, view, x, [w.to(x.dtype) for w in attn.norm_params()], b, 1)
    kv = kv_blocks(spec, p.k, p.v, cos, sin)[0][:, 0]  # [B, 2 nkv, d]
    q = apply_rope(p.q, cos, sin)[:, 0]  # [B, nq, d]
    qkv = all_gather_stack(torch.cat([q, kv], dim=1), tsp)  # [D, B, nq + 2 nkv, d]
    q_all = qkv[:, :, :nq].transpose(0, 1).reshape(b, d * nq, hd)  # head order = Hugging Face order
    if slot is not None:  # one copy of each KV group (its first owner's)
        kv_all = qkv[::r, :, nq:].transpose(0, 1)  # [B, n_kv / nkv, 2 nkv, d]
        k_cache[:, :, slot] = kv_all[:, :, :nkv].reshape(b, -1, hd)
        v_cache[:, :, slot] = kv_all[:, :, nkv:].reshape(b, -1, hd)
    n = cache.length
    o, lse = partial_attention(q_all, k_cache[:, :, :n], v_cache[:, :, :n], cache.valid())
    send = torch.cat([o, lse.unsqueeze(-1)], dim=-1).view(b, d, nq, hd + 1).transpose(0, 1)  # [D, B, nq, d+1]
    recv = all_to_all(send, tsp)  # row p: rank p's partials for MY heads
    o_mine = merge_partials(recv[..., :hd], recv[..., hd])  # [B, nq, d]
    y = o_mine.reshape(b, nq * hd).to(x.dtype) @ view.w_o.T
    return all_reduce_(y.to(acc_dtype(x.dtype)), tsp).to(x.dtype)


def mlp_decode(mlp, x: Tensor) -> Tensor:
    wg, wu, wd = (local_tensor(m.weight) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    y = (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T
    return all_reduce_(y.to(acc_dtype(x.dtype)), mlp.tsp).to(x.dtype)


@torch.no_grad()
def decode_step(model, cache: KVCache, tokens: Tensor) -> Tensor:
    """Process one new token per sequence (``tokens`` [B], identical on every rank) at position
    ``prompt_len + cache.step``; append its K/V on rank ``cache.step % D``. Returns the final-norm hidden state
    [B, h], replicated on every rank. Updates only ``cache``."""
    cfg = model.cfg
    x = embed_tokens(model, tokens)
    cos, sin = model.rope(cache.next_positions(), x.dtype)  # [B, d]
    slot = cache.claim_slot()
    for i, layer in enumerate(model.model.layers):
        x = x + attention_decode(layer.self_attn, layer.input_layernorm(x), cos, sin, cache.k[i], cache.v[i],
                                 cache, slot)
        x = x + mlp_decode(layer.mlp, layer.post_attention_layernorm(x))
    cache.step += 1
    return model.model.norm(x)
