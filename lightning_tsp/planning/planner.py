"""Candidate layouts for a cluster, input validation, ranking and the recommendation."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .hardware import GiB, Hardware
from .model import ModelShape
from .precision import Precision
from .strategies import Estimate, Layout, estimate

__all__ = ["PlanError", "Plan", "divisors", "validate", "candidate_layouts", "make_plan", "format_table"]


class PlanError(ValueError):
    """An impossible request; the message names the value and the fix."""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mlp_ok(shape: ModelShape, d: int, whole_experts: bool = False) -> bool:
    """The MLPs split over d ranks: the dense MLP's and the shared expert's columns, and the routed experts whole
    (TSP: num_experts % d) or by columns (TP: each expert's width % d)."""
    if shape.n_moe_layers < shape.n_layers and shape.intermediate_size % d:
        return False
    if not shape.is_moe:
        return True
    experts = shape.num_experts if whole_experts else shape.expert_intermediate_size
    return experts % d == 0 and shape.shared_expert_intermediate_size % d == 0


def _mlp_need(shape: ModelShape) -> str:
    """What TSP's MLP split needs divisible by D, for messages."""
    need = [f"intermediate_size={shape.intermediate_size}"] if shape.n_moe_layers < shape.n_layers else []
    if shape.is_moe:
        need.append(f"num_experts={shape.num_experts}")
    if shape.shared_expert_intermediate_size:
        need.append(f"shared_expert_intermediate_size={shape.shared_expert_intermediate_size}")
    return " and ".join(need)


def _head_ok(shape: ModelShape, d: int, whole_experts: bool = False) -> bool:
    """Heads and MLP split over d ranks (KV heads split, or replicated to d / n_kv owners); ``whole_experts``:
    TSP's split of an MoE model (E/d whole experts per rank) instead of TP's (every expert's columns)."""
    kv = shape.n_kv_heads
    return shape.n_heads % d == 0 and (kv % d == 0 or d % kv == 0) and _mlp_ok(shape, d, whole_experts)


def _next_multiple(x: int, m: int) -> int:
    return -(-x // m) * m


def _validate_degree(shape: ModelShape, seq_len: int, gpus: int, D: int) -> None:
    if D < 2:
        raise PlanError(f"--tsp-degree {D} must be at least 2")
    if gpus % D:
        raise PlanError(f"--tsp-degree {D} does not divide --gpus {gpus}: use a divisor of {gpus}")
    if shape.n_heads % D:
        raise PlanError(f"--tsp-degree {D} does not divide n_heads={shape.n_heads}: use a divisor of "
                        f"{shape.n_heads} ({[d for d in divisors(shape.n_heads) if d >= 2 and gpus % d == 0]})")
    if not (shape.n_kv_heads % D == 0 or D % shape.n_kv_heads == 0):
        raise PlanError(f"--tsp-degree {D}: n_kv_heads={shape.n_kv_heads} must divide D or be divisible by it")
    if not _mlp_ok(shape, D, whole_experts=True):
        raise PlanError(f"--tsp-degree {D} does not divide {_mlp_need(shape)}")
    if seq_len % (2 * D):
        raise PlanError(
            f"--seq-len {seq_len} is not divisible by 2*D = {2 * D} (zigzag layout for --tsp-degree {D}): use "
            f"--seq-len {_next_multiple(seq_len, 2 * D)}"
        )


def validate(shape: ModelShape, seq_len: int, gpus: int, gpus_per_node: int, micro_batch: int = 1,
             tsp_degree: int | None = None) -> list[int]:
    """Raise PlanError for impossible inputs; return the usable TSP degrees D (>= 2) for this request."""
    for name, v in (("--gpus", gpus), ("--gpus-per-node", gpus_per_node), ("--seq-len", seq_len),
                    ("--micro-batch", micro_batch)):
        if v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v}")
    if gpus % gpus_per_node:
        lo = max(gpus_per_node, gpus // gpus_per_node * gpus_per_node)
        hi = _next_multiple(gpus, gpus_per_node)
        raise PlanError(
            f"--gpus {gpus} is not a multiple of --gpus-per-node {gpus_per_node}: use whole nodes "
            f"(e.g. --gpus {lo} or --gpus {hi}), or set --gpus-per-node to a divisor of {gpus}"
        )
    if tsp_degree is not None:
        _validate_degree(shape, seq_len, gpus, tsp_degree)
        return [tsp_degree]
    if gpus == 1:
        return []
    cand = [d for d in divisors(gpus) if d >= 2]
    heads = [d for d in cand if shape.n_heads % d == 0 and (shape.n_kv_heads % d == 0 or d % shape.n_kv_heads == 0)]
    if not heads:
        d = next((d for d in range(2, shape.n_heads + 1) if shape.n_heads % d == 0 and
                  (shape.n_kv_heads % d == 0 or d % shape.n_kv_heads == 0)), None)
        fix = (f"e.g. --gpus {math.lcm(gpus, d)} (D={d})" if d else "none exists for a single-head model")
        raise PlanError(
            f"n_heads={shape.n_heads} (n_kv_heads={shape.n_kv_heads}) of model {shape.name!r}: no TSP degree D in "
            f"{cand} (the divisors of --gpus {gpus}) divides the head count. TSP needs n_heads % D == 0: use a "
            f"--gpus that has such a divisor, {fix}"
        )
    ffn = [d for d in heads if _mlp_ok(shape, d, whole_experts=True)]
    if not ffn and not shape.is_moe:
        raise PlanError(
            f"intermediate_size={shape.intermediate_size} is not divisible by any head-compatible TSP degree "
            f"{heads}: the MLP ring needs intermediate_size % D == 0"
        )
    if not ffn:
        raise PlanError(f"no head-compatible TSP degree in {heads} divides {_mlp_need(shape)}: each rank holds "
                        f"num_experts/D whole experts (and 1/D of each dense MLP's columns)")
    seq = [d for d in ffn if seq_len % (2 * d) == 0]
    if not seq:
        d = min(ffn)
        raise PlanError(
            f"--seq-len {seq_len} is not divisible by 2*D for any TSP degree D in {ffn} (the zigzag layout cuts the "
            f"sequence into 2*D chunks): use --seq-len {_next_multiple(seq_len, 2 * max(ffn))} "
            f"(a multiple of {2 * max(ffn)}), or at least a multiple of {2 * d}"
        )
    return seq


def candidate_layouts(shape: ModelShape, seq_len: int, gpus: int, gpus_per_node: int,
                      notes: list[str] | None = None, tsp_degree: int | None = None) -> list[Layout]:
    """Every layout worth evaluating: model-parallel degrees divide the GPU count, heads / intermediate / sequence
    constraints hold; the rest of the GPUs are data-parallel replicas."""
    notes = notes if notes is not None else []
    gpn = gpus_per_node
    out = [Layout("dp", gpus, gpn)]
    for f in sorted({min(gpn, gpus), gpus}):
        if f >= 2:
            out.append(Layout("fsdp", gpus, gpn, fsdp=f))
    ds = [d for d in divisors(gpus) if d >= 2]
    skipped = []
    for d in ds:
        if _head_ok(shape, d):
            out.append(Layout("tp", gpus, gpn, tp=d))
            out.append(Layout("tp_sp", gpus, gpn, tp=d))
        if not _head_ok(shape, d, whole_experts=True) or (tsp_degree is not None and d != tsp_degree):
            continue
        if seq_len % (2 * d) == 0:
            out.append(Layout("tsp", gpus, gpn, tsp=d))
        else:
            skipped.append(d)
    if skipped:
        notes.append(f"TSP with D in {skipped} skipped: --seq-len {seq_len} is not a multiple of 2*D")
    for d in ds:
        if seq_len % (2 * d) == 0:
            out.append(Layout("sp", gpus, gpn, sp=d))
    for t in ds:
        if t > gpn or gpn % t or not _head_ok(shape, t):
            continue  # TP stays inside a node
        for sig in ds:
            if sig >= 2 and gpus % (t * sig) == 0 and seq_len % (2 * sig) == 0:
                out.append(Layout("tp_x_sp", gpus, gpn, tp=t, sp=sig))
    return out


@dataclass
class Plan:
    estimates: list[Estimate]
    recommended: Estimate | None
    reason: str
    notes: list[str] = field(default_factory=list)


THROUGHPUT_TIE = 0.02  # layouts within 2% of the best throughput count as equally fast
OVERLAP_SLACK = 0.5  # hidden communication above this fraction of compute time is a risk (overlap is imperfect)


def _rank_key(e: Estimate):
    return (not e.fits, -e.tokens_per_s if e.fits else e.peak_bytes)


def _risky(e: Estimate) -> bool:
    return e.comm_overlap_s > OVERLAP_SLACK * e.compute_s


def _rank(ests: list[Estimate]) -> list[Estimate]:
    """Fitting layouts first, fastest first; among those within THROUGHPUT_TIE of the fastest, first those whose
    overlapped communication needs less than OVERLAP_SLACK of the compute time to hide (robust to imperfect
    overlap), then the smallest peak memory (headroom for a larger micro-batch or context). Then the layouts
    that do not fit, by memory."""
    ests = sorted(ests, key=_rank_key)
    fit = [e for e in ests if e.fits]
    if fit:
        top = fit[0].tokens_per_s
        tied = sorted((e for e in fit if e.tokens_per_s >= (1 - THROUGHPUT_TIE) * top),
                      key=lambda e: (_risky(e), e.peak_bytes))
        rest = [e for e in ests if e not in tied]
        ests = tied + rest
    return ests


def make_plan(shape: ModelShape, hw: Hardware, precision: Precision, seq_len: int, gpus: int, gpus_per_node: int,
              micro_batch: int = 1, checkpointing: str = "full", overlap: bool = True, headroom: float = 0.9,
              tsp_degree: int | None = None, optimizer: str = "foreach") -> Plan:
    """Validate, enumerate and rank every candidate layout (``tsp_degree`` restricts TSP to one D; ``optimizer``:
    the AdamW implementation whose step the memory model counts)."""
    validate(shape, seq_len, gpus, gpus_per_node, micro_batch, tsp_degree)
    notes: list[str] = []
    layouts = candidate_layouts(shape, seq_len, gpus, gpus_per_node, notes, tsp_degree)
    ests = [estimate(shape, l, hw, precision, micro_batch, seq_len, checkpointing, overlap, headroom, optimizer)
            for l in layouts]
    ests = _rank(ests)
    best = ests[0]
    cap = headroom * hw.hbm_bytes / GiB
    if best.fits:
        runner = next((e for e in ests[1:] if e.fits and e.layout.strategy != best.layout.strategy), None)
        mp = best.layout.model_parallel
        where = ("one model replica per node-local group of %d GPUs (model-parallel traffic on intra-node links)" % mp
                 if 1 < mp <= gpus_per_node else
                 "model-parallel groups span nodes" if mp > gpus_per_node else "no model parallelism")
        tied = sum(1 for e in ests if e.fits and e.tokens_per_s >= (1 - THROUGHPUT_TIE) * best.tokens_per_s)
        how = ("highest estimated throughput among layouts that fit" if tied == 1 else
               f"lowest peak memory among the {tied} fitting layouts within {THROUGHPUT_TIE:.0%} of the best "
               f"estimated throughput" + ("" if _risky(best) else
                                          f" whose hidden communication needs < {OVERLAP_SLACK:.0%} of compute"))
        reason = (f"{how} ({best.tokens_per_s:,.0f} tok/s, "
                  f"{best.peak_bytes / GiB:.1f} GiB of the {cap:.0f} GiB usable); {where}; "
                  f"{best.layout.dp} data-parallel replica(s)")
        if runner is not None:
            reason += (f". Next best other strategy: {runner.layout.label} {runner.layout.degrees} at "
                       f"{runner.tokens_per_s:,.0f} tok/s, {runner.peak_bytes / GiB:.1f} GiB")
    else:
        reason = (f"NOTHING FITS in {cap:.0f} GiB per GPU; the smallest footprint is {best.layout.label} "
                  f"{best.layout.degrees} at {best.peak_bytes / GiB:.1f} GiB. Try another --checkpointing or --precision (see "
                  f"'what this context needs' below), a smaller --micro-batch or --seq-len, more GPUs per model "
                  f"replica, or a GPU with more memory")
    return Plan(ests, best, reason, notes)


def select_rows(plan: Plan, per_strategy: int = 3) -> list[Estimate]:
    """The best ``per_strategy`` layouts of every strategy (plan order), strategies ordered by their best row."""
    seen: dict[str, list[Estimate]] = {}
    for e in plan.estimates:
        seen.setdefault(e.layout.strategy, [])
        if len(seen[e.layout.strategy]) < per_strategy:
            seen[e.layout.strategy].append(e)
    rows = [e for s in seen.values() for e in s]
    order = {id(e): i for i, e in enumerate(plan.estimates)}
    rows.sort(key=lambda e: order[id(e)])
    return rows


def format_table(rows: list[Estimate]) -> str:
    head = ("strategy", "degrees", "dp", "mem GiB", "fits", "intra GB/step", "inter GB/step", "step s",
            "tok/s", "tokens/step")
    lines = []
    for e in rows:
        lines.append((
            e.layout.label,
            e.layout.degrees,
            str(e.layout.dp),
            f"{e.peak_bytes / GiB:.1f}",
            "yes" if e.fits else "no",
            f"{e.step_wire('intra') / 1e9:.2f}",
            f"{e.step_wire('inter') / 1e9:.2f}",
            f"{e.step_s:.3f}",
            f"{e.tokens_per_s:,.0f}",
            f"{e.tokens_per_step:,}",
        ))
    widths = [max(len(head[i]), *(len(r[i]) for r in lines)) if lines else len(head[i]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(widths[i]) if i < 2 else c.rjust(widths[i]) for i, c in enumerate(r))
    return "\n".join([fmt(head), fmt(tuple("-" * w for w in widths))] + [fmt(r) for r in lines])

