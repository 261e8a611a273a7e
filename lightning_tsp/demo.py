"""Tiny TSP training on CPU: D gloo processes train the built-in model on Python's own source text.

    python -m lightning_tsp.demo --tsp-size 2 --steps 150

Every rank holds 1/D of every weight and 1/D of every sequence; all ranks print the same loss.
"""

from __future__ import annotations

import argparse
import datetime
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_tsp import TSPGroup, TSPLlama
from lightning_tsp.data import PackedTextDataset, stdlib_text_files
from lightning_tsp.models.llama import get_config
from lightning_tsp.teardown import destroy_process_groups


def _train(rank: int, args, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=args.tsp_size,
                            timeout=datetime.timedelta(seconds=120))
    ok = False
    try:
        _loop(rank, args)
        ok = True
    finally:
        destroy_process_groups(barrier=ok)  # _loop has returned: nothing references the groups any more


def _loop(rank: int, args) -> None:
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    data = PackedTextDataset(stdlib_text_files(), args.seq_len, max_tokens=2_000_000)
    model = TSPLlama(get_config(args.model, vocab_size=data.vocab_size), tsp)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    g = torch.Generator().manual_seed(0)  # the same samples on every rank of the TSP group
    n_local = sum(p.numel() for p in model.parameters())
    if rank == 0:
        print(f"TSP group of {tsp.size} CPU processes; {len(data)} sequences of {args.seq_len} bytes of Python "
              f"stdlib source; {n_local:,} parameters on this rank of {model.cfg.num_params():,} in the model")
    t0 = time.time()
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(data), (args.batch_size,), generator=g)
        ids = data.tokens[idx]
        loss = model(*model.shard_batch(ids))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step == 1 or step % args.log_every == 0):
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.time() - t0:.1f} s)", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tsp-size", type=int, default=2)
    p.add_argument("--model", default="tiny")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_train, args=(args, os.path.join(tmp, "store")), nprocs=args.tsp_size,
                           start_method="spawn")


if __name__ == "__main__":
    main()
