"""Attention kernels on TSP's zigzag calls: one rank's chunk of c queries against its K/V prefix of (p+1)c keys
(bottom-right causal), bf16, head dim 128, forward + backward as the TSP layer runs them.

    python -m benchmarks.zigzag_attention [--seq-len 131072 --tsp-size 8 --heads 4 32 --ranks 0 3 7]

Prints a markdown table of median fwd+bwd time and TFLOP/s (causal FLOPs counted exactly:
4 * d * H * visible (query, key) pairs forward, 2.5x that backward). The backward of backends without a public
backward entry point recomputes their forward: that recompute is counted as time, not as useful FLOPs.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from lightning_tsp.kernels import available_kernels, select_attention_kernel


def visible_pairs(lq: int, lk: int) -> int:
    return lq * (lk - lq) + lq * (lq + 1) // 2


def bench(fn, warmup: int = 3, reps: int = 10) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.zigzag_attention")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--tsp-size", type=int, default=8)
    ap.add_argument("--heads", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--ranks", type=int, nargs="+", default=[0, 3, 7])
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    dev = torch.device("cuda")
    c = args.seq_len // (2 * args.tsp_size)
    names = [n for n in available_kernels(dev) if n != "math"]
    print("| heads | p | Lq | Lk | " + " | ".join(f"{n} ms / TFLOP/s" for n in names) + " |")
    print("|" + " --- |" * (4 + len(names)))
    for h in args.heads:
        for p in args.ranks:
            lq, lk = c, (p + 1) * c
            q = torch.randn(1, h, lq, args.head_dim, device=dev, dtype=torch.bfloat16)
            k = torch.randn(1, h, lk, args.head_dim, device=dev, dtype=torch.bfloat16)
            v = torch.randn_like(k)
            do = torch.randn_like(q)
            flops = 3.5 * 4 * args.head_dim * h * visible_pairs(lq, lk)
            cells = []
            for n in names:
                kern = select_attention_kernel(dev, n)

                own = (k[:, :, lk - lq:], v[:, :, lk - lq:])  # the query block's own chunk (square causal)
                pre = (k[:, :, :lk - lq], v[:, :, :lk - lq]) if lk > lq else (None, None)  # fully visible prefix

                def step():
                    o, lse = kern.forward(q, *own, *pre)
                    kern.backward(do, q, *own, *pre, o, lse)

                t = bench(step)
                cells.append(f"{t * 1e3:.2f} / {flops / t / 1e12:.0f}")
            print(f"| {h} | {p} | {lq} | {lk} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
