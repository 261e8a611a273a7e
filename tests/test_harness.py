"""The benchmark harness (python -m benchmarks.harness) and its baseline strategies (benchmarks/baselines/).

1. Every strategy runs on CPU with the fake process group at a tiny size and yields a table row and a JSON line
   (no memory numbers on CPU, no timings asserted).
2. The sweep path (a fresh subprocess per configuration) produces rows and a markdown table.
3. The baselines are not silently wrong: on a real gloo group of 4 processes, TP, TP-SP, SP (zigzag context
   parallel), FSDP+CP and TP x SP (2 x 2) give the loss and the gradients of the unsharded model (fp32, full
   activation checkpointing), and their optimizers step.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--layers", "2", "--seq-len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu"]


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_every_strategy_yields_a_row(tmp_path):
    out = tmp_path / "res.md"
    proc = _run(["--sweep", "tsp", "tp", "tp_sp", "sp", "fsdp_cp", "fsdp", "tp_x_sp=2x2", "--world", "2",
                 "--in-process", "--out", str(out), *TINY])
    rows = [json.loads(line) for line in (tmp_path / "res.jsonl").read_text().splitlines()]
    assert [r["strategy"] for r in rows] == ["tsp", "tp", "tp_sp", "sp", "fsdp_cp", "fsdp", "tp_x_sp"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["step_s"] is not None and r["tokens_per_s_per_gpu"] > 0
        assert r["peak_gb"] is None  # CPU: not measured
        assert "fake process group" in r["excluded"]
        assert r["pred_comm_s"] is not None and r["pred_comm_s"] > 0, r.get("comm_model")
        assert r["command"].startswith("python -m benchmarks.harness --strategy " + r["strategy"])
        assert r["compiled"] is (r["strategy"] == "tsp" and r["fused_elementwise"] != "off")
    assert rows[-1]["world"] == 4 and rows[-1]["tp"] == 2 and rows[-1]["sp"] == 2
    table = out.read_text()
    assert table.count("\n| ") == 1 + len(rows)  # separator + one line per row (header is the first line)
    assert "| tp_x_sp |" in table and "| fsdp_cp |" in proc.stdout


def test_sweep_subprocess_and_layer_extrapolation(tmp_path):
    out = tmp_path / "sweep.md"
    _run(["--sweep", "tp_sp:64", "--world", "2", "--probe-layers", "1", "2", "--out", str(out), *TINY],
         timeout=180)
    rows = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert [(r["strategy"], r["seq_len"], r["status"]) for r in rows] == [("tp_sp", 64, "ok")]
    assert all(r["extrapolated_from"] == "1,2" and r["layers"] == 2 for r in rows)
    assert "--probe-layers 1 2" in rows[0]["command"]


def test_combine_probes_takes_peaks_and_steps_from_their_own_pairs(tmp_path):
    """Probes measured apart: peak from the two largest layer counts >= 1, step from the two smallest warm ones."""
    from benchmarks import harness

    args = harness.parse_args(["--model", "paper-7b", "--seq-len", "4194304", "--world", "8"])
    base = {**harness.base_row(args, harness.model_config(args)), "status": "ok"}
    probes = [{**base, "layers": 0, "warmup": 1, "step_s": 3.0, "peak_gb": 20.0, "host_peak_gb": 0.0},
              {**base, "layers": 1, "warmup": 1, "step_s": 153.0, "peak_gb": 60.0, "host_peak_gb": 4.0},
              {**base, "layers": 2, "warmup": 0, "step_s": 330.0, "peak_gb": 61.5, "host_peak_gb": 8.0}]
    path = tmp_path / "probes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in probes))
    _run(["--combine-probes", str(path), "--model", "paper-7b", "--jsonl", str(tmp_path / "out.jsonl")])
    (row,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert row["layers"] == 32 and row["extrapolated"] is True and row["extrapolated_from"] == "1,2"
    assert row["peak_gb"] == pytest.approx(61.5 + 30 * 1.5) and row["host_peak_gb"] == pytest.approx(8 + 30 * 4)
    assert row["step_extrapolated_from"] == "0,1" and row["step_s_valid"] is True
    assert row["step_s"] == pytest.approx(153 + 31 * 150)  # not 330 + 30 * 177: the 2-layer step was cold
    assert row["tokens_per_s_per_gpu"] == pytest.approx(4194304 / 8 / row["step_s"]) and row["mfu_peak"] > 0
    assert set(row["measured"]) == {"0", "1", "2"}
    cold = harness.combine_probes([probes[1], probes[2]], 32)  # no two warm steps: marked
    assert cold["step_s_valid"] is False and cold["step_s"] == pytest.approx(330 + 30 * 177)


@pytest.mark.parametrize("autocast,param_dtype,expected", [(True, "float32", torch.bfloat16),
                                                             (False, "bfloat16", torch.bfloat16),
                                                             (False, "float32", torch.float32)])
def test_row_kernel_is_resolved_for_the_dtype_the_layers_see(monkeypatch, autocast, param_dtype, expected):
    """bf16-true rows name the kernel that bf16 activations get (the model resolves by x.dtype), not fp32's."""
    import lightning_tsp.kernels.attention as attention
    from benchmarks.baselines.common import Setup
    from benchmarks.baselines.model import cp_kernel

    seen = []
    monkeypatch.setattr(attention, "select_attention_kernel", lambda device, name, dtype: seen.append(dtype))
    cp_kernel(Setup(cfg=None, strategy="tsp", world=8, rank=0, seq_len=64, autocast=autocast, param_dtype=param_dtype))
    assert seen == [expected]


def test_memory_peak_replays_a_snapshot():
    """benchmarks.memory_peak: the peak and what is alive there, from a caching-allocator snapshot's trace (blocks
    allocated before recording began count in the baseline; freeing one of them lowers the later peak)."""
    from benchmarks.memory_peak import peak_blocks

    def frame(line):
        return [{"filename": "/site/torch/nn/functional.py", "line": 1, "name": "linear"},
                {"filename": "/repo/lightning_tsp/layers/mlp.py", "line": line, "name": "backward"}]

    trace = [{"action": "free_completed", "addr": 9, "size": 40},  # allocated before recording
             {"action": "alloc", "addr": 1, "size": 50, "frames": frame(87)},
             {"action": "alloc", "addr": 2, "size": 30, "frames": frame(93)},
             {"action": "free_completed", "addr": 1, "size": 50},
             {"action": "alloc", "addr": 3, "size": 60, "frames": frame(94)}]
    blocks_now = [{"size": 100, "state": "active_allocated"}, {"size": 30, "state": "active_allocated"},
                  {"size": 60, "state": "active_allocated"}, {"size": 8, "state": "inactive"}]
    snapshot = {"segments": [{"device": 0, "blocks": blocks_now}], "device_traces": [trace]}
    start, peak, alive = peak_blocks(snapshot)
    assert start == 140  # 190 now = 140 + 50 + 30 - 50 + 60 - 40
    assert peak == 140 - 40 + 30 + 60  # after the last allocation: 190, above 140 - 40 + 80 = 180
    assert sorted(size for size, _ in alive.values()) == [30, 60]
    assert {where for _, where in alive.values()} == {"lightning_tsp/layers/mlp.py:93 backward",
                                                      "lightning_tsp/layers/mlp.py:94 backward"}


def _equivalence(rank: int, world: int, strategies=("tp", "tp_sp", "sp", "fsdp_cp", "tp_x_sp")) -> None:
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from benchmarks.baselines import build
    from benchmarks.baselines.common import Setup, make_batch, n_valid
    from benchmarks.baselines.model import Transformer
    from lightning_tsp.models.llama import get_config

    torch.manual_seed(0)
    cfg = get_config("tiny", n_layers=2, n_heads=8, n_kv_heads=4)  # GQA; TP = 4 divides both head counts
    seq = 32
    ref = Transformer(cfg)
    ref.init_weights(seed=3)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    ids, targets = make_batch(Setup(cfg, "tp", world, rank, seq))
    logits = ref(ids, torch.arange(seq))
    ref_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=-100,
                               reduction="sum") / n_valid(targets)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in ref.named_parameters()}

    for strategy in strategies:
        grid = dict(tp=2, sp=world // 2) if strategy == "tp_x_sp" else {}
        setup = Setup(cfg, strategy, world, rank, seq, device="cpu", autocast=False, checkpointing="full",
                      optimizer="forloop", **grid)
        runner = build(setup, full_state=state)
        loss = runner.forward_backward()
        torch.testing.assert_close(loss, ref_loss.detach(), rtol=1e-5, atol=1e-5, msg=f"{strategy} loss")
        for name, p in runner.model.named_parameters():
            key = name.replace("_checkpoint_wrapped_module.", "")
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            torch.testing.assert_close(g, ref_grads[key], rtol=1e-4, atol=1e-5, msg=f"{strategy} grad {key}")
        runner.optimizer.step()  # the optimizer accepts the (DTensor / plain) parameter groups


@pytest.mark.timeout(180)
def test_baselines_match_unsharded_model_on_gloo():
    """4 real processes: TP=4, TP-SP=4, SP=4, FSDP+CP=4 and TP x SP = 2 x 2 against the unsharded model."""
    run_distributed(_equivalence, 4, timeout=170)


_TSP_PARAMS_CHECK = """
import torch, torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from benchmarks import harness
from benchmarks.baselines import build
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
for kind in ("dtensor", "plain"):
    args = harness.parse_args(["--strategy", "tsp", "--tsp-params", kind, "--world", "2", *{tiny}])
    runner = build(harness.make_setup(args, harness.model_config(args), "cpu"))
    runner.forward_backward()
    params = list(runner.model.parameters())
    want = kind == "dtensor"
    assert all(isinstance(p, DTensor) is want and isinstance(p.grad, DTensor) is want for p in params), kind
    runner.optimizer.step()
    print(kind, "ok", len(params))
"""


def test_tsp_rows_hold_parameters_as_the_strategies_do():
    """--tsp-params dtensor (the default): TSP's parameters and gradients are DTensors on a 'tsp' mesh, as under
    TSPStrategy / the Fabric strategy (the rivals' are DTensors too); plain: local tensors, as rows before
    2026-12-07. A rival refuses the option."""
    code = _TSP_PARAMS_CHECK.replace("{tiny}", repr(TINY))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [line.split()[:2] for line in proc.stdout.splitlines()] == [["dtensor", "ok"], ["plain", "ok"]]
    refused = subprocess.run([sys.executable, "-m", "benchmarks.harness", "--strategy", "tp", "--tsp-params",
                              "plain", *TINY], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "--tsp-params is TSP's" in refused.stderr
