"""``lightning-tsp plan``: rank parallel layouts for a model, sequence length and cluster.

Example::

    python -m lightning_tsp.planning --model paper-7b --seq-len 131072 --gpus 1024 --gpus-per-node 8
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from typing import Sequence

from .collectives import CHECKPOINTING, OFFLOADS
from .hardware import HARDWARE_PRESETS, GiB, get_hardware
from .model import MODEL_PRESETS, ModelShape, get_model_shape
from .planner import PlanError, format_table, make_plan, select_rows
from .precision import PRECISIONS, get_precision
from .strategies import OPTIMIZERS, Estimate, estimate, memory_breakdown, tsp_expert_crossover_seq

__all__ = ["main", "build_parser"]


def _tokens(text: str) -> int:
    """An integer, optionally with a K (x1024) or M (x1024^2) suffix: 131072, 128K, 1M."""
    t = text.strip().upper()
    mult = 1
    if t.endswith("K"):
        mult, t = 1024, t[:-1]
    elif t.endswith("M"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        return int(t) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a token count like 131072 or 128K, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightning-tsp plan",
        description="Estimate per-GPU memory, communication and step time of DP, FSDP, TP, TP-SP, SP, TPxSP and "
                    "TSP layouts, and recommend one.",
    )
    p.add_argument("--model", required=True,
                   help=f"a preset ({', '.join(MODEL_PRESETS)}) or a path to a Hugging Face config.json")
    p.add_argument("--seq-len", type=_tokens, required=True, help="tokens per sequence (e.g. 131072 or 128K)")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", default="h200", help=f"accelerator: {', '.join(HARDWARE_PRESETS)} (default h200)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per data-parallel replica per step")
    p.add_argument("--checkpointing", default="full", choices=CHECKPOINTING,
                   help="activation checkpointing per transformer layer (default full)")
    p.add_argument("--precision", default="bf16-mixed", choices=tuple(PRECISIONS), help="default bf16-mixed")
    p.add_argument("--tsp-degree", type=int, default=None, metavar="D",
                   help="only consider this TSP degree (checked strictly: divides gpus and heads, 2*D divides seq)")
    p.add_argument("--mlp-activations", choices=("keep", "recompute"), default="keep",
                   help="TSP's MLP ring: keep the gate/up pre-activations for backward (default) or recompute them "
                        "there (less memory at long contexts, one more GEMM per shard)")
    p.add_argument("--kv-bucket-heads", type=int, default=None, metavar="N",
                   help="TSP's head bucketing (kv_bucket_heads): KV heads whose full-sequence K/V are gathered at "
                        "once (default: all of a broadcast-schedule step's)")
    p.add_argument("--host-memory", type=float, default=256.0, metavar="GB",
                   help="pinned host memory an offloading mode may use per GPU, in GB (default 256: a DGX H200's "
                        "2 TB over 8 GPUs)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="foreach",
                   help="AdamW implementation the optimizer step's peak is counted for: foreach (torch's CUDA "
                        "default: one temporary of half the optimizer state), fused (AdamW(fused=True), in place) or "
                        "forloop (default foreach)")
    p.add_argument("--headroom", type=float, default=0.9,
                   help="fraction of HBM a layout may use to count as fitting (default 0.9)")
    p.add_argument("--no-overlap", action="store_true",
                   help="assume no communication hides behind compute (step = compute + all communication)")
    p.add_argument("--all", action="store_true", help="list every candidate layout, not the best 3 per strategy")
    p.add_argument("--breakdown", action="store_true",
                   help="print the memory parts and per-layer collectives of the recommended layout")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot of memory vs sequence length per strategy")
    return p


def _describe_model(s: ModelShape) -> str:
    if s.is_moe:
        mlp = (f"{s.n_moe_layers} MoE layers of E={s.num_experts} top-{s.experts_per_token} F_e="
               f"{s.expert_intermediate_size}" + (f" + shared F_s={s.shared_expert_intermediate_size}"
                                                   if s.shared_expert_intermediate_size else "")
               + (f", {s.n_dense_layers} dense F={s.intermediate_size}" if s.n_dense_layers else ""))
        active = f", {s.active_params / 1e9:.2f}B active"
    else:
        mlp, active = f"F={s.intermediate_size}", ""
    return (f"{s.name}: V={s.vocab_size} h={s.hidden_size} L={s.n_layers} heads={s.n_heads}/{s.n_kv_heads} "
            f"hd={s.hd} {mlp}, {s.total_params / 1e9:.2f}B params "
            f"({s.non_embedding_params / 1e9:.2f}B without embeddings{active})")


def _fmt_seq(n: int) -> str:
    """A token count the way --seq-len takes it: 12K, 1.5M, 300."""
    if n >= 2**20:
        return f"{n / 2**20:.1f}M"
    return f"{n / 1024:.0f}K" if n >= 10 * 1024 else f"{n / 1024:.1f}K" if n >= 1024 else str(n)


def _expert_lines(rows: list[Estimate]) -> list[str]:
    """For an MoE model: the expert schedule of each TSP degree shown and the sequence length where it flips."""
    lines, seen = [], set()
    for e in rows:
        D = e.layout.tsp
        if e.expert_schedule is None or D in seen:
            continue
        seen.add(D)
        S = tsp_expert_crossover_seq(e.shape, e.layout, e.hardware, e.precision, e.micro_batch)
        if S is None:
            why = "cheaper at every S"
        elif e.expert_schedule == "ring":
            why = f"dispatch below S = {_fmt_seq(S)}"
        else:
            why = f"ring from S = {_fmt_seq(S)}"
        lines.append(f"experts: {e.expert_schedule} ({why} at D = {D})")
    return lines


def _shard_group_lines(rows: list[Estimate]) -> list[str]:
    """For TSP rows: the shard group ``shard_group="auto"`` runs the broadcast schedule with, per TSP degree."""
    lines, seen = [], set()
    for e in sorted(rows, key=lambda e: e.layout.tsp):
        D = e.layout.tsp
        if e.shard_group is None or D in seen or D == 1:
            continue
        seen.add(D)
        lines.append(f"attention: shard_group={e.shard_group} (auto) at D = {D}: {D // e.shard_group} broadcast-"
                     f"schedule step(s) of {e.shard_group} owner(s) per layer pass; step {e.step_fitted_s:.3f} s "
                     f"with TSP's fitted fixed cost ({e.fixed_s:.3f} s; ranking uses {e.step_s:.3f} s)")
    return lines


def _breakdown(e: Estimate) -> str:
    lines = [f"breakdown of {e.layout.label} {e.layout.degrees}:"]
    m = e.memory
    parts = ("weights", "compute_copy", "grads", "optimizer", "activations", "layer_working", "head_working",
             "transient_buffers")
    lines.append("  memory GiB: " + ", ".join(f"{k} {m[k] / GiB:.2f}" for k in parts)
                 + f"; train peak = weights + compute_copy + optimizer + max(activations + max(layer_working, "
                   f"head_working), grads + layer_working) = "
                   f"{m['train_peak'] / GiB:.2f}; optimizer-step peak {m['optimizer_step_peak'] / GiB:.2f}")
    for ph in ("forward", "backward"):
        per = e.comm_bytes(per_layer=True, phase=ph)
        txt = ", ".join(f"{op} {v / 1e6:,.1f}" for op, v in per.items() if v)
        lines.append(f"  per layer {ph} MB (logical): {txt or '-'}")
    for ph in ("forward", "backward"):
        per = e.comm_bytes(phase=ph)
        txt = ", ".join(f"{op} {v / 1e9:,.2f}" for op, v in per.items() if v)
        lines.append(f"  per step {ph} GB (logical): {txt or '-'}")
    lines.append(f"  per step wire GB/GPU: intra {e.step_wire('intra') / 1e9:.2f}, "
                 f"inter {e.step_wire('inter') / 1e9:.2f}")
    lines.append(f"  FLOPs/GPU/step: model {e.flops['model'] / 1e12:,.1f} T, "
                 f"hardware {e.flops['hardware'] / 1e12:,.1f} T; compute {e.compute_s:.3f} s, "
                 f"overlappable comm {e.comm_overlap_s:.3f} s, exposed comm {e.comm_exposed_s:.3f} s "
                 f"-> step {e.step_s:.3f} s")
    return "\n".join(lines)


def host_bytes(shape, layout, precision, micro_batch: int, seq_len: int, mode: str) -> float:
    """Pinned host memory per GPU of a checkpointing mode: what ``keep-attention`` (``offload``) or ``full``
    (``full-offload``) keeps on the GPU; 0 for the other modes."""
    on_gpu = OFFLOADS.get(mode)
    if on_gpu is None:
        return 0.0
    return memory_breakdown(shape, layout, precision, micro_batch, seq_len, on_gpu)["activations"]


def checkpointing_lines(rec: Estimate) -> list[str]:
    """The recommended layout under every activation-checkpointing mode: peak, fits, step (TSP: with its fitted
    fixed cost) and the pinned host memory the offloading modes need per GPU (see :func:`host_bytes`)."""
    args = (rec.shape, rec.layout, rec.precision, rec.micro_batch, rec.seq_len)
    lines = [f"checkpointing modes for {rec.layout.label} {rec.layout.degrees}:"]
    for mode in CHECKPOINTING:
        e = estimate(rec.shape, rec.layout, rec.hardware, rec.precision, rec.micro_batch, rec.seq_len, mode,
                     headroom=rec.headroom, optimizer=rec.optimizer)
        host = host_bytes(*args, mode)
        extra = f", {host / GiB:.1f} GiB pinned host memory per GPU" if host else ""
        lines.append(f"  {mode:<15} {e.peak_bytes / GiB:6.1f} GiB  {'fits' if e.fits else 'does NOT fit':<12} "
                     f"step {e.step_fitted_s:.3f} s{extra}")
    return lines


def needs_lines(rec: Estimate, host_limit_gb: float) -> list[str]:
    """What the sequence length needs on the recommended layout: under the requested precision and, from
    ``bf16-mixed``, under ``bf16-true`` (bf16 weights, states and residual stream: the layer inputs half as large),
    every checkpointing mode that fits the GPU (``headroom``) and ``host_limit_gb`` of pinned host memory per GPU,
    fastest first (then the smaller GPU and host footprint); where no mode fits, TSP's modes again with the MLP
    ring recomputing its pre-activations (``mlp_activations="recompute"``), then also gathering one KV head's K/V
    at a time (``kv_bucket_heads=1``); when still none does, the smallest GPU footprint and why it does not fit."""
    precisions = [rec.precision] + ([get_precision("bf16-true")] if rec.precision.name == "bf16-mixed" else [])
    shapes = [(rec.shape, "")]
    if rec.layout.strategy == "tsp":
        shape, label = rec.shape, ""
        if shape.mlp_activations == "keep" and shape.n_moe_layers < shape.n_layers:
            shape, label = replace(shape, mlp_activations="recompute"), " + mlp_activations=recompute"
            shapes.append((shape, label))
        if shape.kv_bucket_heads != 1:
            shapes.append((replace(shape, kv_bucket_heads=1), label + " + kv_bucket_heads=1"))
    lines = [f"what this context needs on {rec.layout.label} {rec.layout.degrees} (<= {rec.headroom:.0%} of "
             f"{rec.hardware.hbm_bytes / GiB:.0f} GiB per GPU, <= {host_limit_gb:.0f} GB pinned host memory per GPU):"]
    for prec in precisions:
        for shape, options in shapes:
            found = []
            for mode in CHECKPOINTING:
                e = estimate(shape, rec.layout, rec.hardware, prec, rec.micro_batch, rec.seq_len, mode,
                             headroom=rec.headroom, optimizer=rec.optimizer)
                host = host_bytes(shape, rec.layout, prec, rec.micro_batch, rec.seq_len, mode)
                found.append((e, mode + options, host, e.fits and host <= host_limit_gb * 1e9))
            if any(f[3] for f in found):
                break
        ok = sorted((f for f in found if f[3]), key=lambda f: (round(f[0].step_fitted_s, 3), f[0].peak_bytes, f[2]))
        if ok:
            text = "; ".join(f"{mode} ({e.peak_bytes / GiB:.1f} GiB"
                             + (f", {host / GiB:.1f} GiB host" if host else "") + f", step {e.step_fitted_s:.1f} s)"
                             for e, mode, host, _ in ok)
        else:
            e, mode, host, _ = min(found, key=lambda f: (f[0].peak_bytes, f[2]))
            over = "GPU" if not e.fits else "host memory"
            text = (f"nothing fits; the smallest GPU footprint is {mode} at {e.peak_bytes / GiB:.1f} GiB"
                    + (f" with {host / GiB:.1f} GiB host" if host else "") + f" (over the {over} limit)")
        lines.append(f"  {prec.name:<11} {text}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:
        argv = argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.plot:  # fail before any work if the plot cannot be drawn
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            print("error: --plot needs matplotlib, which is not installed: pip install matplotlib", file=sys.stderr)
            return 1
    try:
        shape = replace(get_model_shape(args.model), mlp_activations=args.mlp_activations,
                        kv_bucket_heads=args.kv_bucket_heads)
        hw = get_hardware(args.gpu)
        prec = get_precision(args.precision)
        if not 0 < args.headroom <= 1:
            raise PlanError(f"--headroom {args.headroom} must be in (0, 1]")
        plan = make_plan(shape, hw, prec, args.seq_len, args.gpus, args.gpus_per_node, args.micro_batch,
                         args.checkpointing, overlap=not args.no_overlap, headroom=args.headroom,
                         tsp_degree=args.tsp_degree, optimizer=args.optimizer)
    except (ValueError, OSError) as exc:  # PlanError is a ValueError
        parser.error(str(exc))
    print(_describe_model(shape))
    nodes = args.gpus // args.gpus_per_node
    print(f"{args.gpus} x {hw.name} ({nodes} node{'s' if nodes > 1 else ''} of {args.gpus_per_node}), "
          f"{hw.hbm_bytes / GiB:.0f} GiB HBM, {hw.sustained_flops / 1e12:.0f} TFLOP/s sustained bf16; "
          f"seq {args.seq_len}, micro-batch {args.micro_batch}, {prec.name}, checkpointing {args.checkpointing}")
    print()
    rows = plan.estimates if args.all else select_rows(plan)
    print(format_table(rows))
    print()
    for line in _expert_lines(rows) + _shard_group_lines(rows):
        print(line)
    for n in plan.notes:
        print("note:", n)
    rec = plan.recommended
    print(f"recommended: {rec.layout.label} {rec.layout.degrees}" + ("" if rec.fits else " (does NOT fit)"))
    print(f"  why: {plan.reason}")
    for line in checkpointing_lines(rec):
        print(line)
    for line in needs_lines(rec, args.host_memory):
        print(line)
    if args.breakdown:
        print()
        print(_breakdown(rec))
    if args.plot:
        from .plot import MissingMatplotlib, plot_memory_vs_seq

        try:
            path = plot_memory_vs_seq(args.plot, shape, hw, prec, args.gpus, args.gpus_per_node, args.micro_batch,
                                      args.checkpointing, args.seq_len, args.headroom)
        except MissingMatplotlib as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(f"wrote {path}")
    return 0


