"""flash-attn (4 and/or 2, whichever run here) against the cuDNN split kernel on TSP's zigzag pieces, on one GPU.

    python -m benchmarks.flash_attn_check [--shapes 8192:32:8 32768:4:1] [--reps 20]

Prints which attention backends import here (and why not), what ``attention_kernel="auto"`` picks, then:

1. accuracy: each kernel against fp32 math (``MathAttention`` on the GPU) on a small call, max abs error of the
   output, log-sum-exp and the five gradients;
2. one table over the shapes [1, S, Hq, 128] with Hkv K/V heads (``--shapes S:Hq:Hkv``), two calls each: "causal"
   (the own piece alone: S queries, square causal over S keys) and "zigzag" (S/2 queries: the prefix piece over
   the first S/2 keys, non-causal, plus the own piece over the last S/2, merged by log-sum-exp): median forward
   and forward+backward ms and TFLOP/s (causal FLOPs counted exactly: 4 * d * Hq * visible pairs forward, 2.5x
   that backward) and the max abs difference of every tensor against cuDNN's (bf16).

Inputs are bf16 views of [B, L, H, d] buffers, as the TSP layer passes them.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from lightning_tsp.kernels.attention import (
    CudnnSplitAttention,
    FlashAttention,
    MathAttention,
    _cuda_capability,
    available_kernels,
    flash_libraries,
    select_attention_kernel,
)

GRADS = ("dq", "dk_own", "dv_own", "dk_pre", "dv_pre")


def _buffer(b, n, h, d, gen, dev):
    """[B, H, L, d] view of a [B, L, H, d] bf16 buffer."""
    return torch.randn(b, n, h, d, generator=gen, device=dev, dtype=torch.bfloat16).transpose(1, 2)


def make_call(s: int, hq: int, hkv: int, d: int, zigzag: bool, dev, seed: int = 0):
    """(q, k_own, v_own, k_pre, v_pre, do): "causal" = S queries on their own S keys; "zigzag" = the last S/2
    queries, own = the last S/2 keys, prefix = the first S/2 keys."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    lq = s // 2 if zigzag else s
    q, do = _buffer(1, lq, hq, d, gen, dev), _buffer(1, lq, hq, d, gen, dev)
    k, v = _buffer(1, s, hkv, d, gen, dev), _buffer(1, s, hkv, d, gen, dev)
    lp = s - lq
    pre = (k[:, :, :lp], v[:, :, :lp]) if lp else (None, None)
    return q, k[:, :, lp:], v[:, :, lp:], *pre, do


def visible_pairs(lq: int, lp: int) -> int:
    return lq * lp + lq * (lq + 1) // 2


def run(kernel, call):
    q, k_own, v_own, k_pre, v_pre, do = call
    o, lse = kernel.forward(q, k_own, v_own, k_pre, v_pre)
    grads = kernel.backward(do, q, k_own, v_own, k_pre, v_pre, o, lse)
    return o, lse, grads


def max_diffs(got, want) -> list[float | None]:
    """Max abs differences of (o, lse, *grads); None where a tensor is absent."""
    (o, lse, grads), (wo, wlse, wgrads) = got, want
    out = []
    for a, b in zip((o, lse, *grads), (wo, wlse, *wgrads)):
        out.append(None if a is None or b is None else (a.float() - b.float()).abs().max().item())
    return out


def timed(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2g}" if x < 0.01 else f"{x:.3f}"


def kernels_here(dev) -> dict[str, object]:
    """{label: kernel} for cuDNN and every flash-attn build that imports and runs on this GPU."""
    out = {}
    if "cudnn-split" in available_kernels(dev):
        out["cudnn-split"] = CudnnSplitAttention()
    cap = _cuda_capability(dev)
    for lib in flash_libraries()[0].values():
        if cap >= lib.min_capability:
            out[lib.name] = FlashAttention(lib)
    return out


def report_environment(dev) -> None:
    cap = _cuda_capability(dev)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)} (sm{cap[0]}{cap[1]})")
    found, missing = flash_libraries()
    for key in ("fa4", "fa2"):
        if key in found:
            lib = found[key]
            runs = "runs here" if cap >= lib.min_capability else f"needs sm{lib.min_capability[0]}0+: not used"
            print(f"  {lib.name}: importable, {runs}")
        else:
            print(f"  {missing[key]}")
    print(f"  cuDNN split: {'available' if 'cudnn-split' in available_kernels(dev) else 'NOT available'}")
    print(f"  attention_kernel='auto' (bf16) picks: {select_attention_kernel(dev, 'auto', torch.bfloat16)!r}")


def accuracy(kernels: dict, dev, d: int) -> None:
    print("\nAccuracy against fp32 math, zigzag call S=2048, Hq=8, Hkv=2 (max abs error):")
    call = make_call(2048, 8, 2, d, True, dev, seed=1)
    ref = run(MathAttention(), [None if t is None else t.float() for t in call])
    print("| kernel | o | lse | " + " | ".join(GRADS) + " |")
    print("|" + " --- |" * (3 + len(GRADS)))
    for label, kernel in kernels.items():
        try:
            cells = [_fmt(x) for x in max_diffs(run(kernel, call), ref)]
        except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
            cells = [f"FAILED: {type(e).__name__}: {e}"[:200]] + [""] * (1 + len(GRADS))
        print(f"| {label} | " + " | ".join(cells) + " |")


def benchmark(kernels: dict, dev, shapes, d: int, warmup: int, reps: int) -> None:
    print(f"\nbf16, head dim {d}; max |diff| vs cudnn-split: o / lse / dq / dk_own / dv_own / dk_pre / dv_pre")
    print("| [B, S, Hq, D] | Hkv | call | kernel | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | max abs diff vs cuDNN |")
    print("|" + " --- |" * 9)
    for s, hq, hkv in shapes:
        for zigzag in (False, True):
            call = make_call(s, hq, hkv, d, zigzag, dev, seed=s + hq)
            q, k_own, v_own, k_pre, v_pre, do = call
            lq, lp = q.shape[2], 0 if k_pre is None else k_pre.shape[2]
            flops = 4 * d * hq * visible_pairs(lq, lp)
            base = None
            for label, kernel in kernels.items():
                length = f"{s // 1024}K" if s % 1024 == 0 else str(s)
                head = f"| [1, {length}, {hq}, {d}] | {hkv} | {'zigzag' if zigzag else 'causal'} | {label} |"
                try:
                    got = run(kernel, call)
                    if label == "cudnn-split":
                        base = got
                    diff = "-" if base is None or label == "cudnn-split" else " / ".join(
                        _fmt(x) for x in max_diffs(got, base))
                    del got
                    t_f = timed(lambda: kernel.forward(q, k_own, v_own, k_pre, v_pre), warmup, reps)
                    t_fb = timed(lambda: run(kernel, call), warmup, reps)
                    print(f"{head} {t_f * 1e3:.3f} | {flops / t_f / 1e12:.0f} | {t_fb * 1e3:.3f} | "
                          f"{3.5 * flops / t_fb / 1e12:.0f} | {diff} |")
                except Exception as e:  # noqa: BLE001 - report and go on with the other kernels
                    print(f"{head} FAILED: {type(e).__name__}: {str(e)[:300]} | | | | |")
                sys.stdout.flush()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.flash_attn_check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["8192:32:8", "32768:4:1"],
                    help="S:Hq:Hkv per shape [1, S, Hq, head_dim] (default: 8192:32:8 32768:4:1)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this check runs on a GPU (tests/test_flash_attn_kernel.py covers the CPU side)")
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    report_environment(dev)
    kernels = kernels_here(dev)
    if not any(isinstance(k, FlashAttention) for k in kernels.values()):
        print("\nno flash-attn build runs here: pip install flash-attn-4 (Hopper/Blackwell) or flash-attn (Ampere); "
              "timing cuDNN alone")
    if not kernels:
        print("no kernel to check")
        return
    shapes = [tuple(int(x) for x in spec.split(":")) for spec in args.shapes]
    accuracy(kernels, dev, args.head_dim)
    benchmark(kernels, dev, shapes, args.head_dim, args.warmup, args.reps)


if __name__ == "__main__":
    main()
