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
