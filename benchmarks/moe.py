"""Mixture-of-experts training step on one GPU playing rank r of D with PyTorch's fake process group (collectives
return at once: a rank's exact peak memory and compute time; communication excluded, then added from the
lightning_tsp.planning cost model as benchmarks.harness does).

  tsp-ring, tsp-dispatch  TSPLlama, expert_schedule forced to "ring" (weights circulate) or "dispatch" (rows move)
  tsp-auto                expert_schedule="auto": the cost model picks per layer call; the row shows the pick
  ep-tpsp                 Megatron-style TP-SP attention (baselines/tp.py's plan) + expert parallelism over the same
                          D ranks: each rank's S/D tokens go to the experts' owners through tsp-dispatch's kernel
                          (DispatchExperts); no load-balancing loss. Needs D | KV heads (as Megatron) and
                          baselines/model.py's attention (head_dim = h/heads, no q/k norms); else "unsupported".

Assumed (the fake group's outputs are garbage, so the router's choices would be too):
  * Routing forced exactly balanced, every strategy: local row i = (token i // k, slot i % k) goes to expert
    i mod E. The router still runs and its combination weights are used; only the expert ids are replaced.
  * Dispatch's count exchange (an all-to-all of E int64 counts) is answered, not exchanged: every member sends this
    rank as many rows per local expert as this rank routes there itself (N*k/E each, balanced). DispatchExperts
    gets a TSPGroup whose group (CountsGroup) answers that call and hands the row all-to-alls to the fake group:
    the library's kernel runs unchanged, nothing is patched.

bf16 autocast over fp32 weights, fused AdamW (states allocated first), micro-batch 1, --checkpointing full per
layer, median of --steps after --warmup; --device cpu: fp32, no autocast, no peak memory. Markdown table + JSON
lines (benchmarks.runner), each row with the command that reproduces it. On one H200 (one subprocess per row and
probe; each command should stay under 10 minutes, --deadline-s 540 stops starting new subprocesses):
    python -m benchmarks.moe --model mixtral-8x7b --tsp-size 8 --seq-len 32K 64K --probe-layers 1 2 \
        --out results/moe_mixtral_32k_64k.md
    python -m benchmarks.moe --model mixtral-8x7b --tsp-size 8 --seq-len 128K --probe-layers 1 2 \
        --out results/moe_mixtral_128k.md
    python -m benchmarks.moe --model qwen3-30b-a3b --tsp-size 8 --seq-len 32K 64K 128K --probe-layers 1 2 \
        --out results/moe_qwen3.md
CPU: python -m benchmarks.moe --model tiny-moe --layers 2 --tsp-size 2 --seq-len 64 --device cpu --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.runner import (Deadline, append_jsonl, first_line, fmt, is_oom, jsonl_path, md_table, parse_seq,
                               run_config, seq_label, write_text)
from lightning_tsp.group import TSPGroup
from lightning_tsp.layers.moe import DispatchExperts, RingExperts, TSPMoE
from lightning_tsp.models.llama import get_config
from lightning_tsp.schedules.comm import local_tensor

SCHEDULE = {"tsp-ring": "ring", "tsp-dispatch": "dispatch", "tsp-auto": "auto", "ep-tpsp": "dispatch"}
STRATEGIES = tuple(SCHEDULE)
EXCLUDED = "all communication (fake process group: collectives return at once)"
ROUTING = "forced balanced (row i -> expert i mod E); dispatch receive counts = this rank's own counts"
CONFIG_OPTS = ("model", "layers", "tsp_size", "rank", "checkpointing", "steps", "warmup", "device", "hardware",
               "gpus_per_node")


class CountsGroup:
    """The group DispatchExperts sees: the count exchange (its only all-to-all without split sizes) gets
    ``recv[p, j] = send[rank, j]`` (every member routes like this rank); the row all-to-alls go to the fake group.
    ``dist.all_to_all_single`` calls ``group.all_to_all_single`` (``alltoall_base`` in older torch)."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
        if not output_splits and not input_splits and input.dtype == torch.int64:
            output.copy_(input.view(self.size, -1)[self.rank].repeat(self.size))
        else:
            dist.all_to_all_single(output, input, output_splits or None, input_splits or None, group=self.group)

    alltoall_base = all_to_all_single


class BalancedExperts(nn.Module):
    """Stands in for ``TSPMoE.experts`` (holds it: same parameters): forced balanced routing, then the library's
    RingExperts or DispatchExperts (over CountsGroup), as the wrapped module's schedule picks (kept in ``ran``)."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.inner, self.ran, t = experts, None, experts.tsp
        self.counts_tsp = TSPGroup(CountsGroup(t.group, t.rank, t.size), t.rank, t.size)

    def forward(self, x, weights, experts):
        n, k = experts.shape
        gu, down = local_tensor(self.inner.gate_up_proj), local_tensor(self.inner.down_proj)
        ids = (torch.arange(n * k, device=experts.device) % (down.shape[0] * self.inner.tsp.size)).view(n, k)
        self.ran = self.inner.schedule_for(n * k, x.dtype)
        fn, tsp = (RingExperts, self.inner.tsp) if self.ran == "ring" else (DispatchExperts, self.counts_tsp)
        return fn.apply(x, weights, ids, gu, down, tsp)


class EPMoE(nn.Module):
    """ep-tpsp's MLP: ffn_norm's sequence-sharded DTensor -> this rank's S/D tokens -> TSPMoE (dispatch) -> the
    local output, added to TP-SP's local residual stream."""

    def __init__(self, moe: TSPMoE):
        super().__init__()
        self.moe = moe

    def forward(self, x):
        return self.moe(local_tensor(x))[0]


def unsupported(cfg, d: int) -> str | None:
    """Why ep-tpsp cannot run this model at TP = d (None: it can)."""
    from benchmarks.baselines.model import check_tp_shape

    try:
        check_tp_shape(cfg, d)
    except ValueError as exc:
        return f"{exc} (Megatron TP needs it too)"
    if cfg.head_dim * cfg.n_heads != cfg.hidden_size or cfg.qk_norm or cfg.attention_bias:
        return "baselines/model.py attention: head_dim = hidden/heads, no q/k norms, no biases"
    return None


def build_ep_tpsp(setup):
    from torch.distributed.device_mesh import init_device_mesh

    from benchmarks.baselines.model import new_model
    from benchmarks.baselines.tp import apply_tp, tp_runner

    cfg, d = setup.cfg, setup.world
    mesh = init_device_mesh(torch.device(setup.device).type, (d,), mesh_dim_names=("tp",))
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    model = new_model(setup, None)
    apply_tp(model, mesh, sequence_parallel=True)  # TP-SP plan; the dense MLP it shards is replaced here:
    for block in model.layers.values():
        block.feed_forward = EPMoE(TSPMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                          cfg.num_experts_per_tok, tsp, cfg.moe_gating, cfg.norm_topk_prob,
                                          cfg.shared_expert_intermediate_size, device="meta", schedule="dispatch"))
    return tp_runner(model, setup, None, f"TP-SP + EP, D={d}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--strategy", nargs="+", choices=STRATEGIES, default=list(STRATEGIES))
    ap.add_argument("--model", default="mixtral-8x7b", help="mixtral-8x7b | qwen3-30b-a3b | tiny-moe")
    ap.add_argument("--layers", type=int, help="fewer layers than the preset")
    ap.add_argument("--probe-layers", type=int, nargs=2, metavar=("L1", "L2"),
                    help="measure L1 and L2 layers; peak and step extrapolated linearly to the preset's count")
    ap.add_argument("--seq-len", nargs="+", default=["32K"], help="e.g. 32K 64K 131072")
    ap.add_argument("--tsp-size", type=int, default=8, help="D")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--checkpointing", choices=("none", "full"), default="full")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--hardware", default="h200", help="cost model preset")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per subprocess")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="start no subprocess after this")
    ap.add_argument("--out", help="markdown table file")
    ap.add_argument("--jsonl", help="JSON lines, appended (default: --out with suffix .jsonl)")
    ap.add_argument("--json-out", help=argparse.SUPPRESS)  # child: its one row
    return ap.parse_args(argv)


def command(args, strategy, seq, layers=None, probe=None) -> list[str]:
    vals, defaults = {k: getattr(args, k) for k in CONFIG_OPTS}, vars(parse_args([]))
    vals["layers"] = layers or vals["layers"]
    cmd = ["python", "-m", "benchmarks.moe", "--strategy", strategy, "--seq-len", str(seq)]
    for k, v in vals.items():
        if v is not None and (k in ("model", "tsp_size") or v != defaults[k]):
            cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd + (["--probe-layers", *map(str, probe)] if probe else [])


def new_row(args, strategy, seq, layers=None) -> dict:
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    cfg = get_config(args.model, expert_schedule=SCHEDULE[strategy],
                     **({"n_layers": layers or args.layers} if layers or args.layers else {}))
    row = {"strategy": strategy, "schedule": None, "model": args.model, "layers": cfg.n_layers, "seq_len": seq,
           "tsp_size": args.tsp_size, "rank": args.rank, "precision": "bf16-mixed" if cuda else "32-true",
           "checkpointing": args.checkpointing, "steps": args.steps, "warmup": args.warmup, "hardware": args.hardware,
           "gpus_per_node": args.gpus_per_node, "routing": ROUTING, "excluded": EXCLUDED,
           "command": shlex.join(command(args, strategy, seq)), "status": "?", "cfg": cfg}
    why = unsupported(cfg, args.tsp_size) if strategy == "ep-tpsp" else None
    return {**row, "status": "unsupported", "error": why} if why else row


def measure(args, strategy: str, seq: int) -> dict:
    """Rank ``args.rank`` of a fake group of D: build, prime AdamW, warm up, time; one row."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.baselines import tsp as tsp_baseline
    from benchmarks.baselines.common import Setup, prime_optimizer

    row = new_row(args, strategy, seq)
    cuda = row["precision"] == "bf16-mixed"
    row.update(device=torch.cuda.get_device_name(0) if cuda else "cpu", torch=torch.__version__)
    if row["status"] == "unsupported":
        return finalize(row)
    if cuda:
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.tsp_size)
    setup = Setup(row["cfg"], strategy, args.tsp_size, args.rank, seq, checkpointing=args.checkpointing,
                  device="cuda" if cuda else "cpu", autocast=cuda, optimizer="fused")
    times = []
    try:
        runner = build_ep_tpsp(setup) if strategy == "ep-tpsp" else tsp_baseline.build(setup)
        moes = [m for m in runner.model.modules() if isinstance(m, TSPMoE)]
        for m in moes:
            m.experts = BalancedExperts(m.experts)
        prime_optimizer(runner)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            runner.step()
            if cuda:
                torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
        row.update(status="ok", layout=runner.layout, schedule=moes[0].experts.ran)
    except Exception as exc:  # noqa: BLE001 - an OOM is a row
        if not is_oom(exc):
            raise
        row.update(status="OOM", error=first_line(exc))
    row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
    row.update(step_times_s=times, step_s=statistics.median(times) if times else None)
    dist.destroy_process_group()
    return finalize(row)


def finalize(row: dict) -> dict:
    """Throughput, model FLOPs, the step's predicted communication and the experts' per-layer costs."""
    from lightning_tsp.planning import (Layout, choose_expert_schedule, communication, expert_schedule_costs,
                                        from_config, get_hardware, get_precision, training_flops)
    from lightning_tsp.planning import collectives as C
    from lightning_tsp.planning.strategies import CommEntry, _comm_time

    shape = from_config(row.pop("cfg", None) or get_config(row["model"], n_layers=row["layers"]), row["model"])
    d, s, gpn, mode = row["tsp_size"], row["seq_len"], row["gpus_per_node"], row["checkpointing"]
    hw, prec, link = get_hardware(row["hardware"]), get_precision(row["precision"]), "intra" if d <= gpn else "inter"
    kw = dict(num_experts=shape.num_experts, hidden_size=shape.hidden_size, top_k=shape.experts_per_token,
              intermediate_size=shape.expert_intermediate_size, tokens=s // d, tsp_size=d,
              compute_bytes=prec.compute, hardware=hw, link=link)
    row.update(expert_costs_per_layer=expert_schedule_costs(**kw), cost_model_pick=choose_expert_schedule(**kw))
    forced = SCHEDULE[row["strategy"]]
    row["schedule"] = row["schedule"] or (row["cost_model_pick"] if forced == "auto" else forced)
    if row["status"] == "unsupported":
        return row
    if row["strategy"] == "ep-tpsp":  # TP-SP's entries, the block AG/RS halved (attention only), + EP dispatch
        halve = lambda e: dataclasses.replace(e, bytes=e.bytes // 2, calls=e.calls // 2)  # noqa: E731
        entries = [halve(e) if e.what.startswith("block AG/RS") else e
                   for e in communication(shape, Layout("tp_sp", d, gpn, tp=d), prec, 1, s, mode)]
        tb, tc = (C.tsp_moe_mlp_collectives(shape, 1, s, d, prec.compute, True, mode, w, "dispatch")
                  for w in ("bytes", "calls"))
        entries += [CommEntry(ph, op, "ep", d, link, v, tc[ph][op], op != "all_to_all", True, "expert dispatch",
                              shape.n_moe_layers) for ph in tb for op, v in tb[ph].items() if v]
    else:
        entries = communication(shape, Layout("tsp", d, gpn, tsp=d), prec, 1, s, mode, row["schedule"])
    ov = sum(_comm_time(e, hw, shape.n_layers) for e in entries if e.overlap)
    ex = sum(_comm_time(e, hw, shape.n_layers) for e in entries if not e.overlap)
    row.update(pred_comm_overlappable_s=ov, pred_comm_exposed_s=ex, pred_comm_s=ov + ex,
               comm_model=f"lightning_tsp.planning, {hw.name}, {gpn} GPUs per node",
               model_flops_per_gpu=training_flops(shape, 1, s, mode)["model"] / d)
    if row["status"] == "ok" and row.get("step_s"):
        step = row["step_s"]
        row.update(tokens_per_s_per_gpu=s / d / step, model_tflops_per_gpu=row["model_flops_per_gpu"] / step / 1e12,
                   pred_step_with_comm_s=max(step, ov) + ex, comm_hidden=ex == 0 and ov <= step)
    return row


def run_row(args, strategy, seq, layers=None, timeout=None) -> dict:
    """One configuration in a fresh subprocess (peaks do not mix; an OOM or a crash is a row)."""
    row = run_config("benchmarks.moe", command(args, strategy, seq, layers)[3:], timeout or args.timeout_s)
    if "strategy" not in row:  # the child left no row: say why
        row = {**finalize({**new_row(args, strategy, seq, layers), "status": row.pop("status"),
                           "error": row.pop("error")}), **row}
    return row


def extrapolated(args, strategy, seq, timeout=None) -> dict:
    """Peak and step at the preset's layer count, linear in layers from --probe-layers L1 L2."""
    (l1, l2), full = args.probe_layers, get_config(args.model).n_layers
    r1 = run_row(args, strategy, seq, l1, timeout)
    r2 = run_row(args, strategy, seq, l2, timeout) if r1["status"] == "ok" else r1
    if r2["status"] != "ok":
        return {**r2, "extrapolated_from": f"{r2['layers']} ({r2['status']})"}
    k = (full - l2) / (l2 - l1)
    lin = lambda a, b: None if a is None or b is None else b + k * (b - a)  # noqa: E731
    row = {k_: v for k_, v in r2.items() if k_ not in ("tokens_per_s_per_gpu", "model_tflops_per_gpu")}
    row.update(layers=full, peak_gb=lin(r1["peak_gb"], r2["peak_gb"]), step_s=lin(r1["step_s"], r2["step_s"]),
               measured={str(l1): [r1["peak_gb"], r1["step_s"]], str(l2): [r2["peak_gb"], r2["step_s"]]},
               extrapolated_from=f"{l1},{l2}", command=shlex.join(command(args, strategy, seq, probe=(l1, l2))))
    return finalize(row)


def format_table(rows: list[dict]) -> str:
    head = ["strategy", "schedule", "seq", "peak GB", "step s", "tokens/s per GPU", "model TFLOP/s",
            "pred. comm s (overl. + exposed)", "step with comm s", "experts/layer ring / dispatch: GB sent, comm ms",
            "command"]
    cells = []
    for r in rows:
        peak = fmt(r.get("peak_gb"), ".2f") if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')}"
        peak += f" (extrap. from L={r['extrapolated_from']})" if r.get("extrapolated_from") else ""
        comm = ("n/a" if r.get("pred_comm_s") is None else
                f"{r['pred_comm_s']:.3f} ({r['pred_comm_overlappable_s']:.3f} + {r['pred_comm_exposed_s']:.3f})")
        experts = " / ".join(f"{(c['bytes_forward'] + c['bytes_backward']) / 1e9:.2f} GB {c['comm_s'] * 1e3:.1f} ms"
                             for c in (r["expert_costs_per_layer"][x] for x in ("ring", "dispatch")))
        cells.append([r["strategy"], r["schedule"] + (" (auto)" if r["strategy"] == "tsp-auto" else ""),
                      seq_label(r["seq_len"]), peak, fmt(r.get("step_s"), ".3f"),
                      fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), fmt(r.get("model_tflops_per_gpu"), ".0f"), comm,
                      fmt(r.get("pred_step_with_comm_s"), ".3f"), experts, f"`{r['command']}`"])
    r0 = rows[0] if rows else {}
    return md_table(head, cells) + "\n\n" + (
        f"{r0.get('model')} (L={r0.get('layers')}) on one {r0.get('device', '?')} (torch {r0.get('torch', '?')}) "
        f"playing rank {r0.get('rank')} of D={r0.get('tsp_size')}; excluded: {EXCLUDED}. Routing: {ROUTING}. "
        f"Predicted comm: {r0.get('comm_model')}; step with comm = max(step, overlappable) + exposed. "
        "Experts/layer: bytes one rank sends and their transfer time, forward + backward, no recompute.")


def main(argv=None) -> None:
    args = parse_args(argv)
    seqs = [parse_seq(s) for s in args.seq_len]
    if args.json_out:  # child: one strategy, one sequence length
        Path(args.json_out).write_text(json.dumps(measure(args, args.strategy[0], seqs[0])))
        return
    clock, rows = Deadline(args.deadline_s), []
    for seq in seqs:
        for strategy in args.strategy:
            if clock.left() <= 0:
                print(f"# deadline reached: skipped {strategy} {seq_label(seq)}", file=sys.stderr)
                continue
            row = new_row(args, strategy, seq)
            if row["status"] == "unsupported":
                row = finalize(row)
            elif args.probe_layers:
                row = extrapolated(args, strategy, seq, clock.limit(args.timeout_s))
            else:
                row = run_row(args, strategy, seq, timeout=clock.limit(args.timeout_s))
            rows.append(row)
            print(f"# {strategy} S={seq_label(seq)}: {row['status']} peak {fmt(row.get('peak_gb'), '.2f')} GB "
                  f"step {fmt(row.get('step_s'), '.3f')} s", file=sys.stderr, flush=True)
    table = format_table(rows)
    print(table, flush=True)
    write_text(args.out, table)
    append_jsonl(rows, jsonl_path(args.out, args.jsonl))


if __name__ == "__main__":
    main()
