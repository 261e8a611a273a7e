"""Real TSP over a real process group (NCCL on GPUs, gloo on CPU), in one call.

Part (a), correctness: for every TSP size D in {2, 4, 8} that divides the number of processes N, the world is cut
into N/D TSP groups; every group trains the same small model (GQA and MHA) and its leader compares against the
single-device reference (TSPLlama with D = 1, same weights by construction, checked bit for bit) computed on its
own device: the loss and every gathered parameter gradient in fp32 (TF32 off) and under bf16 autocast, and the
loss curve of a few AdamW steps. A PASS/FAIL table; the exit status is non-zero on any FAIL.

Part (b), throughput and memory with real communication: the paper's 7B (``--layers`` cuts the depth, and every
row says so) at 16K-128K for TSP (D = N) and the baselines of benchmarks/baselines/ (TP, TP-SP, SP, TP x SP
layouts, FSDP2 over CP) built on the real world group. Tokens/s per GPU, model TFLOP/s, peak memory (max over
ranks) and, for TSP, the overlap efficiency = compute-only step (the same configuration with the fake process
group on one GPU, benchmarks/harness.py) / real step. Every configuration runs in a fresh torchrun subprocess
(an OOM becomes a row saying so); ``--deadline-s`` keeps one call within its time box.

    bash benchmarks/multi_gpu.sh 8                                   # (a) then (b) on 8 GPUs
    python benchmarks/multi_gpu.py --nproc 8 --skip-throughput       # (a) only
    python benchmarks/multi_gpu.py --nproc 8 --skip-correctness --seqs 128K --out results/mg8.md
    python benchmarks/multi_gpu.py --device cpu --backend gloo --nproc 2 --check-preset tiny \\
        --model tiny --seqs 256 --strategies tsp                     # the CPU mode the tests run

Every subprocess gets NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (NVLink
multicast stays off whatever the caller's environment says).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (str(ROOT), str(ROOT / "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# NVLink multicast must stay off on the machines this runs on: forced into every child's environment.
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
STRATEGIES = ("tsp", "tp_sp", "tp", "tp_x_sp", "fsdp_cp", "sp")  # execution order within one sequence length
TP_SP_LIKE = ("tp_sp", "tp_x_sp")  # "TP + SP" layouts the TSP targets compare with
OOM_EXIT = 17
DEFAULT_SEQS = "128K,64K,32K,16K"


def parse_seq(s: str) -> int:
    n = s.strip().upper()
    mult = 1 << 20 if n.endswith("M") else 1024 if n.endswith("K") else 1
    return int(n.rstrip("MK")) * mult


def seq_label(n: int) -> str:
    return f"{n // (1 << 20)}M" if n % (1 << 20) == 0 else f"{n // 1024}K" if n % 1024 == 0 else str(n)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    g = ap.add_argument_group("run")
    g.add_argument("--nproc", type=int, help="processes (GPUs) N; default: all visible GPUs (CPU: 2)")
    g.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    g.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto", help="auto: nccl on cuda, else gloo")
    g.add_argument("--skip-correctness", action="store_true")
    g.add_argument("--skip-throughput", action="store_true")
    g.add_argument("--out", help="markdown file for the tables; JSON lines are appended to --jsonl "
                                 "(default: --out with the suffix .jsonl)")
    g.add_argument("--jsonl")
    g.add_argument("--log-dir", help="keep every subprocess's stdout/stderr here (default: a temporary directory)")
    g.add_argument("--deadline-s", type=float, default=520.0,
                   help="start no new subprocess after this many seconds (one call fits a 10-minute box)")
    g.add_argument("--timeout-s", type=float, default=420.0, help="limit for one subprocess")
    g.add_argument("--pg-timeout-s", type=float, default=300.0, help="process-group (collective) timeout")
    g.add_argument("--strict-targets", action="store_true",
                   help="exit non-zero (2) when a measured TSP target is missed")
    g.add_argument("--dry-run", action="store_true", help="print the environment and the commands, run nothing")

    g = ap.add_argument_group("(a) correctness")
    g.add_argument("--check-sizes", help="comma-separated TSP sizes (default: those of 2, 4, 8 dividing N)")
    g.add_argument("--check-preset", choices=("small", "tiny"), default="small",
                   help="small: 4 layers, hidden 512, seq 4096, vocab 32000; tiny: 2 layers, hidden 64, seq 64")
    g.add_argument("--check-layers", type=int)
    g.add_argument("--check-hidden", type=int)
    g.add_argument("--check-seq", type=int)
    g.add_argument("--check-batch", type=int, default=2)
    g.add_argument("--check-steps", type=int, default=4, help="AdamW steps of the loss curve")
    g.add_argument("--check-checkpointing", choices=("none", "selective", "full", "offload"), default="full",
                   help="TSP model's activation checkpointing (recompute re-issues its collectives); the "
                        "reference runs without")
    g.add_argument("--rtol-fp32", type=float, default=1e-5)
    g.add_argument("--rtol-bf16", type=float, default=2e-2)
    g.add_argument("--rtol-curve-fp32", type=float, default=1e-4,
                   help="fp32 loss curve (Adam's normalised update turns round-off in near-zero gradient "
                        "elements into full-size update differences, so after a few steps 1e-5 is too tight)")

    g = ap.add_argument_group("(b) throughput")
    g.add_argument("--model", default="paper-7b")
    g.add_argument("--layers", type=int, help="cut the preset's depth (rows say so)")
    g.add_argument("--seqs", default=DEFAULT_SEQS, help="comma-separated, run in this order (e.g. 128K,64K)")
    g.add_argument("--strategies", default=",".join(STRATEGIES),
                   help="subset of tsp,tp,tp_sp,sp,tp_x_sp,fsdp_cp (tp_x_sp: every T x S = N with T, S >= 2, "
                        "or tp_x_sp=TxS)")
    g.add_argument("--micro-batch", type=int, default=1)
    g.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    g.add_argument("--checkpointing", choices=("none", "full"), default="full")
    g.add_argument("--tsp-checkpointing", choices=("none", "selective", "full", "offload"), default="offload",
                   help="TSP rows' activation checkpointing: offload (default; TSP's leanest and, at long context, "
                        "fastest mode: layer inputs and attention outputs in pinned host memory) or as the rivals")
    g.add_argument("--optimizer", choices=("foreach", "fused", "forloop"), default="foreach")
    g.add_argument("--attention-kernel", default="auto")
    g.add_argument("--sdpa-backend", default="auto")
    g.add_argument("--fsdp-precision", choices=("policy", "autocast"), default="policy")
    g.add_argument("--rmsnorm", choices=("torch", "manual"), default="torch")
    g.add_argument("--steps", type=int, default=2, help="timed steps (median)")
    g.add_argument("--warmup", type=int, default=1)
    g.add_argument("--no-compute-only", action="store_true",
                   help="skip the fake-process-group run of TSP (no overlap efficiency)")

    g = ap.add_argument_group("internal (set by the orchestrator for the torchrun workers)")
    g.add_argument("--worker", choices=("correctness", "throughput"), help=argparse.SUPPRESS)
    g.add_argument("--result", help=argparse.SUPPRESS)
    g.add_argument("--strategy", help=argparse.SUPPRESS)
    g.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    g.add_argument("--tp", type=int, help=argparse.SUPPRESS)
    g.add_argument("--sp", type=int, help=argparse.SUPPRESS)
    g.add_argument("--simulate-oom-rank", type=int, help=argparse.SUPPRESS)  # tests: this rank raises an OOM
    args = ap.parse_args(argv)
    _resolve(args)
    return args


def _resolve(args) -> None:
    if args.device == "auto" or (args.nproc is None and not args.worker):
        import torch

        if args.device == "auto":
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        if args.nproc is None and not args.worker:
            args.nproc = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.backend == "auto":
        args.backend = "nccl" if args.device == "cuda" else "gloo"


# ---------------------------------------------------------------------------------------------------------------
# subprocesses
# ---------------------------------------------------------------------------------------------------------------

def child_env(args) -> dict:
    env = dict(os.environ)
    env.update(NO_MULTICAST_ENV)
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def torchrun_cmd(args, worker_argv: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc),
            str(Path(__file__).resolve().relative_to(ROOT)), *worker_argv]


_CHECK_OPTS = ("device", "backend", "check_sizes", "check_preset", "check_layers", "check_hidden", "check_seq",
               "check_batch", "check_steps", "check_checkpointing", "rtol_fp32", "rtol_bf16", "rtol_curve_fp32")
_RUN_OPTS = ("device", "backend", "model", "layers", "micro_batch", "precision", "checkpointing",
             "tsp_checkpointing", "optimizer",
             "attention_kernel", "sdpa_backend", "fsdp_precision", "rmsnorm", "steps", "warmup")


def repro_command(args, part: str, **values) -> str:
    """The orchestrator command that re-runs one part (or one configuration) on its own."""
    defaults = vars(parse_args(["--nproc", "1", "--device", "cpu", "--backend", "gloo"]))
    defaults.update(device="auto", backend="auto")
    cmd = ["bash", "benchmarks/multi_gpu.sh", str(args.nproc),
           "--skip-throughput" if part == "correctness" else "--skip-correctness"]
    vals = {**vars(args), **values}
    if args.device == "cuda":
        vals.update(device="auto", backend="auto" if args.backend == "nccl" else args.backend)
    for k in (_CHECK_OPTS if part == "correctness" else _RUN_OPTS + ("seqs", "strategies")):
        v = vals.get(k)
        if v is None or (v == defaults.get(k) and k not in ("seqs", "strategies")):
            continue
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return shlex.join(cmd)


def run_logged(cmd: list[str], env: dict, timeout: float, log_stem: Path) -> tuple[int | None, str]:
    """Run ``cmd`` in its own session (a timeout kills the whole process tree); returns (rc or None, stderr+stdout
    tail). Output goes to ``log_stem``.out/.err."""
    out_f, err_f = log_stem.with_suffix(".out"), log_stem.with_suffix(".err")
    with open(out_f, "w") as fo, open(err_f, "w") as fe:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe, start_new_session=True)
        try:
            rc = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = None
    text = err_f.read_text(errors="replace") + "\n" + out_f.read_text(errors="replace")
    return rc, text


def _kill_tree(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=15)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_error_line(text: str) -> str:
    """The most telling line of a failed run: the last 'SomethingError: ...' line (a worker's exception, not
    torchrun's summary), else the last line mentioning an error, else the last line."""
    import re

    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    exc = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt)\b(: .*)?$")
    skip = ("ChildFailedError", "error_file")
    for ln in reversed(lines):
        if exc.match(ln) and not any(k in ln for k in skip):
            return ln[:300]
    for ln in reversed(lines):
        if "error" in ln.lower() and not any(k in ln for k in skip) and not ln.startswith("File "):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def _is_oom_text(text: str) -> bool:
    low = text.lower()
    return "out of memory" in low or "alloc_failed" in low or "outofmemoryerror" in low


# ---------------------------------------------------------------------------------------------------------------
# worker plumbing (inside torchrun)
# ---------------------------------------------------------------------------------------------------------------

def init_worker(args):
    import torch
    import torch.distributed as dist

    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dev = f"cuda:{local}"
    else:
        torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        dev = "cpu"
    kw = {"device_id": torch.device(dev)} if args.backend == "nccl" else {}
    dist.init_process_group(args.backend, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=args.pg_timeout_s), **kw)
    return rank, world, local, dev


def _sync_all(dev: str) -> None:
    """All ranks start the next step together (a one-element all-reduce, then a device sync)."""
    import torch
    import torch.distributed as dist

    t = torch.zeros(1, device=dev)
    dist.all_reduce(t)
    if dev.startswith("cuda"):
        torch.cuda.synchronize()


def _max_over_ranks(x: float, dev: str) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([x], dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


# ---------------------------------------------------------------------------------------------------------------
# (a) correctness
# ---------------------------------------------------------------------------------------------------------------

def check_sizes(args) -> list[int]:
    if args.check_sizes:
        sizes = [int(x) for x in args.check_sizes.split(",")]
    else:
        sizes = [d for d in (2, 4, 8) if d <= args.nproc and args.nproc % d == 0]
    bad = [d for d in sizes if d < 2 or args.nproc % d]
    if bad:
        raise SystemExit(f"--check-sizes {bad}: every TSP size must be >= 2 and divide N={args.nproc}")
    return sizes


def check_config(args, d: int, attn: str):
    """The correctness model for TSP size d. GQA: 2 query heads per KV head, n_kv = max(4, d) (TSP needs
    n_kv % D == 0, so D = 8 uses 16/8 instead of 8/4); MHA: n = max(8, d)."""
    from lightning_tsp.models.llama import ModelConfig

    tiny = args.check_preset == "tiny"
    base_kv, base_mha = (2, 4) if tiny else (4, 8)
    n_kv = max(base_kv, d) if attn == "gqa" else max(base_mha, d)
    n_q = 2 * n_kv if attn == "gqa" else n_kv
    hidden = args.check_hidden or (64 if tiny else 512)
    return ModelConfig(vocab_size=256 if tiny else 32000, hidden_size=hidden,
                       n_layers=args.check_layers or (2 if tiny else 4), n_heads=n_q, n_kv_heads=n_kv,
                       intermediate_size=3 * hidden)


def check_seq(args) -> int:
    return args.check_seq or (64 if args.check_preset == "tiny" else 4096)


def _batch(cfg, b: int, s: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = ids.clone()
    labels[0, torch.randperm(s, generator=g)[:5]] = -100  # some positions carry no loss
    return ids, labels


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (the tests' measure: relative to the tensor's scale)."""
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    return err / scale if scale > 0 else err


def _autocast(dev: str, prec: str):
    import contextlib

    import torch

    if prec == "bf16":
        return torch.autocast(torch.device(dev).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _loss_and_grads(model, ids, labels, prec: str, dev: str, keep: bool):
    """Loss and every gathered (full) parameter gradient; the gathers are collectives of the model's group."""
    from lightning_tsp.models.llama import gather_full

    model.zero_grad(set_to_none=True)
    inputs = [x.to(dev) for x in model.shard_batch(ids, labels)]
    with _autocast(dev, prec):
        loss = model(*inputs)
    loss.backward()
    dims = model.shard_dims()
    grads = {}
    for name, p in model.named_parameters():
        full = gather_full(p.grad, dims[name], model.tsp)
        if keep:
            grads[name] = full
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def _loss_curve(model, cfg, args, prec: str, dev: str) -> list[float]:
    import torch

    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    curve = []
    for step in range(args.check_steps):
        ids, labels = _batch(cfg, args.check_batch, check_seq(args), seed=step % 2)  # two batches, alternating
        inputs = [x.to(dev) for x in model.shard_batch(ids, labels)]
        with _autocast(dev, prec):
            loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(float(loss.detach().float()))
    model.init_weights()
    return curve


def correctness_worker(args) -> None:
    import torch
    import torch.distributed as dist

    from lightning_tsp import TSPGroup, TSPLlama
    from lightning_tsp.models.llama import gather_full

    rank, world, local, dev = init_worker(args)
    # fp32 means fp32: no TF32 in matmuls or cuDNN
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    t_start = time.perf_counter()
    sizes = [int(x) for x in args.check_sizes.split(",")]
    seq, b = check_seq(args), args.check_batch
    checks = []  # identical order on every rank; only group leaders fill in errors

    def record(d, attn, prec, what, err, tol, worst="", extra=None):
        checks.append({"D": d, "attention": attn, "precision": prec, "check": what, "err": err, "tol": tol,
                       "worst": worst, **(extra or {})})

    for d in sizes:
        if d == world:
            group = dist.group.WORLD
        else:
            group, _ = dist.new_subgroups(group_size=d)
        tsp = TSPGroup.from_process_group(group)
        lead = tsp.rank == 0
        for attn in ("gqa", "mha"):
            cfg = check_config(args, d, attn)
            label = f"{'GQA' if attn == 'gqa' else 'MHA'} {cfg.n_heads}/{cfg.n_kv_heads}"
            ids, labels = _batch(cfg, b, seq, seed=0)
            model = TSPLlama(cfg, tsp, activation_checkpointing=args.check_checkpointing, device=dev,
                             dtype=torch.float32)
            ref = TSPLlama(cfg, None, device=dev, dtype=torch.float32) if lead else None
            # same weights: each rank draws every full tensor from the same seed and keeps its slice
            dims = model.shard_dims()
            worst, werr = "", 0.0
            for name, p in model.named_parameters():
                full = gather_full(p.detach(), dims[name], tsp)
                if lead:
                    e = rel_err(full, ref.get_parameter(name).detach())
                    if e > werr or not worst:
                        worst, werr = name, e
            worst = worst if werr > 0 else ""
            record(d, label, "fp32", "weights identical", werr if lead else None, 0.0, worst)
            ref32 = None
            for prec in ("fp32", "bf16"):
                tol = args.rtol_fp32 if prec == "fp32" else args.rtol_bf16
                loss, grads = _loss_and_grads(model, ids, labels, prec, dev, keep=lead)
                if lead:
                    rloss, rgrads = _loss_and_grads(ref, ids, labels, prec, dev, keep=True)
                    # bf16 rows also say how far the bf16 reference itself is from the fp32 one (the noise floor)
                    floor = {} if ref32 is None else {"ref_bf16_vs_fp32": rel_err(rloss, ref32[0])}
                    record(d, label, prec, "loss", rel_err(loss, rloss), tol, "",
                           {"value": float(loss), "ref": float(rloss), **floor})
                    errs = {n: rel_err(grads[n], rgrads[n]) for n in rgrads}
                    missing = sorted(set(rgrads) ^ set(grads))
                    name = max(errs, key=errs.get)
                    floor = {} if ref32 is None else \
                        {"ref_bf16_vs_fp32": max(rel_err(rgrads[n], ref32[1][n]) for n in rgrads)}
                    record(d, label, prec, f"grads ({len(errs)} tensors)",
                           float("inf") if missing else errs[name], tol, missing[0] if missing else name, floor)
                    ref32 = (rloss, rgrads) if prec == "fp32" else None
                    del grads, rgrads
                else:
                    record(d, label, prec, "loss", None, tol)
                    record(d, label, prec, f"grads ({len(list(model.parameters()))} tensors)", None, tol)
            for prec in ("fp32", "bf16"):
                tol = args.rtol_curve_fp32 if prec == "fp32" else args.rtol_bf16
                curve = _loss_curve(model, cfg, args, prec, dev)
                what = f"loss curve ({args.check_steps} AdamW steps)"
                if lead:
                    rcurve = _loss_curve(ref, cfg, args, prec, dev)
                    scale = max(abs(x) for x in rcurve)
                    err = max(abs(a - r) for a, r in zip(curve, rcurve)) / scale
                    record(d, label, prec, what, err, tol, "",
                           {"curve": curve, "ref_curve": rcurve, "ref_learned": rcurve[-1] < rcurve[0]})
                else:
                    record(d, label, prec, what, None, tol)
            del model, ref
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
        dist.barrier(group=None)

    gathered = [None] * world
    dist.all_gather_object(gathered, checks)
    if rank == 0:
        rows = []
        for i, c in enumerate(checks):
            per_group = [(r, g[i]) for r, g in enumerate(gathered) if g[i]["err"] is not None]
            r_worst, worst = max(per_group, key=lambda t: t[1]["err"])
            row = dict(worst)
            row.update(kind="correctness", groups=len(per_group), worst_group_leader=r_worst,
                       result="PASS" if worst["err"] <= c["tol"] else "FAIL", seq_len=seq, batch=b, world=world,
                       checkpointing=args.check_checkpointing, device=_device_name(dev), torch=torch.__version__,
                       backend=args.backend)
            rows.append(row)
        _write_json(args.result, {"rows": rows, "wall_s": time.perf_counter() - t_start})
    _finish(dev)


def _write_json(path, obj) -> None:
    """Write atomically: a reader never sees half a file."""
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


def _finish(dev: str) -> None:
    """Leave together: a barrier before tearing the group down (a rank destroying its gloo group while the
    other still completes the last collective can abort the process)."""
    import torch.distributed as dist

    _sync_all(dev)
    dist.destroy_process_group()
    # Skip the interpreter's own teardown: with gloo it occasionally aborts ("terminate called without an active
    # exception") after all the work is done; the results are already on disk.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _device_name(dev: str) -> str:
    import torch

    return torch.cuda.get_device_name(torch.device(dev)) if dev.startswith("cuda") else "cpu"


def format_check_table(rows: list[dict]) -> str:
    head = ("| D | attention | precision | check | max rel err | tolerance | worst tensor (group leader) | "
            "bf16 reference vs fp32 reference | result |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        err = r.get("err")
        err_s = "n/a" if err is None else ("inf" if err == float("inf") else f"{err:.2e}")
        where = (r.get("worst") or "") + (f" (rank {r['worst_group_leader']})" if r.get("groups", 1) > 1 else "")
        floor = _fmt(r.get("ref_bf16_vs_fp32"), ".2e", "")
        lines.append(f"| {r['D']} | {r['attention']} | {r['precision']} | {r['check']} | {err_s} | "
                     f"{r['tol']:.0e} | {where} | {floor} | **{r['result']}** |")
    return "\n".join(lines)


def run_correctness(args, t0: float, log_dir: Path) -> tuple[list[dict], str, bool]:
    """Returns (rows, markdown, ok)."""
    sizes = check_sizes(args)
    if not sizes:
        note = f"(a) correctness: no TSP size of 2, 4, 8 divides N={args.nproc}: nothing to check"
        return [], note, False
    result = log_dir / "correctness.json"
    worker = ["--worker", "correctness", "--result", str(result), "--check-sizes", ",".join(map(str, sizes)),
              "--device", args.device, "--backend", args.backend, "--check-preset", args.check_preset,
              "--check-batch", str(args.check_batch), "--check-steps", str(args.check_steps),
              "--check-checkpointing", args.check_checkpointing, "--rtol-fp32", str(args.rtol_fp32),
              "--rtol-bf16", str(args.rtol_bf16), "--rtol-curve-fp32", str(args.rtol_curve_fp32),
              "--pg-timeout-s", str(args.pg_timeout_s)]
    for opt in ("check_layers", "check_hidden", "check_seq"):
        if getattr(args, opt) is not None:
            worker += [f"--{opt.replace('_', '-')}", str(getattr(args, opt))]
    cmd = torchrun_cmd(args, worker)
    print(f"# (a) correctness: D in {sizes}, N={args.nproc}: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return [], "", True
    left = args.deadline_s - (time.perf_counter() - t0)
    result.unlink(missing_ok=True)  # never read a stale result from a reused --log-dir
    t1 = time.perf_counter()
    rc, text = run_logged(cmd, child_env(args), min(args.timeout_s, max(left, 60.0)), log_dir / "correctness")
    wall = time.perf_counter() - t1
    if result.exists():  # complete (written atomically after every check); a crash at teardown changes nothing
        if rc != 0:
            print(f"# note: the correctness run exited with {rc} after writing its results: "
                  f"{_last_error_line(text)}", file=sys.stderr)
        rows = json.loads(result.read_text())["rows"]
        ok = all(r["result"] == "PASS" for r in rows)
        n_fail = sum(r["result"] != "PASS" for r in rows)
        cfgs = sorted({(r["D"], r["attention"]) for r in rows})
        r0 = rows[0]
        md = (f"## (a) Correctness: TSP on a real {args.backend} group vs the D = 1 reference\n\n"
              + format_check_table(rows)
              + f"\n\n{len(rows) - n_fail} PASS, {n_fail} FAIL ({len(cfgs)} configurations, {wall:.0f} s). "
              f"Model: {_check_model_note(args)}; batch {r0['batch']} x {r0['seq_len']} tokens; TSP model with "
              f"{r0['checkpointing']} activation checkpointing, reference without; device {r0['device']}, torch "
              f"{r0['torch']}. Error = max |TSP - reference| / max |reference| per tensor (the worst tensor and, "
              "with several TSP groups, the worst group are shown). bf16 = torch.autocast(bfloat16) over fp32 "
              "weights, compared with the reference under the same autocast; the bf16 rows also show the bf16 "
              "reference's own distance from the fp32 reference (its noise floor). Reproduce: "
              f"`{repro_command(args, 'correctness')}`")
        for r in rows:
            r["command"] = repro_command(args, "correctness")
            r["worker_command"] = shlex.join(cmd)
        return rows, md, ok
    status = "timeout" if rc is None else f"exit code {rc}"
    md = (f"## (a) Correctness\n\n**FAIL**: the correctness run did not finish ({status}): "
          f"{_last_error_line(text)}\nLogs: {log_dir}/correctness.err")
    return [{"kind": "correctness", "result": "FAIL", "error": status + ": " + _last_error_line(text),
             "command": repro_command(args, "correctness"), "worker_command": shlex.join(cmd)}], md, False


def _check_model_note(args) -> str:
    c, mha = check_config(args, 2, "gqa"), check_config(args, 2, "mha")
    return (f"{c.n_layers} layers, hidden {c.hidden_size}, SwiGLU {c.intermediate_size}, vocab {c.vocab_size}; GQA "
            f"2 query heads per KV head with max({c.n_kv_heads}, D) KV heads, MHA max({mha.n_heads}, D) heads (TSP "
            "needs the KV-head count divisible by D)")


# ---------------------------------------------------------------------------------------------------------------
# (b) throughput
# ---------------------------------------------------------------------------------------------------------------

def layouts(args) -> list[tuple[str, int | None, int | None]]:
    """(strategy, T, S) in execution order; tp_x_sp expands to every T x S = N with T, S >= 2."""
    n = args.nproc
    out = []
    for spec in [s.strip() for s in args.strategies.split(",") if s.strip()]:
        name, _, grid = spec.partition("=")
        if name not in STRATEGIES:
            raise SystemExit(f"--strategies: unknown {name!r} (use {', '.join(STRATEGIES)})")
        if name == "tp_x_sp":
            grids = [tuple(int(x) for x in grid.lower().split("x"))] if grid else \
                [(t, n // t) for t in range(2, n // 2 + 1) if n % t == 0 and n // t >= 2]
            if any(t * s != n for t, s in grids):
                raise SystemExit(f"--strategies {spec}: T x S must equal N={n}")
            out += [(name, t, s) for t, s in grids] or [(name, None, None)]  # None: not applicable at this N
        else:
            out.append((name, None, None))
    return out


def checkpointing_for(args, strategy: str) -> str:
    """The activation checkpointing of one strategy's rows: --tsp-checkpointing applies to TSP only."""
    return args.tsp_checkpointing if strategy == "tsp" else args.checkpointing


def harness_ns(args, strategy: str, seq: int, tp=None, sp=None) -> argparse.Namespace:
    """benchmarks/harness.py's namespace for the same configuration (its rows, FLOPs and fake-PG child)."""
    import harness

    argv = ["--strategy", strategy, "--seq-len", str(seq), "--model", args.model, "--world", str(args.nproc),
            "--micro-batch", str(args.micro_batch), "--precision", args.precision, "--checkpointing",
            checkpointing_for(args, strategy), "--optimizer", args.optimizer, "--rmsnorm", args.rmsnorm,
            "--sdpa-backend",
            args.sdpa_backend, "--attention-kernel", args.attention_kernel, "--fsdp-precision", args.fsdp_precision,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
            "--timeout-s", str(args.timeout_s), "--gpus-per-node", str(max(args.nproc, 1))]
    if args.layers is not None:
        argv += ["--layers", str(args.layers)]
    if strategy == "tp_x_sp":
        argv += ["--tp", str(tp), "--sp", str(sp)]
    return harness.parse_args(argv)


def throughput_worker(args) -> None:
    import torch
    import torch.distributed as dist

    import harness
    from baselines import build
    from baselines.common import Setup, prime_optimizer

    rank, world, local, dev = init_worker(args)
    cuda = dev.startswith("cuda")
    hns = harness_ns(argparse.Namespace(**{**vars(args), "nproc": world}), args.strategy, args.seq, args.tp, args.sp)
    cfg = harness.model_config(hns)
    setup = Setup(cfg, args.strategy, world, rank, args.seq, args.micro_batch, tp=args.tp or 1, sp=args.sp or 1,
                  checkpointing=checkpointing_for(args, args.strategy), device=dev,
                  autocast=args.precision == "bf16-mixed",
                  optimizer=args.optimizer, sdpa_backend=args.sdpa_backend, attention_kernel=args.attention_kernel,
                  fsdp_precision=args.fsdp_precision, norm=args.rmsnorm)
    rank_file = Path(args.result).with_name(f"{Path(args.result).stem}.rank{rank}.json")
    times, layout = [], ""
    try:
        runner = build(setup)
        layout = runner.layout
        if args.simulate_oom_rank == rank:
            raise torch.OutOfMemoryError("simulated out of memory (--simulate-oom-rank)")
        prime_optimizer(runner)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        for i in range(args.warmup + args.steps):
            _sync_all(dev)
            t0 = time.perf_counter()
            loss = runner.step()
            if cuda:
                torch.cuda.synchronize()
            dt = _max_over_ranks(time.perf_counter() - t0, dev)  # the step ends when the slowest rank is done
            if i >= args.warmup:
                times.append(dt)
        loss_val = float(loss)
    except Exception as exc:  # noqa: BLE001 - an OOM becomes a row; anything else is re-raised
        if not harness._is_oom(exc):
            raise
        peak = torch.cuda.max_memory_allocated() / 1e9 if cuda else None
        _write_json(rank_file, {"status": "OOM", "rank": rank, "peak_gb": peak, "layout": layout,
                                "device": _device_name(dev), "torch": torch.__version__,
                                "error": str(exc).splitlines()[0][:300]})
        sys.stderr.write(f"[rank {rank}] out of memory: {str(exc).splitlines()[0][:200]}\n")
        sys.stderr.flush()
        os._exit(OOM_EXIT)  # torchrun then stops the other ranks (they may be waiting in a collective)
    mine = {"rank": rank, "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if cuda else None,
            "reserved_gb": torch.cuda.max_memory_reserved() / 1e9 if cuda else None}
    if cuda:
        free, total = torch.cuda.mem_get_info()
        mine["device_used_gb"] = (total - free) / 1e9  # includes NCCL buffers, the CUDA context, the cache
    per_rank = [None] * world
    dist.all_gather_object(per_rank, mine)
    if rank == 0:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and args.backend == "nccl" else None
        out = {"status": "ok", "layout": layout, "step_times_s": times,
               "step_s": statistics.median(times) if times else None, "loss": loss_val,
               "peak_gb_per_rank": [r["peak_gb"] for r in per_rank], "device": _device_name(dev),
               "torch": torch.__version__, "nccl": nccl, "backend": args.backend}
        if cuda:
            out["peak_gb"] = max(r["peak_gb"] for r in per_rank)
            out["reserved_gb"] = max(r["reserved_gb"] for r in per_rank)
            out["device_used_gb"] = max(r["device_used_gb"] for r in per_rank)
        else:
            out["peak_gb"] = None
            out["peak_note"] = "CPU run: peak memory not measured"
        _write_json(args.result, out)
    _finish(dev)


def throughput_worker_argv(args, strategy, seq, tp, sp, result: Path) -> list[str]:
    argv = ["--worker", "throughput", "--result", str(result), "--strategy", strategy, "--seq", str(seq),
            "--device", args.device, "--backend", args.backend, "--model", args.model,
            "--micro-batch", str(args.micro_batch), "--precision", args.precision,
            "--checkpointing", args.checkpointing, "--optimizer", args.optimizer,
            "--attention-kernel", args.attention_kernel, "--sdpa-backend", args.sdpa_backend,
            "--fsdp-precision", args.fsdp_precision, "--rmsnorm", args.rmsnorm, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--pg-timeout-s", str(args.pg_timeout_s)]
    if args.layers is not None:
        argv += ["--layers", str(args.layers)]
    argv += ["--tsp-checkpointing", args.tsp_checkpointing]
    if strategy == "tp_x_sp":
        argv += ["--tp", str(tp), "--sp", str(sp)]
    if args.simulate_oom_rank is not None:
        argv += ["--simulate-oom-rank", str(args.simulate_oom_rank)]
    return argv


def compute_only(args, seq: int, timeout: float, log_dir: Path) -> dict:
    """TSP's step with the fake process group on one device (harness.py in a subprocess): compute only."""
    import harness

    hns = harness_ns(args, "tsp", seq)
    hns.timeout_s = timeout
    saved = os.environ.copy()
    try:
        os.environ.update(NO_MULTICAST_ENV)
        if args.device == "cuda":  # one GPU: the first visible one
            vis = os.environ.get("CUDA_VISIBLE_DEVICES", "")
            os.environ["CUDA_VISIBLE_DEVICES"] = vis.split(",")[0] if vis else "0"
        row = harness.run_child(hns, "tsp", seq, timeout=timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    (log_dir / f"compute_only_tsp_{seq}.json").write_text(json.dumps(row))
    return row


def run_throughput(args, t0: float, log_dir: Path) -> list[dict]:
    import harness

    seqs = [parse_seq(s) for s in args.seqs.split(",") if s.strip()]
    rows = []
    for seq in seqs:
        for strategy, tp, sp in layouts(args):
            if strategy == "tp_x_sp" and tp is None:
                hns = harness_ns(args, "tp", seq)
                row = harness.base_row(hns, harness.model_config(hns))
                row.update(strategy="tp_x_sp", kind="throughput", layout="T x S with T, S >= 2",
                           status=f"not applicable at N={args.nproc}", command="")
                if not args.dry_run:
                    rows.append(harness.finalize(row))
                continue
            hns = harness_ns(args, strategy, seq, tp, sp)
            cfg = harness.model_config(hns)
            row = harness.base_row(hns, cfg)
            tag = f"{strategy}{f'_{tp}x{sp}' if tp else ''}_{seq}"
            result = log_dir / f"run_{tag}.json"
            cmd = torchrun_cmd(args, throughput_worker_argv(args, strategy, seq, tp, sp, result))
            spec = f"{strategy}={tp}x{sp}" if strategy == "tp_x_sp" else strategy
            row.update(kind="throughput", excluded="nothing (real process group)", backend=args.backend,
                       command=repro_command(args, "throughput", seqs=seq_label(seq), strategies=spec),
                       worker_command=shlex.join(["torchrun"] + cmd[3:]), layers_note=_layers_note(args, cfg),
                       env={k: v for k, v in NO_MULTICAST_ENV.items()})
            left = args.deadline_s - (time.perf_counter() - t0)
            if args.dry_run:
                print(f"# (b) {tag}: {shlex.join(cmd)}", file=sys.stderr)
                continue
            if left <= 0:
                print(f"# deadline reached: skipped {tag}", file=sys.stderr, flush=True)
                row.update(status="skipped (deadline)")
                rows.append(harness.finalize(row))
                continue
            for stale in [result, *log_dir.glob(f"run_{tag}.rank*.json")]:
                stale.unlink(missing_ok=True)
            t1 = time.perf_counter()
            limit = min(args.timeout_s, max(left, 30.0))
            rc, text = run_logged(cmd, child_env(args), limit, log_dir / tag)
            if result.exists():  # complete: written atomically after the last step
                row.update(json.loads(result.read_text()))
                if rc != 0:
                    row["teardown_note"] = f"exit code {rc} after the result: {_last_error_line(text)}"
            else:
                ranks = [json.loads(p.read_text()) for p in sorted(log_dir.glob(f"run_{tag}.rank*.json"))]
                ooms = [r for r in ranks if r.get("status") == "OOM"]
                if ooms or (rc is not None and _is_oom_text(text)):
                    peaks = [r["peak_gb"] for r in ooms if r.get("peak_gb") is not None]
                    row.update({k: ooms[0][k] for k in ("layout", "device", "torch") if ooms and ooms[0].get(k)})
                    row.update(status="OOM", error=(ooms[0]["error"] if ooms else _last_error_line(text)),
                               oom_ranks=[r["rank"] for r in ooms], peak_gb=max(peaks) if peaks else None)
                else:
                    capped = limit < args.timeout_s
                    row.update(status=("timeout (deadline)" if capped else "timeout") if rc is None else "error",
                               error=(f"no result within {limit:.0f} s" if rc is None else
                                      f"exit code {rc}: {_last_error_line(text)}"))
            row["wall_s"] = time.perf_counter() - t1
            row = harness.finalize(row)
            if strategy == "tsp" and row["status"] == "ok" and not args.no_compute_only:
                left = args.deadline_s - (time.perf_counter() - t0)
                if left > 0:
                    fake = compute_only(args, seq, min(args.timeout_s, max(left, 30.0)), log_dir)
                    row["compute_only_status"] = fake.get("status")
                    row["compute_only_step_s"] = fake.get("step_s")
                    row["compute_only_peak_gb"] = fake.get("peak_gb")
                    row["compute_only_command"] = fake.get("command")
                    if fake.get("status") == "ok" and fake.get("step_s") and row.get("step_s"):
                        row["overlap_efficiency"] = fake["step_s"] / row["step_s"]
                else:
                    row["compute_only_status"] = "skipped (deadline)"
            print(f"# (b) {strategy} {row.get('layout', '')} S={seq_label(seq)}: {row['status']} "
                  f"step {_fmt(row.get('step_s'), '.3f')} s, peak {_fmt(row.get('peak_gb'), '.2f')} GB"
                  + (f", overlap {_fmt(row.get('overlap_efficiency'), '.2f')}" if strategy == "tsp" else "")
                  + f" ({time.perf_counter() - t1:.0f} s wall)", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _layers_note(args, cfg) -> str:
    from lightning_tsp.models.llama import get_config

    full = get_config(args.model).n_layers
    return "" if cfg.n_layers == full else f"depth cut to {cfg.n_layers} of {full} layers (--layers)"


def _fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None else format(v, spec)


def _order(r: dict):
    return (r["seq_len"], STRATEGIES.index(r["strategy"]) if r["strategy"] in STRATEGIES else 99, r.get("tp") or 0)


def format_throughput_table(rows: list[dict]) -> str:
    head = ("| strategy | layout | seq | status | step s | tokens/s per GPU | model TFLOP/s per GPU | peak GB "
            "(max over ranks) | compute-only step s (fake PG) | overlap efficiency | command |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in sorted(rows, key=_order):
        st = r.get("status")
        peak = _fmt(r.get("peak_gb"), ".2f")
        if st == "OOM":
            peak = "OOM" + (f" (>{r['peak_gb']:.1f})" if r.get("peak_gb") else "")
        status = st if st != "error" else f"error: {r.get('error', '')[:80]}"
        layout = r.get("layout") or (f"T={r['tp']} SP x S={r['sp']}" if r["strategy"] == "tp_x_sp" else "")
        lines.append("| " + " | ".join([
            r["strategy"], layout, seq_label(r["seq_len"]), status, _fmt(r.get("step_s"), ".3f"),
            _fmt(r.get("tokens_per_s_per_gpu"), ",.0f"), _fmt(r.get("model_tflops_per_gpu"), ".0f"), peak,
            _fmt(r.get("compute_only_step_s"), ".3f", "" if r["strategy"] != "tsp" else "n/a"),
            _fmt(r.get("overlap_efficiency"), ".2f", "" if r["strategy"] != "tsp" else "n/a"),
            f"`{r['command']}`" if r.get("command") else ""]) + " |")
    return "\n".join(lines)


def check_targets(rows: list[dict], n: int) -> list[dict]:
    """The TSP targets at the longest measured sequence (defined for D = 8 at 128K; other N: informational)."""
    ok_rows = [r for r in rows if r.get("status") == "ok"]
    tsp_rows = [r for r in ok_rows if r["strategy"] == "tsp"]
    if not tsp_rows:
        return [{"target": "TSP measured", "result": "not measured", "detail": "no TSP row finished"}]
    seq = max(r["seq_len"] for r in tsp_rows)
    tsp = next(r for r in tsp_rows if r["seq_len"] == seq)
    same = [r for r in ok_rows if r["seq_len"] == seq]
    all_same = [r for r in rows if r["seq_len"] == seq]
    where = f"S={seq_label(seq)}, D={n}" + ("" if (n == 8 and seq == 131072) else " (targets are set for 128K, D=8)")
    out = []

    def add(name, passed, detail):
        out.append({"target": name, "where": where,
                    "result": "not measured" if passed is None else ("MET" if passed else "MISSED"), "detail": detail})

    eff = tsp.get("overlap_efficiency")
    add("overlap efficiency >= 0.9", None if eff is None else eff >= 0.9,
        f"{_fmt(eff, '.3f')} = compute-only {_fmt(tsp.get('compute_only_step_s'), '.3f')} s / real "
        f"{_fmt(tsp.get('step_s'), '.3f')} s")
    tps = tsp["tokens_per_s_per_gpu"]
    sp_like = [r for r in same if r["strategy"] in TP_SP_LIKE]
    if sp_like:
        best = max(sp_like, key=lambda r: r["tokens_per_s_per_gpu"])
        add("tokens/s per GPU >= 1.3 x best TP+SP layout", tps >= 1.3 * best["tokens_per_s_per_gpu"],
            f"TSP {tps:,.0f} vs {best.get('layout')} {best['tokens_per_s_per_gpu']:,.0f} "
            f"({tps / best['tokens_per_s_per_gpu']:.2f}x)")
    else:
        add("tokens/s per GPU >= 1.3 x best TP+SP layout", None, "no TP+SP row finished at this length")
    tp = [r for r in same if r["strategy"] == "tp"]
    if tp:
        add("tokens/s per GPU >= TP", tps >= tp[0]["tokens_per_s_per_gpu"],
            f"TSP {tps:,.0f} vs TP {tp[0]['tokens_per_s_per_gpu']:,.0f} ({tps / tp[0]['tokens_per_s_per_gpu']:.2f}x)")
    else:
        add("tokens/s per GPU >= TP", None, "no TP row finished at this length")
    peaks = [r for r in same if r.get("peak_gb") is not None and r["strategy"] != "tsp"]
    if tsp.get("peak_gb") is None:
        add("lowest peak memory of all", None, "peak memory not measured (CPU)")
    else:
        others = ", ".join(f"{r['strategy']} {r.get('layout', '')} {r['peak_gb']:.1f}" for r in peaks)
        ooms = [r for r in all_same if r.get("status") == "OOM"]
        add("lowest peak memory of all", all(tsp["peak_gb"] < r["peak_gb"] for r in peaks),
            f"TSP {tsp['peak_gb']:.2f} GB; " + (others or "no other row") +
            (f"; OOM: {', '.join(r['strategy'] for r in ooms)}" if ooms else ""))
    return out


def format_targets(targets: list[dict]) -> str:
    lines = ["| target | where | result | detail |", "| --- | --- | --- | --- |"]
    lines += [f"| {t['target']} | {t.get('where', '')} | **{t['result']}** | {t['detail']} |" for t in targets]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "correctness":
        correctness_worker(args)  # exits the process
        return 0
    if args.worker == "throughput":
        throughput_worker(args)  # exits the process
        return 0
    t0 = time.perf_counter()
    if args.nproc < 1:
        raise SystemExit("no GPU visible: pass --nproc, or --device cpu --backend gloo")
    if args.device == "cuda" and args.backend == "gloo":
        print("# note: gloo on cuda tensors is not what the benchmarks measure", file=sys.stderr)
    print(f"# N={args.nproc} device={args.device} backend={args.backend}; child environment: "
          + " ".join(f"{k}={v}" for k, v in NO_MULTICAST_ENV.items()), file=sys.stderr, flush=True)
    tmp = None
    if args.log_dir:
        log_dir = Path(args.log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="multi_gpu_")
        log_dir = Path(tmp.name)
    sections, jrows, rc = [], [], 0
    if not args.skip_correctness:
        rows, md, ok = run_correctness(args, t0, log_dir)
        if md:
            print(md + "\n", flush=True)
            sections.append(md)
        jrows += rows
        if not ok and not args.dry_run:
            rc = 1
    if not args.skip_throughput:
        rows = run_throughput(args, t0, log_dir)
        if rows:
            r0 = next((r for r in rows if r.get("device")), rows[0])
            cuts = {r["layers_note"] for r in rows if r.get("layers_note")}
            md = (f"## (b) Throughput and memory with real communication ({args.nproc} x {r0.get('device', '?')}, "
                  f"{args.backend})\n\n" + format_throughput_table(rows)
                  + f"\n\nModel {args.model}" + (f", {'; '.join(sorted(cuts))}" if cuts else "")
                  + f", micro-batch {args.micro_batch}, {args.precision}, {args.checkpointing} activation "
                  + f"checkpointing (TSP: {args.tsp_checkpointing})"
                  + f", AdamW ({args.optimizer}); step = median of {args.steps} timed steps after "
                  f"{args.warmup} warm-up (each the slowest rank's time), optimizer step included. Peak = "
                  "torch.cuda.max_memory_allocated, max over ranks (NCCL's own buffers are outside it: "
                  "device_used_gb in the JSON). Overlap efficiency = the same TSP step with the fake process "
                  "group on one GPU (compute only) / the real step. Model TFLOP/s counts 6 x params x tokens + "
                  "causal attention, not recompute. torch " + str(r0.get("torch", "?"))
                  + (f", NCCL {r0['nccl']}" if r0.get("nccl") else "") + ".")
            targets = check_targets(rows, args.nproc)
            md += "\n\n### TSP targets\n\n" + format_targets(targets)
            print(md + "\n", flush=True)
            sections.append(md)
            jrows += rows
            jrows.append({"kind": "targets", "world": args.nproc, "targets": targets})
            if args.strict_targets and any(t["result"] == "MISSED" for t in targets):
                rc = rc or 2
    if args.out and not args.dry_run:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n\n".join(sections) + "\n")
    jsonl = args.jsonl or (str(Path(args.out).with_suffix(".jsonl")) if args.out else None)
    if jsonl and not args.dry_run:
        with open(jsonl, "a") as f:
            for r in jrows:
                f.write(json.dumps(r) + "\n")
    if args.log_dir:
        print(f"# logs: {log_dir}", file=sys.stderr)
    if tmp is not None:
        tmp.cleanup()
    if rc == 1:
        print("# RESULT: correctness FAILED", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
