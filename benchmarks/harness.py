"""One benchmark harness for TSP and its rivals: one GPU plays rank r of a group of D with PyTorch's fake process
group (every collective returns at once), so a rank's exact peak memory and compute time are measured the same
way for every strategy; the communication an 8-GPU H200 NVLink node would add comes from lightning_tsp.planning.

Strategies (benchmarks/baselines/): tsp, tp, tp_sp (Megatron-style sequence parallelism), sp (zigzag context
parallelism, all-gathered K/V), tp_x_sp (T x S mesh), fsdp_cp (FSDP2 over the context-parallel axis), fsdp (plain
FSDP2 data parallelism: every rank runs whole sequences of its own micro-batch). ``--compile`` runs a rival as its
users do: each transformer block under torch.compile, torchtitan's way (TSP compiles its own pieces).

One configuration (in this process):
    python -m benchmarks.harness --strategy tp_sp --model paper-7b --seq-len 131072 --world 8
A sweep (each configuration in a fresh subprocess; an OOM becomes a row saying OOM):
    python -m benchmarks.harness --sweep tp:16384,32768 tp_sp:16384 tp_x_sp=2x4:131072 --model paper-7b \
        --world 8 --out results.md
The rivals compiled (each transformer block under torch.compile), rows appended to a JSON lines file:
    python -m benchmarks.harness --sweep tp_sp:8K,16K fsdp:8K --compile --model paper-7b --world 8 --warmup 2 \
        --jsonl docs/results/compiled-rivals.jsonl
The longest sequence that fits a memory budget (doubling + bisection; optionally on fewer layers, extrapolated
linearly in layers):
    python -m benchmarks.harness --max-context --strategy tsp --model paper-7b --world 8 --budget-gb 140 \
        --probe-layers 1 2
Probes too long for one process or device call (4M tokens): one --layers L run each, then one row from them (peak
from the two largest L, step from the two smallest run after a warm-up step):
    python -m benchmarks.harness --combine-probes probes.jsonl --model paper-7b --jsonl probes.jsonl
What is alive at a step's peak: --memory-snapshot s.pickle, then python -m benchmarks.memory_peak s.pickle.
Rows are printed as a markdown table, written to --out, and appended as JSON lines to --jsonl
(default: --out with the suffix .jsonl). benchmarks.plot turns the JSON lines into plots.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.runner import (Deadline, append_jsonl, first_line, fmt, is_oom, jsonl_path, md_table, parse_seq,
                               run_config, seq_label, write_text)
from lightning_tsp.planning import CHECKPOINTING
from lightning_tsp.planning.collectives import OFFLOADED

STRATEGIES = ("tsp", "tp", "tp_sp", "sp", "tp_x_sp", "fsdp_cp", "fsdp")
COMPILE_SCOPES = ("checkpointed-block", "block")
# keys every row carries (None where not measured: an OOM, a CPU peak, an unprofiled GPU busy time)
ROW_KEYS = ("strategy", "seq_len", "compiled", "checkpointing", "attention_kernel", "step_s", "peak_gb", "gpu_busy_s",
            "tokens_per_s_per_gpu", "model", "world", "layers", "status", "command")
EXCLUDED = "all communication (fake process group: collectives return at once)"

# reference/anchors.md: paper-7b, 32 layers, D = 8, micro-batch 1, bf16-mixed, AdamW, full checkpointing per
# block, vocab-parallel loss, cuDNN SDPA (H200, torch 2.11): (peak GB, step s)
ANCHORS = {
    ("tp", 16384): (25.09, 0.988), ("tp", 32768): (34.82, 1.347),
    ("tp", 65536): (56.15, 2.449), ("tp", 131072): (98.82, 6.737),
    ("tp_sp", 16384): (22.79, 0.849), ("tp_sp", 32768): (22.92, 0.960),
    ("tp_sp", 65536): (24.34, 2.165), ("tp_sp", 131072): (35.20, 6.172),
}

# every option that defines one configuration (forwarded to subprocesses and printed in each row's command)
CONFIG_OPTS = ("model", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "world", "tp", "sp", "rank",
               "micro_batch", "precision", "checkpointing", "optimizer", "rmsnorm", "sdpa_backend", "attention_kernel",
               "fsdp_precision", "kv_bucket_heads", "shard_group", "mlp_activations", "cuda_graphs", "tsp_params", "compile", "compile_backend", "compile_scope", "profile", "steps",
               "warmup", "device")


def _shard_group(v: str) -> int | str:
    return v if v == "auto" else int(v)


def _cuda_graphs(v: str) -> bool | str:
    if v.lower() in ("auto", "true", "false"):
        return {"true": True, "false": False}.get(v.lower(), "auto")
    raise argparse.ArgumentTypeError(f"--cuda-graphs {v!r}: give false, true or auto")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.harness", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--strategy", choices=STRATEGIES, default="tsp")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--model", default="paper-7b", help="a preset of lightning_tsp.models.llama.PRESETS")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--kv-heads", type=int)
    ap.add_argument("--ffn", type=int, help="SwiGLU width")
    ap.add_argument("--vocab", type=int)
    ap.add_argument("--world", type=int, default=8, help="group size D (tp_x_sp: T * S)")
    ap.add_argument("--tp", type=int, help="tp_x_sp: T (default 2)")
    ap.add_argument("--sp", type=int, help="tp_x_sp: S (default world / T)")
    ap.add_argument("--rank", type=int, default=0, help="the rank this GPU plays")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--precision", choices=("bf16-mixed", "bf16-true", "32-true"), default="bf16-mixed",
                    help="bf16-true (bf16 weights, optimizer states and residual stream, no autocast): TSP only")
    ap.add_argument("--checkpointing", choices=CHECKPOINTING, default="full",
                    help="selective, offload, full-offload: TSP only (keep attention and re-run norm + MLP ring; "
                         "keep-attention's / full's kept tensors in pinned host memory)")
    ap.add_argument("--kv-bucket-heads", type=int, help="TSP: KV heads gathered at once (head bucketing)")
    ap.add_argument("--mlp-activations", choices=("keep", "recompute"), default="keep",
                    help="TSP: the MLP ring keeps its gate/up pre-activations for backward or recomputes them")
    ap.add_argument("--shard-group", type=_shard_group, default="auto",
                    help="TSP: owners per broadcast-schedule step (a divisor of --world, or auto)")
    ap.add_argument("--optimizer", choices=("foreach", "fused", "forloop"), default="fused",
                    help="AdamW implementation, fp32 states, for every strategy (fused: torchtitan's default, in "
                         "place; foreach: torch's CUDA default, whose sqrt temporary adds 4 B/param to the "
                         "optimizer-step peak)")
    ap.add_argument("--rmsnorm", choices=("torch", "manual"), default="torch",
                    help="baselines' RMSNorm: nn.RMSNorm or elementary ops (if the fused kernel lacks DTensor rules)")
    ap.add_argument("--sdpa-backend", choices=("auto", "cudnn", "flash", "math", "default"), default="auto",
                    help="square causal SDPA of tp / tp_sp / fsdp (auto: cuDNN when it runs)")
    ap.add_argument("--attention-kernel", default="auto",
                    help="lightning_tsp kernel for the zigzag calls of tsp / sp / tp_x_sp / fsdp_cp")
    ap.add_argument("--fsdp-precision", choices=("policy", "autocast"), default="policy",
                    help="fsdp_cp: FSDP2 MixedPrecisionPolicy(bf16, fp32) as torchtitan, or bf16 autocast")
    ap.add_argument("--cuda-graphs", type=_cuda_graphs, default=False,
                    help="tsp: CUDA-graphed layers (TSPLlama cuda_graphs: false | true | auto); graphs need two "
                         "untimed steps (warm-up, capture): --warmup is raised to 2")
    ap.add_argument("--tsp-params", choices=("dtensor", "plain"), default="dtensor",
                    help="tsp: parameters as DTensors on a 'tsp' mesh, as TSPStrategy and the Fabric strategy hold "
                         "them (optimizer and gradients included), or plain local tensors (the rows before 2026-12-07)")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more step: gpu_busy_s (the union of kernel time) and kernels in the row")
    ap.add_argument("--memory-snapshot", metavar="PICKLE",
                    help="CUDA: one more step with every allocation recorded, dumped here for "
                         "python -m benchmarks.memory_peak (what is alive at the peak)")
    ap.add_argument("--compile", action="store_true",
                    help="rivals: each transformer block under torch.compile (default mode; fullgraph except the "
                         "context-parallel ones' zigzag attention), torchtitan's way. Not for tsp: TSP compiles its "
                         "own pieces (lightning_tsp.kernels.fused; LIGHTNING_TSP_FUSED=0 turns them off)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend (aot_eager: quick CPU tests)")
    ap.add_argument("--compile-scope", choices=COMPILE_SCOPES, default="checkpointed-block",
                    help="what torch.compile wraps: the checkpointed block (torchtitan: recomputation inside the "
                         "compiled graph) or the block inside the checkpoint wrapper")
    ap.add_argument("--steps", type=int, default=2, help="timed steps (median reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="cost model: GPUs per NVLink node")
    ap.add_argument("--hardware", default="h200", help="cost model hardware preset")
    ap.add_argument("--probe-layers", type=int, nargs=2, metavar=("L1", "L2"),
                    help="measure at L1 and L2 layers and extrapolate peak and step linearly to the full count")
    ap.add_argument("--combine-probes", metavar="JSONL",
                    help="one row at the preset's layer count from probe rows of one configuration measured apart "
                         "(--layers L each; separate device calls): peak from the two largest L >= 1, step from "
                         "the two smallest L measured after a warm-up step (0 layers allowed)")
    ap.add_argument("--sweep", nargs="+", metavar="SPEC",
                    help="STRATEGY[=TxS]:SEQ[,SEQ...] ...  e.g. tp:16384,32768 tp_x_sp=2x4:131072")
    ap.add_argument("--max-context", action="store_true", help="longest sequence within --budget-gb")
    ap.add_argument("--budget-gb", type=float, default=140.0)
    ap.add_argument("--seq-start", type=int, default=131072, help="max-context: first probe")
    ap.add_argument("--resolution", type=int, default=65536, help="max-context: stop when the bracket is this narrow")
    ap.add_argument("--seq-limit", type=int, default=1 << 24, help="max-context: never probe beyond")
    ap.add_argument("--deadline-s", type=float, default=540.0,
                    help="sweep / max-context: start no new subprocess after this many seconds")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per-configuration subprocess limit")
    ap.add_argument("--in-process", action="store_true",
                    help="sweep: measure every configuration in this process (quick CPU checks; peaks may mix)")
    ap.add_argument("--out", help="markdown table file")
    ap.add_argument("--jsonl", help="JSON lines file (appended; default: --out with suffix .jsonl)")
    ap.add_argument("--json-out", help=argparse.SUPPRESS)  # internal: a child writes its one row here
    args = ap.parse_args(argv)
    if args.compile and args.strategy == "tsp" and not args.sweep:
        ap.error(TSP_COMPILE)
    if args.tsp_params != "dtensor" and args.strategy != "tsp" and not args.sweep:
        ap.error("--tsp-params is TSP's: the rivals' parameters are what their DTensor plans make them")
    if args.cuda_graphs is not False and args.strategy != "tsp" and not args.sweep:
        ap.error("--cuda-graphs is TSP's (TSPLlama(cuda_graphs=...)); the rivals compile with --compile")
    if args.cuda_graphs is not False:
        args.warmup = max(args.warmup, 2)
    if args.strategy == "tp_x_sp":
        _fill_2d(args)
    return args


TSP_COMPILE = ("--compile with strategy tsp: TSP compiles its own pieces (lightning_tsp.kernels.fused, on unless "
               "LIGHTNING_TSP_FUSED=0; a tsp row's `compiled` says whether they are); --compile compiles the rivals' "
               "blocks: measure tsp without it")


def _fill_2d(args) -> None:
    if args.tp is None:
        args.tp = 2 if args.sp is None else args.world // args.sp
    if args.sp is None:
        args.sp = args.world // args.tp
    args.world = args.tp * args.sp


# ---------------------------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------------------------

def model_config(args):
    from lightning_tsp.models.llama import get_config

    over = {k: v for k, v in (("n_layers", args.layers), ("hidden_size", args.hidden), ("n_heads", args.heads),
                              ("n_kv_heads", args.kv_heads), ("intermediate_size", args.ffn),
                              ("vocab_size", args.vocab)) if v is not None}
    if args.mlp_activations != "keep":
        if args.strategy != "tsp":
            raise SystemExit(f"--mlp-activations {args.mlp_activations}: TSP's MLP ring option (strategy tsp)")
        over["mlp_activations"] = args.mlp_activations
    if "n_heads" in over and "n_kv_heads" not in over:
        over["n_kv_heads"] = over["n_heads"]
    return get_config(args.model, **over)


def single_command(args, strategy=None, seq=None, layers=None, tp=None, sp=None, extra=()) -> list[str]:
    """The command that measures one configuration on its own (what each row prints)."""
    vals = {k: getattr(args, k) for k in CONFIG_OPTS}
    vals["strategy"] = strategy or args.strategy
    vals["seq_len"] = seq or args.seq_len
    if layers is not None:
        vals["layers"] = layers
    if vals["strategy"] == "tp_x_sp":
        vals["tp"], vals["sp"] = tp or args.tp, sp or args.sp
        vals["world"] = vals["tp"] * vals["sp"]
    else:
        vals["tp"] = vals["sp"] = None
    defaults = vars(parse_args([]))
    cmd = ["python", "-m", "benchmarks.harness", "--strategy", vals["strategy"], "--seq-len", str(vals["seq_len"])]
    for k in CONFIG_OPTS:
        v = vals[k]
        if v is None or (k not in ("model", "world") and v == defaults.get(k)):
            continue
        if k in ("compile_backend", "compile_scope") and not vals["compile"]:
            continue
        if k in ("cuda_graphs", "tsp_params") and vals["strategy"] != "tsp":
            continue  # TSP's options: only on tsp rows of a sweep
        flag = f"--{k.replace('_', '-')}"
        if k == "cuda_graphs":  # a value: true / auto
            cmd += [flag, str(v).lower()]
            continue
        cmd += [flag] if v is True else [flag, str(v)]
    return cmd + list(extra)


# ---------------------------------------------------------------------------------------------------------------
# one measurement (in this process)
# ---------------------------------------------------------------------------------------------------------------

def make_setup(args, cfg, device: str):
    from benchmarks.baselines.common import Setup

    return Setup(cfg, args.strategy, args.world, args.rank, args.seq_len, args.micro_batch,
                 tp=args.tp or 1, sp=args.sp or 1, checkpointing=args.checkpointing, device=device,
                 autocast=args.precision == "bf16-mixed",
                 param_dtype="bfloat16" if args.precision == "bf16-true" else "float32", optimizer=args.optimizer, sdpa_backend=args.sdpa_backend,
                 attention_kernel=args.attention_kernel, fsdp_precision=args.fsdp_precision,
                 norm=args.rmsnorm, kv_bucket_heads=args.kv_bucket_heads, shard_group=args.shard_group,
                 cuda_graphs=args.cuda_graphs if args.strategy == "tsp" else False, tsp_params=args.tsp_params,
                 compile=args.compile, compile_backend=args.compile_backend, compile_scope=args.compile_scope)


def measure(args) -> dict:
    """Build the strategy as rank ``args.rank`` of a fake group, run warm-up + timed steps; a raw row."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import warnings

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.baselines import build
    from benchmarks.baselines.common import prime_optimizer

    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.*deprecated")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if args.memory_snapshot and device != "cuda":
        raise SystemExit(f"--memory-snapshot records CUDA's caching allocator; this run is on {device}")
    cfg = model_config(args)
    row = base_row(args, cfg)
    row["device"] = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    row["torch"] = torch.__version__
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        torch.cuda.reset_peak_memory_stats()
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    setup = make_setup(args, cfg, device)
    times = []
    try:
        row["attention_kernel"] = attention_used(setup)
        runner = build(setup)
        row["layout"] = runner.layout
        prime_optimizer(runner)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = runner.step()
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            if i >= args.warmup:
                times.append(dt)
        if args.profile:
            row.update(profile_step(runner.step, cuda))
        if args.memory_snapshot:  # one more step, every allocation recorded (benchmarks.memory_peak)
            torch.cuda.memory._record_memory_history(max_entries=1_000_000)
            runner.step()
            torch.cuda.synchronize()
            torch.cuda.memory._dump_snapshot(args.memory_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
        if args.strategy == "tsp":  # whether the layers ran as CUDA graphs (cuda_graphs="auto" decides per step)
            row["graphed"] = getattr(runner.model, "_layer_graphs", None) is not None
        row["status"] = "ok"
        row["loss"] = float(loss) if torch.isfinite(loss).all() else None  # fake collectives: not meaningful
    except Exception as exc:  # noqa: BLE001 - reported in the row
        if not is_oom(exc):
            raise
        row["status"] = "OOM"
        row["error"] = first_line(exc)
    if cuda:
        row["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
        row["reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
        host = getattr(torch.cuda, "host_memory_stats", None)  # pinned host memory (offloading modes)
        row["host_peak_gb"] = host()["allocated_bytes.peak"] / 1e9 if host is not None else None
    else:
        row["peak_gb"] = None  # no allocator statistics on CPU
        row["peak_note"] = "CPU run: peak memory not measured"
    row["step_times_s"] = times
    row["step_s"] = statistics.median(times) if times else None
    dist.destroy_process_group()
    return finalize(row)


def gpu_runner(args):
    """The configuration as rank ``args.rank`` of a fake group on this GPU, its optimizer states allocated (for the
    profiling tools; :func:`measure` builds its own, on CPU too, and reports failures in the row)."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from benchmarks.baselines import build
    from benchmarks.baselines.common import prime_optimizer

    cfg = model_config(args)
    torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.world)
    runner = build(make_setup(args, cfg, "cuda"))
    prime_optimizer(runner)
    return runner


def profile_step(step, cuda: bool) -> dict:
    """One more step under torch.profiler: GPU busy seconds (the union of the kernels' intervals: time the GPU did
    not wait for the host) and the number of kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return {}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        torch.cuda.synchronize()
        step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0
                   and not e.name.startswith("Optimizer."))  # (a range annotation, not a kernel)
    busy, end = 0.0, float("-inf")
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    return {"gpu_busy_s": busy / 1e6, "kernels": len(spans)}


def attention_used(setup) -> str:
    """The attention kernel a configuration runs: SDPA's backend for the square causal attention of tp / tp_sp /
    fsdp, else lightning_tsp's kernel of the zigzag calls (as TSP and the context-parallel rivals resolve it)."""
    from benchmarks.baselines.model import cp_kernel, resolve_sdpa_backend

    if setup.strategy in SQUARE_ATTENTION:
        return f"sdpa-{resolve_sdpa_backend(setup.sdpa_backend, setup.device)}"
    return cp_kernel(setup).name


SQUARE_ATTENTION = ("tp", "tp_sp", "fsdp")  # the rest attend zigzag chunks through a lightning_tsp kernel


def base_row(args, cfg) -> dict:
    from lightning_tsp.kernels.fused import MIN_FUSED_TOKENS, fusion_enabled

    command = shlex.join(single_command(args))
    fused = fusion_enabled()
    tsp = args.strategy == "tsp"
    return {
        "strategy": args.strategy, "layout": "", "model": args.model, "layers": cfg.n_layers,
        "hidden": cfg.hidden_size, "heads": cfg.n_heads, "kv_heads": cfg.n_kv_heads, "ffn": cfg.intermediate_size,
        "vocab": cfg.vocab_size, "seq_len": args.seq_len, "micro_batch": args.micro_batch, "world": args.world,
        "tp": args.tp, "sp": args.sp, "rank": args.rank, "precision": args.precision,
        "checkpointing": args.checkpointing, "kv_bucket_heads": args.kv_bucket_heads,
        "mlp_activations": args.mlp_activations if tsp else None,
        "shard_group": args.shard_group, "cuda_graphs": args.cuda_graphs if tsp else None,
        "tsp_params": args.tsp_params if tsp else None,
        "optimizer": args.optimizer, "warmup": args.warmup,
        "steps": args.steps, "gpus_per_node": args.gpus_per_node, "hardware": args.hardware,
        "excluded": EXCLUDED, "status": "?", "step_s": None, "peak_gb": None, "host_peak_gb": None,
        "extrapolated": False, "tokens_per_s_per_gpu": None,
        "gpu_busy_s": None,  # measured with --profile (profile_step)
        # as requested; measure() replaces it with the kernel it resolves to
        "attention_kernel": f"sdpa-{args.sdpa_backend}" if args.strategy in SQUARE_ATTENTION else args.attention_kernel,
        # the elementwise pieces compiled on CUDA (lightning_tsp.kernels.fused) and from which call size
        "fused_elementwise": f"calls of >= {MIN_FUSED_TOKENS} tokens" if fused else "off",
        # rivals: every block under torch.compile (--compile); tsp: its fused pieces compiled
        "compiled": fused if tsp else args.compile,
        "compile_backend": None if tsp or not args.compile else args.compile_backend,
        "compile_scope": None if tsp or not args.compile else args.compile_scope,
        "command": command if fused else f"LIGHTNING_TSP_FUSED=0 {command}",
    }


# ---------------------------------------------------------------------------------------------------------------
# derived numbers: throughput, model FLOPs, predicted communication, anchors
# ---------------------------------------------------------------------------------------------------------------

def predicted_comm(row: dict) -> dict:
    """Communication one GPU would add on an NVLink node (lightning_tsp.planning cost model)."""
    from lightning_tsp.planning import Layout, communication, estimate, get_hardware, get_precision
    from lightning_tsp.planning.model import ModelShape
    from lightning_tsp.planning.strategies import _comm_time

    shape = ModelShape(row["vocab"], row["hidden"], row["layers"], row["heads"], row["kv_heads"], row["ffn"],
                       name=row["model"], mlp_activations=row.get("mlp_activations") or "keep",
                       kv_bucket_heads=row.get("kv_bucket_heads") if row["strategy"] == "tsp" else None)
    hw, prec = get_hardware(row["hardware"]), get_precision(row["precision"])
    s, w, gpn = row["strategy"], row["world"], max(row["gpus_per_node"], 1)
    B, S, mode = row["micro_batch"], row["seq_len"], row["checkpointing"]
    out = {}
    if s == "fsdp_cp":
        entries = communication(shape, Layout("fsdp", w, gpn, fsdp=w), prec, B, S, mode)
        entries += [e for e in communication(shape, Layout("sp", w, gpn, sp=w), prec, B, S, mode) if e.group == "sp"]
    else:
        kw = {"tsp": dict(tsp=w), "tp": dict(tp=w), "tp_sp": dict(tp=w), "sp": dict(sp=w), "fsdp": dict(fsdp=w),
              "tp_x_sp": dict(tp=row["tp"] or 1, sp=row["sp"] or 1)}[s]
        layout = Layout(s, w, gpn, **kw)
        entries = communication(shape, layout, prec, B, S, mode, shard_group=row.get("shard_group") or "auto")
        est = estimate(shape, layout, hw, prec, B, S, mode, optimizer=row.get("optimizer") or "foreach")
        out["model_peak_gb"] = est.peak_bytes / 1e9  # the cost model's memory, for comparison
    ov = sum(_comm_time(e, hw, shape.n_layers) for e in entries if e.overlap)
    ex = sum(_comm_time(e, hw, shape.n_layers) for e in entries if not e.overlap)
    wire = sum(e.occurrences(shape.n_layers) * e.wire for e in entries)
    out.update(pred_comm_overlappable_s=ov, pred_comm_exposed_s=ex, pred_comm_s=ov + ex, pred_wire_gb=wire / 1e9,
               comm_model=f"lightning_tsp.planning, {hw.name}, {gpn} GPUs per node")
    return out


def sharing_a_micro_batch(row: dict) -> int:
    """GPUs that process one micro-batch of B sequences of S tokens together: the whole group (D, or T x S), but one
    for fsdp (each rank runs its own micro-batch), so tokens per GPU per step are B * S / D, or B * S for fsdp."""
    return 1 if row["strategy"] == "fsdp" else row["world"]


def finalize(row: dict) -> dict:
    from lightning_tsp.planning.flops import training_flops
    from lightning_tsp.planning.model import ModelShape

    if row["layers"] == 0:  # a probe of the layers' base (embedding, LM head, optimizer): no cost model for it
        row["tokens_per_s_per_gpu"] = None
        return row
    shape = ModelShape(row["vocab"], row["hidden"], row["layers"], row["heads"], row["kv_heads"], row["ffn"])
    sharing = sharing_a_micro_batch(row)
    model_flops = training_flops(shape, row["micro_batch"], row["seq_len"], row["checkpointing"])["model"]
    row["model_flops_per_gpu"] = model_flops / sharing
    if row["strategy"] == "tsp":  # the g that "auto" resolves to, as the model resolves it
        from lightning_tsp.planning.collectives import resolve_shard_group

        w_bytes = 2 if row["precision"] in ("bf16-mixed", "bf16-true") else 4
        row["shard_group_used"] = resolve_shard_group(shape, row["micro_batch"], row["seq_len"], row["world"],
                                                      w_bytes, row.get("shard_group") or "auto")
    try:
        row.update(predicted_comm(row))
    except Exception as exc:  # noqa: BLE001 - the cost model may not cover a shape; the row still stands
        row["pred_comm_s"] = None
        row["comm_model"] = f"unavailable: {exc}"
    step = row.get("step_s")
    row["tokens_per_s_per_gpu"] = None
    if row.get("status") == "ok" and step:
        row["tokens_per_s_per_gpu"] = row["micro_batch"] * row["seq_len"] / sharing / step
        row["model_tflops_per_gpu"] = row["model_flops_per_gpu"] / step / 1e12
        from lightning_tsp.planning import get_hardware

        hw = get_hardware(row.get("hardware", "h200"))  # MFU against the dense bf16 peak and the measured GEMM rate
        row["mfu_peak"] = row["model_tflops_per_gpu"] / hw.peak_bf16_tflops
        row["mfu_gemm"] = row["model_tflops_per_gpu"] * 1e12 / hw.sustained_flops
        if row.get("pred_comm_s") is not None:
            ov, ex = row["pred_comm_overlappable_s"], row["pred_comm_exposed_s"]
            row["pred_step_with_comm_s"] = max(step, ov) + ex
            row["comm_hidden"] = ex == 0 and ov <= step
    anchor = ANCHORS.get((row["strategy"], row["seq_len"]))
    if (anchor and row["model"] == "paper-7b" and row["layers"] == 32 and row["world"] == 8
            and row["micro_batch"] == 1 and row["checkpointing"] == "full" and row["precision"] == "bf16-mixed"
            and row["hidden"] == 4096 and row["vocab"] == 32000):
        row["anchor_peak_gb"], row["anchor_step_s"] = anchor
        if row.get("peak_gb") and row.get("status") == "ok":
            row["anchor_peak_dev"] = row["peak_gb"] / anchor[0] - 1
        if step:
            row["anchor_step_dev"] = step / anchor[1] - 1
    return row


# ---------------------------------------------------------------------------------------------------------------
# output
# ---------------------------------------------------------------------------------------------------------------

def format_table(rows: list[dict]) -> str:
    head = ["strategy", "layout", "seq", "peak GB", "step s", "tokens/s per GPU", "model TFLOP/s",
            "MFU (peak / GEMM rate)", "predicted comm s (overlappable + exposed)", "step with comm s", "anchor GB / s",
            "command"]
    cells = []
    for r in rows:
        st = r.get("status")
        peak = r.get("peak_gb")
        if st == "OOM":
            peak_s = "OOM" + (f" (>{peak:.1f})" if peak else "")
        elif st != "ok":
            peak_s = st or "?"
        else:
            peak_s = fmt(peak, ".2f")
            if r.get("fits_budget") is False:
                peak_s += " (over budget)"
        if r.get("extrapolated_from"):
            peak_s += f" (extrap. from L={r['extrapolated_from']})"
        comm = ("n/a" if r.get("pred_comm_s") is None else
                f"{r['pred_comm_s']:.3f} ({r['pred_comm_overlappable_s']:.3f} + {r['pred_comm_exposed_s']:.3f})"
                + (" hidden" if r.get("comm_hidden") else ""))
        anchor = ""
        if r.get("anchor_peak_gb"):
            anchor = f"{r['anchor_peak_gb']:.2f} / {r['anchor_step_s']:.3f}"
            if r.get("anchor_peak_dev") is not None:
                anchor += f" ({r['anchor_peak_dev']:+.0%} / {r.get('anchor_step_dev', 0):+.0%})"
        cells.append([
            r["strategy"] + (" compiled" if r.get("compiled") and r["strategy"] != "tsp" else ""),
            (r.get("layout") or "") + (f", g={r['shard_group_used']}" if r.get("shard_group_used")
                                                      else ""), seq_label(r["seq_len"]), peak_s, fmt(r.get("step_s"), ".3f"),
            fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), fmt(r.get("model_tflops_per_gpu"), ".0f"),
            "" if r.get("mfu_peak") is None else f"{r['mfu_peak']:.0%} / {r['mfu_gemm']:.0%}", comm,
            fmt(r.get("pred_step_with_comm_s"), ".3f"), anchor, f"`{r['command']}`",
        ])
    r0 = rows[0] if rows else {}
    return md_table(head, cells) + "\n\n" + (
        f"One GPU ({r0.get('device', '?')}, torch {r0.get('torch', '?')}) plays rank {r0.get('rank', 0)} of the group; "
        f"excluded: {EXCLUDED}. Predicted comm: {r0.get('comm_model', 'n/a')} (overlappable traffic can hide behind "
        "compute, exposed traffic adds to the step; 'step with comm' = max(step, overlappable) + exposed). "
        "Model TFLOP/s counts 6 x params x tokens + causal attention exactly, not recompute; MFU divides it by the "
        "hardware preset's dense bf16 peak and by its measured GEMM rate. Peak = "
        "torch.cuda.max_memory_allocated / 1e9.")


def emit(rows: list[dict], args) -> None:
    for r in rows:
        missing = [k for k in ROW_KEYS if k not in r]
        if missing:
            raise ValueError(f"a {r.get('strategy')} row lacks {missing}: every row carries ROW_KEYS")
    table = format_table(rows)
    print(table, flush=True)
    write_text(args.out, table)
    append_jsonl(rows, jsonl_path(args.out, args.jsonl))


# ---------------------------------------------------------------------------------------------------------------
# subprocesses: sweeps, layer extrapolation, max context
# ---------------------------------------------------------------------------------------------------------------

def config_args(args, strategy, seq, tp=None, sp=None, layers=None) -> argparse.Namespace:
    """``args`` for one configuration of a sweep."""
    xsp = strategy == "tp_x_sp"
    ns = argparse.Namespace(**{**vars(args), "strategy": strategy, "seq_len": seq, "tp": tp if xsp else None,
                               "sp": sp if xsp else None})
    if layers is not None:
        ns.layers = layers
    if xsp:
        ns.world = tp * sp
    return ns


def run_child(args, strategy, seq, layers=None, tp=None, sp=None, timeout=None, env=None) -> dict:
    """Measure one configuration in a fresh Python process (peaks do not mix; a crash or an OOM becomes a row)."""
    argv = single_command(args, strategy, seq, layers, tp, sp)[3:]
    argv += ["--gpus-per-node", str(args.gpus_per_node), "--hardware", args.hardware]
    row = run_config("benchmarks.harness", argv, timeout or args.timeout_s, env)
    if "strategy" not in row:  # no row from the child: say why, with everything known without measuring
        ns = config_args(args, strategy, seq, tp, sp, layers)
        row = {**finalize({**base_row(ns, model_config(ns)), "status": row.pop("status"), "error": row.pop("error")}),
               **row}
    return row


def extrapolated(args, strategy, seq, tp=None, sp=None, timeout=None) -> dict:
    """Peak and step at the full layer count, linear in layers from two measured layer counts."""
    l1, l2 = args.probe_layers
    r1 = run_child(args, strategy, seq, l1, tp, sp, timeout)
    if r1["status"] != "ok":
        r1["extrapolated_from"] = f"{l1} (failed)"
        return r1
    r2 = run_child(args, strategy, seq, l2, tp, sp, timeout)
    if r2["status"] != "ok":
        r2["extrapolated_from"] = f"{l2} (failed)"
        return r2
    if args.warmup == 0:
        print("# warning: --probe-layers with --warmup 0: the extrapolated step time includes compilation; "
              "peaks are valid, step times are not (use --warmup 1)", file=sys.stderr)
    command = shlex.join(single_command(args, strategy, seq, tp=tp, sp=sp, extra=["--probe-layers", str(l1), str(l2)]))
    return combine_probes([r1, r2], model_config(args).n_layers, command)


PROBE_CONFIG = ("strategy", "model", "seq_len", "world", "micro_batch", "precision", "checkpointing", "kv_bucket_heads",
                "mlp_activations", "shard_group", "attention_kernel", "hardware")


def combine_probes(rows: list[dict], full: int, command: str | None = None) -> dict:
    """One configuration's row at ``full`` layers from probes of fewer layers, linear in layers.

    Peak (GPU and pinned host) comes from the two largest probed layer counts >= 1: a layer's working set is in
    every peak from one layer on, so the difference of two such peaks is what one more layer keeps. Step time comes
    from the two smallest layer counts whose step followed a warm-up step (``warmup`` >= 1): the difference of two
    steps is one layer's time (a 0-layer probe is the embedding, LM head, loss and optimizer alone). A step measured
    without a warm-up includes compiling the fused pieces, so the time pair may differ from the peak pair: at 4M
    tokens a 2-layer step with its warm-up outlasts one device call. Rows marked ``extrapolated`` are skipped, so a
    results file holding the probes and their combined row can be given again.
    """
    ok = sorted((r for r in rows if r.get("status") == "ok" and not r.get("extrapolated")), key=lambda r: r["layers"])
    for key in PROBE_CONFIG:
        if len({json.dumps(r.get(key)) for r in ok}) > 1:
            raise ValueError(f"combine_probes: the probes differ in {key} ({sorted({str(r.get(key)) for r in ok})}): "
                             "give the rows of one configuration")
    if len({r["layers"] for r in ok}) != len(ok):
        raise ValueError(f"combine_probes: one row per layer count, got layers {[r['layers'] for r in ok]}")
    mem = [r for r in ok if r["layers"] >= 1][-2:]  # peaks are None on CPU: then so is the extrapolated one
    timed = [r for r in ok if r.get("warmup", 0) >= 1 and r.get("step_s")][:2]
    if len(mem) < 2:
        raise ValueError("combine_probes: need two ok probes of >= 1 layer, got layers "
                         f"{[r['layers'] for r in ok]}")

    if ok[0].get("checkpointing") in OFFLOADED and mem[0]["layers"] < 2:
        print("# warning: offload modes: a 1-layer model holds one layer's kept tensors brought back from host, every "
              "deeper model two (the next layer's are prefetched), so a peak extrapolated from 1 layer overstates the "
              "slope (512K full-offload: +75%); probe 2 and 3 layers", file=sys.stderr)

    def line(pair, key):
        (a, b) = pair
        if a.get(key) is None or b.get(key) is None:
            return None
        return b[key] + (full - b["layers"]) / (b["layers"] - a["layers"]) * (b[key] - a[key])

    ref = dict(mem[-1])  # the configuration: the largest probe's fields
    step_pair = timed if len(timed) == 2 else mem  # no two warm steps: from the peak pair, marked invalid
    row = {**ref, "layers": full, "peak_gb": line(mem, "peak_gb"), "host_peak_gb": line(mem, "host_peak_gb"),
           "step_s": line(step_pair, "step_s"), "step_s_valid": all(r.get("warmup", 0) >= 1 for r in step_pair),
           "extrapolated": True, "extrapolated_from": f"{mem[0]['layers']},{mem[1]['layers']}",
           "measured": {str(r["layers"]): [r.get("peak_gb"), r.get("step_s")] for r in ok},
           "measured_host_peak_gb": {str(r["layers"]): r.get("host_peak_gb") for r in ok},
           "measured_warmup": {str(r["layers"]): r.get("warmup") for r in ok}}
    if [r["layers"] for r in step_pair] != [r["layers"] for r in mem]:
        row["step_extrapolated_from"] = f"{step_pair[0]['layers']},{step_pair[1]['layers']}"
    row["command"] = command or " ; ".join(r["command"] for r in ok)
    for key in ("tokens_per_s_per_gpu", "model_tflops_per_gpu", "pred_step_with_comm_s", "comm_hidden",
                "anchor_peak_dev", "anchor_step_dev", "mfu_peak", "mfu_gemm", "model_flops_per_gpu"):
        row.pop(key, None)
    return finalize(row)


def measure_any(args, strategy, seq, tp=None, sp=None, timeout=None) -> dict:
    """One row of a sweep: in this process (--in-process), extrapolated in layers (--probe-layers) or in a child."""
    if args.in_process:
        t0 = time.perf_counter()
        row = measure(config_args(args, strategy, seq, tp, sp))
        row["wall_s"] = time.perf_counter() - t0
        return row
    if args.probe_layers:
        return extrapolated(args, strategy, seq, tp, sp, timeout)
    return run_child(args, strategy, seq, None, tp, sp, timeout)


def parse_sweep(specs: list[str], args) -> list[tuple]:
    """'tp:16384,32768' 'tp_x_sp=2x4:131072' -> [(strategy, seq, tp, sp), ...]."""
    out = []
    for spec in specs:
        name, _, seqs = spec.partition(":")
        tp = sp = None
        name, _, grid = name.partition("=")
        if name not in STRATEGIES:
            raise SystemExit(f"--sweep {spec!r}: unknown strategy {name!r} (use {', '.join(STRATEGIES)})")
        if name == "tsp" and args.compile:
            raise SystemExit(f"--sweep {spec!r}: {TSP_COMPILE}")
        if name == "tp_x_sp":
            if grid:
                tp, sp = (int(x) for x in grid.lower().split("x"))
            else:
                tp = args.tp or 2
                sp = args.sp or args.world // tp
        out += [(name, parse_seq(s), tp, sp) for s in (seqs or str(args.seq_len)).split(",")]
    return out


def sweep(args) -> list[dict]:
    clock = Deadline(args.deadline_s)
    rows = []
    for strategy, seq, tp, sp in parse_sweep(args.sweep, args):
        if clock.left() <= 0:
            print(f"# deadline reached: skipped {strategy} {seq}", file=sys.stderr)
            continue
        row = measure_any(args, strategy, seq, tp, sp, timeout=clock.limit(args.timeout_s))
        rows.append(row)
        print(f"# {strategy} {row.get('layout', '')} S={seq}: {row['status']} peak {fmt(row.get('peak_gb'), '.2f')} "
              f"GB step {fmt(row.get('step_s'), '.3f')} s ({row['wall_s']:.0f} s wall)", file=sys.stderr, flush=True)
    return rows


def _round(n: int, q: int) -> int:
    return max(q, n // q * q)


def max_context(args) -> list[dict]:
    """Longest sequence whose peak stays within --budget-gb: doubling until a failure, then bisection down to
    --resolution; once two fitting points are known, the next probe is also capped by their linear fit (peak is
    close to linear in the sequence length with flash-style attention), which saves the slowest probes."""
    clock = Deadline(args.deadline_s)
    q = args.resolution
    tp, sp = (args.tp, args.sp) if args.strategy == "tp_x_sp" else (None, None)
    fits: dict[int, dict] = {}
    rows = []
    lo, hi = None, None

    def probe(seq):
        if clock.left() <= 0:
            return None
        r = measure_any(args, args.strategy, seq, tp, sp, timeout=clock.limit(args.timeout_s))
        ok = r["status"] == "ok" and (r.get("peak_gb") is None or r["peak_gb"] <= args.budget_gb)
        r["fits_budget"] = ok
        rows.append(r)
        print(f"# probe S={seq}: {r['status']} peak {fmt(r.get('peak_gb'), '.2f')} GB -> "
              f"{'fits' if ok else 'does not fit'} ({r['wall_s']:.0f} s)", file=sys.stderr, flush=True)
        return ok

    seq = _round(args.seq_start, q)
    while True:
        ok = probe(seq)
        if ok is None:
            break
        if ok:
            fits[seq] = rows[-1]
            lo = seq
        else:
            hi = seq
            if lo is None:
                if seq <= q:
                    break
                seq = _round(seq // 2, q)
                continue
        if hi is not None and hi - lo <= q:
            break
        if hi is None:
            nxt = min(2 * lo, args.seq_limit)
            if len(fits) >= 2:
                (s1, r1), (s2, r2) = sorted(fits.items())[-2:]
                if r1.get("peak_gb") and r2.get("peak_gb") and r2["peak_gb"] > r1["peak_gb"]:
                    slope = (r2["peak_gb"] - r1["peak_gb"]) / (s2 - s1)
                    pred = s2 + (args.budget_gb - r2["peak_gb"]) / slope
                    nxt = min(nxt, max(lo + q, _round(int(pred), q)))
            if nxt <= lo:
                break
        else:
            nxt = _round((lo + hi) // 2, q)
            if nxt <= lo:
                nxt = lo + q
            if nxt >= hi:
                break
        seq = nxt
    summary = {
        "strategy": args.strategy, "budget_gb": args.budget_gb, "max_seq_fits": lo, "first_seq_over": hi,
        "resolution": q, "probe_layers": args.probe_layers, "elapsed_s": clock.elapsed(),
    }
    note = (f"max context for {args.strategy} ({rows[0].get('layout', '') if rows else ''}) within "
            f"{args.budget_gb:g} GB: {seq_label(lo) if lo else 'none'} fits"
            + (f", {seq_label(hi)} does not" if hi else ", no failure found (search stopped)")
            + (f"; peaks extrapolated linearly in layers from {args.probe_layers[0]} and {args.probe_layers[1]} "
               f"layers to {model_config(args).n_layers}" if args.probe_layers else ""))
    print("# " + note, flush=True)
    for r in rows:
        r["max_context"] = summary
    return rows, note


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.json_out:  # child: one configuration, one row
        row = measure(args)
        Path(args.json_out).write_text(json.dumps(row))
        return
    if args.max_context:
        rows, note = max_context(args)
        emit(rows, args)
        print("\n" + note)
        if args.out:
            with open(args.out, "a") as f:
                f.write("\n" + note + "\n")
        return
    if args.combine_probes:
        probes = [json.loads(line) for line in Path(args.combine_probes).read_text().splitlines() if line.strip()]
        rows = [combine_probes(probes, model_config(args).n_layers)]
    elif args.sweep:
        rows = sweep(args)
    elif args.probe_layers:
        rows = [extrapolated(args, args.strategy, args.seq_len, args.tp, args.sp)]
    else:
        rows = [measure(args)]
    emit(rows, args)


if __name__ == "__main__":
    main()
