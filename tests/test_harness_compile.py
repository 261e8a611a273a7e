"""The rivals compiled (``--compile``) and plain FSDP2 (``fsdp``) in the benchmark harness.

1. Compiling a rival does not change it: on a real gloo group, each rival with every transformer block under
   torch.compile gives the loss and the gradients of the same rival uncompiled (fp32, same weights and batch, full
   activation checkpointing, tight tolerance), and both are the unsharded model's (``fsdp``: on the global batch).
2. Every row carries the keys of ``harness.ROW_KEYS`` (failure rows too), ``compiled`` says what ran, and tokens/s
   per GPU counts a micro-batch per rank for fsdp and one per group otherwise.
3. ``--compile`` is refused for tsp (TSP compiles its own pieces) before anything runs.

The CPU tests compile with the ``aot_eager`` backend (Dynamo + AOT autograd: the graphs Inductor would get, without
its C++ code generation, which takes minutes on two cores; with ``backend="inductor"`` the same checks pass).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_distributed

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--model", "tiny", "--layers", "2", "--seq-len", "64", "--steps", "1", "--warmup", "0", "--device", "cpu"]
# (strategy, compile scope): torchtitan's order for every rival, and TP-SP also with the checkpoint outside
CASES = (("tp", "checkpointed-block"), ("tp_sp", "checkpointed-block"), ("sp", "checkpointed-block"),
         ("fsdp_cp", "checkpointed-block"), ("fsdp", "checkpointed-block"), ("tp_sp", "block"))


def _grads(model) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        key = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
        out[key] = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
    return out


def _reference(ref, ids, targets):
    """(loss, gradients) of the unsharded model on the batch (ids, targets)."""
    import torch.nn.functional as F

    from benchmarks.baselines.common import n_valid

    ref.zero_grad(set_to_none=True)
    logits = ref(ids, torch.arange(ids.shape[1]))
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(0, 1), ignore_index=-100,
                           reduction="sum") / n_valid(targets)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in ref.named_parameters()}


def _compiled_equals_eager(rank: int, world: int, cases, backend: str = "aot_eager") -> None:
    from benchmarks.baselines import build
    from benchmarks.baselines.common import Setup, make_batch
    from benchmarks.baselines.model import Transformer
    from lightning_tsp.models.llama import get_config

    torch.manual_seed(0)
    cfg = get_config("tiny", n_layers=2, n_heads=8, n_kv_heads=4)
    seq = 32
    ref = Transformer(cfg)
    ref.init_weights(seed=3)
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    for strategy, scope in cases:
        grid = dict(tp=2, sp=world // 2) if strategy == "tp_x_sp" else {}
        # SDPA's math kernel: torch 2.13 cannot compile a checkpointed TP block calling SDPA's CPU flash kernel
        # (AOT autograd finds a DeviceMesh among the tensors saved for backward)
        eager = Setup(cfg, strategy, world, rank, seq, device="cpu", autocast=False, checkpointing="full",
                      optimizer="forloop", sdpa_backend="math", **grid)
        compiled = replace(eager, compile=True, compile_backend=backend, compile_scope=scope)
        runners = [build(s, full_state=state) for s in (eager, compiled)]
        assert not isinstance(runners[0].model.layers["0"], torch._dynamo.eval_frame.OptimizedModule)
        assert any(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in runners[1].model.modules())
        losses = [r.forward_backward() for r in runners]
        label = f"{strategy} ({scope})"
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, msg=f"{label} compiled loss")
        g_eager, g_compiled = (_grads(r.model) for r in runners)
        assert g_compiled.keys() == g_eager.keys()
        for key, g in g_eager.items():
            torch.testing.assert_close(g_compiled[key], g, rtol=1e-5, atol=1e-6, msg=f"{label} compiled grad {key}")
        # and both are the unsharded model's (fsdp: data parallel, on the global batch of `world` sequences)
        batch = make_batch(replace(eager, micro_batch=world if strategy == "fsdp" else 1))
        ref_loss, ref_grads = _reference(ref, *batch)
        torch.testing.assert_close(losses[1], ref_loss, rtol=1e-5, atol=1e-5, msg=f"{label} loss")
        for key, g in ref_grads.items():
            torch.testing.assert_close(g_compiled[key], g, rtol=1e-4, atol=1e-5, msg=f"{label} grad {key}")
        runners[1].optimizer.step()


@pytest.mark.timeout(300)
def test_compiled_rivals_match_eager_rivals_on_gloo():
    """2 processes: tp, tp_sp, sp, fsdp_cp and fsdp compiled (torchtitan's order; tp_sp also with the checkpoint
    outside) == uncompiled == the unsharded model."""
    run_distributed(_compiled_equals_eager, 2, CASES, timeout=290)


@pytest.mark.timeout(300)
def test_compiled_tp_x_sp_matches_eager_on_gloo():
    """4 processes, T x S = 2 x 2, compiled the torchtitan way (the checkpointed block)."""
    run_distributed(_compiled_equals_eager, 4, (("tp_x_sp", "checkpointed-block"),), timeout=290)


def _harness(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_rows_carry_every_key_compiled_and_tokens_per_gpu(tmp_path):
    from benchmarks.harness import ROW_KEYS

    jsonl = tmp_path / "rows.jsonl"
    compiled = _harness(["--sweep", "tp_sp", "fsdp", "--world", "2", "--micro-batch", "2", "--in-process", "--compile",
                         "--compile-backend", "aot_eager", "--compile-scope", "block", "--jsonl", str(jsonl), *TINY])
    assert compiled.returncode == 0, compiled.stderr[-4000:]
    eager = _harness(["--sweep", "tsp", "--world", "2", "--in-process", "--jsonl", str(jsonl), *TINY])
    assert eager.returncode == 0, eager.stderr[-4000:]
    # a child that fails (seq 66 is no multiple of 2 * D for sp): the row says why and still has every key
    failed = _harness(["--sweep", "sp:66", "--world", "2", "--jsonl", str(jsonl), *TINY[:4], *TINY[6:]])
    assert failed.returncode == 0, failed.stderr[-4000:]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert [(r["strategy"], r["status"]) for r in rows] == [("tp_sp", "ok"), ("fsdp", "ok"), ("tsp", "ok"),
                                                             ("sp", "error")]
    for r in rows:
        assert not [k for k in ROW_KEYS if k not in r], r
    tp_sp, fsdp, tsp, sp = rows
    assert tp_sp["compiled"] is True and fsdp["compiled"] is True and sp["compiled"] is False
    assert "--compile" in tp_sp["command"] and "--compile-scope block" in fsdp["command"]
    assert tsp["compiled"] is (tsp["fused_elementwise"] != "off")
    assert tp_sp["attention_kernel"] == "sdpa-default" and tsp["attention_kernel"] == "sdpa"  # on CPU
    assert sp["step_s"] is None and sp["tokens_per_s_per_gpu"] is None and "2*D" in sp["error"]
    # tokens per GPU per step: B * S shared by the group of D (tp_sp), B * S on each rank (fsdp)
    assert tp_sp["tokens_per_s_per_gpu"] == pytest.approx(2 * 64 / 2 / tp_sp["step_s"])
    assert fsdp["tokens_per_s_per_gpu"] == pytest.approx(2 * 64 / fsdp["step_s"])
    assert fsdp["model_flops_per_gpu"] == pytest.approx(2 * tp_sp["model_flops_per_gpu"])
    assert fsdp["pred_comm_s"] is not None and fsdp["layout"].startswith("FSDP=2")


def test_compile_refused_for_tsp():
    from benchmarks.baselines import build
    from benchmarks.baselines.common import Setup
    from benchmarks.harness import parse_args, parse_sweep
    from lightning_tsp.models.llama import get_config

    proc = _harness(["--strategy", "tsp", "--compile", *TINY])
    assert proc.returncode == 2
    assert "TSP compiles its own pieces" in proc.stderr and "LIGHTNING_TSP_FUSED" in proc.stderr
    with pytest.raises(SystemExit, match="TSP compiles its own pieces"):
        parse_sweep(["tp_sp:64", "tsp:64"], parse_args(["--sweep", "tp_sp:64", "tsp:64", "--compile"]))
    # no process group exists here: the refusal comes before anything is built
    with pytest.raises(ValueError, match="TSP compiles its own pieces"):
        build(Setup(get_config("tiny"), "tsp", 2, 0, 64, device="cpu", compile=True))
