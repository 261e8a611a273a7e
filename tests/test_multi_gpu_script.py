"""benchmarks/multi_gpu.py and multi_gpu.sh in their CPU mode (gloo, 2 processes under torchrun).

1. One call runs (a) the correctness check on the tiny config (TSP D = 2 against the D = 1 reference: loss,
   every gathered gradient in fp32 and bf16 autocast, the loss curve, for GQA and MHA) and (b) one tiny TSP
   throughput row with its fake-process-group compute-only run; the table, the JSON lines and the targets
   section come out, and the exit status is 0.
2. An OOM inside a throughput configuration becomes a row saying OOM (the other rank, blocked in a collective,
   is stopped by torchrun), not a hang or a crash of the sweep.
3. A FAIL (or a crashed correctness run) makes the exit status non-zero; the tables and the target checks read
   synthetic rows correctly; multicast stays off in every child's environment; the shell wrapper passes N and
   the options through (dry run).
Every subprocess has a timeout.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "multi_gpu.py"
CPU = ["--device", "cpu", "--backend", "gloo", "--nproc", "2", "--timeout-s", "90", "--pg-timeout-s", "60"]
TINY_RUN = ["--model", "tiny", "--seqs", "256", "--steps", "1", "--warmup", "1"]

sys.path.insert(0, str(ROOT / "benchmarks"))
import multi_gpu  # noqa: E402


def _run(argv: list[str], timeout: float = 150, expect_rc: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(SCRIPT), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_correctness_and_one_throughput_row_on_gloo(tmp_path):
    out = tmp_path / "mg.md"
    proc = _run([*CPU, "--check-preset", "tiny", *TINY_RUN, "--strategies", "tsp", "--out", str(out)])
    rows = _jsonl(tmp_path / "mg.jsonl")

    checks = [r for r in rows if r["kind"] == "correctness"]
    assert checks and all(r["result"] == "PASS" for r in checks), checks
    assert {r["D"] for r in checks} == {2}
    assert {r["attention"] for r in checks} == {"GQA 4/2", "MHA 4/4"}
    for attn in ("GQA 4/2", "MHA 4/4"):
        got = {(r["precision"], r["check"].split(" (")[0]) for r in checks if r["attention"] == attn}
        assert got == {("fp32", "weights identical"), ("fp32", "loss"), ("fp32", "grads"), ("fp32", "loss curve"),
                       ("bf16", "loss"), ("bf16", "grads"), ("bf16", "loss curve")}
    for r in checks:
        assert r["err"] <= r["tol"]
        assert r["backend"] == "gloo" and r["world"] == 2
        if r["check"].startswith("grads"):
            assert r["check"] == "grads (21 tensors)"  # 2 layers x 9 + embedding, final norm, LM head
        if r["check"].startswith("loss curve"):
            assert len(r["curve"]) == len(r["ref_curve"]) == 4
    assert all("ref_bf16_vs_fp32" in r for r in checks if r["precision"] == "bf16" and
               r["check"].split(" (")[0] in ("loss", "grads"))
    assert checks[0]["command"].startswith("bash benchmarks/multi_gpu.sh 2 --skip-throughput")

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

    table = out.read_text()
    assert "**PASS**" in table and "**FAIL**" not in table
    assert "| tsp | D=2 zigzag | 256 | ok |" in table and "### TSP targets" in table
    assert "14 PASS, 0 FAIL" in proc.stdout


def test_oom_in_a_configuration_becomes_a_row(tmp_path):
    out = tmp_path / "oom.md"
    _run([*CPU, "--skip-correctness", *TINY_RUN, "--strategies", "tp_sp", "--simulate-oom-rank", "1",
          "--out", str(out)], timeout=90)
    (row,) = [r for r in _jsonl(tmp_path / "oom.jsonl") if r["kind"] == "throughput"]
    assert row["status"] == "OOM" and row["oom_ranks"] == [1] and "simulated" in row["error"]
    assert row["layout"] == "T=2 SP" and row.get("tokens_per_s_per_gpu") is None
    assert "| tp_sp | T=2 SP | 256 | OOM |" in out.read_text()


def test_fail_or_crash_exits_nonzero(tmp_path, monkeypatch):
    def fake_run(result_rows, rc=0):
        def run_logged(cmd, env, timeout, log_stem):
            assert env["NCCL_NVLS_ENABLE"] == "0"
            if result_rows is not None:
                Path(cmd[cmd.index("--result") + 1]).write_text(json.dumps({"rows": result_rows, "wall_s": 1}))
                return rc, "terminate called without an active exception" if rc else ""
            return 1, "Traceback ...\nRuntimeError: NCCL error: unhandled system error\n[rank0]: done"
        return run_logged

    base = dict(D=2, attention="GQA 4/2", precision="fp32", check="loss", tol=1e-5, worst="", groups=1,
                worst_group_leader=0, kind="correctness", seq_len=64, batch=2, world=2, checkpointing="full",
                device="cpu", torch="x", backend="gloo")
    argv = [*CPU, "--check-preset", "tiny", "--skip-throughput", "--out", str(tmp_path / "f.md")]
    monkeypatch.setattr(multi_gpu, "run_logged", fake_run([{**base, "err": 1e-7, "result": "PASS"}]))
    assert multi_gpu.main(argv) == 0
    # a crash at teardown after the complete result was written does not turn PASS into FAIL
    monkeypatch.setattr(multi_gpu, "run_logged", fake_run([{**base, "err": 1e-7, "result": "PASS"}], rc=1))
    assert multi_gpu.main(argv) == 0
    monkeypatch.setattr(multi_gpu, "run_logged", fake_run([{**base, "err": 1e-7, "result": "PASS"},
                                                          {**base, "err": 3e-3, "result": "FAIL"}]))
    assert multi_gpu.main(argv) == 1
    assert "**FAIL**" in (tmp_path / "f.md").read_text()
    monkeypatch.setattr(multi_gpu, "run_logged", fake_run(None))
    assert multi_gpu.main(argv) == 1
    text = (tmp_path / "f.md").read_text()
    assert "did not finish" in text and "RuntimeError: NCCL error" in text


def test_layouts_targets_and_environment(monkeypatch):
    args = multi_gpu.parse_args(["--nproc", "8", "--device", "cpu"])
    assert multi_gpu.layouts(args) == [("tsp", None, None), ("tp_sp", None, None), ("tp", None, None),
                                       ("tp_x_sp", 2, 4), ("tp_x_sp", 4, 2), ("fsdp_cp", None, None),
                                       ("sp", None, None)]
    assert multi_gpu.check_sizes(args) == [2, 4, 8]
    assert multi_gpu.check_sizes(multi_gpu.parse_args(["--nproc", "6", "--device", "cpu"])) == [2]
    assert [multi_gpu.check_config(args, d, "gqa").n_kv_heads for d in (2, 4, 8)] == [4, 4, 8]
    assert multi_gpu.check_config(args, 4, "gqa").n_heads == 8 and multi_gpu.check_config(args, 8, "mha").n_heads == 8
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
    env = multi_gpu.child_env(args)
    assert (env["NCCL_NVLS_ENABLE"], env["TORCH_SYMM_MEM_DISABLE_MULTICAST"], env["NVSHMEM_DISABLE_NVLS"]) == \
        ("0", "1", "1")


def test_shell_wrapper_dry_run():
    sh = ROOT / "benchmarks" / "multi_gpu.sh"
    assert os.access(sh, os.X_OK)
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(sh), "2", "--device", "cpu", "--backend", "gloo", "--dry-run",
                           "--check-preset", "tiny", *TINY_RUN, "--strategies", "tsp,tp_sp"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    assert "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1" in err
    assert err.count("torch.distributed.run --standalone --nproc-per-node 2") == 3  # (a) + 2 configurations
    assert "--worker correctness" in err and "--strategy tsp --seq 256" in err and "--strategy tp_sp" in err
