"""Sharded checkpoints of TSPStrategy: exact resume (same and different tsp size / device count), consolidation,
refusing checkpoints of another model and plain (non-DTensor) tensors.

One D=2 run (2 processes) trains 3 epochs of 2 steps with AdamW and ``ModelCheckpoint`` saving every epoch, then
resumes from the epoch-0 checkpoint: the loss curve must continue exactly as the uninterrupted run (AdamW: a lost
optimizer state changes the next steps). The same checkpoint is then resumed with D=3 (3 processes) and with
dp=2 x D=2 (4 processes; the per-replica batch halves so the global batch is the same samples): DCP reshards the
Shard(dim) weights, the replicated norms and the optimizer state. Consolidation runs in the test process itself,
without any process group, and must reproduce the trained weights bit for bit (also through Hugging Face's
``from_pretrained``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_tsp import TSPConfigError, TSPLlama
from lightning_tsp import checkpoint as ckpt
from lightning_tsp.models.llama import ModelConfig
from tests.reference import assert_close
from tests.test_strategy import LR, RTOL, make_dataset, run_ranks
from tests.test_strategy_eval import lightning_module_class, make_trainer

# divisible by D = 2 and 3 (heads, KV heads, MLP columns, vocabulary); S = 24 = a multiple of 2D for both
CFG = ModelConfig(vocab_size=240, hidden_size=48, n_layers=2, n_heads=12, n_kv_heads=6, intermediate_size=96)
GLOBAL_BATCH = 4
STEPS_PER_EPOCH, EPOCHS = 2, 3
RESUME_FROM = f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
LAST = f"epoch={EPOCHS - 1}-step={STEPS_PER_EPOCH * EPOCHS}.ckpt"


def _data():
    return make_dataset(CFG, GLOBAL_BATCH * STEPS_PER_EPOCH)


def _fit(world_size, tsp_size, tmp, cfg=CFG, ckpt_path=None, callbacks=(), hf_config=None):
    dp = world_size // tsp_size
    trainer = make_trainer(world_size, tsp_size, max_epochs=EPOCHS, callbacks=list(callbacks),
                           enable_checkpointing=bool(callbacks), default_root_dir=tmp)
    module = lightning_module_class()(cfg, optimizer="adamw", hf_config=hf_config)
    trainer.fit(module, train_dataloaders=DataLoader(_data(), batch_size=GLOBAL_BATCH // dp), ckpt_path=ckpt_path)
    return trainer, module


def _full_params(module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor() for n, p in module.model.named_parameters()}  # collective over the TSP group


def _global_curve(module) -> torch.Tensor:
    """The global token-mean loss per step: the mean over all ranks of what each rank's training_step returned
    (a rank's loss is its replica's token-loss sum / (N / dp))."""
    import torch.distributed as dist

    curve = torch.stack(module.losses).double()
    curves = [torch.empty_like(curve) for _ in range(dist.get_world_size())]
    dist.all_gather(curves, curve)
    return torch.stack(curves).mean(0)


def _check_continues(tag, module, tmp, rank):
    """The resumed run's losses and final weights equal the uninterrupted run's (saved by the D=2 run)."""
    import torch.distributed as dist

    full = _full_params(module)
    curve = _global_curve(module)
    assert len(curve) == STEPS_PER_EPOCH * (EPOCHS - 1), f"{tag}: resumed run made {len(curve)} steps"
    if rank == 0:
        want = torch.load(os.path.join(tmp, "uninterrupted.pt"))
        assert_close(f"{tag} resumed loss curve", curve, want["curve"][STEPS_PER_EPOCH:], RTOL)
        for name, value in want["params"].items():
            assert_close(f"{tag} final {name}", full[name], value, RTOL, atol=LR * 1e-2)
    dist.barrier()


def _worker_d2(rank, world_size, tmp, hf_config):
    import torch.distributed as dist
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.distributed.tensor import DTensor

    ckdir = os.path.join(tmp, "ck")
    saver = ModelCheckpoint(dirpath=ckdir, save_top_k=-1, every_n_epochs=1)
    trainer, module = _fit(world_size, 2, tmp, callbacks=[saver], hf_config=hf_config)
    curve = _global_curve(module)
    assert len(curve) == STEPS_PER_EPOCH * EPOCHS
    full = _full_params(module)
    if rank == 0:
        assert curve[-1] < curve[0], "no learning: the resume comparison would prove little"
        torch.save({"curve": curve, "params": full}, os.path.join(tmp, "uninterrupted.pt"))
        for name in (RESUME_FROM, LAST):
            files = sorted(os.listdir(os.path.join(ckdir, name)))
            assert {".metadata", "meta.pt", ckpt.TSP_METADATA_FILENAME, "__0_0.distcp", "__1_0.distcp"} <= set(files)
        meta = ckpt.read_module_metadata(os.path.join(ckdir, LAST))
        assert meta["tsp_size"] == 2 and meta["modules"][0]["prefix"] == "model"
        assert meta["modules"][0]["model_config"] == dataclasses.asdict(CFG)
    # every saved model and optimizer tensor is a DTensor (or a scalar): the strategy's state dicts
    strategy = trainer.strategy
    ckpt.assert_sharded_state(strategy.lightning_module_state_dict(), "state_dict")
    opt_state = strategy.optimizer_state(trainer.optimizers[0])
    ckpt.assert_sharded_state(opt_state, "optimizer")
    assert any(isinstance(v, DTensor) for s in opt_state["state"].values() for v in s.values())
    # a plain per-rank tensor is refused before anything is written (DCP would keep one rank's copy)
    with pytest.raises(TSPConfigError, match="plain \\(4,\\) tensor"):
        strategy.save_checkpoint({"state_dict": {"w": torch.full((4,), float(rank))}}, os.path.join(tmp, "bad"))
    assert not os.path.exists(os.path.join(tmp, "bad"))
    dist.barrier()

    # resume with the same D from the end of epoch 0: the curve continues exactly (optimizer state included)
    _, resumed = _fit(world_size, 2, tmp, ckpt_path=os.path.join(ckdir, RESUME_FROM))
    _check_continues("D=2 -> D=2", resumed, tmp, rank)

    # a checkpoint of another model: a clear error naming the parameter and both shapes, no hang
    other = dataclasses.replace(CFG, intermediate_size=48)
    with pytest.raises(TSPConfigError, match=r"parameter 'model\.model\.layers\.0\.mlp\.[\w.]+' has shape "
                                             r"\((96, 48|48, 96)\) in the checkpoint but \((48, 48)\) in the model"):
        _fit(world_size, 2, tmp, cfg=other, ckpt_path=os.path.join(ckdir, RESUME_FROM))
    deeper = dataclasses.replace(CFG, n_layers=3)
    with pytest.raises(TSPConfigError, match=r"lacks .* tensors, e\.g\. \['model\.model\.layers\.2\."):
        _fit(world_size, 2, tmp, cfg=deeper, ckpt_path=os.path.join(ckdir, RESUME_FROM))
    dist.barrier()


def _worker_resume(rank, world_size, tmp, tsp_size):
    _, resumed = _fit(world_size, tsp_size, tmp, ckpt_path=os.path.join(tmp, "ck", RESUME_FROM))
    _check_continues(f"D=2 -> world={world_size} D={tsp_size}", resumed, tmp, rank)


def _hf_config() -> dict:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=CFG.vocab_size, hidden_size=CFG.hidden_size, intermediate_size=CFG.intermediate_size,
        num_hidden_layers=CFG.n_layers, num_attention_heads=CFG.n_heads, num_key_value_heads=CFG.n_kv_heads,
        rms_norm_eps=CFG.norm_eps, rope_theta=CFG.rope_theta, tie_word_embeddings=False, max_position_embeddings=64,
        architectures=["LlamaForCausalLM"],
    ).to_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The D=2 run (fit + checkpoints + same-D resume + wrong-model errors); returns its directory."""
    tmp = tmp_path_factory.mktemp("tsp_ckpt")
    run_ranks(_worker_d2, 2, str(tmp), _hf_config(), timeout=200.0)
    return tmp


@pytest.mark.timeout(240)
def test_resume_same_tsp_size(trained):
    assert (trained / "uninterrupted.pt").is_file()  # the fixture's workers ran every assertion


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size,tsp_size", [(3, 3), (4, 2)], ids=["D3", "dp2-D2"])
def test_resume_with_another_layout(trained, world_size, tsp_size):
    run_ranks(_worker_resume, world_size, str(trained), tsp_size, timeout=180.0)


@pytest.mark.timeout(120)
def test_consolidation_round_trip(trained, tmp_path):
    from safetensors.torch import load_file

    assert not torch.distributed.is_initialized()
    want = torch.load(trained / "uninterrupted.pt")["params"]
    out = tmp_path / "full"
    path = ckpt.consolidate(trained / "ck" / LAST, out)
    assert path == out / ckpt.MODEL_FILENAME
    state = load_file(str(path))  # plain safetensors, Hugging Face names, no prefix
    assert sorted(state) == sorted(want)
    model = TSPLlama(ModelConfig(**json.loads((out / ckpt.CONFIG_FILENAME).read_text())["model_config"]))
    model.load_state_dict(state, strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, want[name]), f"consolidated {name} differs from the trained weights"

    # Hugging Face: config.json written from the model's hf_config; from_pretrained gives the same weights
    transformers = pytest.importorskip("transformers")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), torch_dtype=torch.float32)
    hf_state = hf.state_dict()
    for name, value in want.items():
        assert torch.equal(hf_state[name], value), name
    ids = torch.randint(0, CFG.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(ids).logits.double(), -1)[0, :-1].gather(1, ids[0, 1:, None])[:, 0]
        ours = -model.token_losses(*model.shard_batch(ids))[0, :-1].double()
    assert_close("HF logprobs of the consolidated model", ours, logprobs, 1e-4)

    # the command line entry point (bf16 cast), and its error exit
    assert ckpt.main([str(trained / "ck" / LAST), str(tmp_path / "cli" / "m.safetensors"), "--dtype", "bfloat16"]) == 0
    cli = load_file(str(tmp_path / "cli" / "m.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in cli.values())
    assert (tmp_path / "cli" / ckpt.HF_CONFIG_FILENAME).is_file()
    assert ckpt.main([str(tmp_path / "missing"), str(tmp_path / "x")]) == 2


# ---- single-process units -------------------------------------------------------------------------------------


def test_assert_sharded_state_refuses_plain_tensors():
    ckpt.assert_sharded_state({"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1}]}, "opt")
    with pytest.raises(TSPConfigError, match=r"optimizer\['state\.0\.exp_avg'\] is a plain \(2, 3\) tensor"):
        ckpt.assert_sharded_state({"state": {0: {"exp_avg": torch.zeros(2, 3)}}}, "optimizer")


def test_check_state_compatible_messages():
    want = {"a.weight": (4, 2), "b.weight": (3,)}
    ckpt.check_state_compatible(want, dict(want), strict=True, source="ck")
    with pytest.raises(TSPConfigError, match=r"'a\.weight' has shape \(8, 2\) in the checkpoint but \(4, 2\)"):
        ckpt.check_state_compatible(want, {"a.weight": (8, 2), "b.weight": (3,)}, strict=False, source="ck")
    with pytest.raises(TSPConfigError, match=r"lacks 1 .*'b\.weight'"):
        ckpt.check_state_compatible(want, {"a.weight": (4, 2)}, strict=True, source="ck")
    ckpt.check_state_compatible(want, {"a.weight": (4, 2)}, strict=False, source="ck")
    with pytest.raises(TSPConfigError, match=r"does not have.*'c'"):
        ckpt.check_state_compatible(want, {**want, "c": (1,)}, strict=True, source="ck")


def test_prefix_inference_without_metadata():
    keys = ["lm.model.embed_tokens.weight", "lm.lm_head.weight", "lm.model.norm.weight"]
    assert ckpt._choose_prefix(keys, None, None) == "lm"
    assert ckpt._choose_prefix(keys, {"modules": [{"prefix": "x"}]}, None) == "x"
    assert ckpt._choose_prefix(keys, None, "given.") == "given"
    with pytest.raises(TSPConfigError, match="pass prefix"):
        ckpt._choose_prefix(["a.weight"], None, None)
