"""Where a training step's time goes: one harness configuration (benchmarks.harness options), one warm-up
step, one step under torch.profiler. Prints the GPU kernels by total time, the GPU busy time against the wall
time (the difference is time the GPU waited for the host), and the kernel count; with ``--ops N`` also the N aten
ops with the most GPU time by input shapes and by source lines (where the time comes from); with ``--gaps N`` also
where the GPU waits for the host: the N longest GPU idle gaps in the step (>= 20 us) with the GPU work around each
and the CPU op and Python frame that launched the work after it, and the idle time by launching op (the profiled
step then records Python stacks, which slows the host: compare with the unprofiled step time printed first;
``--no-stacks`` leaves them out).

    python -m benchmarks.profile_step --strategy tsp --model paper-7b --layers 2 --seq-len 131072 --world 8
    python -m benchmarks.profile_step --strategy tsp --model paper-7b --seq-len 16384 --world 8 \
        --checkpointing keep-attention --cuda-graphs auto --gaps 25

Fake process group as in the harness: communication excluded.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import nullcontext

from benchmarks import harness
from benchmarks.gaps import STEP, format_gaps, idle_gaps


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    # --ops N: also the N aten ops with the most GPU time, by shape and source; --gaps N: also the N longest GPU
    # idle gaps and what launched the work after them
    counts = {"--top": 25, "--ops": 0, "--gaps": 0}
    for flag in counts:
        if flag in argv:
            i = argv.index(flag)
            counts[flag] = int(argv[i + 1])
            del argv[i : i + 2]
    top, ops, gaps = counts["--top"], counts["--ops"], counts["--gaps"]
    stacks = "--no-stacks" not in argv  # --no-stacks: gaps without Python frames (the host runs at full speed)
    argv = [a for a in argv if a != "--no-stacks"]
    args = harness.parse_args(argv)
    runner = harness.gpu_runner(args)
    cfg = harness.model_config(args)
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    for _ in range(3):  # warm-up (cuda_graphs: eager), a second warm-up (cuda_graphs: the capture), then a timing
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        runner.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=ops > 0,
                 with_stack=ops > 0 or (gaps > 0 and stacks)) as prof:
        with record_function(STEP) if gaps else nullcontext():  # the step's CPU bounds, as the unprofiled wall
            runner.step()
            torch.cuda.synchronize()
    per_kernel = defaultdict(lambda: [0.0, 0])
    busy_intervals = []
    for ev in prof.events():
        # a record_function range shows on the GPU timeline too (the optimizer's "Optimizer.step#...", the step
        # marker of --gaps): it spans host time, so it is neither a kernel nor GPU-busy time
        annotation = getattr(ev, "is_user_annotation", False) or ev.name.startswith("Optimizer.") or ev.name == STEP
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time > 0 and not annotation:
            per_kernel[ev.name][0] += ev.device_time
            per_kernel[ev.name][1] += 1
            busy_intervals.append((ev.time_range.start, ev.time_range.end))
    busy_intervals.sort()
    busy, end = 0.0, -1.0
    for a, b in busy_intervals:  # union of kernel intervals (streams may overlap)
        if b > end:
            busy += b - max(a, end)
            end = b
    total = sum(v[0] for v in per_kernel.values())
    n = sum(v[1] for v in per_kernel.values())
    print(f"{args.strategy} {cfg.n_layers} layers S={args.seq_len} world={args.world} ckpt={args.checkpointing}: "
          f"step {wall:.3f} s unprofiled; GPU busy {busy / 1e6:.3f} s, kernel time {total / 1e6:.3f} s, "
          f"{n} kernels; peak {torch.cuda.max_memory_allocated() / 1e9:.2f} GB")
    print("| kernel | ms | calls | share |")
    print("| --- | --- | --- | --- |")
    for name, (t, c) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name[:110]} | {t / 1e3:.1f} | {c} | {t / total:.1%} |")
    if ops:
        sort = "self_device_time_total"
        print(prof.key_averages(group_by_input_shape=True).table(sort_by=sort, row_limit=ops, max_name_column_width=40,
                                                                 max_shapes_column_width=100))
        print(prof.key_averages(group_by_stack_n=6).table(sort_by=sort, row_limit=ops, max_src_column_width=200))
    if gaps:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        print("\n" + format_gaps(idle_gaps(trace, gaps), stacks))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
