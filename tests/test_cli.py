"""The ``lightning-tsp`` CLI, the recipes, TextDataModule, TSPLanguageModel and TSPThroughputMonitor.

The multi-process case runs the console script's module (``python -m lightning_tsp.cli fit``) in a subprocess:
Lightning's subprocess launcher re-runs that command line for the second rank, exactly as for a user.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from lightning.pytorch import Callback

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))
TSP_CLASS = "lightning_tsp.TSPStrategy"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    return env


def print_config(*args: str) -> dict:
    """``lightning-tsp fit ARGS --print_config`` in this process -> the printed config as a dict."""
    from lightning_tsp.cli import lightning_cli

    out = io.StringIO()
    argv, sys.argv = sys.argv, sys.argv[:1]  # LightningCLI warns when both sys.argv and args hold arguments
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
            lightning_cli(["fit", *args, "--print_config"])
    finally:
        sys.argv = argv
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(out.getvalue())


# ---- recipes and --print_config -------------------------------------------------------------------------------


def test_recipes_exist():
    names = {p.name for p in RECIPES}
    assert {"tiny-cpu.yaml", "paper-7b-128k.yaml", "llama3-8b.yaml"} <= names
    assert (ROOT / "recipes" / "slurm" / "tsp.sbatch").is_file()
    assert (ROOT / "recipes" / "torchrun.sh").is_file()
    for script in ("slurm/tsp.sbatch", "torchrun.sh"):
        subprocess.run(["bash", "-n", str(ROOT / "recipes" / script)], check=True)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_print_config_shows_strategy(recipe):
    cfg = print_config("--config", str(recipe))
    strategy = cfg["trainer"]["strategy"]
    assert strategy["class_path"] == TSP_CLASS
    args = strategy["init_args"]
    assert {"tsp_size", "data_parallel_size", "save_distributed_checkpoint", "process_group_backend"} <= set(args)
    raw = yaml.safe_load(recipe.read_text())
    assert args["tsp_size"] == raw["trainer"]["strategy"]["init_args"]["tsp_size"]
    assert cfg["model"]["class_path"] == "lightning_tsp.module.TSPLanguageModel"
    assert cfg["data"]["class_path"] == "lightning_tsp.datamodule.TextDataModule"
    seq, tsp = cfg["data"]["init_args"]["seq_len"], args["tsp_size"]
    assert seq % (2 * tsp) == 0, "the recipe's seq_len must be a multiple of 2 * tsp_size"


def test_paper_recipe_settings():
    cfg = print_config("--config", str(ROOT / "recipes" / "paper-7b-128k.yaml"))
    assert cfg["trainer"]["strategy"]["init_args"]["tsp_size"] == 8
    assert cfg["trainer"]["devices"] == 8 and cfg["trainer"]["precision"] == "bf16-mixed"
    model = cfg["model"]["init_args"]
    assert model["preset"] == "paper-7b" and model["activation_checkpointing"] == "offload"
    assert cfg["data"]["init_args"]["seq_len"] == 131072 and cfg["data"]["init_args"]["batch_size"] == 1
    long = print_config("--config", str(ROOT / "recipes" / "paper-7b-2m.yaml"))
    assert long["model"]["init_args"]["activation_checkpointing"] == "offload"
    assert long["model"]["init_args"]["kv_bucket_heads"] == 1 and long["data"]["init_args"]["seq_len"] == 2097152
    four = print_config("--config", str(ROOT / "recipes" / "paper-7b-4m.yaml"))
    assert four["trainer"]["precision"] == "bf16-true" and four["data"]["init_args"]["seq_len"] == 4194304
    assert four["model"]["init_args"]["activation_checkpointing"] == "full-offload"
    assert four["model"]["init_args"]["overrides"] == {"mlp_activations": "recompute"}


def test_strategy_string_is_expanded(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("trainer:\n  strategy: tsp\n  accelerator: cpu\n")
    cfg = print_config("--config", str(config))
    assert cfg["trainer"]["strategy"]["class_path"] == TSP_CLASS
    assert cfg["trainer"]["strategy"]["init_args"]["tsp_size"] == "auto"
    # on the command line, followed by one of its arguments
    cfg = print_config("--trainer.strategy", "tsp", "--trainer.strategy.tsp_size", "4")
    assert cfg["trainer"]["strategy"] == {**cfg["trainer"]["strategy"], "class_path": TSP_CLASS}
    assert cfg["trainer"]["strategy"]["init_args"]["tsp_size"] == 4
    # default without any strategy given
    assert print_config()["trainer"]["strategy"]["class_path"] == TSP_CLASS


# ---- dispatch -------------------------------------------------------------------------------------------------


def test_plan_imports_no_torch():
    code = (
        "import sys\n"
        "from lightning_tsp.cli import main\n"
        "rc = main(['plan', '--model', 'paper-7b', '--seq-len', '128K', '--gpus', '16', '--gpus-per-node', '8'])\n"
        "heavy = sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'lightning.')))\n"
        "assert rc == 0 and not heavy, heavy\n"
    )
    res = subprocess.run([sys.executable, "-c", code], env=_env(), cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "TSP" in res.stdout


def test_usage_and_missing_module(monkeypatch, capsys):
    from lightning_tsp import cli

    assert cli.main([]) == 0
    usage = capsys.readouterr().out
    for name in ("fit", "validate", "test", "predict", "plan", "demo", "consolidate", "generate"):
        assert name in usage
    assert cli.main(["nope"]) == 2
    monkeypatch.setitem(cli.COMMANDS, "consolidate", ("lightning_tsp._no_such_module", "x"))
    assert cli.main(["consolidate", "a", "b"]) == 1
    assert "no lightning_tsp._no_such_module module" in capsys.readouterr().err


# ---- data module ----------------------------------------------------------------------------------------------


def test_datamodule_packs_and_splits(tmp_path):
    from lightning_tsp.datamodule import TextDataModule

    (tmp_path / "a.txt").write_text("hello world " * 50)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("é" * 100)  # 2 bytes per character
    with open(tmp_path / "c.jsonl", "w") as f:
        for i in range(20):
            f.write(json.dumps({"text": f"line {i}"}) + "\n")
    docs = ["hello world " * 50, "é" * 100] + [f"line {i}" for i in range(20)]
    n_tokens = sum(len(d.encode()) + 1 for d in docs)  # one end-of-text token per document

    dm = TextDataModule(source=[str(tmp_path / "a.txt"), str(tmp_path / "sub"), str(tmp_path / "c.jsonl")],
                        seq_len=32, batch_size=4, val_fraction=0.2)
    dm.setup("fit")
    n = n_tokens // 32
    assert len(dm.dataset) == n and dm.vocab_size == 256
    stream = torch.tensor([t for d in docs for t in (*d.encode(), 0)][: n * 32])
    assert torch.equal(dm.dataset.tokens.reshape(-1), stream)
    train, val = dm.train_set.indices, dm.val_set.indices
    assert len(val) == round(0.2 * n) and sorted(train + val) == list(range(n)) and max(train) < min(val)
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids"} and batch["input_ids"].shape == (4, 32)
    assert len(dm.train_dataloader()) == len(train) // 4  # full micro-batches only
    assert sum(b["input_ids"].shape[0] for b in dm.val_dataloader()) == len(val)


def test_datamodule_stdlib_and_errors(tmp_path):
    from lightning_tsp.datamodule import TextDataModule

    dm = TextDataModule(seq_len=64, batch_size=2, max_tokens=20_000, val_fraction=0.1)
    dm.setup("fit")
    assert len(dm.dataset) >= 20_000 // 64 and dm.dataset.tokens.shape[1] == 64
    assert len(dm.val_set) >= 1
    with pytest.raises(FileNotFoundError):
        TextDataModule(source=str(tmp_path / "missing")).setup("fit")
    with pytest.raises(ValueError):
        TextDataModule(val_fraction=1.0)


# ---- module ---------------------------------------------------------------------------------------------------


def test_module_config_and_schedule():
    from lightning_tsp.module import TSPLanguageModel, warmup_cosine
    from lightning_tsp.models.llama import ModelConfig, TSPLlama

    m = TSPLanguageModel(preset="tiny", overrides={"n_layers": 3}, lr=1e-3, warmup_steps=4)
    assert m.cfg.n_layers == 3 and m.hparams["config"]["n_layers"] == 3 and m.hparams.lr == 1e-3
    m.configure_model()
    assert isinstance(m.model, TSPLlama) and all(p.is_meta for p in m.model.parameters())
    m2 = TSPLanguageModel(config=ModelConfig(hidden_size=32, n_heads=2, n_kv_heads=2), init_on_meta=False)
    m2.configure_model()
    assert m2.model.cfg.hidden_size == 32 and not any(p.is_meta for p in m2.model.parameters())

    assert warmup_cosine(0, 4, 100, 0.1) == pytest.approx(0.2)
    assert warmup_cosine(4, 4, 100, 0.1) == pytest.approx(1.0)
    assert warmup_cosine(52, 4, 100, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(100, 4, 100, 0.1) == pytest.approx(0.1)
    assert warmup_cosine(500, 4, 100, 0.1) == pytest.approx(0.1)
    # weight decay on matrices only
    opt = m2.configure_optimizers()["optimizer"]
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert all((id(p) in decayed) == (p.ndim >= 2) for p in m2.parameters())


# ---- throughput callback --------------------------------------------------------------------------------------


def test_callback_flops_match_planning():
    from lightning_tsp.callbacks import TSPThroughputMonitor, model_flops_per_batch
    from lightning_tsp.models.llama import TSPLlama, get_config
    from lightning_tsp.planning.flops import training_flops
    from lightning_tsp.planning.model import from_config

    cfg = get_config("tiny")
    B, S = 3, 256
    flops = model_flops_per_batch(cfg, B, S)
    assert flops == training_flops(from_config(cfg), B, S)
    # by hand: projections + SwiGLU + LM head, and causal attention counted exactly (S(S+1)/2 pairs)
    h, hd, L = cfg.hidden_size, cfg.head_dim, cfg.n_layers
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    linear = L * 2 * B * S * h * (2 * q + 2 * kv + 3 * cfg.intermediate_size)
    attention = L * 4 * B * cfg.n_heads * hd * (S * (S + 1) // 2)
    head = 2 * B * S * h * cfg.vocab_size
    assert flops["model"] == 3 * (linear + attention + head)
    assert model_flops_per_batch(cfg, B, S, "full")["hardware"] > flops["hardware"]

    # the global batch behind one rank's zigzag slice: D = 2, dp = 3
    module = torch.nn.Module()
    module.model = TSPLlama(cfg, device="meta")
    trainer = SimpleNamespace(strategy=SimpleNamespace(tsp_size=2, data_parallel_size=3), world_size=6)
    local = {"input_ids": torch.zeros(B, S // 2, dtype=torch.long)}
    tokens, batch_flops = TSPThroughputMonitor().batch_stats(trainer, module, local)
    assert tokens == B * S * 3
    assert batch_flops == flops["model"] * 3


# ---- fit on 2 CPU processes -----------------------------------------------------------------------------------


def test_fit_moe_recipe_two_processes(tmp_path):
    """The mixture-of-experts recipe trains on 2 CPU processes and logs the load-balancing loss."""
    cmd = [
        sys.executable, "-m", "lightning_tsp.cli", "fit", "--config", str(ROOT / "recipes" / "tiny-moe-cpu.yaml"),
        "--trainer.max_steps=3", "--trainer.log_every_n_steps=1", "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={tmp_path}", "--data.seq_len=64", "--data.max_tokens=100000",
        "--model.warmup_steps=0",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    rows = list(csv.DictReader(next(tmp_path.rglob("metrics.csv")).open()))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    aux = [float(r["train_aux_loss"]) for r in rows if r.get("train_aux_loss")]
    assert len(losses) == 3 and len(aux) == 3
    # an untrained byte model: log(256) plus 0.01 x the load-balancing loss (top_k = 2 when perfectly balanced)
    assert all(1.0 < a < 4.0 for a in aux) and losses[0] == pytest.approx(math.log(256) + 0.01 * aux[0], rel=0.05)


class RecordSampler(Callback):
    """Writes each rank's training sampler split (num_replicas, rank) next to the logs (used by the fit test)."""

    def on_train_start(self, trainer, pl_module):
        sampler = trainer.train_dataloader.sampler
        out = {"global_rank": trainer.global_rank, "sampler": type(sampler).__name__,
               "num_replicas": getattr(sampler, "num_replicas", None), "rank": getattr(sampler, "rank", None)}
        path = Path(trainer.default_root_dir) / f"sampler-{trainer.global_rank}.json"
        path.write_text(json.dumps(out))


def test_fit_tiny_recipe_two_processes(tmp_path):
    cmd = [
        sys.executable, "-m", "lightning_tsp.cli", "fit", "--config", str(ROOT / "recipes" / "tiny-cpu.yaml"),
        "--trainer.max_steps=5", "--trainer.log_every_n_steps=1", "--trainer.val_check_interval=5",
        "--trainer.limit_val_batches=2", f"--trainer.default_root_dir={tmp_path}",
        "--trainer.callbacks+=tests.test_cli.RecordSampler",
        "--data.seq_len=64", "--data.max_tokens=100000", "--model.warmup_steps=0",
    ]
    res = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    assert "Trainer.fit` stopped: `max_steps=5` reached" in res.stdout + res.stderr
    # the throughput monitor's lines (rank 0 only)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert any(ln.startswith("step     5/5") and "tok/s" in ln for ln in lines), res.stdout[-2000:]

    metrics_files = list(tmp_path.rglob("metrics.csv"))
    assert len(metrics_files) == 1
    rows = list(csv.DictReader(metrics_files[0].open()))
    losses = [float(r["train_loss"]) for r in rows if r.get("train_loss")]
    assert len(losses) == 5 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(256), rel=0.05)  # untrained byte model
    val = [float(r["val_loss"]) for r in rows if r.get("val_loss")]
    assert val and all(math.isfinite(x) for x in val)
    ppl = [float(r["val_ppl"]) for r in rows if r.get("val_ppl")]
    assert ppl and ppl[-1] == pytest.approx(math.exp(val[-1]), rel=1e-6)  # both from the same token statistics
    tps = [float(r["throughput/tokens_per_sec"]) for r in rows if r.get("throughput/tokens_per_sec")]
    assert tps and all(x > 0 for x in tps)
    assert any(r.get("memory/peak_rss_gb/rank1") for r in rows)

    # TextDataModule's resumable sampler (kept by Lightning: a DistributedSampler) over the data-parallel axis
    # only: D = 2, dp = 1 -> both ranks of the TSP group read the same samples
    samplers = [json.loads((tmp_path / f"sampler-{r}.json").read_text()) for r in (0, 1)]
    for s in samplers:
        assert s["sampler"] == "ResumableDistributedSampler" and s["num_replicas"] == 1 and s["rank"] == 0
    config = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert config["trainer"]["strategy"]["class_path"] == TSP_CLASS
