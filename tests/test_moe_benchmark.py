"""python -m benchmarks.moe (MoE training step, fake process group) on CPU at tiny sizes; no timings asserted.

1. Every strategy (tsp-ring, tsp-dispatch, tsp-auto, ep-tpsp) yields a row and a JSON line for 2-layer tiny-moe.
2. Layer extrapolation, and ep-tpsp marked unsupported where TP would split KV heads it cannot (no subprocess).
3. The routing hook: under the fake group, dispatch's count exchange goes through CountsGroup and is answered with
   balanced counts; on a real gloo group it gives exactly the library's DispatchExperts (the answered counts are the
   true ones when every rank routes the benchmark's balanced way).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny-moe", "--seq-len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu"]


def _run(args: list[str], tmp_path: Path, timeout: float = 240) -> tuple[str, list[dict]]:
    out = tmp_path / "moe.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.moe", *args, "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in (tmp_path / "moe.jsonl").read_text().splitlines()]
    return out.read_text(), rows


def test_every_strategy_yields_a_row(tmp_path):
    table, rows = _run(["--layers", "2", "--tsp-size", "2", *TINY], tmp_path)
    assert [r["strategy"] for r in rows] == ["tsp-ring", "tsp-dispatch", "tsp-auto", "ep-tpsp"]
    assert [r["schedule"] for r in rows[:2] + rows[3:]] == ["ring", "dispatch", "dispatch"]
    assert rows[2]["schedule"] in ("ring", "dispatch")  # what the cost model picked at run time
    for r in rows:
        assert r["status"] == "ok", r
        assert r["layers"] == 2 and r["tsp_size"] == 2 and r["precision"] == "32-true"
        assert r["step_s"] > 0 and r["tokens_per_s_per_gpu"] > 0 and r["peak_gb"] is None  # CPU: no peak
        assert r["pred_comm_s"] > 0 and "fake process group" in r["excluded"] and "balanced" in r["routing"]
        costs = r["expert_costs_per_layer"]
        assert costs["ring"]["bytes_forward"] > 0 and costs["dispatch"]["bytes_forward"] > 0
        assert r["command"].startswith(f"python -m benchmarks.moe --strategy {r['strategy']} --seq-len 64")
    assert table.count("\n| ") == 1 + len(rows)  # separator + one line per row
    assert "| ep-tpsp | dispatch |" in table and "| tsp-auto | " in table


def test_layer_extrapolation_and_unsupported_baseline(tmp_path):
    # D = 4 > tiny-moe's 2 KV heads: TSP replicates them, TP-SP (as Megatron) cannot split them
    _, rows = _run(["--tsp-size", "4", "--probe-layers", "1", "2", "--strategy", "tsp-dispatch", "ep-tpsp", *TINY],
                   tmp_path)
    tsp, ep = rows
    assert tsp["status"] == "ok" and tsp["extrapolated_from"] == "1,2" and tsp["layers"] == 2
    assert set(tsp["measured"]) == {"1", "2"} and "--probe-layers 1 2" in tsp["command"]
    assert ep["status"] == "unsupported" and "K/V heads" in ep["error"] and ep.get("pred_comm_s") is None


def test_fake_group_counts_are_answered_balanced():
    import benchmarks.moe as bm
    from lightning_tsp.group import TSPGroup
    from lightning_tsp.layers.moe import TSPExperts
    from torch.testing._internal.distributed.fake_pg import FakeStore

    calls = []

    class Recording(bm.CountsGroup):
        def all_to_all_single(self, output, input, output_splits, input_splits, opts=None):
            super().all_to_all_single(output, input, output_splits, input_splits, opts)
            calls.append((input.dtype, list(output_splits), output.tolist() if input.dtype == torch.int64 else None))

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        tsp = TSPGroup.from_process_group(dist.group.WORLD)
        experts = bm.BalancedExperts(TSPExperts(4, 8, 6, tsp, schedule="dispatch", top_k=2))
        experts.counts_tsp = TSPGroup(Recording(tsp.group, 1, 2), 1, 2)
        x = torch.randn(1, 16, 8, requires_grad=True)
        y = experts(x, torch.rand(16, 2), torch.zeros(16, 2, dtype=torch.long))
        y.sum().backward()
    finally:
        dist.destroy_process_group()
    assert experts.ran == "dispatch" and y.shape == x.shape
    # 16 tokens x top-2 = 32 rows, 8 per expert: every member sends 8 rows to each of my 2 experts
    assert calls[0] == (torch.int64, [], [8, 8, 8, 8])
    assert [c[1] for c in calls[1:]] == [[16, 16]] * 4  # rows out, outputs back, grads out, grads back


def _counts_group_is_exact(rank: int, world: int) -> None:
    import benchmarks.moe as bm
    from lightning_tsp.group import TSPGroup
    from lightning_tsp.layers.moe import DispatchExperts, TSPExperts

    torch.manual_seed(rank)
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    ex = TSPExperts(4, 8, 6, tsp, dtype=torch.float64, schedule="dispatch", top_k=2)
    x = torch.randn(1, 6, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(6, 2, dtype=torch.float64, requires_grad=True)
    y = bm.BalancedExperts(ex)(x, w, torch.zeros(6, 2, dtype=torch.long))  # ids replaced: row i -> expert i % 4
    ref = DispatchExperts.apply(x, w, (torch.arange(12) % 4).view(6, 2), ex.gate_up_proj, ex.down_proj, tsp)
    dy = torch.randn_like(y)
    leaves = (x, w, ex.gate_up_proj, ex.down_proj)
    for a, b in zip((y, *torch.autograd.grad(y, leaves, dy)), (ref, *torch.autograd.grad(ref, leaves, dy))):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_counts_group_matches_the_real_exchange_on_gloo():
    run_distributed(_counts_group_is_exact, 2)
