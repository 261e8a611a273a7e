"""python -m benchmarks.inference on CPU at a tiny size: every configuration (TSP D = 2 on the fake process group and the
single-GPU baseline, for two short prompts, one of them padded) runs in its own subprocess and yields a table
row and a JSON line. No timing is asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_inference_benchmark_rows(tmp_path):
    out = tmp_path / "inference.jsonl"
    args = ["--device", "cpu", "--model", "tiny", "--dtype", "float32", "--tsp-size", "2", "--prompt-lens", "10",
            "16", "--decode-steps", "2", "--decode-warmup", "0", "--repeats", "1", "--warmup-len", "0",
            "--max-seconds", "120", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.inference", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["tsp_size"], r["prompt_len"]) for r in rows] == [(2, 10), (1, 10), (2, 16), (1, 16)]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["prefill_s"] > 0 and r["decode_s_per_token"] > 0 and len(r["decode_times_s"]) == 2
        assert r["prefill_tokens_per_s_per_gpu"] > 0 and r["decode_tokens_per_s"] > 0
        assert r["padded_len"] % (2 * r["tsp_size"]) == 0 and r["padded_len"] >= r["prompt_len"]
        assert r["command"].startswith("python -m benchmarks.inference --in-process")
    tsp, single = rows[0], rows[1]
    # the rank keeps about 1/D of the cache: its prefill slots are P/D (P = 12 for the 10-token prompt at D = 2)
    assert tsp["kv_cache_prefill_bytes"] * 2 == single["kv_cache_prefill_bytes"] * 12 // 10
    assert tsp["weights_bytes"] < single["weights_bytes"]
    assert tsp["comm_pred"]["decode_calls"] > 0 and tsp["comm_pred"]["prefill_wire_bytes"] > 0
    assert single["comm_pred"]["decode_s_per_token"] == 0

    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 2 + len(rows)  # header, separator, one line per configuration
    assert "TSP D=2 rank 0" in table[2] and "single GPU (D=1)" in table[3]
    assert sum(line.startswith(f"{i}. `python -m benchmarks.inference --in-process") for i in range(1, 5)
               for line in proc.stdout.splitlines()) == 4
