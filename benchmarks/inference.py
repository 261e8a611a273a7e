"""Inference benchmark: TSP prefill and decoding measured on one GPU playing rank r of a TSP group of D (PyTorch's
fake process group: every collective returns at once, so a rank's memory and compute are exact and all
communication is excluded), against the unsharded model on one GPU (D = 1, ``tsp=None``, the same code path).
The communication an NVLink node would add comes from the cost model (see ``--hardware``).

    python -m benchmarks.inference                                  # paper-7b, D = 8, rank 0, 32K/128K/1M + D = 1
    python -m benchmarks.inference --prompt-lens 131072 --tsp-size 8 --no-baseline --out runs/inf.jsonl
    python -m benchmarks.inference --device cpu --model tiny --tsp-size 2 --prompt-lens 32 --decode-steps 2
    python -m benchmarks.inference --prompt-lens 2048 --new-tokens 32 256 --calls 6   # whole generate calls too

Every configuration (D, prompt length) runs in a fresh subprocess, so peak memory does not mix between rows and
an out-of-memory error becomes a row saying OOM. Rows are printed as a markdown table (each row's exact command
below it) and appended as JSON lines to ``--out``. See benchmarks/INFERENCE.md for how to read the numbers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

from benchmarks.runner import Deadline, append_jsonl, first_line, is_oom, md_table, run_config, write_json

EXCLUDED = "all communication (fake process group: collectives return at once)"
DEFAULT_LENS = (32768, 131072, 1048576)

# options that define one configuration: forwarded to the subprocess and printed in the row's command
CONFIG_OPTS = ("model", "layers", "tsp_size", "rank", "batch", "dtype", "device", "attention_kernel", "repeats",
               "warmup_len", "decode_steps", "decode_warmup", "max_seconds", "hardware", "seed", "decode_mode",
               "new_tokens", "calls", "fresh_calls")
HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e: the decode floor reads the weights and the filled cache once per token


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.inference", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="paper-7b", help="a preset of lightning_tsp.models.llama (paper-7b, "
                                                         "llama3-8b, tiny)")
    ap.add_argument("--layers", type=int, help="override the preset's layer count")
    ap.add_argument("--tsp-size", type=int, default=8, help="TSP degree D of the measured group")
    ap.add_argument("--rank", type=int, default=0, help="the rank this GPU plays")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=list(DEFAULT_LENS),
                    help="prompt lengths in tokens (right-padded to a multiple of 2D, as generate does)")
    ap.add_argument("--batch", type=int, default=1, help="prompts per batch (all of the same length)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="skip the single-GPU rows (D = 1, tsp=None: the unsharded model, same prefill/decode code)")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                    help="weights and compute dtype (no fp32 master copy, no autocast)")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--attention-kernel", default="auto", help="prefill attention kernel (TSPLlama's option)")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills (median); fewer when --max-seconds "
                                                           "would be exceeded")
    ap.add_argument("--warmup-len", type=int, default=32768,
                    help="untimed warm-up prefill (+2 decode steps) of min(prompt, this) tokens; 0: none")
    ap.add_argument("--decode-steps", type=int, default=16, help="timed decode steps (median)")
    ap.add_argument("--decode-warmup", type=int, default=3, help="untimed decode steps before the timed ones (the "
                                                                 "CUDA graph is captured during them)")
    ap.add_argument("--decode-mode", choices=("graph", "eager"), default="graph",
                    help="decode steps replayed as one CUDA graph (generate's default on CUDA) or run eagerly")
    ap.add_argument("--new-tokens", type=int, nargs="*", default=[],
                    help="also time whole generate() calls end to end (prefill, decoding, host reads), in a loop of "
                         "--calls calls with new prompts of the same shapes, for each of these max_new_tokens")
    ap.add_argument("--calls", type=int, default=6, help="generate calls per --new-tokens value: the first, then "
                                                         "the median of the others (decoder kept across calls)")
    ap.add_argument("--fresh-calls", type=int, default=2,
                    help="generate calls per --new-tokens value with keep_decoder=False (a new decoder every call: "
                         "the behaviour before decoders were kept), median; 0: none")
    ap.add_argument("--max-seconds", type=float, default=300.0,
                    help="per configuration: the subprocess is killed after this (row 'timeout'); prefill "
                         "repeats stop once another would pass half of it, decode steps at 90%%")
    ap.add_argument("--budget-seconds", type=float, default=None,
                    help="whole run: configurations not started within this many seconds are skipped")
    ap.add_argument("--hardware", default="h200", help="lightning_tsp.planning hardware preset for the predicted "
                                                       "communication time (h200: NVLink 4 / NVSwitch)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="append one JSON line per row to this file")
    ap.add_argument("--in-process", action="store_true",
                    help="run the single configuration in this process (what each subprocess does)")
    ap.add_argument("--json-out", help=argparse.SUPPRESS)  # internal: a child writes its one row here
    args = ap.parse_args(argv)
    if args.tsp_size < 1 or not 0 <= args.rank < args.tsp_size:
        ap.error(f"need D >= 1 and 0 <= rank < D, got D={args.tsp_size} rank={args.rank}")
    if any(s < 1 for s in args.prompt_lens) or args.batch < 1 or args.repeats < 1 or args.decode_steps < 1:
        ap.error("prompt lengths, --batch, --repeats and --decode-steps must be >= 1")
    if any(n < 2 for n in args.new_tokens) or args.calls < 2 or args.fresh_calls < 0:
        ap.error("--new-tokens values must be >= 2, --calls >= 2 (the first call and at least one more), "
                 "--fresh-calls >= 0")
    return args


def configurations(args) -> list[argparse.Namespace]:
    """One namespace per row: for each prompt length the TSP group, then the single-GPU baseline."""
    out = []
    for s in args.prompt_lens:
        sizes = [args.tsp_size] + ([] if args.no_baseline or args.tsp_size == 1 else [1])
        for d in sizes:
            c = argparse.Namespace(**vars(args))
            c.prompt_lens, c.tsp_size, c.rank, c.no_baseline = [s], d, args.rank if d > 1 else 0, True
            out.append(c)
    return out


def command(c: argparse.Namespace) -> list[str]:
    """The exact command that measures configuration ``c`` in one process."""
    cmd = ["python", "-m", "benchmarks.inference", "--in-process", "--no-baseline", "--prompt-lens",
           str(c.prompt_lens[0])]
    for opt in CONFIG_OPTS:
        v = getattr(c, opt)
        if isinstance(v, list):
            cmd += [f"--{opt.replace('_', '-')}", *map(str, v)] if v else []
        elif v is not None:
            cmd += [f"--{opt.replace('_', '-')}", str(v)]
    return cmd


def config_label(d: int, rank: int) -> str:
    return f"TSP D={d} rank {rank}" if d > 1 else "single GPU (D=1)"


# ---------------------------------------------------------------------------------------------------------------
# predicted communication (cost model; the fake group measures none)
# ---------------------------------------------------------------------------------------------------------------

def predicted_comm(cfg, batch: int, padded_len: int, d: int, dtype, hardware: str) -> dict:
    """Communication time of one prefill and of one decoded token on ``hardware`` (alpha-beta model of
    lightning_tsp.planning: wire bytes / NVLink bandwidth + a fixed latency per call).

    Prefill: the TSP forward without backward (per layer: D attention-shard broadcasts, D K/V all-gathers, D-1 MLP
    ring sends; the embedding's D-1 vocab-ring sends; the last token's hidden all-reduce; the greedy choice). The
    broadcasts and ring sends are prefetched (overlappable); prefill.attention_prefill waits for each K/V gather
    at once, so those are exposed. Decode: lightning_tsp.inference.costs (checked byte for byte by the tests);
    all of it on the critical path."""
    import torch

    from lightning_tsp.inference.costs import decode_step_collectives
    from lightning_tsp.planning import collectives as C
    from lightning_tsp.planning import from_config, get_hardware
    from lightning_tsp.planning.strategies import INTRA_LATENCY_S

    hw = get_hardware(hardware)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    out = {"hardware": hw.name, "intra_bw_GBps": hw.intra_bw / 1e9, "latency_us_per_call": INTRA_LATENCY_S * 1e6,
           "source": "lightning_tsp.planning (collectives, hardware preset, INTRA_LATENCY_S) for prefill; "
                     "lightning_tsp.inference.costs.decode_step_collectives for decode"}
    if d == 1:
        out.update(prefill_s=0.0, prefill_exposed_s=0.0, prefill_overlappable_s=0.0, prefill_wire_bytes=0,
                   prefill_calls=0, decode_s_per_token=0.0, decode_wire_bytes=0, decode_calls=0)
        return out
    shape = from_config(cfg)
    L = shape.n_layers
    lb = C.tsp_layer_collectives(shape, batch, padded_len, d, dtype_bytes, training=False, what="bytes")["forward"]
    lc = C.tsp_layer_collectives(shape, batch, padded_len, d, dtype_bytes, training=False, what="calls")["forward"]
    eb = C.tsp_embedding_collectives(shape, d, dtype_bytes, training=False, what="bytes")["forward"]
    ec = C.tsp_embedding_collectives(shape, d, dtype_bytes, training=False, what="calls")["forward"]
    ops = {op: (L * lc[op] + ec[op], L * lb[op] + eb[op]) for op in C.OPS}
    ops["all_reduce"] = (ops["all_reduce"][0] + 1, ops["all_reduce"][1] + batch * shape.hidden_size * dtype_bytes)
    choice = (1, d * batch * 2 * 8)  # greedy (max, id) in fp64

    def t(op: str, calls: int, nbytes: float) -> tuple[float, float]:
        wire = C.wire_bytes(op, nbytes, d)
        bw = hw.intra_p2p_bw if op == "send" else hw.intra_bw
        return wire, wire / bw + calls * INTRA_LATENCY_S

    per_op = {op: t(op, *cb) for op, cb in ops.items() if cb[0]}
    per_op["all_gather (token choice)"] = t("all_gather_into_tensor", *choice)
    overlappable = sum(v[1] for op, v in per_op.items() if op in ("broadcast", "send"))
    exposed = sum(v[1] for op, v in per_op.items() if op not in ("broadcast", "send"))
    out.update(
        prefill_s=overlappable + exposed, prefill_exposed_s=exposed, prefill_overlappable_s=overlappable,
        prefill_wire_bytes=sum(v[0] for v in per_op.values()),
        prefill_calls=sum(cb[0] for cb in ops.values()) + 1,
        prefill_by_op={op: {"wire_bytes": v[0], "s": v[1]} for op, v in per_op.items()},
    )
    dec = decode_step_collectives(cfg, batch, d, dtype=dtype)
    factor = {"all_reduce": 2 * (d - 1) / d, "all_gather": (d - 1) / d, "all_to_all": (d - 1) / d}
    wire = {op: factor[op] * nb for op, (_, nb) in dec.items()}
    calls = sum(c for c, _ in dec.values())
    out.update(decode_wire_bytes=sum(wire.values()), decode_calls=calls,
               decode_s_per_token=sum(wire.values()) / hw.intra_bw + calls * INTRA_LATENCY_S,
               decode_latency_s_per_token=calls * INTRA_LATENCY_S)
    return out


# ---------------------------------------------------------------------------------------------------------------
# one configuration, in this process
# ---------------------------------------------------------------------------------------------------------------

def measure(c: argparse.Namespace) -> dict:
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    from lightning_tsp import TSPConfigError, TSPGroup, TSPLlama
    from lightning_tsp.inference import local_logits, prefill
    from lightning_tsp.inference.decode import Decoder
    from lightning_tsp.inference.sampling import SamplingConfig, TokenChooser
    from lightning_tsp.inference.vocab import vocab_offset
    from lightning_tsp.models.llama import get_config
    from lightning_tsp.planning import from_config
    from lightning_tsp.planning.flops import forward_flops

    row_startup_s = time.perf_counter() - t_start
    device = c.device if c.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device == "cuda"
    d, rank, s, b = c.tsp_size, c.rank, c.prompt_lens[0], c.batch
    dtype = getattr(torch, c.dtype)
    cfg = get_config(c.model, **({} if c.layers is None else {"n_layers": c.layers}))
    if cfg.num_experts and d > 1:  # under the fake group dispatch's exchanged row counts would be garbage
        cfg = dataclasses.replace(cfg, expert_schedule="ring")
    padded = -(-s // (2 * d)) * 2 * d
    n_dec = c.decode_warmup + c.decode_steps
    row = {
        "config": config_label(d, rank), "model": c.model, "layers": cfg.n_layers, "tsp_size": d, "rank": rank,
        "prompt_len": s, "padded_len": padded, "batch": b, "dtype": c.dtype,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
        "excluded": EXCLUDED if d > 1 else "nothing (no collective at D=1)", "command": shlex.join(command(c)),
        "status": "ok", "import_s": row_startup_s,
    }
    elem = torch.empty((), dtype=dtype).element_size()
    row["kv_cache_unsharded_bytes"] = 2 * cfg.n_layers * b * cfg.n_kv_heads * cfg.head_dim * (s + n_dec) * elem
    row["comm_pred"] = predicted_comm(cfg, b, padded, d, dtype, c.hardware)
    fwd = forward_flops(from_config(cfg), b, padded)
    # prefill scores only the last token of each sequence: no LM head over the prompt
    row["prefill_flops_per_gpu"] = (fwd["linear"] + fwd["attention"]) / d + 2 * b * cfg.hidden_size * cfg.vocab_size / d

    def elapsed() -> float:
        return time.perf_counter() - t_start

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    if d > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=d)
        tsp = TSPGroup.from_process_group(dist.group.WORLD)
    else:
        tsp = None
    if cuda:
        torch.cuda.set_device(0)
    phase = "build"
    prefill_times, decode_times = [], []
    try:
        # built on the meta device, then materialised and initialised where it runs: no fp32 copy, no CPU pass
        model = TSPLlama(cfg, tsp, attention_kernel=c.attention_kernel, device="meta", dtype=dtype)
        model.to_empty(device=device)
        model.init_weights(seed=c.seed)
        model.requires_grad_(False).eval()
        sync()
        row["build_s"] = elapsed() - row_startup_s  # meta build + to_empty + init_weights
        row["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        chooser = TokenChooser(SamplingConfig(), cfg.vocab_size, model.tsp)
        offset = vocab_offset(model)
        gen = torch.Generator().manual_seed(c.seed)

        def prompt(length: int):
            p = -(-length // (2 * d)) * 2 * d
            ids = torch.zeros(b, p, dtype=torch.long)
            ids[:, :length] = torch.randint(0, cfg.vocab_size, (b, length), generator=gen)
            return ids.to(device), torch.full((b,), length, dtype=torch.long, device=device)

        def first_token(hidden):
            return chooser(local_logits(model, hidden), offset).cpu()

        graphs = cuda and c.decode_mode == "graph"

        def step(decoder, tok):
            # fake collectives leave the gathered (max, id) pairs uninitialised: the embedding clamps token ids
            return chooser(decoder(tok), offset)

        with torch.no_grad():
            if c.warmup_len > 0:
                phase = "warm-up"
                w_ids, w_lens = prompt(min(s, c.warmup_len))
                cache, hidden = prefill(model, w_ids, w_lens, decode_steps=2)
                tok = first_token(hidden).to(device)
                decoder = Decoder(model, cache, graphs=False)
                for _ in range(2):
                    tok = step(decoder, tok)
                del cache, hidden, w_ids, decoder
                sync()
            row["warmup_s"] = elapsed() - row_startup_s - row["build_s"]
            phase = "prefill"
            ids, lens = prompt(s)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            cache = hidden = None
            for i in range(c.repeats):
                cache = hidden = None  # free the previous repeat's cache first
                sync()
                t0 = time.perf_counter()
                cache, hidden = prefill(model, ids, lens, decode_steps=n_dec)
                tok = first_token(hidden)
                sync()
                prefill_times.append(time.perf_counter() - t0)
                if i + 1 < c.repeats and elapsed() + prefill_times[-1] > 0.5 * c.max_seconds:
                    row["prefill_repeats_cut"] = f"stopped after {i + 1} of {c.repeats} (--max-seconds)"
                    break
            if cuda:
                row["prefill_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                row["prefill_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
            row["kv_cache_bytes"] = cache.nbytes(used_only=False)  # this rank's allocation (prompt + decode slots)
            row["kv_cache_prefill_bytes"] = cache.nbytes(used_only=True)
            row["kv_cache_slots"] = cache.capacity
            phase = "decode"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            decoder = Decoder(model, cache, graphs=graphs, warmup=min(2, c.decode_warmup))
            tok = tok.to(device)
            for i in range(n_dec):
                sync()
                t0 = time.perf_counter()
                tok = step(decoder, tok)
                sync()
                if i >= c.decode_warmup:
                    decode_times.append(time.perf_counter() - t0)
                if decode_times and elapsed() > 0.9 * c.max_seconds:
                    row["decode_steps_cut"] = f"stopped after {len(decode_times)} timed steps (--max-seconds)"
                    break
            if cuda:
                row["decode_peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
                row["decode_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
            row["decode_cache_bytes_used"] = cache.nbytes(used_only=True)
            row["decode_mode"] = "CUDA graph" if decoder.graph is not None else "eager"
            # the memory-bandwidth floor of one step on this GPU: weights and the filled cache read once
            row["decode_floor_s"] = (row["weights_bytes"] + cache.nbytes(used_only=True)) / HBM_BYTES_PER_S
            if c.new_tokens:
                phase = "generate"
                del cache, decoder, hidden
                row["generate"] = []
                for n in c.new_tokens:
                    row["generate"].append(time_generate_calls(model, lambda: prompt(s), n, c, graphs, sync))
                    if elapsed() > 0.9 * c.max_seconds:
                        row["generate_cut"] = f"stopped after new_tokens={n} (--max-seconds)"
                        break
    except TSPConfigError as exc:  # e.g. heads not divisible by D: a row saying so
        row["status"] = "invalid"
        row["error"] = first_line(exc)
    except Exception as exc:  # noqa: BLE001 - an OOM becomes the row's status; anything else propagates
        if not is_oom(exc):
            raise
        row["status"] = "OOM"
        row["oom_phase"] = phase
        row["error"] = first_line(exc)
        if cuda:
            key = "prefill_peak_gb" if phase in ("build", "warm-up", "prefill") else "decode_peak_gb"
            row.setdefault(key, torch.cuda.max_memory_allocated() / 1e9)
    if not cuda:
        row["peak_note"] = "CPU run: peak memory not measured"
    if dist.is_initialized():
        dist.destroy_process_group()
    return finalize(row, prefill_times, decode_times)


def time_generate_calls(model, make_prompt, n: int, c: argparse.Namespace, graphs: bool, sync) -> dict:
    """Whole ``generate`` calls as a user makes them, in a loop: ``c.calls`` calls with new prompts of the same
    shapes (the decoder is kept after the first: cache, graph), then ``c.fresh_calls`` with ``keep_decoder=False``.
    Per call the wall time from the call to its return (host sync included) and the time to the first token (the
    streamer's first call: prefill + first choice)."""
    from lightning_tsp.inference import generate, release

    def one(keep: bool) -> dict:
        ids, lens = make_prompt()
        prompts = [ids[i, : int(lens[i])].tolist() for i in range(ids.shape[0])]
        first = []
        sync()
        t0 = time.perf_counter()
        generate(model, prompts, n, cuda_graphs=graphs, keep_decoder=keep,
                 streamer=lambda step, _: first.append(time.perf_counter()) if step == 0 else None)
        sync()
        return {"total_s": time.perf_counter() - t0, "ttft_s": first[0] - t0}

    release(model)  # the first call builds its decoder
    calls = [one(True) for _ in range(c.calls)]
    release(model)
    fresh = [one(False) for _ in range(c.fresh_calls)]
    rest = calls[1:]
    out = {"new_tokens": n, "calls": calls, "fresh_calls": fresh,
           "first_s": calls[0]["total_s"], "rest_s": statistics.median(x["total_s"] for x in rest),
           "rest_ttft_s": statistics.median(x["ttft_s"] for x in rest)}
    if fresh:
        out["fresh_s"] = statistics.median(x["total_s"] for x in fresh)
    return out


def finalize(row: dict, prefill_times: list[float], decode_times: list[float]) -> dict:
    d, s, b = row["tsp_size"], row["prompt_len"], row["batch"]
    comm = row["comm_pred"]
    row["prefill_times_s"] = prefill_times
    row["decode_times_s"] = decode_times
    if prefill_times:
        p = statistics.median(prefill_times)
        row["prefill_s"] = p
        # the whole prompt (all B sequences, S real tokens each) per second, divided over the D GPUs
        row["prefill_tokens_per_s_per_gpu"] = b * s / p / d
        row["prefill_tflops_per_gpu"] = row["prefill_flops_per_gpu"] / p / 1e12
        # cost-model estimate of the same prefill on a real D-GPU node
        row["est_prefill_s_with_comm"] = max(p, comm["prefill_overlappable_s"]) + comm["prefill_exposed_s"]
    if decode_times:
        t = statistics.median(decode_times)
        row["decode_s_per_token"] = t
        row["decode_tokens_per_s"] = b / t  # the group's rate: one token per sequence per step
        row["decode_tokens_per_s_per_gpu"] = b / t / d
        row["est_decode_s_per_token_with_comm"] = t + comm["decode_s_per_token"]
        if row.get("decode_floor_s"):
            row["decode_x_floor"] = t / row["decode_floor_s"]
    for g in row.get("generate", []):
        n = g["new_tokens"]
        # end to end: the call's wall time per new token (prefill included); decode part: after the first token
        g["first_ms_per_token"] = 1e3 * g["first_s"] / n
        g["ms_per_token"] = 1e3 * g["rest_s"] / n
        g["decode_ms_per_token"] = 1e3 * (g["rest_s"] - g["rest_ttft_s"]) / (n - 1)
        if "fresh_s" in g:
            g["fresh_ms_per_token"] = 1e3 * g["fresh_s"] / n
        if decode_times:
            g["x_steady"] = g["ms_per_token"] / (1e3 * row["decode_s_per_token"])
            g["decode_x_steady"] = g["decode_ms_per_token"] / (1e3 * row["decode_s_per_token"])
    return row


# ---------------------------------------------------------------------------------------------------------------
# the sweep: one subprocess per configuration
# ---------------------------------------------------------------------------------------------------------------

def base_row(c: argparse.Namespace) -> dict:
    """What a row says before (or without) a measurement."""
    return {"config": config_label(c.tsp_size, c.rank), "model": c.model, "tsp_size": c.tsp_size, "rank": c.rank,
            "prompt_len": c.prompt_lens[0], "batch": c.batch, "command": shlex.join(command(c))}


def run_subprocess(c: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                   "expandable_segments:True")}
    row = run_config("benchmarks.inference", command(c)[3:], c.max_seconds, env)
    return row if "config" in row else {**base_row(c), **row}


def _f(v, fmt: str) -> str:
    return "" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    head = ["#", "config", "prompt", "status", "prefill s", "prefill tok/s/GPU", "prefill TFLOP/s", "prefill peak GB",
            "decode ms/token", "floor ms", "x floor", "decode tok/s", "decode peak GB", "KV cache GB/rank",
            "weights GB/rank", "pred. comm prefill s (exposed)", "pred. comm decode ms/token",
            "est. prefill s with comm", "est. decode ms/token with comm"]
    cells = []
    for i, r in enumerate(rows, 1):
        comm = r.get("comm_pred") or {}
        status = r["status"] + (f" ({r['oom_phase']})" if r.get("oom_phase") else "")
        ms = lambda v: None if v is None else 1e3 * v  # noqa: E731
        gb = lambda v: None if v is None else v / 1e9  # noqa: E731
        pc = comm.get("prefill_s")
        pred_prefill = "" if pc is None else f"{pc:.3f} ({comm['prefill_exposed_s']:.3f})"
        cells.append([
            str(i), r["config"], f"{r['prompt_len']:,}" + (f" x{r['batch']}" if r.get("batch", 1) > 1 else ""),
            status, _f(r.get("prefill_s"), ".3f"), _f(r.get("prefill_tokens_per_s_per_gpu"), ",.0f"),
            _f(r.get("prefill_tflops_per_gpu"), ".0f"), _f(r.get("prefill_peak_gb"), ".2f"),
            _f(ms(r.get("decode_s_per_token")), ".2f"), _f(ms(r.get("decode_floor_s")), ".2f"),
            _f(r.get("decode_x_floor"), ".2f"), _f(r.get("decode_tokens_per_s"), ".1f"),
            _f(r.get("decode_peak_gb"), ".2f"), _f(gb(r.get("kv_cache_bytes")), ".3f"),
            _f(gb(r.get("weights_bytes")), ".2f"), pred_prefill, _f(ms(comm.get("decode_s_per_token")), ".3f"),
            _f(r.get("est_prefill_s_with_comm"), ".3f"), _f(ms(r.get("est_decode_s_per_token_with_comm")), ".2f"),
        ])
    lines = [md_table(head, cells), ""]
    gen = generate_table(rows)
    if gen:
        lines += [gen, ""]
    lines += ["Commands (each row measured in its own process):", ""]
    for i, r in enumerate(rows, 1):
        lines.append(f"{i}. `{r['command']}`" + (f" -- {r['error']}" if r.get("error") and r["status"] != "ok"
                                                 else ""))
    return "\n".join(lines)


def generate_table(rows: list[dict]) -> str:
    """Whole generate calls beside the steady-state step (rows measured with --new-tokens)."""
    head = ["#", "config", "prompt", "new tokens", "steady ms/token", "first call ms/token", "ms/token (calls 2..N)",
            "x steady", "after 1st token ms/token", "x steady (decode)", "new decoder per call ms/token"]
    cells = []
    for i, r in enumerate(rows, 1):
        steady = r.get("decode_s_per_token")
        for g in r.get("generate", []):
            cells.append([str(i), r["config"], f"{r['prompt_len']:,}", str(g["new_tokens"]),
                          _f(None if steady is None else 1e3 * steady, ".2f"), _f(g["first_ms_per_token"], ".2f"),
                          _f(g["ms_per_token"], ".2f"), _f(g.get("x_steady"), ".2f"),
                          _f(g["decode_ms_per_token"], ".2f"), _f(g.get("decode_x_steady"), ".2f"),
                          _f(g.get("fresh_ms_per_token"), ".2f")])
    return md_table(head, cells) if cells else ""


def main(argv=None) -> None:
    args = parse_args(argv)
    configs = configurations(args)
    if args.in_process:
        if len(configs) != 1:
            raise SystemExit("--in-process measures one configuration: give one prompt length and --no-baseline")
        row = measure(configs[0])
        if args.json_out:
            write_json(args.json_out, row)
        append_jsonl([row], args.out)
        print(table([row]), flush=True)
        return
    rows, clock = [], Deadline(args.budget_seconds)
    for c in configs:
        if clock.left() < 0:
            row = {**base_row(c), "status": "skipped", "error": "--budget-seconds spent"}
        else:
            row = run_subprocess(c)
        rows.append(row)
        append_jsonl([row], args.out)  # as soon as it is measured: an interrupted sweep keeps its finished rows
        print(f"[{clock.elapsed():7.1f} s] {row['config']} S={row['prompt_len']}: {row['status']}"
              + (f", prefill {row['prefill_s']:.3f} s" if row.get("prefill_s") is not None else "")
              + (f", decode {1e3 * row['decode_s_per_token']:.2f} ms/token" if row.get("decode_s_per_token")
                 is not None else ""), file=sys.stderr, flush=True)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
