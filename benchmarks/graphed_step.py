"""CUDA-graphed TSP layers (``cuda_graphs=True``) against eager, on one GPU.

1. Exactness (``--check``): a small model at D = 1, several AdamW steps from one initialisation, eager and graphed
   (step 1 warm-up, step 2 capture, then replays): every step's loss and every final parameter compared.
2. Speed: paper-7b as rank 0 of a fake group of ``--world`` ranks (communication excluded, as the harness), step
   time (median of ``--steps``), peak memory, and with ``--profile`` the GPU busy time and kernel count of one step.

    python -m benchmarks.graphed_step --check --seq-len 8192 16384 32768 --checkpointing keep-attention --profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def _model(cfg, tsp, mode, graphs, kernel="auto"):
    import torch

    from lightning_tsp import TSPLlama

    return TSPLlama(cfg, tsp, activation_checkpointing=mode, cuda_graphs=graphs, attention_kernel=kernel,
                    device="cuda", dtype=torch.float32)


def check(mode: str, autocast: bool, steps: int = 4) -> dict:
    """Eager vs graphed at D = 1 with fixed parameters: every step's loss and every parameter gradient (step 1
    warm-up, step 2 capture, then replays; a new batch each step)."""
    import torch

    from lightning_tsp.models.llama import get_config

    cfg = get_config("paper-7b", n_layers=3, hidden_size=512, n_heads=8, n_kv_heads=4, intermediate_size=1024,
                     vocab_size=1024)
    g = torch.Generator(device="cuda").manual_seed(2)
    batches = [torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda", generator=g) for _ in range(steps)]
    out = {}
    for graphs in (False, True):
        model = _model(cfg, None, mode, graphs)
        model.init_weights(seed=1)
        losses, grads = [], []
        for ids in batches:
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = model(*model.shard_batch(ids))
            loss.backward()
            losses.append(loss.item())
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
            model.zero_grad(set_to_none=True)
        out[graphs] = (losses, grads)
    (le, ge), (lg, gg) = out[False], out[True]
    dloss = max(abs(a - b) / abs(a) for a, b in zip(le, lg))
    dgrad = max(((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)).item()
                for a, b in zip(ge, gg) for n in a)
    return {"check": mode, "autocast_bf16": autocast, "losses_eager": le, "losses_graphed": lg,
            "max_rel_loss_diff": dloss, "max_rel_grad_diff": dgrad}


def speed(seq: int, mode: str, graphs: bool, world: int, steps: int, profile: bool, layers: int | None,
          top: int = 0, kernel: str = "auto") -> dict:
    import torch

    from lightning_tsp import TSPGroup
    from lightning_tsp.models.llama import get_config

    cfg = get_config("paper-7b", **({"n_layers": layers} if layers else {}))
    tsp = TSPGroup.from_process_group(torch.distributed.group.WORLD)
    torch.cuda.reset_peak_memory_stats()
    model = _model(cfg, tsp, mode, graphs, kernel)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    ids = torch.randint(0, cfg.vocab_size, (1, seq))
    inputs = [t.cuda() for t in model.shard_batch(ids)]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for i in range(steps + 3):  # warm-up, capture, one replay, then timed
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    spec = model.model.layers[0].self_attn.spec(torch.device("cuda"), torch.bfloat16)
    row = {"strategy": "tsp", "seq_len": seq, "attention_kernel": type(spec.kernel).__name__, "checkpointing": mode, "cuda_graphs": graphs, "world": world,
           "layers": cfg.n_layers, "model": "paper-7b", "step_s": statistics.median(times), "steps": times,
           "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
           "reserved_gb": torch.cuda.max_memory_reserved() / 1e9,
           "fused_elementwise": os.environ.get("LIGHTNING_TSP_FUSED", "1") != "0"}
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof_ctx

        with prof_ctx(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0)
        busy, end, n = 0.0, -1.0, len(spans)
        for a, b in spans:
            if b > end:
                busy += b - max(a, end)
                end = b
        row["gpu_busy_s"], row["kernels"] = busy / 1e6, n
        if top:
            per = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
                    t, c = per.get(e.name, (0.0, 0))
                    per[e.name] = (t + e.device_time, c + 1)
            print(f"top kernels, seq {seq}, graphs {graphs}: total ms, count, name")
            for name, (t, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:top]:
                print(f"  {t / 1e3:8.2f} {c:6d}  {name[:150]}")
    del model, opt
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--seq-len", type=int, nargs="*", default=[8192])
    ap.add_argument("--checkpointing", default="keep-attention")
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--top", type=int, default=0, help="with --profile: print the N kernels with the most GPU time")
    ap.add_argument("--eager", action="store_true", help="also measure eager at each length")
    ap.add_argument("--attention-kernel", default="auto")
    ap.add_argument("--jsonl")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.cuda.set_device(0)
    rows = []
    if args.check:
        for mode, autocast in (("keep-attention", False), ("full", False), ("keep-attention", True)):
            r = check(mode, autocast)
            print(json.dumps(r), flush=True)
            rows.append(r)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=args.world)
    for seq in args.seq_len:
        for graphs in ((False, True) if args.eager else (True,)):
            r = speed(seq, args.checkpointing, graphs, args.world, args.steps, args.profile, args.layers, args.top,
                      args.attention_kernel)
            r["command"] = "python -m benchmarks.graphed_step " + " ".join(sys.argv[1:] if argv is None else argv)
            print(json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
            rows.append(r)
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
