"""How far the host runs ahead of the GPU in a training step (benchmarks.harness options, fake process group, CUDA):
after three warm-up steps, the time the host takes to issue forward + backward and the optimizer step, each against
the time the GPU finishes them, then one whole step under cProfile (host time by Python function).

    python -m benchmarks.host_time --strategy tsp --model paper-7b --seq-len 8192 --world 8 \\
        --checkpointing keep-attention --cuda-graphs auto
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time

from benchmarks import harness


def main(argv=None) -> None:
    runner = harness.gpu_runner(harness.parse_args(sys.argv[1:] if argv is None else argv))
    import torch
    import torch.distributed as dist

    for _ in range(3):  # warm-up (with cuda_graphs: eager, capture, replay)
        runner.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    runner.forward_backward()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    runner.optimizer.step()
    t3 = time.perf_counter()
    runner.optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    print(f"host: forward+backward issued in {1e3 * (t1 - t0):.1f} ms (GPU done at {1e3 * (t2 - t0):.1f}); "
          f"optimizer issued in {1e3 * (t3 - t2):.1f} ms, done at {1e3 * (t4 - t2):.1f}")
    prof = cProfile.Profile()
    prof.enable()
    runner.step()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("cumulative").print_stats(28)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
