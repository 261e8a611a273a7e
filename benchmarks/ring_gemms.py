"""The MLP ring's GEMMs at a step's shapes: per shard (as the ring schedule runs them) against one GEMM over all
D shards (what a gathered MLP would run), with and without the copies that lay the shards side by side.

    python -m benchmarks.ring_gemms --tokens 256 1024 2048 4096        # paper-7b at D = 8 (h 4096, F 16384)

``--tokens`` are a rank's local tokens (S / D). Per row, microseconds (median of ``--reps`` CUDA-event timings
after warm-up; perf_counter on CPU, a check of the script only), bf16 operands:

- down: y = sum_s hid_s Wd_s^T. ``ring``: D GEMMs adding into one fp32 output in the epilogue (the forward ring);
  ``each``: the same D GEMMs, no accumulation; ``one+copies``: every shard's hid and Wd copied side by side, then
  one GEMM (K = F); ``one``: that GEMM alone (operands already side by side).
- dx: dx = sum_s d[gate|up]_s [Wg_s; Wu_s] into fp32: ``ring`` (D epilogue adds, the backward), ``one+copies``,
  ``one``.
- gate/up: x [Wg_s; Wu_s]^T. ``ring`` (D GEMMs), ``one`` (one GEMM over [2F, h]), ``batched`` (one batched GEMM
  over D gathered ring messages, batch stride = one message).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lightning_tsp.kernels.gemm import add_matmul_, matmul_into


def _timer(device: str, reps: int):
    def run(fn) -> float:
        for _ in range(3):
            fn()
        if device == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
            for start, end in events:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return statistics.median(s.elapsed_time(e) for s, e in events) * 1e3
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6
    return run


def rows(n: int, h: int, ffn: int, d: int, device: str, reps: int) -> dict[str, float]:
    """Microseconds per variant for ``n`` local tokens."""
    f, bf = ffn // d, torch.bfloat16
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=bf, generator=g)

    x, hid, d_gu = rand(n, h), [rand(n, f) for _ in range(d)], [rand(n, 2 * f) for _ in range(d)]
    messages = rand(d, 3 * f * h)  # D ring messages side by side: [Wg_s; Wu_s] [2f, h], then Wd_s [h, f]
    w_gu = [messages[s, : 2 * f * h].view(2 * f, h) for s in range(d)]
    w_d = [messages[s, 2 * f * h :].view(h, f) for s in range(d)]
    acc = torch.empty(n, h, device=device, dtype=torch.float32)
    hid_all, w_d_all = torch.empty(n, d * f, device=device, dtype=bf), torch.empty(h, d * f, device=device, dtype=bf)
    d_gu_all, w_gu_all = torch.empty(n, 2 * ffn, device=device, dtype=bf), torch.empty(2 * ffn, h, device=device, dtype=bf)

    def down_ring():
        for s in range(d):
            (matmul_into if s == 0 else add_matmul_)(acc, hid[s], w_d[s].T)

    def down_each():
        for s in range(d):
            hid[s] @ w_d[s].T

    def down_one_copies():
        for s in range(d):
            hid_all[:, s * f : (s + 1) * f] = hid[s]
            w_d_all[:, s * f : (s + 1) * f] = w_d[s]
        hid_all @ w_d_all.T

    def dx_ring():
        for s in range(d):
            (matmul_into if s == 0 else add_matmul_)(acc, d_gu[s], w_gu[s])

    def dx_one_copies():
        for s in range(d):
            d_gu_all[:, 2 * s * f : 2 * (s + 1) * f] = d_gu[s]
            w_gu_all[2 * s * f : 2 * (s + 1) * f] = w_gu[s]
        matmul_into(acc, d_gu_all, w_gu_all)

    def gu_ring():
        for s in range(d):
            x @ w_gu[s].T

    batched = messages[:, : 2 * f * h].view(d, 2 * f, h)  # batch stride: one message
    timed = _timer(device, reps)
    return {
        "down ring": timed(down_ring), "down each": timed(down_each), "down one+copies": timed(down_one_copies),
        "down one": timed(lambda: hid_all @ w_d_all.T),
        "dx ring": timed(dx_ring), "dx one+copies": timed(dx_one_copies),
        "dx one": timed(lambda: matmul_into(acc, d_gu_all, w_gu_all)),
        "gate/up ring": timed(gu_ring), "gate/up one": timed(lambda: x @ w_gu_all.T),
        "gate/up batched": timed(lambda: torch.bmm(x.expand(d, n, h), batched.transpose(1, 2))),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 2048, 4096], help="local tokens (S / D)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--tsp-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    if args.ffn % args.tsp_size:
        raise SystemExit(f"--ffn {args.ffn} is not divisible by --tsp-size {args.tsp_size}")
    torch.backends.cuda.matmul.allow_tf32 = False
    table = {n: rows(n, args.hidden, args.ffn, args.tsp_size, args.device, args.reps) for n in args.tokens}
    names = list(next(iter(table.values())))
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"{name}: h {args.hidden}, F {args.ffn}, D {args.tsp_size}; microseconds, median of {args.reps}")
    print("| local tokens | " + " | ".join(names) + " |")
    print("| --- " * (len(names) + 1) + "|")
    for n, r in table.items():
        print(f"| {n} | " + " | ".join(f"{r[k]:.0f}" for k in names) + " |")


if __name__ == "__main__":
    main()
