"""python -m benchmarks.multi_gpu and benchmarks/multi_gpu.sh in their CPU mode (gloo, 2 processes under torchrun).

1. One call measures one tiny TSP throughput row with its fake-process-group compute-only run; the table, the JSON
   lines and the targets section come out, and the exit status is 0.
2. An OOM inside a throughput configuration becomes a row saying OOM (the other rank, blocked in a collective,
   is stopped by torchrun), not a hang or a crash of the sweep.
3. A crashed configuration becomes an error row with the telling error line; a crash at teardown after the result
   was written keeps the row; the tables and the target checks read synthetic rows correctly; multicast stays off
   in every child's environment; the shell wrapper passes N and the options through (dry run).
The correctness check against the single-device model (formerly part (a) of this script) is
tests/test_multi_gpu.py. Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import multi_gpu

ROOT = Path(__file__).resolve().parent.parent
CPU = ["--device", "cpu", "--backend", "gloo", "--nproc", "2", "--timeout-s", "90", "--pg-timeout-s", "60"]
TINY_RUN = ["--model", "tiny", "--seqs", "256", "--steps", "1", "--warmup", "1"]


def _run(argv: list[str], timeout: float = 150, expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.multi_gpu", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_one_throughput_row_on_gloo(tmp_path):
    out = tmp_path / "mg.md"
    proc = _run([*CPU, *TINY_RUN, "--strategies", "tsp", "--out", str(out)])
    rows = _jsonl(tmp_path / "mg.jsonl")

    (tsp,) = [r for r in rows if r["kind"] == "throughput"]
    assert tsp["strategy"] == "tsp" and tsp["status"] == "ok" and tsp["world"] == 2 and tsp["seq_len"] == 256
    assert tsp["layout"] == "D=2 zigzag" and tsp["excluded"].startswith("nothing")
    assert tsp["checkpointing"] == "offload"  # TSP's rows default to its offload mode (--tsp-checkpointing)
    assert tsp["tokens_per_s_per_gpu"] > 0 and tsp["model_tflops_per_gpu"] > 0
    assert len(tsp["step_times_s"]) == 1 and tsp["loss"] > 0
    assert tsp["peak_gb"] is None  # CPU: not measured
    assert tsp["compute_only_status"] == "ok" and tsp["compute_only_step_s"] > 0
    assert tsp["overlap_efficiency"] == pytest.approx(tsp["compute_only_step_s"] / tsp["step_s"])
    assert tsp["env"] == multi_gpu.NO_MULTICAST_ENV
    assert "--strategies tsp" in tsp["command"] and "--nproc-per-node 2" in tsp["worker_command"]
    (targets,) = [r for r in rows if r["kind"] == "targets"]
    assert {t["target"] for t in targets["targets"]} >= {"overlap efficiency >= 0.9", "lowest peak memory of all"}

    assert tsp["command"].startswith("bash benchmarks/multi_gpu.sh 2 ")
    assert "-m benchmarks.multi_gpu --worker" in tsp["worker_command"]
    assert tsp["compute_only_command"].startswith("python -m benchmarks.harness --strategy tsp --seq-len 256")

    table = out.read_text()
    assert "| tsp | D=2 zigzag | 256 | ok |" in table and "### TSP targets" in table
    assert "| tsp | D=2 zigzag | 256 | ok |" in proc.stdout


def test_oom_in_a_configuration_becomes_a_row(tmp_path):
    out = tmp_path / "oom.md"
    _run([*CPU, "--skip-correctness", *TINY_RUN, "--strategies", "tp_sp", "--simulate-oom-rank", "1",
          "--out", str(out)], timeout=90)
    (row,) = [r for r in _jsonl(tmp_path / "oom.jsonl") if r["kind"] == "throughput"]
    assert row["status"] == "OOM" and row["oom_ranks"] == [1] and "simulated" in row["error"]
    assert row["layout"] == "T=2 SP" and row.get("tokens_per_s_per_gpu") is None
    assert "| tp_sp | T=2 SP | 256 | OOM |" in out.read_text()


def test_crash_becomes_an_error_row(tmp_path, monkeypatch):
    def fake_run(write_result, rc):
        def run(cmd, timeout, env, log_stem):
            assert env["NCCL_NVLS_ENABLE"] == "0"
            if write_result:
                Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps({"status": "ok", "step_s": 1.0,
                                                                          "step_times_s": [1.0], "layout": "D=2"}))
                return rc, "terminate called without an active exception" if rc else ""
            return rc, "Traceback ...\nRuntimeError: NCCL error: unhandled system error\n[rank0]: done"
        return run

    argv = [*CPU, *TINY_RUN, "--strategies", "tsp", "--no-compute-only", "--out", str(tmp_path / "f.md")]
    # a crash at teardown after the complete result was written keeps the measured row
    monkeypatch.setattr(multi_gpu, "run", fake_run(True, rc=1))
    assert multi_gpu.main(argv) == 0
    (row,) = [r for r in _jsonl(tmp_path / "f.jsonl") if r["kind"] == "throughput"]
    assert row["status"] == "ok" and row["step_s"] == 1.0 and "terminate called" in row["teardown_note"]
    monkeypatch.setattr(multi_gpu, "run", fake_run(False, rc=1))
    assert multi_gpu.main(argv) == 0
    row = [r for r in _jsonl(tmp_path / "f.jsonl") if r["kind"] == "throughput"][-1]
    assert row["status"] == "error" and row["error"] == "exit code 1: RuntimeError: NCCL error: unhandled system error"
    assert "error: exit code 1: RuntimeError: NCCL error" in (tmp_path / "f.md").read_text()
    monkeypatch.setattr(multi_gpu, "run", fake_run(False, rc=None))
    multi_gpu.main(argv)
    row = [r for r in _jsonl(tmp_path / "f.jsonl") if r["kind"] == "throughput"][-1]
    assert row["status"] == "timeout" and row["error"].startswith("no result within")


def test_layouts_targets_and_environment(monkeypatch):
    args = multi_gpu.parse_args(["--nproc", "8", "--device", "cpu"])
    assert multi_gpu.layouts(args) == [("tsp", None, None), ("tp_sp", None, None), ("tp", None, None),
                                       ("tp_x_sp", 2, 4), ("tp_x_sp", 4, 2), ("fsdp_cp", None, None),
                                       ("sp", None, None)]
    assert [multi_gpu.parse_seq(s) for s in multi_gpu.DEFAULT_SEQS.split(",")] == [131072, 65536, 32768, 16384]

    def row(strategy, tps, peak, layout="", **kw):
        return dict(strategy=strategy, layout=layout, seq_len=131072, status="ok", tokens_per_s_per_gpu=tps,
                    peak_gb=peak, **kw)

    rows = [row("tsp", 2700, 26.5, "D=8", overlap_efficiency=0.93, compute_only_step_s=7.4, step_s=7.96),
            row("tp_sp", 2000, 35.3, "T=8 SP"), row("tp_x_sp", 2050, 47.8, "T=4 SP x S=2"),
            row("tp", 2400, 98.9, "T=8"), dict(strategy="sp", seq_len=131072, status="OOM", peak_gb=None)]
    res = {t["target"]: t["result"] for t in multi_gpu.check_targets(rows, 8)}
    assert res == {"overlap efficiency >= 0.9": "MET", "tokens/s per GPU >= 1.3 x best TP+SP layout": "MET",
                   "tokens/s per GPU >= TP": "MET", "lowest peak memory of all": "MET"}
    rows[0].update(tokens_per_s_per_gpu=2300, overlap_efficiency=0.8, peak_gb=40.0)
    res = {t["target"]: t["result"] for t in multi_gpu.check_targets(rows, 8)}
    assert set(res.values()) == {"MISSED"}
    assert "targets are set" not in multi_gpu.check_targets(rows, 8)[0]["where"]
    assert "targets are set" in multi_gpu.check_targets(rows, 4)[0]["where"]

    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = multi_gpu.child_env()
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == \
        ("0", "1", "1")


def test_shell_wrapper_dry_run():
    sh = ROOT / "benchmarks" / "multi_gpu.sh"
    assert os.access(sh, os.X_OK)
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(sh), "2", "--device", "cpu", "--backend", "gloo", "--dry-run",
                           "--skip-correctness", *TINY_RUN, "--strategies", "tsp,tp_sp"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in err
    assert err.count("torch.distributed.run --standalone --nproc-per-node 2 -m benchmarks.multi_gpu --worker") == 2
    assert "--strategy tsp --seq 256" in err and "--strategy tp_sp" in err
