"""What is alive at a step's peak GPU memory: from a CUDA caching-allocator snapshot (``--memory-snapshot`` of
``benchmarks.harness``), replay the recorded allocations and frees, find the peak and list the blocks alive there,
grouped by the innermost frame of this project that allocated them.

    python -m benchmarks.memory_peak snapshot.pickle [--top 25]
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict


def _where(frames: list[dict]) -> str:
    """The innermost frame in this project's code, from its package folder on (or the innermost frame at all)."""
    for f in frames:
        name = f.get("filename", "")
        for package in ("lightning_tsp/", "benchmarks/"):
            if package in name:
                return f"{package}{name.split(package, 1)[1]}:{f.get('line')} {f.get('name')}"
    return f"{frames[0].get('filename')}:{frames[0].get('line')}" if frames else "?"


def peak_blocks(snapshot: dict, device: int = 0) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """(bytes allocated when recording began, peak bytes, {addr: (size, where)} allocated since and alive at the
    peak)."""
    trace = snapshot["device_traces"][device]
    now = sum(b["size"]
              for seg in snapshot["segments"] if seg.get("device", 0) == device
              for b in seg["blocks"] if b["state"] == "active_allocated")
    live: dict[int, tuple[int, str]] = {}
    net = best = 0  # bytes allocated since recording began, less those freed (of any block)
    best_live: dict[int, tuple[int, str]] = {}
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            net += e["size"]
            if net > best:
                best, best_live = net, dict(live)
        elif e["action"] == "free_completed":
            # a block allocated before recording began lowers the count all the same
            net -= live.pop(e["addr"])[0] if e["addr"] in live else e["size"]
    start = now - net  # allocated when recording began
    return start, start + best, best_live


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.memory_peak", description=__doc__.split("\n\n")[0])
    ap.add_argument("snapshot")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    with open(args.snapshot, "rb") as f:
        snap = pickle.load(f)
    base, peak, blocks = peak_blocks(snap)
    during = sum(size for size, _ in blocks.values())
    print(f"peak {peak / 2**30:.2f} GiB: allocated when the recorded step began {base / 2**30:.2f} GiB (less what "
          f"the step freed of it by the peak: {(base + during - peak) / 2**30:.2f} GiB), "
          f"+ {during / 2**30:.2f} GiB allocated during the step and alive at the peak")
    groups: dict[str, list[int]] = defaultdict(list)
    for size, where in blocks.values():
        groups[where].append(size)
    for where, sizes in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[: args.top]:
        print(f"{sum(sizes) / 2**30:8.3f} GiB  {len(sizes):4d} blocks  {where}")


if __name__ == "__main__":
    main()
