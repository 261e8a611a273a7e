"""python -m benchmarks.schedules runs (tiny sizes, CPU, fake process group) and prints its three rows; no timings
are asserted."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_schedule_benchmark_prints_its_rows():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.schedules", "--hidden", "64", "--heads", "4", "--kv-heads",
         "4", "--ffn", "256", "--seq-len", "256", "--tsp-size", "4", "--reps", "1", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith(("| what", "| ---"))]
    assert len(rows) == 3, out.stdout
    assert all(float(r.rsplit("|", 2)[1]) > 0 for r in rows)


def test_ring_gemms_benchmark_prints_its_table():
    """python -m benchmarks.ring_gemms at tiny sizes on CPU: one row per token count, every variant timed."""
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.ring_gemms", "--tokens", "8", "16", "--hidden", "32", "--ffn", "64",
         "--tsp-size", "4", "--reps", "1", "--device", "cpu"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith(("| local", "| ---"))]
    assert [r.split("|")[1].strip() for r in rows] == ["8", "16"], out.stdout
    assert all(len(r.strip("|").split("|")) == 11 and all(float(c) > 0 for c in r.strip("| ").split("|")[1:]) for r in rows)
