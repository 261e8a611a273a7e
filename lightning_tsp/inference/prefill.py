"""Prefill: one TSP forward pass over the (padded) prompt batch that leaves each rank the KV cache of its own
tokens for all heads, and the final hidden state of every sequence's last prompt token.

Padding: prompts are RIGHT-padded to a common length P (a multiple of 2D), real tokens at positions 0..L_b-1.
Under a causal mask a real token only sees earlier slots, which are all real, so the prefill attention needs no
padding mask and runs the training kernels unchanged; pad slots are marked empty (position -1) in the cache and
masked out during decoding.

The attention is the training broadcast schedule without backward: for each owner j the packed shard
[Wq_j; Wk_j; Wv_j; Wo_j] is broadcast, every rank projects its local tokens, rotates q/k with their global
positions, all-gathers k/v over the sequence, runs its two zigzag chunks and accumulates o_j Wo_j^T. Besides, the
local (post-RoPE) k/v of head group j are written into the cache at heads [j n_kv/D, (j+1) n_kv/D). The MLP
(ring schedule), embedding (vocab ring) and norms are the model's own modules run under ``no_grad``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.collectives import all_reduce_
from lightning_tsp.inference.vocab import acc_dtype
from lightning_tsp.kernels.attention import select_attention_kernel
from lightning_tsp.kernels.gemm import add_matmul_
from lightning_tsp.layers.attention import KVGather, _AttnSpec, attend, kv_blocks, project_qkv
from lightning_tsp.layers.rope import apply_rope
from lightning_tsp.schedules.broadcast import broadcast_shards
from lightning_tsp.schedules.comm import local_tensor, pack, unpack
from lightning_tsp.zigzag import zigzag_positions, zigzag_shard


def attention_prefill(attn, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """Broadcast-schedule attention of local tokens x [B, L, h]; writes every head group's local k/v into
    ``k_cache``/``v_cache`` [B, n_kv, >=L, d] (slots 0..L-1). Returns the attention output [B, L, h]."""
    tsp, nq, nkv, hd = attn.tsp, attn.n_heads, attn.n_kv_heads, attn.head_dim
    kernel = select_attention_kernel(x.device, attn.kernel_name, x.dtype)
    spec = _AttnSpec(tsp, nq, nkv, hd, kernel, kv_bucket=attn.kv_bucket_heads)
    b, l, h = x.shape
    x2 = x.reshape(b * l, h)
    w = [local_tensor(m.weight) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)]
    shapes = [t.shape for t in w]
    cos4, sin4 = cos[:, None], sin[:, None]
    y = torch.zeros(b * l, h, dtype=acc_dtype(x.dtype), device=x.device)
    for j, buf in broadcast_shards(tsp, pack(w, x.dtype)):
        w_o = unpack(buf, shapes)[3]
        _, _, q, k, v = project_qkv(spec, x2, buf, shapes, [], b, l)
        blocks = kv_blocks(spec, k, v, cos4, sin4)
        first = KVGather(blocks[0], tsp)
        for (kvs, _), blk in zip(spec.buckets(), blocks):
            n = kvs.stop - kvs.start
            heads = slice(j * nkv + kvs.start, j * nkv + kvs.stop)
            k_cache[:, heads, :l] = blk[:, :, :n].transpose(1, 2)
            v_cache[:, heads, :l] = blk[:, :, n:].transpose(1, 2)
        o, _ = attend(spec, apply_rope(q, cos4, sin4), blocks, first, want_lse=False)
        add_matmul_(y, o.view(b * l, nq * hd), w_o.T)
    return y.view(b, l, h).to(x.dtype)


@torch.no_grad()
def prefill(model, padded_ids: Tensor, prompt_lens: Tensor, decode_steps: int) -> tuple[KVCache, Tensor]:
    """Run the prompt batch once.

    ``padded_ids`` [B, P]: the FULL right-padded batch (identical on every rank), P a multiple of 2D;
    ``prompt_lens`` [B]: real lengths; ``decode_steps``: how many decode tokens the cache must be able to take.
    Returns the cache (this rank's 1/D) and the final-norm hidden state [B, h] of each sequence's last prompt
    token, replicated on every rank (one all-reduce of B*h values).
    """
    tsp, cfg = model.tsp, model.cfg
    d, p = tsp.size, tsp.rank
    b, s = padded_ids.shape
    device = padded_ids.device
    ids = zigzag_shard(padded_ids, d, p)
    positions = zigzag_positions(s, d, p, device=device)
    x = model.model.embed_tokens(ids)
    cos, sin = model.rope(positions, x.dtype)
    cache = KVCache.allocate(
        n_layers=cfg.n_layers, batch=b, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        prefill_slots=s // d, decode_steps=decode_steps, rank=p, size=d, prompt_lens=prompt_lens,
        dtype=x.dtype, device=device,
    )
    real = positions[None, :] < prompt_lens.to(device)[:, None]  # [B, S/D]
    cache.slot_pos[:, : s // d] = torch.where(real, positions[None, :], -1)
    for i, layer in enumerate(model.model.layers):
        x = x + attention_prefill(layer.self_attn, layer.input_layernorm(x), cos, sin, cache.k[i], cache.v[i])
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    x = model.model.norm(x)
    # the last prompt token of sequence b sits at global position L_b - 1 on exactly one rank
    is_last = positions[None, :] == (prompt_lens.to(device) - 1)[:, None]  # [B, S/D]
    last = torch.where(is_last.unsqueeze(-1), x, 0).sum(1)  # [B, h]: the row itself or zeros
    return cache, all_reduce_(last, tsp)
