"""TSP computes the unsharded model's function: loss, every parameter gradient, the input-embedding gradient
and an optimizer's loss curve match the D=1 model and Hugging Face LlamaForCausalLM (fp64, real gloo groups)."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.distributed as dist

from lightning_tsp import TSPLlama, zigzag_unshard
from lightning_tsp.models.llama import ModelConfig
from tests.dist_utils import run_distributed
from tests.reference import assert_close, assert_replicas_identical, batch, full_grads, world_tsp

HAS_HF = importlib.util.find_spec("transformers") is not None
B, S = 2, 24


def shapes_for(d: int, gqa: bool, tie: bool = False) -> ModelConfig:
    """Head counts divisible by D (GQA: 2 query heads per KV head); other sizes divisible by 1..4."""
    n_kv = d if d > 1 else 2
    n_heads = 2 * n_kv if gqa else n_kv
    return ModelConfig(vocab_size=240, hidden_size=8 * n_heads, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv,
                       intermediate_size=96, tie_embeddings=tie)


def hf_model(cfg: ModelConfig, ref: TSPLlama):
    """The Hugging Face model of the same architecture: Llama, Qwen2 (q/k/v biases) or Qwen3 (q/k norms)."""
    import transformers

    family = "Qwen3" if cfg.qk_norm else "Qwen2" if cfg.attention_bias else "Llama"
    extra = {"head_dim": cfg.head_dim} if family == "Qwen3" else {}
    hf_cfg = getattr(transformers, f"{family}Config")(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
        max_position_embeddings=4 * S, **extra,
    )
    hf_cfg._attn_implementation = "sdpa"  # eager does its softmax in fp32
    hf = getattr(transformers, f"{family}ForCausalLM")(hf_cfg).to(torch.float64)
    missing, unexpected = hf.load_state_dict(ref.state_dict(), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    return hf


def _capture(store: dict):
    def hook(module, inputs, out):
        out.retain_grad()
        store["emb"] = out

    return hook


def run_and_capture(model: TSPLlama, ids, labels):
    """Loss, gathered parameter gradients and the gradient of the input embeddings (natural order)."""
    captured = {}
    handle = model.model.embed_tokens.register_forward_hook(_capture(captured))
    i, t, p = model.shard_batch(ids, labels)
    loss = model(i, t, p)
    loss.backward()
    handle.remove()
    emb_grad = captured["emb"].grad
    if model.tsp.size > 1:
        parts = [torch.empty_like(emb_grad) for _ in range(model.tsp.size)]
        dist.all_gather(parts, emb_grad, group=model.tsp.group)
        emb_grad = zigzag_unshard(parts)
    return loss.detach(), full_grads(model), emb_grad


def check_case(cfg: ModelConfig, checkpointing: str, rtol: float = 1e-10, b: int = B, **model_kwargs) -> None:
    tag = (f"D={world_tsp().size} heads={cfg.n_heads}/{cfg.n_kv_heads} tie={cfg.tie_embeddings} ckpt={checkpointing} "
           f"B={b} mlp={cfg.mlp_activations}")
    ids, labels = batch(cfg, b, S)
    ref = TSPLlama(dataclasses.replace(cfg, mlp_activations="keep"), None, dtype=torch.float64)  # the plain model
    randomize_biases_and_norms(ref)
    model = TSPLlama(cfg, world_tsp(), activation_checkpointing=checkpointing, dtype=torch.float64, **model_kwargs)
    model.load_full_state_dict(ref.state_dict())
    ref_loss, ref_grads, ref_emb = run_and_capture(ref, ids, labels)
    loss, grads, emb = run_and_capture(model, ids, labels)
    assert_close(f"{tag} loss", loss, ref_loss, rtol)
    assert set(grads) == set(ref_grads)
    for name in ref_grads:
        assert_close(f"{tag} grad {name}", grads[name], ref_grads[name], rtol)
    assert_close(f"{tag} input-embedding grad", emb, ref_emb, rtol)

    if HAS_HF:
        hf = hf_model(cfg, ref)
        hf_emb = {}
        hf.model.embed_tokens.register_forward_hook(_capture(hf_emb))
        out = hf(input_ids=ids, labels=labels)
        out.loss.backward()
        # HF's RMSNorm computes in fp32 even in an fp64 model: compare at fp32 round-off.
        rtol = 2e-6
        assert_close(f"{tag} loss vs HF", loss, out.loss.detach(), rtol)
        for name, p in hf.named_parameters():
            assert_close(f"{tag} grad {name} vs HF", grads[name], p.grad, rtol)
        assert_close(f"{tag} input-embedding grad vs HF", emb, hf_emb["emb"].grad, rtol)


@torch.no_grad()
def randomize_biases_and_norms(model: TSPLlama) -> None:
    """init_weights makes biases 0 and norm weights 1: perturb them so their gradients are tested."""
    g = torch.Generator().manual_seed(7)
    for name, p in model.named_parameters():
        if name.endswith("bias") or "norm" in name:
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def check_loss_curve(cfg: ModelConfig, steps: int = 6) -> None:
    """Several AdamW steps: the TSP loss curve equals the reference curve."""
    curves = []
    for tsp in (None, world_tsp()):
        model = TSPLlama(cfg, tsp, dtype=torch.float64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        curve = []
        for step in range(steps):
            ids, labels = batch(cfg, B, S, seed=step % 2)  # two batches, alternating
            loss = model(*model.shard_batch(ids, labels))
            loss.backward()
            opt.step()
            opt.zero_grad()
            curve.append(loss.detach())
        curves.append(torch.stack(curve))
    assert_close(f"D={world_tsp().size} loss curve", curves[1], curves[0], 1e-10)
    assert curves[0][-1] < curves[0][0], "the reference did not learn: the curve comparison proves nothing"


def _worker(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    for gqa in (False, True):
        for checkpointing in ("none", "full"):
            check_case(shapes_for(world_size, gqa), checkpointing)
    check_case(shapes_for(world_size, True, tie=True), "none")
    # the LM head's ring over token blocks of 5 rows (a remainder block): the travelling accumulator is taken at
    # the first block and written by its GEMM, the later blocks add into it; tied to the embedding's ring
    check_case(shapes_for(world_size, True, tie=True), "none", token_chunk=5)
    check_case(shapes_for(world_size, True), "selective")
    # layer inputs in host memory; batch 1 (the K/V exchange's in-place path, no transposing copy)
    check_case(shapes_for(world_size, True), "offload", b=1)
    check_case(shapes_for(world_size, True), "keep-attention")  # the same replay, the stash left on the device
    check_case(shapes_for(world_size, True), "full-offload")  # the layer input only in host memory, full's re-run
    # the MLP ring keeping no activations (its gate/up GEMMs re-run in backward, the output summed per shard)
    lean = dataclasses.replace(shapes_for(world_size, True), mlp_activations="recompute")
    check_case(lean, "none")
    check_case(lean, "full-offload", b=1)
    # the MLP's weight gradients both ways ("auto" picks one by the call's size): the fp32 accumulator travelling
    # with its shard, and each shard's activation gradients sent to its owner (one GEMM over all tokens there);
    # with kept and with recomputed gate/up pre-activations, and through a checkpointed layer's re-run
    for weight_grads in ("ring", "owners"):
        cfg = dataclasses.replace(shapes_for(world_size, True), mlp_weight_grads=weight_grads)
        check_case(cfg, "none")
        check_case(cfg, "keep-attention")
        check_case(dataclasses.replace(cfg, mlp_activations="recompute"), "full-offload", b=1)
    # head bucketing: the 2 local KV heads gathered one at a time
    bucketed = dataclasses.replace(shapes_for(world_size, True), n_heads=4 * world_size, n_kv_heads=2 * world_size,
                                   hidden_size=32 * world_size)
    check_case(bucketed, "full", kv_bucket_heads=1)
    # the 4M recipe's combination (recipes/paper-7b-4m.yaml): layer inputs in host memory, the MLP ring
    # recomputing, one KV head's K/V gathered at a time
    check_case(dataclasses.replace(bucketed, mlp_activations="recompute"), "full-offload", b=1, kv_bucket_heads=1)
    if world_size == 2:  # Qwen2-style q/k/v biases and Qwen3-style q/k norms with an explicit head_dim
        check_case(dataclasses.replace(shapes_for(world_size, True), attention_bias=True), "full")
        check_case(dataclasses.replace(shapes_for(world_size, True), qk_norm=True, head_dim=12), "none")
    check_loss_curve(shapes_for(world_size, True))
    _replicated_kv_cases(world_size)


def replicated(d: int, n_kv: int, group: int = 2, **overrides) -> ModelConfig:
    """Fewer KV heads than ranks (D a multiple of n_kv): each KV head replicated on D / n_kv ranks."""
    n_heads = group * d
    return ModelConfig(vocab_size=240, hidden_size=8 * n_heads, n_layers=2, n_heads=n_heads, n_kv_heads=n_kv,
                       intermediate_size=96, **overrides)


def _replicated_kv_cases(world_size: int) -> None:
    """KV-head replication: MQA (n_kv = 1) at every D, n_kv = 2 at D = 4; biases, q/k norms, bucketing,
    checkpointing; loss and every gradient vs D = 1 and Hugging Face, then an optimizer curve with the replicas
    checked bit-identical after every step (replicas that drift apart break the model silently)."""
    cases = [replicated(world_size, 1)]
    if world_size == 4:
        cases.append(replicated(world_size, 2))
    for cfg in cases:
        check_case(cfg, "none")
        check_case(cfg, "full", b=1)
    check_case(replicated(world_size, 1, attention_bias=True), "offload")
    check_case(replicated(world_size, 1, qk_norm=True, head_dim=12), "full-offload", b=1)
    check_case(replicated(world_size, 1, qk_norm=True, head_dim=12), "selective")
    cfg = cases[-1]
    model = TSPLlama(cfg, world_tsp(), dtype=torch.float64)
    ref = TSPLlama(cfg, None, dtype=torch.float64)
    curves = []
    for m in (ref, model):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        curve = []
        for step in range(4):
            ids, labels = batch(cfg, B, S, seed=step % 2)
            loss = m(*m.shard_batch(ids, labels))
            loss.backward()
            if m is model:
                assert_replicas_identical(model, f"step {step}")
            opt.step()
            opt.zero_grad()
            curve.append(loss.detach())
        curves.append(torch.stack(curve))
    assert_replicas_identical(model, "after training")
    assert_close(f"D={world_size} replicated-KV loss curve", curves[1], curves[0], 1e-10)
    assert curves[0][2] < curves[0][0], "the reference did not learn (same batch, two steps apart)"


def test_mlp_weight_grads_is_checked():
    with pytest.raises(ValueError, match="mlp_weight_grads='bogus'.*'owners'"):
        ModelConfig(mlp_weight_grads="bogus")


@pytest.mark.parametrize("gqa", [False, True])
def test_unsharded_model_matches_hugging_face(gqa):
    """D = 1, no process group: the built-in model is Llama (checked against the HF implementation)."""
    check_case(shapes_for(1, gqa), "none")
    check_case(shapes_for(1, gqa, tie=True), "full")
    check_case(dataclasses.replace(shapes_for(1, gqa), attention_bias=True), "none")
    check_case(dataclasses.replace(shapes_for(1, gqa), qk_norm=True, head_dim=12), "none")


@pytest.mark.parametrize("d", [2, 3, 4])
def test_tsp_matches_reference(d):
    run_distributed(_worker, d)


def test_fp32_matches_within_float_roundoff():
    run_distributed(_fp32_worker, 2)


def _fp32_worker(rank: int, world_size: int) -> None:
    cfg = shapes_for(world_size, True)
    ids, labels = batch(cfg, B, S)
    ref = TSPLlama(cfg, None, dtype=torch.float64)
    model = TSPLlama(cfg, world_tsp(), dtype=torch.float32)
    ref_loss, ref_grads, _ = run_and_capture(ref, ids, labels)
    loss, grads, _ = run_and_capture(model, ids, labels)
    assert_close("fp32 loss", loss, ref_loss, 1e-5)
    for name in ref_grads:
        assert_close(f"fp32 grad {name}", grads[name], ref_grads[name], 1e-5)


def _uninitialised_worker(rank: int, world_size: int) -> None:
    # every torch.empty is filled with NaN: a buffer a schedule leaves partly unwritten (the MLP ring's backward
    # partials are uninitialised, its GEMMs write them whole) turns the loss or a gradient into NaN
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        check_case(shapes_for(world_size, True), "full")
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2])
def test_no_schedule_reads_uninitialised_memory(world_size):
    run_distributed(_uninitialised_worker, world_size, timeout=280.0)
