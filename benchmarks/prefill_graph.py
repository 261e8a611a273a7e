"""The prefill of one prompt batch, eager and from a kept decoder's CUDA graph, on rank ``--rank`` of a fake group.

``python -m benchmarks.prefill_graph --tsp-size 8 --prompt-len 2048`` builds the model (bf16, random weights),
times ``prefill`` after two warm-up prefills (synchronised, median of ``--repeats``), then a
:class:`~lightning_tsp.inference.decode.Decoder`'s refills (``Decoder.prefill``: the first one captures the graph,
the next ones replay it; eager where ``graphs_prefill`` says no). ``--one-owner-per-step`` builds the model with
``shard_group=1``: the broadcast schedule one owner per step, as the prefill ran before 2026-12-06. ``--profile``
prints one eager prefill's kernel time and kernel count. Communication is excluded (the fake group's collectives
return at once).
"""

from __future__ import annotations

import argparse
import os
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="paper-7b")
    ap.add_argument("--tsp-size", type=int, default=8)
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32, help="the cache's decode room (max_new_tokens)")
    ap.add_argument("--attention-kernel", default="auto")
    ap.add_argument("--device", default="cuda", help="cuda (graphs) or cpu (a check of the script: eager only)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--one-owner-per-step", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch
    import torch.distributed as dist

    from lightning_tsp import TSPGroup, TSPLlama
    from lightning_tsp.inference import prefill
    from lightning_tsp.inference.decode import Decoder
    from lightning_tsp.models.llama import get_config

    d, s, b = args.tsp_size, args.prompt_len, args.batch
    tsp = None
    if d > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=args.rank, world_size=d)
        tsp = TSPGroup.from_process_group(dist.group.WORLD)
    cfg = get_config(args.model)
    model = TSPLlama(cfg, tsp, attention_kernel=args.attention_kernel, device="meta", dtype=torch.bfloat16,
                     shard_group=1 if args.one_owner_per_step else "auto")
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    model.to_empty(device=dev)
    model.init_weights(seed=0)
    model.requires_grad_(False).eval()
    padded = -(-s // (2 * d)) * 2 * d
    ids = torch.zeros(b, padded, dtype=torch.long, device=dev)
    ids[:, :s] = torch.randint(0, cfg.vocab_size, (b, s), device=dev)
    lens = torch.full((b,), s, device=dev)
    steps = args.new_tokens - 1

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    label = f"{args.model} D={d} rank {args.rank} B={b} S={s}" + (" one owner per step" * args.one_owner_per_step)
    with torch.no_grad():
        for _ in range(2):
            prefill(model, ids, lens, decode_steps=steps)
        ts = sorted(timed(lambda: prefill(model, ids, lens, decode_steps=steps)) for _ in range(args.repeats))
        print(f"{label}: eager prefill median {ts[len(ts) // 2] * 1e3:.2f} ms (all {[round(t * 1e3, 2) for t in ts]})")
        if args.profile and cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                prefill(model, ids, lens, decode_steps=steps)
                sync()
            ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
            print(f"{label}: one eager prefill: kernel time {sum(e.self_device_time_total for e in ev) / 1e3:.2f} ms, "
                  f"{sum(e.count for e in ev)} kernels")
        cache, _ = prefill(model, ids, lens, decode_steps=steps)
        dec = Decoder(model, cache, graphs=cuda)
        first = timed(lambda: dec.prefill(ids, lens, steps))
        ts = sorted(timed(lambda: dec.prefill(ids, lens, steps)) for _ in range(args.repeats))
        all_ms = [round(t * 1e3, 2) for t in ts]
        print(f"{label}: Decoder.prefill graphed={dec.prefill_graph is not None}: first (capture) "
              f"{first * 1e3:.2f} ms, then median {ts[len(ts) // 2] * 1e3:.2f} ms (all {all_ms})")


if __name__ == "__main__":
    main()
