"""Mixture-of-experts models under TSP: the built-in MoE decoder and Hugging Face Mixtral / Qwen3-MoE, exact in
training (loss, load-balancing loss, every gradient), prefill and greedy decoding, on real gloo groups.

* Built-in (fp64): D = 2 and 4 equal D = 1 for both expert schedules and ``"auto"``, top-1 and top-2, Mixtral and
  Qwen3 gating, with a shared expert and a dense layer among MoE layers, with activation checkpointing.
* Hugging Face (fp64 models; Hugging Face runs the router softmax in fp32, hence fp32-level tolerances): the
  converted model's loss, ``aux_loss`` and every gradient equal ``MixtralForCausalLM`` / ``Qwen3MoeForCausalLM``
  (with ``output_router_logits=True``, ``mlp_only_layers``) at D = 1, and the model loaded from their
  ``save_pretrained`` directory (per-expert tensors, each rank reading only its experts) at D = 2 and 4; greedy
  tokens of ``generate`` and of ``lightning-tsp generate`` equal ``model.generate`` at D = 1, 2 and 4.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from lightning_tsp import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.models.llama import ModelConfig, TSPLlama, gather_full, get_config
from lightning_tsp.schedules.comm import local_tensor
from tests.dist_utils import run_distributed
from tests.reference import assert_close, world_tsp

HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None

B, S = 2, 16  # S a multiple of 2D for D = 1, 2, 4
VOCAB = 240


def builtin_configs() -> dict[str, ModelConfig]:
    base = dict(vocab_size=VOCAB, hidden_size=32, n_layers=3, n_heads=4, n_kv_heads=4, intermediate_size=64,
                num_experts=4, moe_intermediate_size=24, router_aux_loss_coef=0.1)
    return {
        # Mixtral gating, top-2, a shared expert, layer 1 dense
        "top2-shared-dense": ModelConfig(**base, num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                         dense_layers=(1,)),
        # Qwen3 gating renormalised, top-1
        "qwen3-top1": ModelConfig(**base, num_experts_per_tok=1, moe_gating="qwen3", norm_topk_prob=True),
    }


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (B, S), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    return ids, labels


def run_builtin(cfg: ModelConfig, tsp: TSPGroup | None, checkpointing: str = "none"):
    """(loss with aux, aux, {name: full gradient}) of the fp64 model on :func:`batch`."""
    model = TSPLlama(cfg, tsp, activation_checkpointing=checkpointing, dtype=torch.float64)
    ids, labels = batch()
    inputs = model.shard_batch(ids, labels)
    loss, aux = model.loss_terms(*inputs)
    (loss + cfg.router_aux_loss_coef * aux).backward()
    t = model.tsp
    grads = {n: gather_full(local_tensor(p.grad), model.shard_dims()[n], t, model.replicas(n))
             for n, p in model.named_parameters()}
    return loss.detach(), aux.detach(), grads


def check_against(tag: str, got, want, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    assert_close(f"{tag} loss", got[0], want[0], rtol)
    assert_close(f"{tag} aux", got[1], want[1], rtol)
    assert set(got[2]) == set(want[2])
    for name, g in want[2].items():
        assert_close(f"{tag} grad {name}", got[2][name], g, rtol, atol=atol)


def _builtin_worker(rank: int, world_size: int, refs: dict) -> None:
    tsp = world_tsp()
    for name, cfg in builtin_configs().items():
        for schedule in ("ring", "dispatch", "auto"):
            for ckpt in ("none", "full", "keep-attention") if schedule == "ring" else ("none",):
                c = dataclasses.replace(cfg, expert_schedule=schedule)
                check_against(f"{name} {schedule} ckpt={ckpt} D={world_size}", run_builtin(c, tsp, ckpt), refs[name])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("d", [2, 4])
def test_builtin_moe_model_matches_unsharded(d):
    refs = {name: run_builtin(cfg, None) for name, cfg in builtin_configs().items()}
    for name, (loss, aux, grads) in refs.items():
        assert aux > 0 and all(g.abs().sum() > 0 for g in grads.values()), f"{name}: a gradient is zero"
    run_distributed(_builtin_worker, d, refs, timeout=240)


def test_builtin_moe_config_and_errors():
    cfg = get_config("tiny-moe")
    model = TSPLlama(cfg)
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    assert cfg.num_active_params() < cfg.num_params()
    mixtral = get_config("mixtral-8x7b")
    assert abs(mixtral.num_params() / 46.70e9 - 1) < 0.01 and abs(mixtral.num_active_params() / 12.88e9 - 1) < 0.01
    qwen = get_config("qwen3-30b-a3b")
    assert abs(qwen.num_params() / 30.53e9 - 1) < 0.01 and abs(qwen.num_active_params() / 3.35e9 - 1) < 0.02
    with pytest.raises(TSPConfigError, match="expert_schedule='fast'"):
        get_config("tiny-moe", expert_schedule="fast")
    with pytest.raises(TSPConfigError, match="dense_layers"):
        get_config("tiny-moe", dense_layers=(5,))
    with pytest.raises(TSPConfigError, match="num_experts=4 is not divisible by tsp_size=3"):  # before any collective
        TSPLlama(get_config("tiny-moe", n_heads=6, n_kv_heads=3, hidden_size=48, vocab_size=255),
                 TSPGroup(group=None, rank=0, size=3), device="meta")


# ---- Hugging Face Mixtral / Qwen3-MoE ---------------------------------------------------------------------------

HF_FAMILIES = {
    "Mixtral": dict(hidden_size=48, intermediate_size=32, num_hidden_layers=2, num_attention_heads=8,
                    num_key_value_heads=4, num_local_experts=4, num_experts_per_tok=2),
    # one dense layer (mlp_only_layers), two KV heads (replicated at D = 4), head_dim != hidden / heads
    "Qwen3Moe": dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                     norm_topk_prob=True, mlp_only_layers=[1]),
}
HF_RTOL = 2e-6  # the router softmax runs in fp32 in Hugging Face
PROMPTS = ([5, 7, 9, 11, 13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [3])
N_NEW = 8


def make_hf(family: str, **overrides):
    import transformers

    torch.manual_seed(len(family))
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=VOCAB, initializer_range=0.2, output_router_logits=True, router_aux_loss_coef=0.05,
        max_position_embeddings=64, experts_implementation="eager", **{**HF_FAMILIES[family], **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(cfg).to(torch.float64)
    with torch.no_grad():  # norms are 1 after init: perturb them so their gradients are tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="module")
def hf_refs(tmp_path_factory):
    """Per family: the save_pretrained directory, HF's loss / aux / gradients on :func:`batch` and greedy tokens."""
    root = tmp_path_factory.mktemp("moe-families")
    out = {}
    for family in HF_FAMILIES:
        hf = make_hf(family)
        path = str(root / family)
        hf.save_pretrained(path)
        ids, labels = batch()
        got = hf(input_ids=ids, labels=labels)
        got.loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in hf.named_parameters()}
        hf.zero_grad()
        hf.eval()
        tokens = []
        for p in PROMPTS:
            gen = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=N_NEW, do_sample=False, output_scores=True, return_dict_in_generate=True)
            tokens.append(gen.sequences[0, len(p):].tolist())
            margin = min((s[0].topk(2).values[0] - s[0].topk(2).values[1]).item() for s in gen.scores)
            assert margin > 1e-3, f"{family}: greedy too close to a tie ({margin:.1e}) to compare tokens"
        out[family] = dict(path=path, loss=got.loss.detach(), aux=got.aux_loss.detach(), grads=grads,
                           tokens=tokens, model=hf.train())
    return out


def check_hf_training(family: str, ref: dict, model) -> None:
    """The converted / loaded model's loss, aux loss and every gradient equal Hugging Face's."""
    tag = f"{family} D={model.tsp.size}"
    ids, labels = batch()
    out = model(input_ids=ids, labels=labels)
    assert_close(f"{tag} loss", out.loss.detach(), ref["loss"], HF_RTOL)
    assert_close(f"{tag} aux_loss", out.aux_loss.detach(), ref["aux"], HF_RTOL)
    out.loss.backward()
    for name, p in model.named_parameters():
        full = gather_full(local_tensor(p.grad), model.shard_dims()[name], model.tsp, model.replicas(name))
        assert_close(f"{tag} grad {name}", full, ref["grads"][name], HF_RTOL, atol=1e-9)


def check_hf_generation(family: str, ref: dict, tsp, rank: int) -> None:
    from lightning_tsp.inference import generate
    from lightning_tsp.inference.loading import load_model
    from tests.test_generate_families import cli_tokens

    tag = f"{family} D={1 if tsp is None else tsp.size}"
    model = load_model(ref["path"], tsp, torch.float64)
    assert model.cfg.num_experts == HF_FAMILIES[family].get("num_local_experts", HF_FAMILIES[family].get("num_experts"))
    got = generate(model, list(PROMPTS), N_NEW).tokens.tolist()
    assert got == ref["tokens"], f"{tag} generate: {got} != HF {ref['tokens']}"
    args = [ref["path"], "--max-new-tokens", str(N_NEW), "--dtype", "float64"]
    for p in PROMPTS:
        args += ["--prompt-ids", " ".join(map(str, p))]
    printed = cli_tokens(args)
    assert rank != 0 or printed == ref["tokens"], f"{tag} CLI: {printed} != HF {ref['tokens']}"
    return model


@pytest.mark.skipif(not HAS_HF, reason="needs transformers and safetensors")
@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_converted_moe_matches_hugging_face(hf_refs, family):
    from lightning_tsp.convert.hf import convert_hf_causal_lm

    ref = hf_refs[family]
    model = convert_hf_causal_lm(ref["model"])
    assert model.cfg.router_aux_loss_coef == 0.05 and model.cfg.n_moe_layers == 2  # Mixtral 2 of 2, Qwen3-MoE 2 of 3
    check_hf_training(family, ref, model)
    check_hf_generation(family, ref, None, 0)


def _hf_worker(rank: int, world_size: int, refs: dict) -> None:
    import torch.distributed as dist

    from lightning_tsp.convert.hf import TSPCausalLM

    tsp = world_tsp()
    for family, ref in refs.items():
        model = TSPCausalLM.from_pretrained(ref["path"], tsp, dtype=torch.float64)
        check_hf_training(family, ref, model)
        check_hf_generation(family, ref, tsp, rank)
    dist.barrier()


@pytest.mark.skipif(not HAS_HF, reason="needs transformers and safetensors")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("d", [2, 4])
def test_sharded_moe_matches_hugging_face(hf_refs, d):
    refs = {f: {k: v for k, v in r.items() if k != "model"} for f, r in hf_refs.items()}
    run_distributed(_hf_worker, d, refs, timeout=240)


@pytest.mark.skipif(not HAS_HF, reason="needs transformers and safetensors")
def test_hugging_face_moe_settings_refused():
    from lightning_tsp.convert.hf import convert_hf_causal_lm

    with pytest.raises(TSPConfigError, match="router_jitter_noise=0.1"):
        convert_hf_causal_lm(make_hf("Mixtral", router_jitter_noise=0.1))
    model = convert_hf_causal_lm(make_hf("Mixtral"))
    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with pytest.raises(TSPConfigError, match="attention_mask with padding and router_aux_loss_coef=0.05"):
        model(input_ids=ids, labels=labels, attention_mask=mask)


def test_strategies_refuse_padding_with_a_load_balancing_loss():
    """The Trainer's and Fabric's batch sharding (shard_global_batch) refuse right padding for a model with a
    load-balancing loss, as TSPCausalLM does (TSP's router statistics would count the padded tokens that Hugging
    Face leaves out); without padding, or without the loss, the batch shards."""
    from lightning_tsp.sharding import models_aux_loss_coef, shard_global_batch

    ids, labels = batch()
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    moe = TSPLlama(dataclasses.replace(builtin_configs()["qwen3-top1"], router_aux_loss_coef=0.05),
                   dtype=torch.float64)
    dense = TSPLlama(ModelConfig(vocab_size=VOCAB, hidden_size=32, n_layers=1, n_heads=4, n_kv_heads=2,
                                 intermediate_size=48), dtype=torch.float64)
    coef = models_aux_loss_coef([("dense", dense), ("moe", moe)])
    assert coef == 0.05 and models_aux_loss_coef([("dense", dense)]) == 0.0
    with pytest.raises(TSPConfigError, match="attention_mask with padding and router_aux_loss_coef=0.05"):
        shard_global_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, TSPGroup.single(), coef)
    shard_global_batch({"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)},
                       TSPGroup.single(), coef)
    out = shard_global_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, TSPGroup.single(), 0.0)
    assert bool((out["targets"][1, -2:] == -100).all())
