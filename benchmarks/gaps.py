"""Where the GPU waits for the host: the idle gaps between GPU work in a torch.profiler chrome trace
(``prof.export_chrome_trace``), each with the GPU work around it and the CPU op (and Python frame) that launched
the work after it. Pure functions on the trace's JSON; ``benchmarks.profile_step --gaps N`` prints them.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict

STEP = "profiled_step"  # the record_function around the profiled step: its CPU start and end bound the step
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
NAME_CHARS = 80


def _cat(ev: dict) -> str:
    return str(ev.get("cat", "")).lower()


def _span(ev: dict) -> tuple[float, float]:
    ts = float(ev["ts"])
    return ts, ts + float(ev.get("dur", 0))


def _thread(ev: dict) -> tuple:
    return ev.get("pid"), ev.get("tid")


class _Enclosing:
    """The innermost of a set of CPU events (nested per thread, as a trace's are) that holds a time point."""

    def __init__(self, events: list[dict]) -> None:
        threads: dict[tuple, list[tuple[float, float, str]]] = defaultdict(list)
        for ev in events:
            threads[_thread(ev)].append((*_span(ev), str(ev.get("name", ""))))
        self._threads = {}
        for key, spans in threads.items():
            spans.sort(key=lambda s: (s[0], -s[1]))  # outer before inner at equal starts
            parents, stack = [], []
            for i, (_, end, _) in enumerate(spans):
                while stack and spans[stack[-1]][1] < end:
                    stack.pop()
                parents.append(stack[-1] if stack else -1)
                stack.append(i)
            self._threads[key] = ([s[0] for s in spans], spans, parents)

    def at(self, thread: tuple, t: float) -> str | None:
        """Name of the innermost event of ``thread`` whose [ts, ts + dur] holds ``t``, or None."""
        if thread not in self._threads:
            return None
        starts, spans, parents = self._threads[thread]
        i = bisect_right(starts, t) - 1  # the last event to start; if it ended before t, one of its ancestors
        while i >= 0 and spans[i][1] < t:
            i = parents[i]
        return spans[i][2] if i >= 0 else None


def idle_gaps(trace: dict, n: int, min_us: float = 20.0) -> dict:
    """GPU idle time in a chrome trace (times in us), from the CPU start of the ``profiled_step`` annotation to
    the later of its CPU end and the last GPU event's end (without the annotation: the GPU events' span).

    - ``busy_us``: union of the kernel/memcpy/memset intervals; ``step_us``; ``idle_us`` = ``step_us - busy_us``:
      gaps between busy runs, ``start_idle_us`` (step start to first GPU event) and ``end_idle_us`` (last GPU
      event to step end).
    - ``gaps``: the ``n`` longest gaps >= ``min_us`` (``n_gaps``, ``gap_us``: count and total of all of them),
      each ``us``, ``at_us`` (from the step start), ``before``/``after`` (GPU event names), ``launcher`` (the
      innermost cpu_op around the runtime call that launched ``after``, else that call's name), ``runtime``
      (that call) and ``python`` (the innermost Python frame around it but built-ins, with ``with_stack``).
    - ``by_launcher``: the gaps >= ``min_us`` summed by launcher, the ``n`` largest: ``launcher``, ``us``, ``gaps``.
    """
    events = [ev for ev in trace.get("traceEvents", []) if ev.get("ph") == "X" and "ts" in ev]
    gpu = sorted((ev for ev in events if _cat(ev) in GPU_CATS), key=lambda ev: float(ev["ts"]))
    runtime = {ev["args"]["correlation"]: ev for ev in events
               if _cat(ev) in RUNTIME_CATS and "correlation" in ev.get("args", {})}
    ops = _Enclosing([ev for ev in events if _cat(ev) == "cpu_op"])
    frames = _Enclosing([ev for ev in events  # built-ins (``<built-in function linear>``) name no source line
                         if _cat(ev) == "python_function" and not str(ev.get("name")).startswith("<built-in")])
    steps = [_span(ev) for ev in events if ev.get("name") == STEP and _cat(ev) in ("user_annotation", "cpu_op")]

    def name(ev: dict) -> str:
        return str(ev.get("name", ""))[:NAME_CHARS]

    def launched(ev: dict) -> dict:
        call = runtime.get(ev.get("args", {}).get("correlation"))
        if call is None:
            return {"launcher": "?", "runtime": None, "python": None}
        t = float(call["ts"])
        op, frame = ops.at(_thread(call), t), frames.at(_thread(call), t)
        return {"launcher": (op or str(call.get("name")))[:NAME_CHARS], "runtime": call.get("name"),
                "python": frame[:NAME_CHARS] if frame else None}

    raw = []  # (us, start, event before or None, event after or None)
    busy, run_end, last = 0.0, None, None
    for ev in gpu:
        a, b = _span(ev)
        if run_end is None or a > run_end:
            if run_end is not None:
                raw.append((a - run_end, run_end, last, ev))
            busy += b - a
            run_end, last = b, ev
        elif b > run_end:
            busy += b - run_end
            run_end, last = b, ev
    start_idle = end_idle = 0.0
    t0 = float(gpu[0]["ts"]) if gpu else 0.0
    if steps:
        t0, t1 = min(s[0] for s in steps), max(s[1] for s in steps)
        if gpu:
            start_idle = max(0.0, float(gpu[0]["ts"]) - t0)
            end_idle = max(0.0, t1 - run_end)
            raw += [(start_idle, t0, None, gpu[0]), (end_idle, run_end, last, None)]
        else:
            start_idle = t1 - t0
            raw.append((start_idle, t0, None, None))
    step_us = busy + sum(r[0] for r in raw)

    gaps = []
    for us, at, before, after in sorted((r for r in raw if r[0] >= min_us), key=lambda r: -r[0]):
        who = launched(after) if after else {"launcher": "(step end)", "runtime": None, "python": None}
        gaps.append({"us": us, "at_us": at - t0, "before": name(before) if before else "(step start)",
                     "after": name(after) if after else "(step end)", **who})
    by_launcher: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for g in gaps:
        by_launcher[g["launcher"]][0] += g["us"]
        by_launcher[g["launcher"]][1] += 1
    return {
        "step_us": step_us, "busy_us": busy, "idle_us": step_us - busy, "start_idle_us": start_idle,
        "end_idle_us": end_idle, "gap_us": sum(g["us"] for g in gaps), "n_gaps": len(gaps), "min_us": min_us,
        "gaps": gaps[:n],
        "by_launcher": [{"launcher": k, "us": v[0], "gaps": v[1]}
                        for k, v in sorted(by_launcher.items(), key=lambda kv: -kv[1][0])[:n]],
    }


def format_gaps(result: dict, stacks: bool = True) -> str:
    """``idle_gaps``'s result as markdown: a totals line, the longest gaps, the idle time by launcher
    (``stacks``: whether the profile recorded Python stacks, which slow the host)."""

    def cell(s: str | None) -> str:
        return "" if s is None else s.replace("|", "\\|")

    r = result
    lines = [
        f"GPU idle: step {r['step_us'] / 1e3:.3f} ms profiled ({'with' if stacks else 'without'} stacks), "
        f"busy {r['busy_us'] / 1e3:.3f} ms, "
        f"idle {r['idle_us'] / 1e3:.3f} ms ({r['idle_us'] / max(r['step_us'], 1e-9):.1%}: start "
        f"{r['start_idle_us'] / 1e3:.3f} ms, end {r['end_idle_us'] / 1e3:.3f} ms; {r['n_gaps']} gaps >= "
        f"{r['min_us']:g} us: {r['gap_us'] / 1e3:.3f} ms)",
        "",
        "| idle us | at ms | before | after | launcher | python |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for g in r["gaps"]:
        lines.append(f"| {g['us']:.1f} | {g['at_us'] / 1e3:.3f} | {cell(g['before'])} | {cell(g['after'])} | "
                     f"{cell(g['launcher'])} | {cell(g['python'])} |")
    lines += ["", "| launcher | idle us | gaps | share of idle |", "| --- | --- | --- | --- |"]
    for b in r["by_launcher"]:
        lines.append(f"| {cell(b['launcher'])} | {b['us']:.1f} | {b['gaps']} | "
                     f"{b['us'] / max(r['idle_us'], 1e-9):.1%} |")
    return "\n".join(lines)
