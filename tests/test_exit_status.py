"""Every torchrun launch of the generation CLI exits with status 0 after printing all its tokens.

Before the fix about one run in three printed the right tokens and then aborted at interpreter exit ("terminate
called without an active exception", SIGABRT in a gloo worker thread; see :mod:`lightning_tsp.teardown`). The
CLI runs 10 times at D = 2 and 10 times at D = 3 on a tiny Hugging Face Llama directory; every run must exit 0 and
print the tokens of the unsharded model.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_tsp.inference import cli

ROOT = Path(__file__).resolve().parents[1]
RUNS = 10
PROMPT = "1 2 3 4 5"
N_NEW = 3

pytestmark = pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers not installed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A one-layer Llama (GQA 2:1; heads divisible by 2 and 3) and the tokens the unsharded model generates."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=48, num_hidden_layers=1, num_attention_heads=12,
                         num_key_value_heads=6, intermediate_size=48, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("hf") / "llama"
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def _expected(model_dir: Path, capsys) -> str:
    args = [str(model_dir), "--prompt-ids", PROMPT, "--max-new-tokens", str(N_NEW), "--tokenizer", "bytes"]
    assert cli.main(args) == 0  # D = 1: the unsharded model
    line = capsys.readouterr().out.strip()
    assert len(line.split()) == N_NEW
    return line


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.timeout(600)
def test_every_launch_exits_zero(model_dir, capsys, d):
    want = _expected(model_dir, capsys)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    failures = []
    for run in range(RUNS):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(d), "--master-port",
               str(_free_port()), "-m", "lightning_tsp.inference.cli", str(model_dir), "--prompt-ids", PROMPT,
               "--max-new-tokens", str(N_NEW), "--tokenizer", "bytes", "--device", "cpu"]
        res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        if res.returncode != 0 or res.stdout.strip() != want:
            failures.append(f"run {run}: exit {res.returncode}, stdout {res.stdout.strip()!r} (want {want!r})\n"
                            f"{res.stderr[-1500:]}")
    assert not failures, f"{len(failures)} of {RUNS} launches at D={d} failed:\n" + "\n".join(failures)
