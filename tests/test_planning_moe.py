"""Mixture of experts in the cost model: shapes, FLOPs, the expert-schedule choice and the plan output (pure Python,
no torch, no timings)."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from lightning_tsp.planning import (
    MODEL_PRESETS,
    ModelShape,
    choose_expert_schedule,
    crossover_tokens,
    estimate,
    expert_schedule_costs,
    forward_flops,
    from_config,
    from_hf_config,
    get_hardware,
    get_precision,
    make_plan,
    tsp_layer_collectives,
    tsp_moe_mlp_collectives,
    tsp_step_collectives,
)
from lightning_tsp.planning.cli import main
from lightning_tsp.planning.planner import PlanError, candidate_layouts, validate
from lightning_tsp.planning.strategies import Layout, local_params, tsp_expert_crossover_seq

MIXTRAL = MODEL_PRESETS["mixtral-8x7b"]
QWEN3 = MODEL_PRESETS["qwen3-30b-a3b"]
H200 = get_hardware("h200")
MIXED = get_precision("bf16-mixed")

# the public config.json of mistralai/Mixtral-8x7B-v0.1 (the fields the cost model reads)
MIXTRAL_HF = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
              "tie_word_embeddings": False}
# ... and of Qwen/Qwen3-30B-A3B
QWEN3_HF = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
            "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
            "tie_word_embeddings": False}


def _params_by_hand(V, h, L, q, kv, E, k, F_e, dense=0, F=0):
    """(total, active) of a decoder with untied embeddings: attention + norms per layer, E experts (router E*h)
    on L - dense layers, a dense SwiGLU of width F on the others."""
    attn = 2 * h * q + 2 * h * kv + 2 * h
    moe, moe_active = E * 3 * F_e * h + E * h, k * 3 * F_e * h + E * h
    rest = 2 * V * h + h
    total = L * attn + (L - dense) * moe + dense * 3 * F * h + rest
    active = L * attn + (L - dense) * moe_active + dense * 3 * F * h + rest
    return total, active


# ---------------------------------------------------------------- shapes


def test_moe_preset_param_counts_match_public_configs():
    total, active = _params_by_hand(32000, 4096, 32, 4096, 1024, E=8, k=2, F_e=14336)
    assert (MIXTRAL.total_params, MIXTRAL.active_params) == (total, active)
    assert total == pytest.approx(46.7e9, rel=0.01) and active == pytest.approx(12.9e9, rel=0.01)
    total, active = _params_by_hand(151936, 2048, 48, 32 * 128, 4 * 128, E=128, k=8, F_e=768)
    assert (QWEN3.total_params, QWEN3.active_params) == (total, active)  # (q/k norms, 256 per layer, not modelled)
    # the model card: 30.5B total, 29.9B non-embedding, "3.3B" activated (3.35B from the shapes: rounded down)
    assert total == pytest.approx(30.5e9, rel=0.01) and QWEN3.non_embedding_params == pytest.approx(29.9e9, rel=0.01)
    assert active == pytest.approx(3.3e9, rel=0.02) and active == pytest.approx(3.35e9, rel=0.01)
    assert (QWEN3.n_moe_layers, QWEN3.expert_intermediate_size, MIXTRAL.expert_intermediate_size) == (48, 768, 14336)


def test_dense_presets_unchanged():
    expect = {"tiny": (106816, 74048, 36992), "paper-7b": (8852344832, 8590200832, 268443648),
              "llama3-8b": (8030261248, 6979588096, 218112000)}
    for name, numbers in expect.items():
        s = MODEL_PRESETS[name]
        assert (s.total_params, s.non_embedding_params, s.layer_params) == numbers
        assert s.active_params == s.total_params and not s.is_moe and s.n_moe_layers == 0


def test_moe_shape_validation():
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelShape(256, 64, 2, 4, 2, 128, num_experts=4, experts_per_token=5)
    with pytest.raises(ValueError, match="need num_experts"):
        ModelShape(256, 64, 2, 4, 2, 128, experts_per_token=2)


def test_from_hf_config_mixtral_and_qwen3_moe(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(MIXTRAL_HF))
    s = from_hf_config(f)
    assert (s.num_experts, s.experts_per_token, s.expert_intermediate_size, s.n_dense_layers) == (8, 2, 14336, 0)
    assert (s.total_params, s.active_params) == (MIXTRAL.total_params, MIXTRAL.active_params)
    q = from_config(QWEN3_HF)
    assert (q.total_params, q.active_params) == (QWEN3.total_params, QWEN3.active_params)
    # mlp_only_layers and decoder_sparse_step: layer i is sparse iff i not in mlp_only_layers and (i+1) % step == 0
    f.write_text(json.dumps({**QWEN3_HF, "mlp_only_layers": [0, 5], "decoder_sparse_step": 2}))
    q2 = from_hf_config(tmp_path)
    dense = sum(1 for i in range(48) if i in (0, 5) or (i + 1) % 2)  # the even layers and layer 5
    assert q2.n_dense_layers == dense == 25
    total, active = _params_by_hand(151936, 2048, 48, 4096, 512, E=128, k=8, F_e=768, dense=25, F=6144)
    assert (q2.total_params, q2.active_params) == (total, active)
    # the built-in config's names: a dense config carrying a default top-k stays dense; dense_layers are indices
    base = dict(vocab_size=256, hidden_size=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate_size=128,
                tie_embeddings=False)
    assert not from_config(SimpleNamespace(**base, num_experts=0, num_experts_per_tok=2)).is_moe
    b = from_config(SimpleNamespace(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                                    shared_expert_intermediate_size=32, dense_layers=(0,)))
    assert (b.n_dense_layers, b.n_moe_layers, b.shared_expert_intermediate_size) == (1, 3, 32)
    assert b.moe_mlp_params == 4 * 3 * 96 * 64 + 4 * 64 + 3 * 32 * 64
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        from_config({**MIXTRAL_HF, "num_experts_per_tok": None})


def test_moe_flops_count_the_active_experts():
    S = 4096
    f = forward_flops(MIXTRAL, 1, S)
    matmul = MIXTRAL.n_layers * (MIXTRAL.attn_params + MIXTRAL.moe_active_mlp_params)
    assert f["linear"] == 2 * S * matmul
    assert matmul == MIXTRAL.active_params - 2 * 32000 * 4096 - MIXTRAL.n_layers * 2 * 4096 - 4096


# ---------------------------------------------------------------- expert schedules

ARGS = {"mixtral": dict(num_experts=8, hidden_size=4096, intermediate_size=14336, top_k=2),
        "qwen3": dict(num_experts=128, hidden_size=2048, intermediate_size=768, top_k=8)}


@pytest.mark.parametrize("model", sorted(ARGS))
@pytest.mark.parametrize("D", [2, 4, 8])
def test_ring_bytes_fixed_dispatch_bytes_linear(model, D):
    kw = ARGS[model]
    E, h, F, k = kw["num_experts"], kw["hidden_size"], kw["intermediate_size"], kw["top_k"]
    c = {n: expert_schedule_costs(**kw, tokens=n, tsp_size=D) for n in (0, 1000, 2000, 50000)}
    for n in c:
        assert c[n]["ring"]["bytes_forward"] == (D - 1) * E * 3 * F * h * 2 // D  # (D-1)/D * E 3 F h a
        assert c[n]["ring"]["bytes_backward"] == (D - 1) * E * 3 * F * h * (2 + 4) // D
    out = (D - 1) / D
    for key, per_row in (("bytes_forward", h * (2 + 4)), ("bytes_backward", (h + 1) * (2 + 4))):
        b = {n: c[n]["dispatch"][key] for n in c}
        assert b[2000] - b[1000] == pytest.approx(b[1000] - b[0])  # linear in the tokens
        assert b[1000] - b[0] == pytest.approx(out * 1000 * k * per_row)
    assert c[0]["dispatch"]["bytes_forward"] == pytest.approx(out * E * 8)  # only the int64 counts
    for n in c:  # same GEMMs either way: 6 N k F h forward, twice that backward
        assert c[n]["ring"]["compute_s"] == c[n]["dispatch"]["compute_s"] == pytest.approx(
            18 * n * k * F * h / H200.sustained_flops)


@pytest.mark.parametrize("model", sorted(ARGS))
@pytest.mark.parametrize("D", [2, 4, 8])
@pytest.mark.parametrize("training", [True, False])
def test_choice_flips_at_the_crossover(model, D, training):
    kw = dict(ARGS[model], tsp_size=D, training=training)
    n = crossover_tokens(**kw)
    if n is None:  # the ring from the first token: dispatch's measured per-pass cost exceeds the experts' transfer
        assert model == "qwen3" and (D < 8 or not training), (model, D, training)
        assert choose_expert_schedule(**kw, tokens=1) == choose_expert_schedule(**kw, tokens=10**6) == "ring"
        return
    assert n > 1
    assert choose_expert_schedule(**kw, tokens=n - 1) == "dispatch"
    assert choose_expert_schedule(**kw, tokens=n) == "ring"
    assert choose_expert_schedule(**kw, tokens=1) == "dispatch"
    assert choose_expert_schedule(**kw, tokens=10 * n) == "ring"
    c = expert_schedule_costs(**kw, tokens=n)
    assert c["ring"]["time_s"] <= c["dispatch"]["time_s"]


def test_single_rank_is_ring_and_errors():
    kw = dict(ARGS["mixtral"], tsp_size=1)
    assert choose_expert_schedule(**kw, tokens=1) == "ring"
    assert crossover_tokens(**kw) is None
    c = expert_schedule_costs(**kw, tokens=4096)
    assert c["ring"]["bytes_forward"] == c["dispatch"]["bytes_forward"] == 0
    with pytest.raises(ValueError, match="num_experts=8"):
        expert_schedule_costs(**dict(ARGS["mixtral"], tsp_size=3), tokens=1)
    # tiny experts: moving them costs less than dispatch's fixed latencies, so the ring wins from the first token
    small = dict(num_experts=2, hidden_size=64, intermediate_size=64, top_k=2, tsp_size=2)
    assert crossover_tokens(**small) is None and choose_expert_schedule(**small, tokens=1) == "ring"


# ---------------------------------------------------------------- collectives, strategies, planner


def test_moe_layer_collectives_by_hand():
    s, B, S, D, w = MIXTRAL, 1, 4096, 8, 2
    M = 3 * 14336 * 4096  # one rank's packed expert (E/D = 1)
    ring = tsp_moe_mlp_collectives(s, B, S, D, w)
    assert ring["forward"]["send"] == 7 * M * w
    assert ring["backward"]["send"] == 7 * M * (w + 4)
    assert ring["backward"]["all_reduce"] == 8 * 4096 * 4  # the router's fp32 gradient
    rows = S // D * 2
    disp = tsp_moe_mlp_collectives(s, B, S, D, w, schedule="dispatch")
    assert disp["forward"]["all_to_all"] == 8 * 8 + rows * 4096 * (w + 4)
    assert disp["backward"]["all_to_all"] == rows * 4097 * (w + 4)
    assert disp["forward"]["send"] == disp["backward"]["send"] == 0
    calls = tsp_moe_mlp_collectives(s, B, S, D, w, schedule="dispatch", checkpointing="full", what="calls")
    assert (calls["forward"]["all_to_all"], calls["backward"]["all_to_all"]) == (3, 2 + 3)
    # an MoE layer = the attention half of a dense layer + the experts; a step sums the layers
    layer = tsp_layer_collectives(s, B, S, D, w, moe=True, expert_schedule="dispatch")
    assert layer["forward"]["all_to_all"] == disp["forward"]["all_to_all"] and layer["forward"]["send"] == 0
    step = tsp_step_collectives(s, B, S, D, w, expert_schedule="dispatch")
    assert step["backward"]["all_to_all"] == 32 * disp["backward"]["all_to_all"]


def test_planner_moe_comm_matches_exact_model_and_picks_the_schedule():
    lay = Layout("tsp", 8, 8, tsp=8)
    for S in (8192, 1048576):
        est = estimate(MIXTRAL, lay, H200, MIXED, 1, S, "full")
        want = choose_expert_schedule(**ARGS["mixtral"], tokens=S // 8, tsp_size=8)
        assert est.expert_schedule == want
        exact = tsp_step_collectives(MIXTRAL, 1, S, 8, 2, checkpointing="full", param_bytes=4, expert_schedule=want,
                                     shard_group=est.shard_group)
        for ph in ("forward", "backward"):
            assert est.comm_bytes(phase=ph, group="tsp") == pytest.approx({op: float(v) for op, v in exact[ph].items()})
    assert {estimate(MIXTRAL, lay, H200, MIXED, 1, S).expert_schedule for S in (8192, 1048576)} == {"ring", "dispatch"}
    # TSP holds E/D whole experts: 1 of Mixtral's 8 per rank at D = 8
    n = local_params(MIXTRAL, lay)
    assert n == 32 * (MIXTRAL.attn_params // 8 + 3 * 14336 * 4096 + 8 * 4096 + 2 * 4096) + 2 * 4000 * 4096 + 4096


def test_every_strategy_estimates_moe_models():
    for shape in (MIXTRAL, QWEN3):
        layouts = candidate_layouts(shape, 32768, 16, 8)
        assert {l.strategy for l in layouts} == {"dp", "fsdp", "tp", "tp_sp", "sp", "tp_x_sp", "tsp"}
        ests = {str(l): estimate(shape, l, H200, MIXED, 1, 32768) for l in layouts}
        for e in ests.values():
            assert 0 < e.step_s < 1e3 and e.peak_bytes > 0
            # the active experts set the FLOPs: far below a dense model of the same total size
            assert e.flops["model"] * e.layout.model_parallel < 6 * shape.total_params * 32768
        dp = estimate(shape, Layout("dp", 16, 8), H200, MIXED, 1, 32768)
        tsp = estimate(shape, Layout("tsp", 16, 8, tsp=8), H200, MIXED, 1, 32768)
        assert tsp.memory["weights"] == pytest.approx(dp.memory["weights"] / 8, rel=0.02)
    with pytest.raises(PlanError, match="num_experts=6"):
        validate(ModelShape(1000, 256, 2, 8, 8, 512, num_experts=6, experts_per_token=2), 4096, 8, 8, tsp_degree=4)
    plan = make_plan(QWEN3, H200, MIXED, 262144, 8, 8)
    assert plan.recommended.fits


def test_cli_prints_the_expert_schedule_for_mixtral(capsys):
    assert main(["plan", "--model", "mixtral-8x7b", "--seq-len", "32768", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "E=8 top-2" in out and "12.88B active" in out
    lines = re.findall(r"^experts: .*$", out, re.M)
    assert [l.rsplit("D = ", 1)[1].rstrip(")") for l in lines] == ["8", "4", "2"]
    pick = choose_expert_schedule(**ARGS["mixtral"], tokens=32768 // 8, tsp_size=8)
    S = tsp_expert_crossover_seq(MIXTRAL, Layout("tsp", 8, 8, tsp=8), H200, MIXED, 1)
    assert S == -(-crossover_tokens(**ARGS["mixtral"], tsp_size=8) * 8 // 1)
    other = "dispatch below" if pick == "ring" else "ring from"
    assert lines[0] == f"experts: {pick} ({other} S = {round(S / 1024)}K at D = 8)"
