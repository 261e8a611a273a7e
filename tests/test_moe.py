"""TSPMoE computes the unsharded MoE layer: output, load-balancing loss and every gradient (router, experts, shared
expert, input) match the D=1 module and a plain-PyTorch per-token reference (fp64, real gloo groups, zigzag), for
both expert schedules (ring and dispatch), which also agree with each other to 1e-12."""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.layers.moe import TSPMoE, load_balancing_loss
from lightning_tsp.schedules.comm import SumOverGroup
from lightning_tsp.zigzag import zigzag_shard, zigzag_unshard
from tests.dist_utils import run_distributed
from tests.reference import assert_close, world_tsp

HAS_HF = importlib.util.find_spec("transformers") is not None
SCHEDULES = ("ring", "dispatch")  # "auto" picks one of these (tests/test_moe_model.py)
B, S, H, E, F_EXP, F_SHARED = 2, 16, 8, 8, 6, 8  # S divisible by 2D for D = 1, 2, 4; E divisible by D
AUX_COEF = 0.7
# (top_k, gating, norm_topk_prob, shared_intermediate_size)
CASES = [(k, g, norm, fs) for k in (1, 2) for g, norm in (("mixtral", False), ("qwen3", False), ("qwen3", True))
         for fs in (0, F_SHARED)]


def case_name(case) -> str:
    k, g, norm, fs = case
    return f"top{k}-{g}{'-norm' if norm else ''}{'-shared' if fs else ''}"


def full_params(shared: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = {
        "gate.weight": torch.randn(E, H, generator=g, dtype=torch.float64),
        "experts.gate_up_proj": torch.randn(E, 2 * F_EXP, H, generator=g, dtype=torch.float64) / H**0.5,
        "experts.down_proj": torch.randn(E, H, F_EXP, generator=g, dtype=torch.float64) / F_EXP**0.5,
    }
    if shared:
        p["shared_expert.gate_proj.weight"] = torch.randn(shared, H, generator=g, dtype=torch.float64) / H**0.5
        p["shared_expert.up_proj.weight"] = torch.randn(shared, H, generator=g, dtype=torch.float64) / H**0.5
        p["shared_expert.down_proj.weight"] = torch.randn(H, shared, generator=g, dtype=torch.float64) / shared**0.5
    return p


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states x [B, S, H] and the loss projection c [B, S, H] (loss = sum(y * c) + coef * aux)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g, dtype=torch.float64)
    return x, torch.randn(B, S, H, generator=g, dtype=torch.float64)


def reference(case, params: dict, x: torch.Tensor, c: torch.Tensor) -> dict[str, torch.Tensor]:
    """The math, one token and one expert at a time: y, aux, loss, every gradient and the routed expert ids."""
    k, gating, norm, shared = case
    p = {n: t.clone().requires_grad_() for n, t in params.items()}
    x = x.clone().requires_grad_()
    wg, w_gu, w_d = p["gate.weight"], p["experts.gate_up_proj"], p["experts.down_proj"]
    ys, counts, prob_sum, routed = [], torch.zeros(E, dtype=torch.float64), 0, torch.empty(B, S, k, dtype=torch.long)
    for b in range(B):
        for t in range(S):
            xt = x[b, t]
            logits = wg @ xt  # [E]
            probs = torch.softmax(logits, -1)
            if gating == "mixtral":
                top = logits.topk(k)
                w = torch.softmax(top.values, -1)
            else:
                top = probs.topk(k)
                w = top.values / top.values.sum() if norm else top.values
            yt = torch.zeros(H, dtype=torch.float64)
            for j in range(k):
                e = int(top.indices[j])
                routed[b, t, j] = e
                counts[e] += 1
                g_, u_ = w_gu[e, :F_EXP] @ xt, w_gu[e, F_EXP:] @ xt
                yt = yt + w[j] * (w_d[e] @ (F.silu(g_) * u_))
            if shared:
                sg, su = p["shared_expert.gate_proj.weight"] @ xt, p["shared_expert.up_proj.weight"] @ xt
                yt = yt + p["shared_expert.down_proj.weight"] @ (F.silu(sg) * su)
            ys.append(yt)
            prob_sum = prob_sum + probs
    y = torch.stack(ys).view(B, S, H)
    n = B * S
    aux = E * ((counts / n) * (prob_sum / n)).sum()
    loss = (y * c).sum() + AUX_COEF * aux
    loss.backward()
    out = {"y": y.detach(), "aux": aux.detach(), "loss": loss.detach(), "x.grad": x.grad, "routed": routed}
    out.update({f"{n}.grad": t.grad for n, t in p.items()})
    return out


# ---- the TSP layer: load full weights, run on local tokens, gather everything back ------------------------------


def shard_dims(module: torch.nn.Module) -> dict[str, int | None]:
    """Parameter name -> dim sharded over the TSP group (None: replicated), from the layers' ``tsp_shard_dims``."""
    out = {}
    for mod_name, mod in module.named_modules():
        dims = getattr(mod, "tsp_shard_dims", None)
        if dims is not None:
            for p_name, _ in mod.named_parameters():
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = dims.get(p_name)
    return out


def build(case, tsp: TSPGroup, params: dict, schedule: str = "ring") -> TSPMoE:
    k, gating, norm, shared = case
    moe = TSPMoE(H, E, F_EXP, k, tsp, gating=gating, norm_topk_prob=norm, shared_intermediate_size=shared,
                 dtype=torch.float64, schedule=schedule)
    dims = shard_dims(moe)
    assert set(dims) == set(params), (sorted(dims), sorted(params))
    with torch.no_grad():
        for name, p in moe.named_parameters():
            full, dim = params[name], dims[name]
            n = p.shape[dim] if dim is not None else None
            p.copy_(full if dim is None else full.narrow(dim, tsp.rank * n, n))
    return moe


def gather(t: torch.Tensor, dim: int | None, tsp: TSPGroup) -> torch.Tensor:
    if dim is None or tsp.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tsp.size)]
    dist.all_gather(parts, t.contiguous(), group=tsp.group)
    return torch.cat(parts, dim=dim)


def run_tsp(case, tsp: TSPGroup, params: dict, x: torch.Tensor, c: torch.Tensor,
            schedule: str = "ring") -> dict[str, torch.Tensor]:
    """The TSP layer on this rank's zigzag tokens; outputs and gradients gathered back to the full tensors."""
    moe = build(case, tsp, params, schedule)
    x_loc = zigzag_shard(x, tsp.size, tsp.rank).clone().requires_grad_()
    c_loc = zigzag_shard(c, tsp.size, tsp.rank)
    y, stats = moe(x_loc)
    aux = load_balancing_loss(stats, x_loc.shape[0] * x_loc.shape[1], tsp)
    part = (y * c_loc).sum()
    loss = (SumOverGroup.apply(part, tsp) if tsp.size > 1 else part) + AUX_COEF * aux
    loss.backward()

    def unshard(t):
        if tsp.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(tsp.size)]
        dist.all_gather(parts, t.contiguous(), group=tsp.group)
        return zigzag_unshard(parts)

    dims = shard_dims(moe)
    out = {"y": unshard(y.detach()), "aux": aux.detach(), "loss": loss.detach(), "x.grad": unshard(x_loc.grad)}
    out.update({f"{n}.grad": gather(p.grad, dims[n], tsp) for n, p in moe.named_parameters()})
    return out


def compare(tag: str, got: dict, want: dict, rtol: float = 1e-10, atol: float = 1e-12) -> None:
    names = [n for n in want if n != "routed"]
    assert set(names) == set(got), (sorted(names), sorted(got))
    for n in names:
        assert_close(f"{tag} {n}", got[n], want[n], rtol=rtol, atol=atol)


@functools.lru_cache(maxsize=None)
def expected(case) -> tuple[dict, dict]:
    """(plain reference, D=1 module with the ring schedule) for one case, computed once per pytest process."""
    params = full_params(case[3])
    x, c = inputs()
    return reference(case, params, x, c), run_tsp(case, TSPGroup.single(), params, x, c)


# ---- tests ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=case_name)
def test_d1_module_matches_reference(case):
    ref, d1 = expected(case)
    compare(f"D=1 ring {case_name(case)}", d1, ref)
    params = full_params(case[3])
    x, c = inputs()
    compare(f"D=1 dispatch {case_name(case)}", run_tsp(case, TSPGroup.single(), params, x, c, "dispatch"), ref)
    # every expert gradient is exercised (or exactly zero where an expert got no token)
    used = torch.bincount(ref["routed"].reshape(-1), minlength=E)
    g = ref["experts.gate_up_proj.grad"]
    assert all(bool((g[e] == 0).all()) == (used[e] == 0) for e in range(E))


def test_some_expert_gets_no_token_on_some_rank():
    """The top-1 data routes no token of some rank to some expert (its GEMMs are skipped, its ring hop is not), and
    at D=4 no token of some rank to a whole owner (dispatch: a zero-row split in both all-to-alls)."""
    ref, _ = expected(CASES[0])
    for d in (2, 4):
        per_rank = [torch.bincount(zigzag_shard(ref["routed"], d, r).reshape(-1), minlength=E) for r in range(d)]
        assert any(bool((cnt == 0).any()) for cnt in per_rank), d
    # and at D=4 some rank has no token for a whole passing shard of E/D = 2 experts
    per_rank = [torch.bincount(zigzag_shard(ref["routed"], 4, r).reshape(-1), minlength=E) for r in range(4)]
    assert any(bool((cnt.view(4, 2).sum(1) == 0).any()) for cnt in per_rank)


def _worker(rank, world_size, schedule, cases, params, x, c, wanted):
    tsp = world_tsp()
    for case, p, (ref, d1) in zip(cases, params, wanted):
        got = run_tsp(case, tsp, p, x, c, schedule)
        tag = f"D={world_size} rank={rank} {schedule} {case_name(case)}"
        compare(tag + " vs reference", got, ref)
        compare(tag + " vs D=1", got, d1)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("d", [2, 4])
def test_tsp_matches_unsharded(d, schedule):
    x, c = inputs()
    wanted = [expected(case) for case in CASES]
    params = [full_params(case[3]) for case in CASES]
    run_distributed(_worker, d, schedule, CASES, params, x, c, wanted, timeout=180.0)


def _agree_worker(rank, world_size, cases, params, x, c):
    tsp = world_tsp()
    for case, p in zip(cases, params):
        ring, dispatch = (run_tsp(case, tsp, p, x, c, s) for s in ("ring", "dispatch"))
        compare(f"D={world_size} rank={rank} {case_name(case)} dispatch vs ring", dispatch, ring,
                rtol=1e-12, atol=1e-14)


def test_schedules_agree_with_each_other():
    """Ring and dispatch give the same output, aux loss and gradients to 1e-12 at D=4 (where some rank sends no
    row to some owner); the cases with a shared expert only add the same dense ring to both, so they are left out."""
    x, c = inputs()
    cases = [case for case in CASES if not case[3]]
    params = [full_params(0) for _ in cases]
    run_distributed(_agree_worker, 4, cases, params, x, c, timeout=180.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_experts=8, tsp=TSPGroup(None, 0, 3)), "num_experts=8 is not divisible by tsp_size=3"),
        (dict(top_k=9), "top_k=9"),
        (dict(gating="softmax"), "gating='softmax'"),
        (dict(shared_intermediate_size=6, tsp=TSPGroup(None, 0, 4)), "shared_intermediate_size=6"),
        (dict(schedule="alltoall", tsp=TSPGroup(None, 0, 4)), r"schedule='alltoall'.*'ring', 'dispatch'"),
    ],
)
def test_config_errors_before_any_collective(kwargs, match):
    """A fake 3- or 4-rank group with no process group: the check must fire at construction, talking to no one."""
    args = dict(hidden_size=H, num_experts=E, intermediate_size=F_EXP, top_k=2, tsp=TSPGroup.single()) | kwargs
    with pytest.raises(TSPConfigError, match=match):
        TSPMoE(**args)


@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
@pytest.mark.parametrize("family, norm", [("Mixtral", True), ("Qwen3Moe", False), ("Qwen3Moe", True)])
def test_d1_matches_hugging_face_block(family, norm):
    """The state dict of a Hugging Face (>= 5) sparse-MoE block loads as is; output and aux loss match."""
    import transformers

    if family == "Mixtral":
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=F_EXP, num_local_experts=E,
                                         num_experts_per_tok=2)
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    else:
        cfg = transformers.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=F_EXP, num_experts=E,
                                          num_experts_per_tok=2, norm_topk_prob=norm)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as Block
        from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
    hf = Block(cfg).to(torch.float64)
    params = full_params(0)
    hf.load_state_dict(params, strict=True)
    moe = build((2, "mixtral" if family == "Mixtral" else "qwen3", norm, 0), TSPGroup.single(), params)
    x, _ = inputs()
    want = hf(x)
    want = want[0] if isinstance(want, tuple) else want
    y, stats = moe(x)
    aux = load_balancing_loss(stats, x.shape[0] * x.shape[1], TSPGroup.single())
    # Hugging Face runs the router softmax (and the aux-loss sums) in fp32 even for fp64 inputs: fp32 tolerance
    assert_close(f"{family} y", y, want, rtol=1e-6)
    logits = x.reshape(-1, H) @ params["gate.weight"].T
    assert_close(f"{family} aux", aux, load_balancing_loss_func((logits,), E, 2), rtol=1e-6)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bf16_autocast_runs_with_fp32_master_weights(schedule):
    """Under bf16 autocast the layer computes in bf16, accumulates in fp32 and returns fp32 parameter gradients."""
    moe = TSPMoE(H, E, F_EXP, 2, TSPGroup.single(), shared_intermediate_size=F_SHARED, schedule=schedule)
    x = torch.randn(B, S, H, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, stats = moe(x)
        aux = load_balancing_loss(stats, x.shape[0] * x.shape[1], TSPGroup.single())
    assert y.dtype == torch.bfloat16 and aux.dtype == torch.float32
    (y.float().sum() + aux).backward()
    for n, p in moe.named_parameters():
        assert p.grad.dtype == torch.float32 and bool(p.grad.isfinite().all()), n
    assert x.grad.dtype == torch.float32
