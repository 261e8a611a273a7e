"""Prefill: one TSP forward pass over the (padded) prompt batch that leaves each rank the KV cache of its own
tokens for all heads, and the final hidden state of every sequence's last prompt token.

Padding: prompts are RIGHT-padded to a common length P (a multiple of 2D), real tokens at positions 0..L_b-1.
Under a causal mask a real token only sees earlier slots, which are all real, so the prefill attention needs no
padding mask and runs the training kernels unchanged; pad slots are marked empty (position -1) in the cache and
masked out during decoding.

The attention is the training layer's broadcast schedule itself (``layers.attention.broadcast_attention``, the
same projection code: biases, q/k norms, RoPE variant, GQA and replicated KV heads), run without saving anything;
its K/V sink writes each KV group's local (post-RoPE) k/v into the cache. The MLP (ring schedule), embedding
(vocab ring) and norms are the model's own modules run under ``no_grad``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_tsp.inference.cache import KVCache
from lightning_tsp.inference.collectives import all_reduce_
from lightning_tsp.layers.attention import broadcast_attention
from lightning_tsp.zigzag import zigzag_positions, zigzag_shard

# slots per cache row rounded up to this on CUDA: the decode GEMMs' fp32 scores and bf16 probabilities [.., T] then
# have 16-byte-aligned rows (an odd T forces cuBLAS off its vectorised kernels when g > 1 query heads share a KV
# head)
CUDA_SLOT_ALIGN = 64


def attention_prefill(attn, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor) -> Tensor:
    """The layer's own broadcast schedule (:func:`~lightning_tsp.layers.attention.broadcast_attention`, forward
    only, with the layer's shard grouping) over local tokens x [B, L, h]; every KV group's local RoPE'd k/v land
    in ``k_cache``/``v_cache`` [B, n_kv, >=L, d] (slots 0..L-1). Returns the attention output [B, L, h]."""
    # the training layer's shard grouping: g owners' shards per schedule step (a short prompt runs one step of
    # all D owners instead of D steps of a few hundred tokens each, as a training step does)
    spec = attn.spec(x.device, x.dtype, group=attn.step_group(x.shape[0], x.shape[1], x.dtype))
    nkv, l = spec.step_layout.n_kv_heads, x.shape[1]

    def into_cache(group: int, blocks: list[Tensor]) -> None:
        for (kvs, _), blk in zip(spec.buckets(), blocks):
            n = kvs.stop - kvs.start
            heads = slice(group * nkv + kvs.start, group * nkv + kvs.stop)
            k_cache[:, heads, :l] = blk[:, :, :n].transpose(1, 2)
            v_cache[:, heads, :l] = blk[:, :, n:].transpose(1, 2)

    shard = spec.layout.pack(attn.shard_params(), x.dtype)
    norms = [w.to(x.dtype) for w in attn.norm_params()]
    y, _, _ = broadcast_attention(spec, x, cos.unsqueeze(-2), sin.unsqueeze(-2), shard, norms, kv_sink=into_cache,
                                  save=False)
    return y


@torch.no_grad()
def prefill(model, padded_ids: Tensor, prompt_lens: Tensor, decode_steps: int,
            cache: KVCache | None = None) -> tuple[KVCache, Tensor]:
    """Run the prompt batch once.

    ``padded_ids`` [B, P]: the FULL right-padded batch (identical on every rank), P a multiple of 2D;
    ``prompt_lens`` [B]: real lengths; ``decode_steps``: how many decode tokens the cache must be able to take;
    ``cache``: a cache of exactly these shapes to fill in place instead of a new one (:meth:`KVCache.reuse`).
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
    shapes = dict(
        n_layers=cfg.n_layers, batch=b, n_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
        prefill_slots=s // d, decode_steps=decode_steps, rank=p, size=d, prompt_lens=prompt_lens,
        dtype=x.dtype, device=device, align=CUDA_SLOT_ALIGN if device.type == "cuda" else 1,
    )
    cache = KVCache.allocate(**shapes) if cache is None else cache.reuse(**shapes)
    real = positions[None, :] < prompt_lens.to(device)[:, None]  # [B, S/D]
    cache.slot_pos[:, : s // d] = torch.where(real, positions[None, :], -1)
    for i, layer in enumerate(model.model.layers):
        x = x + attention_prefill(layer.self_attn, layer.input_layernorm(x), cos, sin, cache.k[i], cache.v[i])
        x = x + layer.feed_forward(x)[0]  # the training layer's MLP half (dense ring or mixture of experts)
    x = model.model.norm(x)
    # the last prompt token of sequence b sits at global position L_b - 1 on exactly one rank
    is_last = positions[None, :] == (prompt_lens.to(device) - 1)[:, None]  # [B, S/D]
    last = torch.where(is_last.unsqueeze(-1), x, 0).sum(1)  # [B, h]: the row itself or zeros
    return cache, all_reduce_(last, tsp)
