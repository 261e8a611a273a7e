"""The exact collectives a TSP group issues, byte for byte, and wire-level estimates.

Byte convention (matches what a runtime counter records per call):
  broadcast -> the broadcast buffer; all_gather_into_tensor -> the OUTPUT tensor; reduce_scatter_tensor -> the
  INPUT tensor; reduce / all_reduce -> the buffer; send -> the sent tensor (sends only; each has a matching recv).
All numbers are what ONE rank of a TSP group of D ranks issues (every rank issues the same calls).
Notation: B micro-batch, S sequence, D TSP degree, L_loc = S/D, h hidden, hd head dim, n_q / n_kv heads,
F intermediate, V vocab; ``w_bytes`` is the compute dtype's element size (weights AND activations travel in it);
gradient reductions travel in fp32 (``G_BYTES`` = 4). With D == 1 nothing is issued.
Mixture-of-experts layers (``moe=True``) replace the MLP ring by the expert ring or expert dispatch; dispatch
adds the op "all_to_all" (all_to_all_single -> the INPUT tensor), present in a tally only when issued.
"""

from __future__ import annotations

from typing import Literal

from .grouping import choose_shard_group, mlp_grads_by_owners
from .model import ModelShape

__all__ = [
    "OPS",
    "ALL_OPS",
    "PHASES",
    "G_BYTES",
    "CHECKPOINTING",
    "tsp_local_heads",
    "tsp_attn_shard_numel",
    "tsp_mlp_shard_numel",
    "tsp_vocab_shard_numel",
    "tsp_expert_shard_numel",
    "tsp_shared_expert_shard_numel",
    "tsp_moe_mlp_collectives",
    "tsp_kv_gather_numel",
    "tsp_layer_collectives",
    "tsp_embedding_collectives",
    "tsp_lm_head_collectives",
    "tsp_final_norm_collectives",
    "tsp_loss_collectives",
    "tsp_step_collectives",
    "add_tallies",
    "scale_tally",
    "wire_bytes",
]

OPS = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "all_reduce", "send")
ALL_OPS = OPS + ("all_to_all",)  # + expert dispatch's all_to_all_single (only in tallies that issue it)
PHASES = ("forward", "backward")
G_BYTES = 4  # gradient reductions are fp32
CHECKPOINTING = ("none", "selective", "full", "keep-attention", "offload", "full-offload")
RECOMPUTING = ("full", "keep-attention", "offload", "full-offload")  # re-run each layer's forward in backward
ATTENTION_REPLAYED = ("keep-attention", "offload")  # ... replaying the attention outputs (no K/V gather, no kernel)
ATTENTION_RECOMPUTED = ("full", "full-offload")  # ... re-running the K/V gathers and the attention kernels too
# the kept tensors in pinned host memory (nothing per layer on the GPU): each offload mode -> the mode it keeps for
OFFLOADS = {"offload": "keep-attention", "full-offload": "full"}
OFFLOADED = tuple(OFFLOADS)

Tally = dict[str, dict[str, int]]  # phase -> op -> bytes (or calls)
What = Literal["bytes", "calls"]


def _empty() -> Tally:
    return {p: {op: 0 for op in OPS} for p in PHASES}


def add_tallies(*tallies: Tally) -> Tally:
    out = _empty()
    for t in tallies:
        for p, ops in t.items():
            for op, v in ops.items():
                out[p][op] = out[p].get(op, 0) + v
    return out


def scale_tally(t: Tally, k: int) -> Tally:
    return {p: {op: v * k for op, v in ops.items()} for p, ops in t.items()}


def _check_what(what: str) -> None:
    if what not in ("bytes", "calls"):
        raise ValueError(f"what must be 'bytes' or 'calls', got {what!r}")


def tsp_local_heads(shape: ModelShape, D: int) -> tuple[int, int]:
    """(query heads, kv heads) per rank's head group. KV heads are split when n_kv % D == 0, otherwise each KV
    head is replicated to D / n_kv owners (then each rank's group holds one KV head)."""
    if shape.n_heads % D:
        raise ValueError(f"n_heads={shape.n_heads} is not divisible by the TSP degree D={D}")
    if shape.n_kv_heads % D == 0:
        kv = shape.n_kv_heads // D
    elif D % shape.n_kv_heads == 0:
        kv = 1
    else:
        raise ValueError(f"n_kv_heads={shape.n_kv_heads} neither divides nor is divisible by D={D}")
    return shape.n_heads // D, kv


def tsp_kv_groups(shape: ModelShape, D: int) -> int:
    """KV groups of the broadcast schedule: D (each owner its own KV heads) or n_kv (each KV head replicated on
    D / n_kv owners, its K/V gathered once and its dK/dV reduce-scattered once)."""
    return D if shape.n_kv_heads % D == 0 else shape.n_kv_heads


def tsp_attn_shard_numel(shape: ModelShape, D: int) -> int:
    """Packed attention shard [Wq_j; Wk_j; Wv_j; Wo_j] = (2 n_q/D + 2 n_kv/D) * hd * h elements."""
    q, kv = tsp_local_heads(shape, D)
    return (2 * q + 2 * kv) * shape.hd * shape.hidden_size


def tsp_mlp_shard_numel(shape: ModelShape, D: int) -> int:
    """Packed MLP shard [W_gate_j; W_up_j; W_down_j^T] = 3 F h / D elements."""
    if shape.intermediate_size % D:
        raise ValueError(f"intermediate_size={shape.intermediate_size} is not divisible by D={D}")
    return 3 * shape.intermediate_size * shape.hidden_size // D


def tsp_expert_shard_numel(shape: ModelShape, D: int) -> int:
    """Packed experts of one rank [gate_up (E/D, 2F_e, h); down (E/D, h, F_e)] = E/D * 3 F_e h elements."""
    if shape.num_experts % D:
        raise ValueError(f"num_experts={shape.num_experts} is not divisible by D={D}")
    return shape.num_experts // D * shape.expert_params


def tsp_shared_expert_shard_numel(shape: ModelShape, D: int) -> int:
    """The shared expert's dense-ring shard: 3 F_s h / D elements."""
    if shape.shared_expert_intermediate_size % D:
        raise ValueError(f"shared_expert_intermediate_size={shape.shared_expert_intermediate_size} is not "
                         f"divisible by D={D}")
    return shape.shared_expert_params // D


def tsp_vocab_shard_numel(shape: ModelShape, D: int) -> int:
    """Vocab shard of the embedding / LM head: ceil(V/D) * h elements (vocab padded to a multiple of D)."""
    return -(-shape.vocab_size // D) * shape.hidden_size


def tsp_kv_gather_numel(shape: ModelShape, B: int, S: int, D: int) -> int:
    """Output of one K/V all-gather: D * [2, B, L_loc, n_kv/D, hd] = 2 B S (n_kv/D) hd elements."""
    _, kv = tsp_local_heads(shape, D)
    return 2 * B * S * kv * shape.hd


def _check_seq(S: int, D: int) -> None:
    if S <= 0 or S % (2 * D):
        raise ValueError(f"seq_len={S} must be a positive multiple of 2*D={2 * D} (zigzag layout)")


def resolve_shard_group(shape: ModelShape, B: int, S: int, D: int, w_bytes: int, shard_group: int | str) -> int:
    """The shard group a TSP model with ``shard_group`` (an int or ``"auto"``) runs at this shape."""
    if shard_group != "auto":
        return int(shard_group)
    if D == 1:
        return 1
    _, kv = tsp_local_heads(shape, D)
    replicas = D // tsp_kv_groups(shape, D)
    return choose_shard_group(D, S, B, kv, shape.hd, replicas, w_bytes)


def _kv_exchanges(shape: ModelShape, D: int, sg: int) -> int:
    """K/V exchanges per pass: one per step that projects K/V (each distinct KV head crosses once)."""
    return min(D // sg, tsp_kv_groups(shape, D))


SHARD_PIECES = 4  # Wq, Wk, Wv, Wo^T: the packed attention shard's pieces (no biases in this model)


def _owner_weights(t: dict, D: int, sg: int, numel: int, elem: int, by: bool, one: str, grouped: str,
                   in_place: bool = False) -> None:
    """D owners' shards: one ``one`` op each (broadcast / reduce), or one ``grouped`` op (all-gather /
    reduce-scatter) of all D when the group is the whole TSP group. Bytes are the same either way. ``in_place``
    (shard groups g > 1 of distinct KV heads, ``HeadLayout.zero_copy_grouping``): one op per packed piece instead,
    each moving that piece straight into the grouped layout."""
    calls = SHARD_PIECES if in_place and sg > 1 else 1
    if sg == D:
        t[grouped] = t.get(grouped, 0) + (D * numel * elem if by else calls)
    else:
        t[one] = t.get(one, 0) + D * (numel * elem if by else calls)


def _attn_mlp_forward(shape: ModelShape, B: int, S: int, D: int, w_bytes: int, what: What, mlp: bool = True,
                      sg: int = 1) -> Tally:
    t = _empty()
    f = t["forward"]
    by = what == "bytes"
    _owner_weights(f, D, sg, tsp_attn_shard_numel(shape, D), w_bytes, by, "broadcast", "all_gather_into_tensor",
                   in_place=tsp_kv_groups(shape, D) == D)
    # per KV exchange: one all-gather per zigzag half; every KV group's K/V once
    g, e = tsp_kv_groups(shape, D), _kv_exchanges(shape, D, sg)
    f["all_gather_into_tensor"] += (g * tsp_kv_gather_numel(shape, B, S, D) * w_bytes) if by else 2 * e
    if mlp:  # the dense MLP ring
        f["send"] = (D - 1) * (tsp_mlp_shard_numel(shape, D) * w_bytes if by else 1)
    return t


def _mlp_ring_backward(b: dict, shard_numel: int, ffn: int, shape: ModelShape, B: int, S: int, D: int, w_bytes: int,
                       by: bool) -> None:
    """A gated-MLP ring's backward sends (``lightning_tsp.layers.mlp``): D-1 weight hops, then either D-1 fp32
    accumulator hops, or (``mlp_grads_by_owners``, short sequences) the input and the output gradient all-gathered
    and D-1 times this rank's gate/up and hidden gradients for one shard sent to its owner (two sends)."""
    h, n, f = shape.hidden_size, B * S // D, ffn // D
    if mlp_grads_by_owners("auto", n, h, f, D, w_bytes, G_BYTES):
        b["send"] = b.get("send", 0) + (D - 1) * ((shard_numel + n * 3 * f) * w_bytes if by else 3)
        b["all_gather_into_tensor"] = b.get("all_gather_into_tensor", 0) + (2 * D * n * h * w_bytes if by else 2)
    else:
        b["send"] = b.get("send", 0) + (D - 1) * ((shard_numel * w_bytes + shard_numel * G_BYTES) if by else 2)


def tsp_moe_mlp_collectives(
    shape: ModelShape,
    B: int,
    S: int,
    D: int,
    w_bytes: int,
    training: bool = True,
    checkpointing: str = "none",
    what: What = "bytes",
    schedule: str = "ring",
) -> Tally:
    """The MLP half of one MoE layer on one TSP rank (``lightning_tsp.layers.moe.TSPMoE``).

    Routed experts, ``schedule="ring"``: forward D-1 sends of this rank's packed experts (M_e = E/D * 3 F_e h
    elements, w_bytes); backward D-1 weight sends + D-1 accumulator sends (acc = max(w_bytes, 4) bytes per element).
    ``schedule="dispatch"``, with N = B*S/D local tokens and k = top-k: forward 3 all_to_alls (E int64 counts,
    N*k*h rows in w_bytes out, N*k*h outputs in acc back), backward 2 (N*k*(h+1) [dy | weight] in w_bytes out,
    N*k*(h+1) [dx | d weight] in acc back); routing assumed balanced (the returned buffers hold N*k rows).
    Shared expert (F_s > 0): the dense MLP ring with M_s = 3 F_s h / D. Router: one fp32 all-reduce of its E*h
    gradient in backward. "full", "keep-attention", "offload" and "selective" checkpointing re-run the MoE forward
    in backward.
    """
    _check_what(what)
    if schedule not in ("ring", "dispatch"):
        raise ValueError(f"schedule must be 'ring' or 'dispatch', got {schedule!r}")
    t = _empty()
    if D == 1:
        return t
    by = what == "bytes"
    w, acc, h = w_bytes, max(w_bytes, G_BYTES), shape.hidden_size
    f, b = t["forward"], t["backward"]
    if schedule == "ring":
        m = tsp_expert_shard_numel(shape, D)
        f["send"] += (D - 1) * (m * w if by else 1)
        b["send"] += (D - 1) * (m * (w + acc) if by else 2)
    else:
        tsp_expert_shard_numel(shape, D)  # E % D checked the same way
        rows = B * S // D * shape.experts_per_token  # routed (token, slot) rows of this rank
        f["all_to_all"] = (shape.num_experts * 8 + rows * h * (w + acc)) if by else 3  # int64 counts, rows, outputs
        b["all_to_all"] = rows * (h + 1) * (w + acc) if by else 2
    if shape.shared_expert_intermediate_size:
        ms = tsp_shared_expert_shard_numel(shape, D)
        f["send"] += (D - 1) * (ms * w if by else 1)
        _mlp_ring_backward(b, ms, shape.shared_expert_intermediate_size, shape, B, S, D, w, by)
    b["all_reduce"] += shape.router_params * G_BYTES if by else 1
    if not training:
        return {"forward": f, "backward": _empty()["backward"]}
    if checkpointing in RECOMPUTING + ("selective",):  # the MoE block's forward re-runs inside backward
        for op, v in f.items():
            b[op] = b.get(op, 0) + v
    return t


def tsp_layer_collectives(
    shape: ModelShape,
    B: int,
    S: int,
    D: int,
    w_bytes: int,
    training: bool = True,
    checkpointing: str = "none",
    what: What = "bytes",
    moe: bool = False,
    expert_schedule: str = "ring",
    shard_group: int | str = 1,
) -> Tally:
    """One transformer layer (attention broadcast schedule + MLP ring + 2 RMSNorms) on one TSP rank.

    Forward: D broadcasts of the attention shard (w_bytes), 2G K/V all-gathers (w_bytes; one per KV group and
    zigzag half; G = D, or n_kv when each KV head is replicated on D / n_kv owners), D-1 MLP ring sends. Backward: D broadcasts again, 2D K/V all-gathers again (gathered K/V are
    not saved), 2G dK/dV reduce-scatters (fp32), D weight-gradient reduces (fp32), 2 RMSNorm weight-grad
    all-reduces of h fp32 (+ one of the replicated K/V weight gradients when G < D), D-1 MLP weight sends
    (w_bytes) + D-1 fp32 gradient-accumulator sends, or at short sequences (``mlp_grads_by_owners``) two
    all-gathers of B S/D x h (w_bytes) and D-1 pairs of sends of B S/D x (2F/D, F/D) activation gradients.
    ``checkpointing="full"`` re-runs the layer forward inside backward (one more forward's worth, less the dense
    MLP ring, whose output the re-run never reads);
    "keep-attention" and "offload" the same without the K/V all-gathers (the attention outputs are replayed);
    "selective" re-runs the norm + MLP block (D-1 more MLP ring sends).
    ``moe``: an MoE layer: the MLP ring's sends are replaced by :func:`tsp_moe_mlp_collectives` with
    ``expert_schedule``.
    ``shard_group`` (g, or ``"auto"`` as the model resolves it): g owners per broadcast-schedule step. The bytes
    stay the same; with g = D the D broadcasts / reduces of the attention shards become one all-gather / one
    reduce-scatter, and the K/V exchanges fall to min(D / g, G) per pass.
    Returns phase -> op -> bytes (``what="bytes"``) or number of calls (``what="calls"``).
    """
    _check_what(what)
    if checkpointing not in CHECKPOINTING:
        raise ValueError(f"checkpointing must be one of {CHECKPOINTING}, got {checkpointing!r}")
    if D == 1:
        return _empty()
    _check_seq(S, D)
    by = what == "bytes"
    sg = resolve_shard_group(shape, B, S, D, w_bytes, shard_group)
    fwd = _attn_mlp_forward(shape, B, S, D, w_bytes, what, mlp=not moe, sg=sg)
    experts = (tsp_moe_mlp_collectives(shape, B, S, D, w_bytes, training, checkpointing, what, expert_schedule)
               if moe else _empty())
    if not training:
        return add_tallies(fwd, experts)
    attn = tsp_attn_shard_numel(shape, D)
    kv = tsp_kv_gather_numel(shape, B, S, D)
    bwd = _empty()
    b = bwd["backward"]
    g, e = tsp_kv_groups(shape, D), _kv_exchanges(shape, D, sg)
    _owner_weights(b, D, sg, attn, w_bytes, by, "broadcast", "all_gather_into_tensor", in_place=g == D)
    b["all_gather_into_tensor"] += g * kv * w_bytes if by else 2 * e
    b["reduce_scatter_tensor"] = g * kv * G_BYTES if by else 2 * e
    _owner_weights(b, D, sg, attn, G_BYTES, by, "reduce", "reduce_scatter_tensor", in_place=g == D)
    b["all_reduce"] = 2 * (shape.hidden_size * G_BYTES if by else 1)
    if g < D:  # replicated KV heads: their weight gradients summed over the group, one all-reduce
        b["all_reduce"] += (shape.n_kv_heads * 2 * shape.hd * shape.hidden_size * G_BYTES) if by else 1
    if not moe:
        _mlp_ring_backward(b, tsp_mlp_shard_numel(shape, D), shape.intermediate_size, shape, B, S, D, w_bytes, by)
    out = add_tallies(fwd, bwd)
    if checkpointing in RECOMPUTING:
        recompute = fwd["forward"]
        for op, v in recompute.items():
            # replayed attention outputs: the recomputation gathers no K/V (only the weights)
            if checkpointing in ATTENTION_REPLAYED and op == "all_gather_into_tensor":
                v = 0 if sg < D else (D * attn * w_bytes if by else SHARD_PIECES if g == D else 1)
            if op == "send" and not moe:  # the re-run skips the MLP ring (its output is never read)
                v = 0
            out["backward"][op] += v
        if sg == D:  # the re-run hands its gathered attention weights to the backward, which gathers none
            out["backward"]["all_gather_into_tensor"] -= D * attn * w_bytes if by else (SHARD_PIECES if g == D else 1)
    elif checkpointing == "selective":  # the norm + MLP block is re-run: its ring sends the weights again
        out["backward"]["send"] += fwd["forward"]["send"]
    return add_tallies(out, experts)


def _vocab_ring(shape: ModelShape, D: int, w_bytes: int, training: bool, what: What, bwd_weights: bool) -> Tally:
    t = _empty()
    if D == 1:
        return t
    shard = tsp_vocab_shard_numel(shape, D)
    by = what == "bytes"
    t["forward"]["send"] = (D - 1) * (shard * w_bytes if by else 1)
    if training:
        if bwd_weights:
            t["backward"]["send"] = (D - 1) * ((shard * w_bytes + shard * G_BYTES) if by else 2)
        else:
            t["backward"]["send"] = (D - 1) * (shard * G_BYTES if by else 1)
    return t


def tsp_embedding_collectives(
    shape: ModelShape, D: int, param_bytes: int, training: bool = True, what: What = "bytes",
    backward_weight_sends: bool = False,
) -> Tally:
    """Vocab-sharded embedding ring (shard = ceil(V/D) * h elements).

    Forward: D-1 shard sends. The shard travels in the embedding PARAMETER's dtype (``param_bytes``: the lookup
    runs outside autocast, like ``nn.Embedding``; 4 under bf16-mixed and 32-true, 2 under bf16-true).
    Backward: D-1 fp32 gradient-accumulator sends; the embedding's backward needs no weights, so the
    implementation sends none (``backward_weight_sends=True`` models a ring that also moves them: D-1 more sends
    of ``param_bytes`` each).
    """
    _check_what(what)
    t = _vocab_ring(shape, D, param_bytes, training, what, backward_weight_sends)
    return t


def tsp_lm_head_collectives(
    shape: ModelShape, D: int, w_bytes: int, training: bool = True, what: What = "bytes"
) -> Tally:
    """LM-head ring (ring cross-entropy with an online log-sum-exp): forward D-1 shard sends in the compute dtype;
    backward D-1 weight sends (the logits are recomputed) + D-1 fp32 accumulator sends. A tied head runs its own
    ring over the embedding's shard: same calls."""
    _check_what(what)
    return _vocab_ring(shape, D, w_bytes, training, what, True)


def tsp_final_norm_collectives(shape: ModelShape, D: int, training: bool = True, what: What = "bytes") -> Tally:
    """Final RMSNorm: one all-reduce of its h fp32 weight-gradient elements in backward."""
    _check_what(what)
    t = _empty()
    if D > 1 and training:
        t["backward"]["all_reduce"] = shape.hidden_size * G_BYTES if what == "bytes" else 1
    return t


def tsp_loss_collectives(
    D: int, what: What = "bytes", count_elem_bytes: int = 8, loss_elem_bytes: int = 8, count_reduced: bool = True
) -> Tally:
    """Loss: all-reduces of one element each in forward: the valid-token count and the loss sum.

    Both are counted as 8 bytes by default (an upper bound). The implementation reduces a float64 count (8) and
    an fp32 sum (the per-token losses promoted to at least fp32: 4), so ``loss_elem_bytes=4`` is exact.
    ``count_reduced=False`` when the caller passes the count (e.g. normalising over data-parallel replicas too):
    then only the loss sum. Negligible either way; the differentiable sum's backward is the identity."""
    _check_what(what)
    t = _empty()
    if D > 1:
        if what == "bytes":
            t["forward"]["all_reduce"] = loss_elem_bytes + (count_elem_bytes if count_reduced else 0)
        else:
            t["forward"]["all_reduce"] = 1 + int(count_reduced)
    return t


def tsp_step_collectives(
    shape: ModelShape,
    B: int,
    S: int,
    D: int,
    w_bytes: int,
    training: bool = True,
    checkpointing: str = "none",
    what: What = "bytes",
    param_bytes: int | None = None,
    expert_schedule: str = "ring",
    shard_group: int | str = 1,
) -> Tally:
    """Everything one TSP rank issues in one step (one micro-batch): n_layers layers (dense and MoE) + embedding +
    LM head + final norm + loss. ``param_bytes``: element size of the stored parameters (the embedding ring moves
    them as stored; default ``w_bytes``; 4 under bf16-mixed). ``expert_schedule``: the MoE layers' schedule;
    ``shard_group``: the attention's (:func:`tsp_layer_collectives`).
    Excludes the data-parallel gradient reduction (it is not a TSP-group collective)."""
    layers = [scale_tally(tsp_layer_collectives(shape, B, S, D, w_bytes, training, checkpointing, what, moe,
                                                expert_schedule, shard_group), n) for n, moe in shape.layer_kinds()]
    return add_tallies(
        *layers,
        tsp_embedding_collectives(shape, D, w_bytes if param_bytes is None else param_bytes, training, what),
        tsp_lm_head_collectives(shape, D, w_bytes, training, what),
        tsp_final_norm_collectives(shape, D, training, what),
        tsp_loss_collectives(D, what),
    )


# ----------------------------------------------------------------------------------------------------------------
# Wire level
# ----------------------------------------------------------------------------------------------------------------

_WIRE_FACTORS = {
    # bytes one rank sends (== receives) per logical byte, for bandwidth-optimal (ring) algorithms on n ranks.
    "all_gather_into_tensor": lambda n: (n - 1) / n,  # of the output
    "reduce_scatter_tensor": lambda n: (n - 1) / n,  # of the input
    "all_reduce": lambda n: 2 * (n - 1) / n,  # reduce-scatter + all-gather
    # A round of n broadcasts (one per root) delivers (n-1)/n of the total to every rank; a single broadcast with
    # scatter + all-gather costs the same per rank. Same for n reduces (reduce-scatter-like).
    "broadcast": lambda n: (n - 1) / n,
    "reduce": lambda n: (n - 1) / n,
    "send": lambda n: 1.0,  # already per rank (each send has one matching recv)
    "all_to_all": lambda n: (n - 1) / n,  # of the input: the part for the other ranks leaves
}


def wire_bytes(op: str, logical_bytes: float, group_size: int) -> float:
    """Bytes one rank puts on the wire for ``logical_bytes`` of collective ``op`` (byte convention above)."""
    if group_size <= 1:
        return 0.0
    return _WIRE_FACTORS[op](group_size) * logical_bytes
