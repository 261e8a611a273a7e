"""Shard grouping for the broadcast schedule: how many owners' attention shards one step runs at once.

At short sequences the broadcast schedule's D steps per layer are small (a few heads over S/D tokens each) and
their fixed per-step cost dominates; grouping g owners makes D/g steps of g times the work, exactly. The price is
memory: a step gathers the K/V of g times the heads over the whole sequence (plus their fp32 gradients in
backward). ``auto`` takes the largest valid g whose gathered K/V stay within :data:`GROUP_KV_BUDGET_BYTES`.

The MLP ring's weight gradients have the same short-sequence choice (:func:`mlp_grads_by_owners`): the fp32
accumulator travelling with each shard, or each shard's activation gradients sent to its owner.
"""

from __future__ import annotations

# bf16 K/V of one step's heads over the whole sequence. Chosen from the H200 measurements (docs/benchmarks.md):
# at D = 8 on the paper's 7B (4 KV heads per owner) it groups all 8 owners at 16K and none at 128K.
GROUP_KV_BUDGET_BYTES = 256 * 2**20


def valid_shard_groups(tsp_size: int, kv_replicas: int = 1) -> list[int]:
    """Group sizes g that run: g divides D and nests with the KV replicas (g | r or r | g)."""
    return [g for g in range(1, tsp_size + 1)
            if tsp_size % g == 0 and (g % kv_replicas == 0 or kv_replicas % g == 0)]


def step_kv_heads(g: int, kv_heads_per_owner: int, kv_replicas: int = 1) -> int:
    """Distinct KV heads of one grouped step (a replicated KV head counts once)."""
    return g * kv_heads_per_owner // min(g, kv_replicas)


def choose_shard_group(tsp_size: int, seq_len: int, batch: int, kv_heads_per_owner: int, head_dim: int,
                       kv_replicas: int = 1, elem_bytes: int = 2, budget_bytes: int = GROUP_KV_BUDGET_BYTES) -> int:
    """The largest valid g whose gathered K/V [B, S, 2 n_kv(g), d] fit ``budget_bytes`` (at least 1)."""
    best = 1
    for g in valid_shard_groups(tsp_size, kv_replicas):
        kv = batch * seq_len * 2 * step_kv_heads(g, kv_heads_per_owner, kv_replicas) * head_dim * elem_bytes
        if kv <= budget_bytes:
            best = max(best, g)
    return best


MLP_WEIGHT_GRADS = ("auto", "ring", "owners")


def mlp_grads_by_owners(weight_grads: str, tokens: int, hidden: int, shard_ffn: int, tsp_size: int,
                        act_bytes: int, acc_bytes: int = 4) -> bool:
    """Whether a gated-MLP ring's backward sends each shard's activation gradients to its owner
    (``lightning_tsp.layers.mlp``) instead of moving the shard's accumulator round the ring.

    Per rank and backward, both send D-1 weight hops, and then either D-1 accumulators of 3 F/D h elements
    (``acc_bytes`` each), or ``tokens`` x (2 h all-gathered: the input and the output gradient; 3 F/D to the
    owner: the gate/up and hidden-activation gradients) elements (``act_bytes``) D-1 times. ``"auto"`` takes the
    smaller: "owners" below 3 F/D h acc / ((2 h + 3 F/D) act) local tokens (3,511 for the paper's 7B at D = 8 in
    bf16), where the ring's accumulating GEMMs are also memory-bound. ``weight_grads`` is one of
    :data:`MLP_WEIGHT_GRADS`, checked where it is configured (``ModelConfig``, ``TSPGatedMLP``)."""
    if tsp_size == 1 or weight_grads == "ring":
        return False
    if weight_grads == "owners":
        return True
    return tokens * (2 * hidden + 3 * shard_ffn) * act_bytes < 3 * shard_ffn * hidden * acc_bytes
