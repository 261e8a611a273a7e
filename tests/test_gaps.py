"""benchmarks.gaps on a synthetic torch.profiler chrome trace (times in us)."""

from __future__ import annotations

import pytest

from benchmarks.gaps import STEP, format_gaps, idle_gaps

MAIN, OTHER, GPU = 10, 11, 7


def x(cat: str, name: str, ts: float, dur: float, tid: int = MAIN, corr: int | None = None) -> dict:
    ev = {"ph": "X", "cat": cat, "name": name, "pid": 0 if tid == GPU else 1, "tid": tid, "ts": ts, "dur": dur}
    if corr is not None:
        ev["args"] = {"correlation": corr}
    return ev


def trace(step: bool = True) -> dict:
    events = [
        x("python_function", "train.py(10): step", 0, 1000),
        x("python_function", "model.py(20): forward", 50, 400),
        x("python_function", "model.py(30): helper", 55, 5),  # ends before the first launch: not its frame
        x("python_function", "<built-in method mm>", 65, 20),  # around the first launch, but a built-in
        x("python_function", "opt.py(5): step", 500, 450),
        x("python_function", "other.py(1): f", 0, 1000, tid=OTHER),  # another thread: never the frame
        x("cpu_op", "aten::mm", 60, 30),
        x("cpu_op", "aten::linear", 290, 70),
        x("cpu_op", "aten::mm", 300, 50),  # innermost around the second launch
        x("cpu_op", "aten::mul", 655, 10),
        x("cuda_runtime", "cudaLaunchKernel", 70, 5, corr=1),
        x("cuda_runtime", "cudaLaunchKernel", 320, 5, corr=2),
        x("cuda_runtime", "cudaMemcpyAsync", 600, 5, corr=3),  # no cpu_op around it
        x("cuda_driver", "cuLaunchKernel", 660, 2, corr=4),
        x("kernel", "gemm", 100, 150, tid=GPU, corr=1),  # [100, 250]
        x("kernel", "add_kernel", 330, 100, tid=GPU, corr=2),  # [330, 430]
        x("kernel", "side_kernel", 400, 60, tid=GPU + 1, corr=2),  # overlaps: busy run [330, 460]
        x("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 650, 10, tid=GPU, corr=3),  # [650, 660]
        x("Kernel", "mul_kernel", 665, 300, tid=GPU, corr=4),  # [665, 965], after a 5 us gap
        x("gpu_user_annotation", STEP, 100, 865, tid=GPU),  # not GPU work
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "pid": 0, "tid": GPU, "ts": 100, "id": 1},
    ]
    if step:
        events.append(x("user_annotation", STEP, 0, 1000))
    return {"traceEvents": events}



def test_totals_and_gaps():
    r = idle_gaps(trace(), n=10)
    assert r["busy_us"] == pytest.approx(150 + 130 + 10 + 300)
    assert r["step_us"] == pytest.approx(1000)
    assert r["idle_us"] == pytest.approx(410)  # 100 start + 80 + 190 + 5 + 35 end
    assert r["start_idle_us"] == pytest.approx(100)
    assert r["end_idle_us"] == pytest.approx(35)
    assert r["n_gaps"] == 4 and r["gap_us"] == pytest.approx(405)  # the 5 us gap is under min_us
    got = [(g["us"], g["at_us"], g["before"], g["after"], g["launcher"], g["runtime"], g["python"]) for g in r["gaps"]]
    assert got == [
        (190, 460, "side_kernel", "Memcpy HtoD (Pageable -> Device)", "cudaMemcpyAsync", "cudaMemcpyAsync",
         "opt.py(5): step"),
        (100, 0, "(step start)", "gemm", "aten::mm", "cudaLaunchKernel", "model.py(20): forward"),
        (80, 250, "gemm", "add_kernel", "aten::mm", "cudaLaunchKernel", "model.py(20): forward"),
        (35, 965, "mul_kernel", "(step end)", "(step end)", None, None),
    ]
    assert r["by_launcher"] == [
        {"launcher": "cudaMemcpyAsync", "us": 190, "gaps": 1},
        {"launcher": "aten::mm", "us": 180, "gaps": 2},
        {"launcher": "(step end)", "us": 35, "gaps": 1},
    ]


def test_top_n_and_min_us():
    r = idle_gaps(trace(), n=2, min_us=3)
    assert r["n_gaps"] == 5 and r["gap_us"] == pytest.approx(410)
    assert [g["us"] for g in r["gaps"]] == [190, 100]
    assert [(b["launcher"], b["us"]) for b in r["by_launcher"]] == [("cudaMemcpyAsync", 190), ("aten::mm", 180)]
    assert r["gaps"][0]["launcher"] == "cudaMemcpyAsync"
    assert idle_gaps(trace(), n=10, min_us=3)["by_launcher"][-1] == {"launcher": "aten::mul", "us": 5, "gaps": 1}


def test_without_step_annotation():
    r = idle_gaps(trace(step=False), n=10)
    assert r["start_idle_us"] == r["end_idle_us"] == 0
    assert r["step_us"] == pytest.approx(965 - 100) and r["idle_us"] == pytest.approx(80 + 190 + 5)
    assert [g["us"] for g in r["gaps"]] == [190, 80]


def test_names_truncated_and_markdown():
    t = trace()
    next(ev for ev in t["traceEvents"] if ev["name"] == "gemm")["name"] = "void gemm<" + "x" * 200 + ">"
    r = idle_gaps(t, n=10)
    assert len(r["gaps"][1]["after"]) == 80
    lines = format_gaps(r).splitlines()
    assert lines[0].startswith("GPU idle: step 1.000 ms profiled (with stacks), busy 0.590 ms, idle 0.410 ms (41.0%")
    assert lines[2] == "| idle us | at ms | before | after | launcher | python |"
    assert lines[4] == ("| 190.0 | 0.460 | side_kernel | Memcpy HtoD (Pageable -> Device) | cudaMemcpyAsync | "
                        "opt.py(5): step |")
    assert "| aten::mm | 180.0 | 2 | 43.9% |" in lines
