"""The two TSP schedules alone: one layer on one GPU playing rank r of D (fake process group, communication
excluded), against unsharded modules doing the same work on the same local tokens.

    python -m benchmarks.schedules --hidden 4096 --heads 32 --kv-heads 32 --ffn 16384 --seq-len 131072 --tsp-size 8

Rows (median fwd+bwd time over repeats, bf16):
- ring MLP: the SwiGLU ring (D shard GEMM triples per direction) vs one unsharded SwiGLU MLP (full F) on the
  rank's S/D tokens: the same FLOPs, so the ratio is the cost of splitting the GEMMs and running the schedule.
- broadcast attention projections: the q/k/v/o GEMMs of the D head groups vs one unsharded set of q/k/v/o GEMMs
  on the same tokens (attention kernels excluded on both sides: the layer is timed with a no-op kernel).
- per-shard GEMM vs one GEMM: D GEMMs of [S/D, h] x [h, F/D] against one [S/D, h] x [h, F].
Target (issue): the per-shard GEMMs within 15% of one unsharded GEMM of the same total work.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_tsp.checks import check_model_shape, check_seq_len
from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.attention import AttentionKernel
from lightning_tsp.layers.attention import TSPAttention
from lightning_tsp.layers.mlp import TSPGatedMLP


class _NoAttention(AttentionKernel):
    """Returns q as the attention output: isolates the schedule's GEMMs and communication from the kernels."""

    name = "none"

    def differentiable(self, q, k_own, v_own, k_pre=None, v_pre=None, mask=None):
        keys = k_own.mean() + v_own.mean() + (0 if k_pre is None else k_pre.mean() + v_pre.mean())
        return q + 0 * keys, None


def _time(fn, device, reps: int) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.schedules", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--ffn", type=int, default=16384)
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--tsp-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    d, h, f = args.tsp_size, args.hidden, args.ffn
    check_model_shape(tsp_size=d, n_heads=args.heads, n_kv_heads=args.kv_heads, hidden_size=h, intermediate_size=f,
                      vocab_size=d)
    check_seq_len(args.seq_len, d)
    tokens = args.seq_len // d
    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=d)
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    x = torch.randn(1, tokens, h, device=dev, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    rows = []

    mlp = TSPGatedMLP(h, f, tsp, device=dev, dtype=dtype)
    wg, wu, wd = ((torch.randn(f, h, device=dev, dtype=dtype) * 0.02).requires_grad_() for _ in range(3))

    def ring():
        mlp(x).backward(dy)

    def dense_mlp():
        (F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd.T)).backward(dy)

    rows.append(("ring MLP fwd+bwd vs one unsharded SwiGLU", _time(ring, dev, args.reps), _time(dense_mlp, dev, args.reps)))

    attn = TSPAttention(h, args.heads, args.kv_heads, tsp, device=dev, dtype=dtype)
    hd = h // args.heads
    cos = torch.ones(tokens, hd, device=dev, dtype=dtype)
    sin = torch.zeros(tokens, hd, device=dev, dtype=dtype)
    import lightning_tsp.layers.attention as attention_module

    original = attention_module.select_attention_kernel  # the schedule runs with a no-op attention kernel
    attention_module.select_attention_kernel = lambda *a, **k: _NoAttention()
    wq, wo = ((torch.randn(h, h, device=dev, dtype=dtype) * 0.02).requires_grad_() for _ in range(2))
    wk, wv = ((torch.randn(args.kv_heads * hd, h, device=dev, dtype=dtype) * 0.02).requires_grad_() for _ in range(2))

    def broadcast():
        attn(x, cos, sin).backward(dy)

    def dense_proj():
        q, k, v = F.linear(x, wq), F.linear(x, wk), F.linear(x, wv)
        (F.linear(q, wo) + 0 * (k.sum() + v.sum())).backward(dy)

    try:
        rows.append(("broadcast attention projections fwd+bwd vs unsharded q/k/v/o", _time(broadcast, dev, args.reps),
                     _time(dense_proj, dev, args.reps)))
    finally:
        attention_module.select_attention_kernel = original

    a = torch.randn(tokens, h, device=dev, dtype=dtype)
    shards = [torch.randn(h, f // d, device=dev, dtype=dtype) for _ in range(d)]
    full = torch.randn(h, f, device=dev, dtype=dtype)
    rows.append(("D per-shard GEMMs vs one GEMM [S/D,h]x[h,F]",
                 _time(lambda: [a @ s for s in shards], dev, args.reps), _time(lambda: a @ full, dev, args.reps)))

    print(f"h={h} heads={args.heads}/{args.kv_heads} F={f} S={args.seq_len} D={d} rank={args.rank} "
          f"{dev.type} {dtype} (fake process group: communication excluded)")
    print("| what | TSP ms | unsharded ms | ratio |")
    print("| --- | --- | --- | --- |")
    for name, t, ref in rows:
        print(f"| {name} | {t * 1e3:.2f} | {ref * 1e3:.2f} | {t / ref:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
