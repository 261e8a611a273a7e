"""One GPU plays rank r of a TSP group of D with PyTorch's fake process group (collectives return at once):
a rank's exact peak memory and compute time for a training step (communication time excluded).

    python -m benchmarks.fake_pg_step --model paper-7b --seq-len 131072 --tsp-size 8 --layers 32 \
        --checkpointing full --steps 3

bf16 autocast with fp32 master weights, AdamW; prints peak memory (GB) and the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from lightning_tsp import TSPGroup, TSPLlama
from lightning_tsp.models.llama import CHECKPOINTING_MODES, get_config


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fake_pg_step")
    ap.add_argument("--model", default="paper-7b")
    ap.add_argument("--seq-len", type=int, default=131072)
    ap.add_argument("--tsp-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--layers", type=int, default=None, help="override the preset's layer count")
    ap.add_argument("--checkpointing", default="full", choices=CHECKPOINTING_MODES)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=args.tsp_size)
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    overrides = {} if args.layers is None else {"n_layers": args.layers}
    cfg = get_config(args.model, **overrides)
    torch.cuda.set_device(0)
    model = TSPLlama(cfg, tsp, activation_checkpointing=args.checkpointing, device="cuda", dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq_len), device="cuda")
    inputs = model.shard_batch(ids)
    times = []
    for _ in range(args.steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = statistics.median(times[1:])
    tokens = args.seq_len / args.tsp_size
    print(f"{args.model} L={cfg.n_layers} S={args.seq_len} D={args.tsp_size} rank={args.rank} "
          f"ckpt={args.checkpointing}: peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB, "
          f"step {step:.3f} s (median of {args.steps}), {tokens / step:.0f} tokens/s per GPU (comm excluded)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
