"""Hugging Face Llama-family causal LMs under TSP: config mapping, refusals, the conversion plan (exact at D=1),
slice-wise loading of sharded safetensors checkpoints at D=2, and an unchanged ``self.model(**batch).loss``
LightningModule trained by ``Trainer(strategy=TSPStrategy(tsp_size=2))``."""

from __future__ import annotations

import copy
import importlib.util
import os
from datetime import timedelta

import pytest
import torch
import torch.nn as nn

HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers and safetensors")

from lightning_tsp import TSPConfigError  # noqa: E402
from lightning_tsp import convert as convert_pkg  # noqa: E402
from lightning_tsp.convert import convert_modules, register_conversion  # noqa: E402
from lightning_tsp.models.llama import ModelConfig  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.reference import assert_close, batch, full_grads, world_tsp  # noqa: E402

B, S = 2, 24
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3")
HF_RTOL = 2e-6  # Hugging Face's RMSNorm computes in fp32 even in an fp64 model


def hf_config(family: str, **overrides):
    import transformers

    args = dict(vocab_size=240, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=50000.0, max_position_embeddings=4 * S,
                initializer_range=0.05)
    if family == "Qwen3":
        args["head_dim"] = 12  # != hidden / heads
    if family == "Mistral":
        args["sliding_window"] = S  # a window as long as the sequence changes nothing: accepted
    args.update(overrides)
    cfg = getattr(transformers, f"{family}Config")(**args)
    cfg._attn_implementation = "sdpa"  # eager does its softmax in fp32
    return cfg


def hf_model(family: str, dtype=torch.float64, seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(hf_config(family, **overrides)).to(dtype)
    with torch.no_grad():  # norms are 1 and biases 0 after init: perturb them so their gradients are tested
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def convert_one(module: nn.Module):
    holder = nn.Module()
    holder.lm = module
    assert convert_modules(holder) == ["lm"]
    return holder.lm


# ---- config mapping ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_config_mapping(family):
    from lightning_tsp.convert.hf import HFModelConfig, model_config_from_hf

    hf = hf_config(family, tie_word_embeddings=family == "Qwen3")
    cfg = model_config_from_hf(hf)
    assert isinstance(cfg, HFModelConfig) and cfg.hf_config is hf
    expected = dict(vocab_size=240, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=96,
                    rope_theta=50000.0, norm_eps=1e-5, tie_embeddings=family == "Qwen3", init_std=0.05,
                    head_dim=12 if family == "Qwen3" else 8, attention_bias=family == "Qwen2",
                    qk_norm=family == "Qwen3", sliding_window=None, attention_dropout=0.0, pretrained_path=None)
    got = {k: getattr(cfg, k) for k in expected}
    if family == "Mistral":
        expected["sliding_window"] = S
    assert got == expected


def test_config_mapping_older_transformers_fields():
    """transformers 4 keeps rope_theta / rope_scaling as plain attributes (no rope_parameters)."""
    from types import SimpleNamespace

    from lightning_tsp.convert.hf import model_config_from_hf

    old = SimpleNamespace(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=None, rope_theta=500000.0,
                          rope_scaling=None, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu")
    cfg = model_config_from_hf(old)
    assert (cfg.rope_theta, cfg.n_kv_heads, cfg.head_dim, cfg.tie_embeddings) == (500000.0, 4, 8, True)
    old.rope_scaling = {"type": "dynamic", "factor": 2.0}
    with pytest.raises(TSPConfigError, match="rope_scaling.*'dynamic'"):
        model_config_from_hf(old)


# scaled RoPE whose angles depend on the current sequence length, or that TSP does not know (llama3, linear and
# yarn are supported: tests/test_rope_scaling.py)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 16, "rope_theta": 1e4}


@pytest.mark.parametrize(
    "family, overrides, match",
    [
        ("Llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_type'\]='dynamic'.*CURRENT"),
        ("Qwen2", {"rope_parameters": {"type": "dynamic", "factor": 4.0, "rope_theta": 1e4}}, "'dynamic'"),
        ("Llama", {"rope_parameters": LONGROPE}, r"rope_type'\]='longrope'"),
        ("Qwen3", {"rope_parameters": {"rope_type": "proportional", "rope_theta": 1e4}}, "'proportional'"),
        ("Llama", {"mlp_bias": True}, "mlp_bias=True"),
        ("Llama", {"attention_bias": True}, "o_proj"),
        ("Qwen3", {"attention_bias": True}, "o_proj"),
        ("Mistral", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ],
)
def test_unsupported_settings_raise(family, overrides, match):
    from lightning_tsp.convert.hf import model_config_from_hf

    with pytest.raises(TSPConfigError, match=match):
        model_config_from_hf(hf_config(family, **overrides))
    with pytest.raises(TSPConfigError, match=match):  # the conversion plan refuses the model itself
        convert_one(hf_model(family, dtype=torch.float32, **overrides))


def test_sliding_window_and_dropout_are_checked_when_they_would_apply():
    ids, labels = batch(ModelConfig(vocab_size=240), B, S)
    # Mistral: a window shorter than the sequence
    model = convert_one(hf_model("Mistral", sliding_window=S - 1))
    with pytest.raises(TSPConfigError, match=f"sliding_window={S - 1}"):
        model(input_ids=ids, labels=labels)
    with pytest.raises(TSPConfigError, match="sliding_window"):  # the strategy's sharded kwargs too
        model(*model.shard_batch(ids, labels))
    # Qwen2: use_sliding_window with a sliding layer (layer 1 >= max_window_layers)
    model = convert_one(hf_model("Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1))
    with pytest.raises(TSPConfigError, match="sliding_window=8"):
        model(input_ids=ids, labels=labels)
    # ... but no layer slides when max_window_layers >= num_hidden_layers
    model = convert_one(hf_model("Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2))
    assert model.cfg.sliding_window is None
    # attention dropout: refused in training, fine in eval
    model = convert_one(hf_model("Llama", attention_dropout=0.1))
    model.train()
    with pytest.raises(TSPConfigError, match="attention_dropout=0.1"):
        model(input_ids=ids, labels=labels)
    model.eval()
    assert torch.isfinite(model(input_ids=ids, labels=labels).loss)


def test_unsupported_hugging_face_models_are_rejected():
    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                bos_token_id=0, eos_token_id=0))
    gpt2.requires_grad_(False)  # even frozen: it would run on 1/D of every sequence
    with pytest.raises(TSPConfigError, match=r"GPT2LMHeadModel.*register_conversion"):
        convert_one(gpt2)
    bare = transformers.LlamaModel(hf_config("Llama"))  # no LM head: not a causal LM TSP can compute the loss of
    with pytest.raises(TSPConfigError, match=r"LlamaModel.*register_conversion"):
        convert_one(bare)

    class MyLlama(transformers.LlamaForCausalLM):
        pass

    with pytest.raises(TSPConfigError, match=r"MyLlama.*subclasses LlamaForCausalLM"):
        convert_one(MyLlama(hf_config("Llama")))


def test_modified_models_are_rejected():
    model = hf_model("Llama", dtype=torch.float32)
    model.model.layers[0].self_attn.q_proj.lora_A = nn.Linear(32, 2, bias=False)  # an adapter
    with pytest.raises(TSPConfigError, match="lora_A"):
        convert_one(model)


def test_register_conversion_for_own_architectures(monkeypatch):
    import transformers

    from lightning_tsp.convert.hf import TSPCausalLM, convert_hf_causal_lm

    convert_pkg._load_builtins()
    monkeypatch.setattr(convert_pkg, "_PLANS", list(convert_pkg._PLANS))  # registrations do not leak

    class MyLlama(transformers.LlamaForCausalLM):  # forward unchanged: the built-in converter fits
        pass

    register_conversion(lambda m: isinstance(m, MyLlama), convert_hf_causal_lm)
    assert isinstance(convert_one(MyLlama(hf_config("Llama"))), TSPCausalLM)

    class TinyLM(nn.Module):  # a user architecture with Llama math and its own parameter names
        def __init__(self):
            super().__init__()
            self.cfg = ModelConfig(vocab_size=64, hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                   intermediate_size=64)
            self.emb = nn.Parameter(torch.randn(64, 32))

    def tiny_to_tsp(module: TinyLM) -> TSPCausalLM:
        new = TSPCausalLM(module.cfg)  # unsharded (tsp=None); here a random init, then the user's weights
        with torch.no_grad():
            new.model.embed_tokens.weight.copy_(module.emb)
        return new

    register_conversion(lambda m: isinstance(m, TinyLM), tiny_to_tsp)
    tiny = TinyLM()
    converted = convert_one(tiny)
    assert isinstance(converted, TSPCausalLM) and torch.equal(converted.model.embed_tokens.weight, tiny.emb)
    # a user plan for a module INSIDE an otherwise unsupported Hugging Face model lets conversion reach it
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                bos_token_id=0, eos_token_id=0))
    gpt2.transformer.h[0] = TinyLM()
    holder = nn.Module()
    holder.lm = gpt2
    assert convert_modules(holder) == ["lm.transformer.h.0"]


# ---- numerical equivalence at D = 1 ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_model_matches_hugging_face(family):
    """Loss and every gradient of the converted model equal Hugging Face's (fp64; tied embeddings on Qwen3)."""
    from lightning_tsp.convert.hf import TSPCausalLM

    hf = hf_model(family, tie_word_embeddings=family == "Qwen3")
    ref = copy.deepcopy(hf)
    embed = hf.model.embed_tokens.weight
    model = convert_one(hf)
    assert type(model) is TSPCausalLM and model.tsp.size == 1 and model.hf_config is hf.config
    assert model.model.embed_tokens.weight is embed  # the same tensors, not a copy
    ids, labels = batch(model.cfg, B, S)

    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    got = model(input_ids=ids, labels=labels)  # a global Hugging Face batch
    got.loss.backward()
    assert got.logits is None
    assert_close(f"{family} loss", got.loss.detach(), want.loss.detach(), HF_RTOL)
    grads = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    assert set(grads) == set(ref_params)
    for name, p in ref_params.items():
        assert_close(f"{family} grad {name}", grads[name].grad, p.grad, HF_RTOL)
    # the strategy's keyword arguments (sharded batch) give the same loss
    i, t, p = model.shard_batch(ids, labels)
    again = model(input_ids=i, targets=t, position_ids=p, num_valid_tokens=None).loss
    assert_close(f"{family} loss (strategy kwargs)", again.detach(), got.loss.detach(), 1e-12)
    # right padding via attention_mask = ignored labels
    mask = torch.ones_like(ids)
    mask[1, S - 5:] = 0
    padded = model(input_ids=ids, labels=labels, attention_mask=mask).loss
    want_padded = ref(input_ids=ids, labels=labels.masked_fill(mask == 0, -100)).loss
    assert_close(f"{family} padded loss", padded.detach(), want_padded.detach(), HF_RTOL)


def test_meta_model_converts_on_meta_and_inits_randomly():
    import transformers

    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(hf_config("Llama"))
    model = convert_one(hf)
    assert all(p.is_meta for p in model.parameters()) and model.cfg.pretrained_path is None
    assert model.cfg.init_std == 0.05  # HF initializer_range


# ---- pretrained weights, sliced, D = 2 ------------------------------------------------------------------------


def _save(model, path: str, shard: str) -> None:
    import logging

    logging.getLogger("transformers").setLevel(logging.ERROR)
    model.save_pretrained(path, max_shard_size=shard)


def _counting_open(counter: dict):
    from lightning_tsp.convert import hf as hf_mod

    real = hf_mod._safe_open

    class Slice:
        def __init__(self, inner):
            self.inner = inner

        def get_shape(self):
            return self.inner.get_shape()

        def __getitem__(self, index):
            out = self.inner[index]
            counter["elements"] += out.numel()
            return out

    class Handle:
        def __init__(self, file):
            self.inner = real(file)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return Slice(self.inner.get_slice(name))

        def get_tensor(self, name):
            raise AssertionError("whole tensors must not be read")

    hf_mod._safe_open = Handle


def _shards_worker(rank: int, world_size: int, path: str) -> None:
    import transformers

    from lightning_tsp.convert.hf import TSPCausalLM

    tsp = world_tsp()
    counter = {"elements": 0}
    _counting_open(counter)
    model = TSPCausalLM.from_pretrained(path, tsp, dtype=torch.float64)
    assert model.tsp.size == 2 and model.cfg.tie_embeddings
    # each rank read exactly its own slices: 1/D of every sharded weight (plus the small replicated norms)
    assert counter["elements"] == sum(p.numel() for p in model.parameters()), counter
    sharded = sum(p.numel() for n, p in model.named_parameters() if model.shard_dims()[n] is not None)
    assert sharded * world_size > 0.9 * model.cfg.num_params()

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    hf.config._attn_implementation = "sdpa"
    full = hf.state_dict()
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), model.local_slice(name, full[name])), name

    ids, labels = batch(model.cfg, B, S)
    loss = model(**dict(zip(("input_ids", "targets", "position_ids"), model.shard_batch(ids, labels)))).loss
    loss.backward()
    want = hf(input_ids=ids, labels=labels)
    want.loss.backward()
    assert_close(f"rank {rank} loss vs HF", loss.detach(), want.loss.detach(), HF_RTOL)
    grads = full_grads(model)
    for name, p in hf.named_parameters():
        assert_close(f"rank {rank} grad {name} vs HF", grads[name], p.grad, HF_RTOL)
    # the MLP ring recomputing its pre-activations: the same function through the same entry point
    lean = TSPCausalLM.from_pretrained(path, tsp, dtype=torch.float64, mlp_activations="recompute")
    assert lean.cfg.mlp_activations == "recompute" and lean.model.layers[0].mlp.recompute
    loss = lean(**dict(zip(("input_ids", "targets", "position_ids"), lean.shard_batch(ids, labels)))).loss
    loss.backward()
    assert_close(f"rank {rank} recompute loss vs HF", loss.detach(), want.loss.detach(), HF_RTOL)
    grads = full_grads(lean)
    for name, p in hf.named_parameters():
        assert_close(f"rank {rank} recompute grad {name} vs HF", grads[name], p.grad, HF_RTOL)

    # the strategy path: a meta Hugging Face model built from the directory's config converts on meta, remembers
    # the directory, and the shards TSPStrategy builds from it load their slices in init_weights()
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    converted = convert_one(meta)
    assert converted.cfg.pretrained_path == path and all(p.is_meta for p in converted.parameters())
    counter["elements"] = 0
    shards = type(converted)(converted.cfg, tsp, device="meta", dtype=torch.float64)  # as TSPStrategy does
    shards.to_empty(device="cpu")
    shards.init_weights()
    assert counter["elements"] == sum(p.numel() for p in shards.parameters())
    for name, p in shards.named_parameters():
        assert torch.equal(p, model.get_parameter(name)), name


@pytest.mark.timeout(120)
def test_load_pretrained_shards_reads_only_this_ranks_slices(tmp_path):
    path = str(tmp_path / "qwen2")
    _save(hf_model("Qwen2", dtype=torch.float32, tie_word_embeddings=True), path, "20KB")
    files = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(files) >= 3 and "model.safetensors.index.json" in os.listdir(path), files
    run_distributed(_shards_worker, 2, path, timeout=100.0)


def test_load_errors(tmp_path):
    from lightning_tsp.convert.hf import TSPCausalLM, load_pretrained_shards

    with pytest.raises(TSPConfigError, match="no \\*.safetensors"):
        load_pretrained_shards(TSPCausalLM(ModelConfig()), tmp_path)
    path = str(tmp_path / "llama")
    _save(hf_model("Llama", dtype=torch.float32), path, "5GB")
    other = TSPCausalLM(ModelConfig(vocab_size=240, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                    intermediate_size=64))
    with pytest.raises(TSPConfigError, match="mlp.*shape"):
        load_pretrained_shards(other, path)
    deeper = TSPCausalLM(ModelConfig(vocab_size=240, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=2,
                                     intermediate_size=96))
    with pytest.raises(TSPConfigError, match="lacks"):
        load_pretrained_shards(deeper, path)


# ---- end to end: Trainer + TSPStrategy(tsp_size=2) + an unchanged Hugging Face LightningModule --------------


SGD_LR, STEPS = 0.5, 4


def _hf_lightning_module(path: str, on_meta: bool):
    import transformers
    from lightning.pytorch import LightningModule

    class HFLanguageModel(LightningModule):
        def __init__(self):
            super().__init__()
            # materialised in __init__ (every rank loads the full model), or built on meta in configure_model
            self.model = None if on_meta else transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
            self.losses: list[torch.Tensor] = []

        def configure_model(self):
            if self.model is None:
                config = transformers.AutoConfig.from_pretrained(path)
                with torch.device("meta"):
                    self.model = transformers.AutoModelForCausalLM.from_config(config)

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss  # unchanged single-device Hugging Face code
            self.losses.append(loss.detach().clone())
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=SGD_LR, momentum=0.9)

    return HFLanguageModel()


def _hf_reference_curve(path: str, data) -> torch.Tensor:
    """Single-process training of the Hugging Face model itself on the global batches Lightning will draw."""
    import transformers
    from torch.utils.data import DistributedSampler

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=SGD_LR, momentum=0.9)
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0))
    losses = []
    for step in range(STEPS):
        idx = order[step * B:(step + 1) * B]
        loss = model(input_ids=torch.stack([data[i]["input_ids"] for i in idx]),
                     labels=torch.stack([data[i]["labels"] for i in idx])).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


def _trainer_worker(rank: int, world_size: int, path: str, want: torch.Tensor) -> None:
    from lightning.pytorch import Trainer
    from torch.utils.data import DataLoader

    from lightning_tsp.convert.hf import TSPCausalLM
    from lightning_tsp.strategy import TSPStrategy
    from tests.test_strategy import make_dataset

    os.environ["HF_HUB_OFFLINE"] = "1"
    data = make_dataset(None, B * STEPS)
    for on_meta in (False, True):
        trainer = Trainer(
            strategy=TSPStrategy(tsp_size=2, timeout=timedelta(seconds=60)), accelerator="cpu", devices=world_size,
            max_steps=STEPS, precision="32-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        )
        module = _hf_lightning_module(path, on_meta)
        trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=B, shuffle=False))
        model = module.model
        assert isinstance(model, TSPCausalLM) and model.tsp.size == 2 and trainer.global_step == STEPS
        assert model.cfg.pretrained_path == (path if on_meta else None)
        got = torch.stack(module.losses)
        assert_close(f"rank {rank} meta={on_meta} loss curve vs Hugging Face", got, want, 1e-5)


@pytest.mark.timeout(180)
def test_trainer_fits_hugging_face_llama_like_single_process(tmp_path):
    from tests.test_strategy import make_dataset, run_ranks

    path = str(tmp_path / "llama")
    _save(hf_model("Llama", dtype=torch.float32), path, "30KB")  # GQA 4/2, untied, sharded checkpoint
    want = _hf_reference_curve(path, make_dataset(None, B * STEPS))
    assert want[-1] < want[0], "the reference did not learn: the comparison proves nothing"
    run_ranks(_trainer_worker, 2, path, want, timeout=160.0)


def _family_shapes(d: int) -> dict:
    """GQA whose heads and KV heads divide D (D = 3: 6 heads of 8 over 3 KV heads)."""
    return {} if d == 2 else dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3)


def _families_train_worker(rank: int, world_size: int, root: str) -> None:
    import transformers

    from lightning_tsp.convert.hf import TSPCausalLM

    tsp = world_tsp()
    for family in FAMILIES:
        path = os.path.join(root, family)
        model = TSPCausalLM.from_pretrained(path, tsp, dtype=torch.float64)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
        hf.config._attn_implementation = "sdpa"
        ids, labels = batch(model.cfg, B, S)
        loss = model(**dict(zip(("input_ids", "targets", "position_ids"), model.shard_batch(ids, labels)))).loss
        loss.backward()
        want = hf(input_ids=ids, labels=labels)
        want.loss.backward()
        tag = f"{family} D={world_size} rank {rank}"
        assert_close(f"{tag} loss vs HF", loss.detach(), want.loss.detach(), HF_RTOL)
        grads = full_grads(model)
        for name, p in hf.named_parameters():
            assert_close(f"{tag} grad {name} vs HF", grads[name], p.grad, HF_RTOL)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("d", [2, 3])
def test_every_family_trains_like_hugging_face(d, tmp_path):
    """Loss and every gradient of each family loaded with from_pretrained at D = 2 and 3 (GQA; Qwen2's biases and
    Qwen3's q/k norms with tied embeddings perturbed away from their init) equal Hugging Face's on the full batch."""
    for family in FAMILIES:
        _save(hf_model(family, tie_word_embeddings=family == "Qwen3", **_family_shapes(d)), str(tmp_path / family),
              "10MB")
    run_distributed(_families_train_worker, d, str(tmp_path), timeout=180.0)
