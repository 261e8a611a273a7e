"""Communication of one decode step (one new token for each of B sequences), per rank.

Buffer sizes follow the collective's tensor (all-gather: the gathered output; all-to-all: the send buffer;
all-reduce: the tensor). Bytes a rank actually puts on the wire with ring/pairwise algorithms:
all-gather and all-to-all (D-1)/D of the buffer, all-reduce 2(D-1)/D of the tensor.
"""

from __future__ import annotations

import torch

from lightning_tsp.models.llama import ModelConfig


def decode_step_collectives(cfg: ModelConfig, batch: int, tsp_size: int, dtype=torch.bfloat16,
                            greedy: bool = True) -> dict[str, tuple[int, int]]:
    """op -> (calls, buffer bytes) of one decode step plus the greedy token choice (D = 1: nothing)."""
    if tsp_size == 1:
        return {}
    c = torch.empty((), dtype=dtype).element_size()  # compute dtype (weights, activations, q/k/v)
    a = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()  # accumulation dtype
    h, hd, nq, nkv, L = cfg.hidden_size, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.n_layers
    out = {
        # embedding rows (compute dtype) + per layer: attention output and MLP partial sums (fp32)
        "all_reduce": (1 + 2 * L, batch * h * c + 2 * L * batch * h * a),
        # per layer: q/k/v of all heads; plus the token choice (value, id) in fp64
        "all_gather": (L + 1, L * batch * (nq + 2 * nkv) * hd * c + tsp_size * batch * 2 * 8),
        # per layer: partial outputs + log-sum-exp of all query heads, to the head owners (fp32)
        "all_to_all": (L, L * batch * nq * (hd + 1) * a),
    }
    return out


def decode_bytes_sent_per_rank(cfg: ModelConfig, batch: int, tsp_size: int, dtype=torch.bfloat16) -> float:
    """Bytes one rank sends in one decode step (ring all-reduce / all-gather, pairwise all-to-all)."""
    d = tsp_size
    if d == 1:
        return 0.0
    ops = decode_step_collectives(cfg, batch, d, dtype)
    f = (d - 1) / d
    return 2 * f * ops["all_reduce"][1] + f * ops["all_gather"][1] + f * ops["all_to_all"][1]
