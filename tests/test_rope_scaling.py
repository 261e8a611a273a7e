"""Scaled RoPE (``linear``, ``llama3``, ``yarn``): cos/sin equal Hugging Face's rotary embedding classes; a
Llama-3.1-style and a Qwen YaRN-style model train exactly (loss and every gradient vs Hugging Face at D=1, vs the
D=1 TSP model at D=2 on gloo) on sequences longer than the original context; greedy generation equals
``generate(do_sample=False)`` at D=1 and D=2; length-dependent and unknown types are refused by name."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math

import pytest
import torch

HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers and safetensors")

from lightning_tsp import TSPConfigError, TSPLlama  # noqa: E402
from lightning_tsp.layers.rope import apply_rope, apply_rope_backward, rope_cos_sin, validate_rope_scaling  # noqa: E402
from lightning_tsp.models.llama import ModelConfig  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.reference import assert_close, batch, full_grads, world_tsp  # noqa: E402

HF_RTOL = 2e-6  # Hugging Face's RMSNorm computes in fp32 even in an fp64 model
B, S = 2, 64  # twice ORIG: half the positions lie past the original context
ORIG = 32

# Llama 3.1's published scaling (factor 8, low 1, high 4) on a short original context; head_dim 16 and theta 1e4
# give wavelengths 6.3 (< ORIG/4 = 8: kept), 19.9 (between: blended) and >= 63 (> ORIG: divided by 8).
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIG, "rope_theta": 10000.0}
# Qwen2.5 / Qwen3 model cards: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "rope_theta": 10000.0}
MODELS = {  # (Qwen3: q/k norms; max_position_embeddings = factor * original, as in the model cards)
    "llama3": ("Llama", dict(rope_parameters=LLAMA3, head_dim=16, max_position_embeddings=8 * ORIG)),
    "yarn": ("Qwen3", dict(rope_parameters=YARN, head_dim=16, max_position_embeddings=4 * ORIG)),
}


def hf_rotary(family: str, **overrides):
    """Hugging Face's own rotary embedding module for a config."""
    import transformers

    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, **overrides)
    module = importlib.import_module(f"transformers.models.{family.lower()}.modeling_{family.lower()}")
    return cfg, getattr(module, f"{family}RotaryEmbedding")(cfg)


def model_pair(name: str, weight_std: float | None = None):
    """(the fp64 Hugging Face model, its converted TSP copy at D=1) with identical weights; ``weight_std`` redraws
    the matrices with a larger std (spread-out logits: greedy choices far from ties)."""
    from tests.test_convert import convert_one, hf_model

    family, overrides = MODELS[name]
    hf = hf_model(family, **copy.deepcopy(overrides))
    if weight_std is not None:
        with torch.no_grad():
            g = torch.Generator().manual_seed(11)
            for p in hf.parameters():
                if p.dim() == 2:
                    p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * weight_std)
    ref = copy.deepcopy(hf)
    return ref, convert_one(hf)


# ---- cos / sin against Hugging Face ------------------------------------------------------------------------------

ROTARY_CASES = {
    # Llama 3.1 8B as published, at positions up to 4x its original 8192
    "llama3-8b": ("Llama", dict(head_dim=128, max_position_embeddings=131072, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0}), 8192),
    "llama3-tiny": ("Llama", dict(head_dim=16, max_position_embeddings=96, rope_parameters=dict(LLAMA3)), ORIG),
    # Qwen style: only factor and original_max_position_embeddings given
    "yarn-qwen": ("Qwen2", dict(max_position_embeddings=131072, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1e6}), 32768),
    # DeepSeek style: mscale / mscale_all_dim, other betas, no truncation
    "yarn-mscale": ("Qwen3", dict(head_dim=64, max_position_embeddings=16384, rope_parameters={
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
        "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2, "truncate": False}), 4096),
    "yarn-attention-factor": ("Llama", dict(head_dim=16, max_position_embeddings=96, rope_parameters={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": ORIG, "rope_theta": 1e4,
        "attention_factor": 1.5}), ORIG),
    "linear": ("Llama", dict(head_dim=16, max_position_embeddings=96, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}), ORIG),
}


@pytest.mark.parametrize("case", sorted(ROTARY_CASES))
def test_cos_sin_match_hugging_face(case):
    """Through the conversion's config mapping (Hugging Face's defaults filled in), at positions up to 4x the
    original context, [L] and [B, L] positions, fp64 and fp32 outputs; and different from plain RoPE there."""
    from lightning_tsp.convert.hf import model_config_from_hf

    family, overrides, orig = ROTARY_CASES[case]
    hf_cfg, rotary = hf_rotary(family, **overrides)
    cfg = model_config_from_hf(hf_cfg)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == case.split("-")[0]
    assert validate_rope_scaling(cfg.rope_scaling, cfg.head_dim) == cfg.rope_scaling  # normalised: a fixed point
    positions = torch.cat([torch.arange(0, 4 * orig, max(1, orig // 64)), torch.tensor([4 * orig - 1])])
    for dtype in (torch.float64, torch.float32):
        rotary = rotary.to(dtype)  # (Hugging Face keeps computing in fp32: so do we)
        x = torch.zeros(1, dtype=dtype)
        want_cos, want_sin = rotary(x, positions[None])
        for pos in (positions, torch.stack([positions, positions.flip(0)])):
            cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, dtype, cfg.rope_scaling)
            assert cos.dtype == dtype and cos.shape == pos.shape + (cfg.head_dim,)
            if pos.dim() == 2:
                cos, sin = cos[0], sin[0]
            assert_close(f"{case} cos {dtype}", cos, want_cos[0], rtol=1e-6, atol=1e-6)
            assert_close(f"{case} sin {dtype}", sin, want_sin[0], rtol=1e-6, atol=1e-6)
    # the test can fail: plain RoPE is far from the scaled table beyond the original context
    plain_cos, _ = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, torch.float64)
    beyond = positions >= orig
    assert (plain_cos[beyond] - want_cos[0][beyond].double()).abs().max() > 0.1


def test_llama3_bands_and_yarn_factor_are_exercised():
    """The tiny llama3 config used for training has all three bands; the YaRN model scales cos/sin."""
    from lightning_tsp.layers.rope import _table

    inv, attention = _table(16, 1e4, LLAMA3, torch.device("cpu"))
    plain, _ = _table(16, 1e4, None, torch.device("cpu"))
    ratio = plain / inv
    assert attention == 1.0 and ratio[0] == 1.0 and 1.0 < ratio[1] < 8.0  # kept, blended
    assert torch.allclose(ratio[2:], torch.tensor(8.0))  # divided by factor
    cos, _ = rope_cos_sin(torch.tensor([0]), 16, 1e4, torch.float64, YARN)
    assert_close("yarn cos(0) = attention factor", cos, torch.full_like(cos, 0.1 * math.log(4.0) + 1), 1e-7)


# ---- validation and refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "scaling, match",
    [
        ({"rope_type": "dynamic", "factor": 2.0}, r"'dynamic'.*CURRENT sequence length.*KV cache"),
        ({"type": "dynamic", "factor": 2.0}, r"'dynamic'"),  # the legacy key
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}, r"'longrope'.*current"),
        ({"rope_type": "ntk-by-magic", "factor": 2.0}, r"'ntk-by-magic'.*'linear', 'llama3', 'yarn'"),
        ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}, r"partial_rotary_factor'\]=0.5"),
        ({"full_attention": dict(LLAMA3), "sliding_attention": dict(LLAMA3)}, "per-layer-type"),
        ({"rope_type": "linear"}, r"needs rope_scaling\['factor'\]"),
        ({"rope_type": "linear", "factor": "2"}, "not a finite number"),
        ({"rope_type": "linear", "factor": 0.0}, "must be > 0"),
        ({k: v for k, v in LLAMA3.items() if k != "low_freq_factor"}, "low_freq_factor"),
        ({**LLAMA3, "high_freq_factor": 1.0}, "must be greater than low_freq_factor"),
        ({"rope_type": "yarn", "factor": 4.0}, "original_max_position_embeddings"),
        ({**YARN, "rope_theta": 5e5}, r"rope_theta'\]=500000.0 differs"),
        ({**YARN, "attention_factor": -1.0}, "attention_factor"),
    ],
)
def test_invalid_scaling_is_refused(scaling, match):
    with pytest.raises(TSPConfigError, match=match):
        validate_rope_scaling(scaling, 16, theta=1e4)
    with pytest.raises(TSPConfigError, match=match):  # and where the model uses it (training, prefill, decode)
        rope_cos_sin(torch.arange(4), 16, 1e4, torch.float32, scaling)


def test_validate_fills_hugging_face_defaults():
    assert validate_rope_scaling(None, 16) is None and validate_rope_scaling({}, 16) is None
    assert validate_rope_scaling({"rope_type": "default", "rope_theta": 1e4}, 16, theta=1e4) is None
    assert validate_rope_scaling({"type": "linear", "factor": 2}, 16) == {"rope_type": "linear", "factor": 2.0}
    # yarn: betas 32/1, truncation on, attention factor 0.1 ln(factor) + 1; original context and a missing factor
    # from the model's max_position_embeddings
    got = validate_rope_scaling({"rope_type": "yarn", "factor": None}, 16, max_position_embeddings=64 * 4)
    assert got == {"rope_type": "yarn", "factor": 1.0, "original_max_position_embeddings": 256, "beta_fast": 32.0,
                   "beta_slow": 1.0, "truncate": True, "attention_factor": 1.0}
    got = validate_rope_scaling({**YARN, "beta_fast": 0, "mscale": 1.0}, 16)  # mscale alone is ignored (as HF)
    assert (got["beta_fast"], got["attention_factor"]) == (32.0, 0.1 * math.log(4.0) + 1)
    assert validate_rope_scaling({**LLAMA3, "original_max_position_embeddings": None}, 16,
                                 max_position_embeddings=96)["original_max_position_embeddings"] == 96


def test_model_config_refusal_reaches_the_model():
    """A ModelConfig built by hand with a refused type fails (when built, or at the latest on the first forward),
    never silently computing plain RoPE."""
    with pytest.raises(TSPConfigError, match="'dynamic'"):
        model = TSPLlama(ModelConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), dtype=torch.float64)
        ids, labels = batch(model.cfg, 1, 8)
        model(*model.shard_batch(ids, labels))


def test_tables_are_validated_and_computed_once(monkeypatch):
    from lightning_tsp.layers import rope

    calls = []
    real = rope.validate_rope_scaling
    monkeypatch.setattr(rope, "validate_rope_scaling", lambda *a, **k: calls.append(a) or real(*a, **k))
    monkeypatch.setattr(rope, "_TABLES", {})
    first = rope_cos_sin(torch.arange(8), 16, 1e4, torch.float32, dict(LLAMA3))
    again = rope_cos_sin(torch.arange(8), 16, 1e4, torch.float32, dict(reversed(list(LLAMA3.items()))))
    assert len(calls) == 1 and torch.equal(first[0], again[0])
    with torch.inference_mode():  # a table first built under inference_mode still serves autograd later
        monkeypatch.setattr(rope, "_TABLES", {})
        rope_cos_sin(torch.arange(8), 16, 1e4, torch.float32, YARN)
    pos = torch.arange(8.0, requires_grad=True)
    rope_cos_sin(pos, 16, 1e4, torch.float32, YARN)[0].sum().backward()
    assert pos.grad is not None


# ---- training: exact at D = 1 (vs Hugging Face) and D = 2 (vs D = 1) ------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_matches_hugging_face(name):
    ref, model = model_pair(name)
    assert model.cfg.rope_scaling["rope_type"] == name
    ids, labels = batch(model.cfg, B, S)
    want = ref(input_ids=ids, labels=labels)
    want.loss.backward()
    got = model(input_ids=ids, labels=labels)
    got.loss.backward()
    assert_close(f"{name} loss", got.loss.detach(), want.loss.detach(), HF_RTOL)
    grads = dict(model.named_parameters())
    for pname, p in ref.named_parameters():
        assert_close(f"{name} grad {pname}", grads[pname].grad, p.grad, HF_RTOL)
    # the comparison can fail: without the scaling the loss is far from Hugging Face's
    with torch.no_grad():
        model.cfg.rope_scaling = None
        plain = model(input_ids=ids, labels=labels).loss
    assert (plain - want.loss).abs() > 10 * HF_RTOL * want.loss.abs(), (plain, want.loss)


def _training_worker(rank: int, world_size: int) -> None:
    from lightning_tsp.convert.hf import TSPCausalLM

    tsp = world_tsp()
    for name in sorted(MODELS):
        hf, single = model_pair(name)
        ids, labels = batch(single.cfg, B, S)
        want = single(input_ids=ids, labels=labels).loss
        want.backward()
        model = TSPCausalLM(single.cfg, tsp, activation_checkpointing="full", dtype=torch.float64)
        model.load_full_state_dict(hf.state_dict())
        i, t, p = model.shard_batch(ids, labels)
        assert p.max() >= ORIG  # this rank's tokens include positions beyond the original context
        loss = model(input_ids=i, targets=t, position_ids=p).loss
        loss.backward()
        assert_close(f"rank {rank} {name} loss", loss.detach(), want.detach(), 1e-9)
        grads = full_grads(model)
        for pname, param in single.named_parameters():
            assert_close(f"rank {rank} {name} grad {pname}", grads[pname], param.grad, 1e-9)


# ---- generation --------------------------------------------------------------------------------------------------

PROMPT_LENS = (27, 35, 3)  # prompts and new tokens run past ORIG
N_NEW = 10


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf, prompts) -> list[list[int]]:
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    out = []
    for p in prompts:
        ids = torch.tensor([p])
        got = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N_NEW, do_sample=False)
        out.append(got[0, len(p):].tolist())
    return out


def _generation_pair(name: str):
    return model_pair(name, weight_std=0.3)


def _min_greedy_margin(hf, prompt: list[int], new: list[int]) -> float:
    """The smallest gap between the chosen and the runner-up logit along the generated continuation."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + new[:-1]])).logits[0, len(prompt) - 1:]
    top = logits.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).min().item()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_generation_matches_hugging_face(name):
    from lightning_tsp.inference import generate

    hf, model = _generation_pair(name)
    prompts = _prompts(model.cfg.vocab_size)
    want = _hf_greedy(hf, prompts)
    for p, w in zip(prompts, want):
        assert _min_greedy_margin(hf, p, w) > 1e-4 and len(set(w)) > 2, w
    got = generate(model, prompts, N_NEW).tokens
    assert got.tolist() == want
    # the comparison can fail: without the scaling some tokens differ
    model.cfg.rope_scaling = None
    assert generate(model, prompts, N_NEW).tokens.tolist() != want


def _generation_worker(rank: int, world_size: int, want: dict[str, list[list[int]]]) -> None:
    from lightning_tsp.convert.hf import TSPCausalLM
    from lightning_tsp.inference import generate

    for name in sorted(MODELS):
        hf, single = _generation_pair(name)
        model = TSPCausalLM(single.cfg, world_tsp(), dtype=torch.float64)
        model.load_full_state_dict(hf.state_dict())
        got = generate(model, _prompts(model.cfg.vocab_size), N_NEW).tokens
        assert got.tolist() == want[name], (rank, name, got.tolist(), want[name])


def _d2_worker(rank: int, world_size: int, want: dict[str, list[list[int]]]) -> None:
    _training_worker(rank, world_size)
    _generation_worker(rank, world_size, want)


# ---- D = 2 on gloo: one pair of processes for training and generation (process start-up dominates) --------------


@pytest.mark.timeout(150)
def test_d2_training_matches_d1_and_generation_matches_hugging_face():
    """Training (llama3 and yarn, full activation checkpointing): loss and every gathered gradient equal the D=1
    TSP model's; greedy generation (KV cache sharded by sequence) equals Hugging Face's."""
    want = {}
    for name in sorted(MODELS):
        hf, model = _generation_pair(name)
        want[name] = _hf_greedy(hf, _prompts(model.cfg.vocab_size))
    run_distributed(_d2_worker, 2, want, timeout=130.0)


def test_apply_rope_backward_is_the_transpose_of_apply_rope():
    """apply_rope against x cos + rotate_half(x) sin on a strided view, apply_rope_backward against autograd's
    transpose of it, for cos/sin whose halves differ (so a swapped half cannot pass)."""
    def rotate_half(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    g = torch.Generator().manual_seed(0)
    buf = torch.randn(2, 5, 7, 8, dtype=torch.float64, generator=g)
    x = buf[:, :, 2:5]  # strided, as the q/k views of the projection buffer
    cos, sin = torch.randn(2, 5, 1, 8, dtype=torch.float64, generator=g).unbind(0)
    ref = x * cos + rotate_half(x) * sin
    torch.testing.assert_close(apply_rope(x, cos, sin), ref, rtol=0, atol=1e-14)
    xr = x.detach().clone().requires_grad_()
    dy = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    (xr * cos + rotate_half(xr) * sin).backward(dy)
    torch.testing.assert_close(apply_rope_backward(dy, cos, sin), xr.grad, rtol=0, atol=1e-14)


def test_tables_outlive_other_configurations(monkeypatch):
    """A table is never dropped while the process lives: a decoder's captured CUDA graph reads it by address (a
    cache that evicted it after N other configurations would let the graph read freed memory)."""
    from lightning_tsp.layers import rope

    monkeypatch.setattr(rope, "_TABLES", {})
    first = rope._table(16, 1e4, None, torch.device("cpu"))[0]
    for theta in range(1, 200):
        rope._table(16, float(theta), None, torch.device("cpu"))
    assert rope._table(16, 1e4, None, torch.device("cpu"))[0] is first
