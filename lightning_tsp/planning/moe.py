"""Expert ring or expert dispatch: which of TSPMoE's two exact schedules is cheaper (pure Python, no torch).

One MoE layer on one rank of a TSP group of D ranks (each rank owns E/D whole experts and N = B*S/D tokens).
k = top_k, F = expert width, h = hidden, a = compute dtype bytes, acc = max(a, 4) (the accumulation dtype),
M = E/D * 3*F*h elements (one rank's packed experts: gate|up [E/D, 2F, h] + down [E/D, h, F]).

ring      expert weights circulate (``ring_shards`` / ``RingGradPass``), tokens stay.
          bytes sent   forward  (D-1) * M * a          backward (D-1) * M * (a + acc)   (independent of N)
          time         forward  (D-1) * max(c, x_w) + c                     c = compute / D, x_w = one weight hop
                       backward (D-1) * max(2c, x_w + x_acc) + 2c          x_acc = one fp32 accumulator hop
                       (``RingGradPass`` computes a shard's partial while the accumulator of the ranks before
                       travels, so both hops of a step hide behind its GEMMs)
                       + one host sync (the routing sort's counts), as dispatch's first
dispatch  routed rows go to the experts' owners by variable-size all-to-alls, weights stay (blocking).
          bytes sent   forward  (D-1)/D * (E*8 + N*k*h*(a + acc))   E int64 counts, rows out, outputs back
                       backward (D-1)/D * N*k*(h+1)*(a + acc)       [dy | weight] out, [dx | d weight] back
          time         compute + bytes / all-to-all bandwidth + 3 (+2) all-to-all latencies + 2 host syncs
                       + DISPATCH_PASS_S per pass (forward 1, backward 2: measured row handling, hardware.py)
compute   forward 6*N*k*F*h FLOPs (gate|up GEMM 4NkFh, down 2NkFh), backward twice that; routing assumed balanced.

Ring time is compute plus a constant that shrinks as N grows; dispatch's is compute plus a term growing with N:
dispatch wins below one local token count (:func:`crossover_tokens`), the ring from there on.
"""

from __future__ import annotations

from functools import lru_cache

from .hardware import (ALL_TO_ALL_LATENCY_S, DISPATCH_PASS_S, HOST_SYNC_S, INTER_LATENCY_S, INTRA_LATENCY_S,
                       Hardware, get_hardware)

__all__ = ["EXPERT_SCHEDULES", "expert_schedule_costs", "choose_expert_schedule", "crossover_tokens"]

EXPERT_SCHEDULES = ("ring", "dispatch")
COUNT_BYTES = 8  # the per-expert row counts exchanged by dispatch are int64


def _check(num_experts: int, top_k: int, tokens: int, tsp_size: int) -> None:
    if tsp_size < 1 or num_experts < 1 or num_experts % tsp_size:
        raise ValueError(f"num_experts={num_experts} must be a positive multiple of tsp_size={tsp_size}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    if tokens < 0:
        raise ValueError(f"tokens={tokens} must be >= 0")


def expert_schedule_costs(*, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, tokens: int,
                          tsp_size: int, compute_bytes: int = 2, hardware: str | Hardware = "h200",
                          training: bool = True, link: str = "intra") -> dict[str, dict[str, float]]:
    """Cost of one MoE layer's experts on one rank under each schedule.

    ``tokens``: routed local tokens per rank, N = B*S/D. ``link``: "intra" (the TSP group inside one node) or
    "inter". Returns ``{"ring": {...}, "dispatch": {...}}``, each with ``bytes_forward`` / ``bytes_backward``
    (bytes this rank sends), ``compute_s`` (expert GEMMs), ``comm_s`` (all transfers and fixed latencies, whether
    hidden or not) and ``time_s`` (the experts' exposed time: what the step waits for). Backward is 0 unless
    ``training``.
    """
    _check(num_experts, top_k, tokens, tsp_size)
    if link not in ("intra", "inter"):
        raise ValueError(f"link must be 'intra' or 'inter', got {link!r}")
    hw = get_hardware(hardware)
    D, h, F, a = tsp_size, hidden_size, intermediate_size, compute_bytes
    acc = max(a, 4)  # fp32 accumulators (fp64 under fp64)
    slow = max(1.0, a / 2)  # fp32 runs on TF32 tensor cores at half the bf16 rate (the planner's assumption)
    rows = tokens * top_k  # routed (token, slot) rows on this rank
    fwd_flops = 6 * rows * F * h  # gate|up [rows, 2F] + down [rows, h]
    c_fwd = fwd_flops * slow / hw.sustained_flops  # seconds
    c_bwd = 2 * c_fwd if training else 0.0
    if link == "inter":
        p2p_bw = a2a_bw = hw.inter_bw
        lat, a2a_lat = INTER_LATENCY_S, max(ALL_TO_ALL_LATENCY_S, INTER_LATENCY_S)
    else:
        p2p_bw, a2a_bw, lat, a2a_lat = hw.intra_p2p_bw, hw.intra_bw, INTRA_LATENCY_S, ALL_TO_ALL_LATENCY_S

    # ---- ring: D-1 hops per pass, each overlapped with the GEMMs of the experts that just arrived ----
    M = num_experts // D * 3 * F * h  # elements of one rank's packed experts
    hops = D - 1
    x_w = M * a / p2p_bw + lat if hops else 0.0  # one weight hop
    x_acc = M * acc / p2p_bw + lat if hops else 0.0  # one fp32 accumulator hop
    c, cb = c_fwd / D, c_bwd / D  # compute per hop (1/D of the rows meet each passing shard)
    ring_fwd = hops * max(c, x_w) + c + HOST_SYNC_S
    ring_bwd = 0.0
    if training and D == 1:
        ring_bwd = cb
    elif training:
        ring_bwd = hops * max(cb, x_w + x_acc) + cb
    ring = {
        "bytes_forward": hops * M * a,
        "bytes_backward": hops * M * (a + acc) if training else 0,
        "compute_s": c_fwd + c_bwd,
        "overhead_s": 0.0,
        "comm_s": hops * (x_w + (x_w + x_acc if training else 0.0)) + HOST_SYNC_S,
        "time_s": ring_fwd + ring_bwd,
    }

    # ---- dispatch: rows to the owners and back, blocking ----
    out = (D - 1) / D  # the part of an all-to-all buffer that leaves the rank
    b_fwd = out * (num_experts * COUNT_BYTES + rows * h * (a + acc))
    b_bwd = out * rows * (h + 1) * (a + acc) if training else 0.0
    calls = (3 + (2 if training else 0)) if D > 1 else 0
    comm = (b_fwd + b_bwd) / a2a_bw + calls * a2a_lat + 2 * HOST_SYNC_S
    # the rows' sorting, gathers and scatters and the count exchange's host syncs (measured, hardware.py)
    extra = DISPATCH_PASS_S * (3 if training else 1) if D > 1 else 0.0
    dispatch = {
        "bytes_forward": b_fwd,
        "bytes_backward": b_bwd,
        "compute_s": c_fwd + c_bwd,
        "overhead_s": extra,
        "comm_s": comm,
        "time_s": c_fwd + c_bwd + extra + comm,
    }
    return {"ring": ring, "dispatch": dispatch}


@lru_cache(maxsize=4096)  # called per layer call at run time with the same few shapes
def choose_expert_schedule(*, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, tokens: int,
                           tsp_size: int, compute_bytes: int = 2, hardware: str | Hardware = "h200",
                           training: bool = True, link: str = "intra") -> str:
    """"ring" or "dispatch", whichever :func:`expert_schedule_costs` finds faster (ties and D == 1: "ring")."""
    if tsp_size == 1:
        return "ring"
    costs = expert_schedule_costs(num_experts=num_experts, hidden_size=hidden_size,
                                  intermediate_size=intermediate_size, top_k=top_k, tokens=tokens,
                                  tsp_size=tsp_size, compute_bytes=compute_bytes, hardware=hardware,
                                  training=training, link=link)
    return "dispatch" if costs["dispatch"]["time_s"] < costs["ring"]["time_s"] else "ring"


def crossover_tokens(*, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, tsp_size: int,
                     compute_bytes: int = 2, hardware: str | Hardware = "h200", training: bool = True,
                     link: str = "intra") -> int | None:
    """The smallest local token count N (per rank) from which the ring is chosen; dispatch below it.

    None when one schedule always wins (D == 1, or the ring already at N = 1; dispatch cannot win for ever: its
    traffic grows with N while the ring's does not). dispatch time - ring time never decreases with N, so a
    bisection finds it.
    """
    def pick(n: int) -> str:
        return choose_expert_schedule(num_experts=num_experts, hidden_size=hidden_size,
                                      intermediate_size=intermediate_size, top_k=top_k, tokens=n,
                                      tsp_size=tsp_size, compute_bytes=compute_bytes, hardware=hardware,
                                      training=training, link=link)

    if tsp_size == 1 or pick(1) == "ring":
        return None
    lo, hi = 1, 2  # invariant: dispatch at lo, ring at hi
    while pick(hi) == "dispatch":
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if pick(mid) == "dispatch" else (lo, mid)
    return hi
