"""TSP mixture-of-experts MLP: a replicated router and two exact expert schedules, EXPERT RING and EXPERT DISPATCH.

Rank r of a TSP group of D ranks owns E/D whole experts, [r*E/D, (r+1)*E/D), and 1/D of the tokens (zigzag).
Routing is per token, so every rank routes its own tokens with the replicated router. The packed expert shards
circulate around the ring exactly like the dense MLP's (:func:`ring_shards`): when the shard of experts
[s*E/D, (s+1)*E/D) passes, every rank runs its LOCAL tokens routed to those experts (rows sorted by expert once
per layer, one GEMM per expert) and accumulates their gate-weighted outputs locally. No token moves, no
all-reduce of activations. Backward runs the ring again with the fp32 weight-gradient accumulators travelling
with the shards back to their owners (:class:`RingGradPass`). The router gets its gradient through the
combination weights; being replicated, its gradient is summed over the group (as RMSNorm's).

``schedule="dispatch"`` (:class:`DispatchExperts`, expert parallelism) computes the same function the other way
round: expert weights stay, each rank's routed (token, slot) rows go to their experts' owners in one
variable-size all-to-all, the owners run their experts and send the outputs back in a second one; the rows are
scaled and combined on the tokens' ranks in the ring's order. Both share the routing sort, the per-expert
forward/backward and the combination (:func:`sort_rows`, :func:`experts_forward`, :func:`experts_backward`,
:func:`combine_rows`). The experts of a shard run as grouped GEMMs (one launch per product for the whole shard)
where the hardware has them, else one GEMM per expert (:mod:`lightning_tsp.kernels.grouped`).

Parameter names follow Hugging Face transformers >= 5 (Qwen3-MoE / Mixtral ``SparseMoeBlock``), so a block's
state dict loads as is (sharded along the expert dim 0):

    gate.weight              [E, h]          replicated router (HF ``gate.weight``)
    experts.gate_up_proj     [E/D, 2F, h]    rows [0, F) = gate (Mixtral w1), rows [F, 2F) = up (Mixtral w3)
    experts.down_proj        [E/D, h, F]     (Mixtral w2)
    shared_expert.{gate,up,down}_proj.weight  optional dense SwiGLU, Llama names, run by the dense ring schedule

Older per-expert checkpoints map as ``gate_up_proj[e] = cat([experts.{e}.w1, experts.{e}.w3])`` (Mixtral) or
``cat([experts.{e}.gate_proj, experts.{e}.up_proj])`` (Qwen3-MoE), ``down_proj[e] = w2`` / ``down_proj``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.grouped import ExpertGroups
from lightning_tsp.layers.mlp import TSPGatedMLP, swiglu_backward
from lightning_tsp.schedules.comm import SumGradOverGroup, SumOverGroup, local_tensor, pack, unpack
from lightning_tsp.schedules.ring import RingGradPass, ring_shards

GATINGS = ("mixtral", "qwen3")


SCHEDULES = ("ring", "dispatch", "auto")  # "auto": the cost model picks per call (same function either way)


# ---- shared by both expert schedules: routing rows, one expert's forward/backward, the combination -------------


def sort_rows(experts: Tensor, weights: Tensor, num_experts: int
              ) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """Sort this rank's N*k (token, slot) rows by global expert once per layer.

    Returns ``order`` [N*k] (sorted row -> (token, slot) index), ``bounds`` (E+1 host ints: expert e's rows are
    ``[bounds[e], bounds[e+1])``; one host sync), ``tok`` [N*k] (token of each sorted row), ``w_rows``
    [N*k, 1] (combination weight of each sorted row) and ``counts`` [E] (rows per expert, on the device).
    """
    k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    bounds = [0] + counts.cumsum(0).tolist()
    return order, bounds, order // k, weights.reshape(-1)[order].unsqueeze(1), counts


def experts_forward(groups: ExpertGroups, xs: Tensor, w_gu: Tensor, w_d: Tensor, gu_out: Tensor,
                    y_out: Tensor) -> None:
    """G experts on their rows (sorted by expert, ``groups``): ``gu_out = x_j @ w_gu_j^T`` (saved for backward),
    ``y_out = swiglu(gu_j) @ w_d_j^T``; ``w_gu`` [G, 2F, h], ``w_d`` [G, h, F]. Two GEMM launches where grouped
    GEMMs run (:mod:`lightning_tsp.kernels.grouped`), else two per expert."""
    f = w_d.shape[2]
    gu = groups.nt(xs, w_gu, out=gu_out)  # [n, 2F]
    act = F.silu(gu[:, :f]) * gu[:, f:]  # [n, F]
    groups.nt(act, w_d, out=y_out)  # [n, h]


def experts_backward(groups: ExpertGroups, xs: Tensor, dys: Tensor, ws: Tensor, gu: Tensor, w_gu: Tensor,
                     w_d: Tensor, dx_out: Tensor, dw_out: Tensor, acc_gu: Tensor, acc_d: Tensor) -> None:
    """Backward of ``ws * expert_j(x)`` for G experts' rows, ``dys`` the output gradient of each row.

    Writes the input gradients ``dx_out`` [n, h] and the combination-weight gradients ``dw_out`` [n]; adds the
    weight gradients into ``acc_gu`` [G, 2F, h] and ``acc_d`` [G, h, F] (fp32) in place.
    """
    d_hid = groups.nn(dys, w_d)  # [n, F] gradient of hid for a unit combination weight
    d_gu, hid = swiglu_backward(gu, d_hid * ws)  # hid [n, F]: the expert hidden activation
    dw_out.copy_((d_hid * hid).sum(-1, dtype=dw_out.dtype))  # d y / d weight = expert output
    groups.nn(d_gu, w_gu, out=dx_out)  # [n, h], one GEMM for both input gradients
    groups.tn_add_(acc_gu, d_gu, xs)  # [G, 2F, h]
    groups.tn_add_(acc_d, dys * ws, hid)  # [G, h, F]


def shard_groups(bounds: list[int], counts: Tensor, first: int, m: int, like: Tensor) -> ExpertGroups:
    """The rows of experts ``[first, first + m)`` (``bounds`` of the sorted rows on the host, ``counts`` per expert
    on the device), as groups starting at row 0."""
    sizes = [bounds[first + j + 1] - bounds[first + j] for j in range(m)]
    return ExpertGroups(sizes, like.device, dtype=like.dtype, counts=counts[first : first + m])


def combine_rows(rows: Tensor, order: Tensor, n: int, k: int, dtype: torch.dtype) -> Tensor:
    """Sorted rows [N*k, ...] back to (token, slot) order, the k slots of a token summed in a fixed order."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out.view(n, k, *rows.shape[1:]).sum(1).to(dtype)


class RingExperts(torch.autograd.Function):
    """The expert ring: ``y[t] = sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` over this rank's tokens.

    ``experts`` [N, k] (int64, no gradient) are global expert ids; ``gate_up`` [E/D, 2F, h] and ``down``
    [E/D, h, F] are this rank's experts. Exact: each (token, slot) row meets its expert's weights once.
    """

    @staticmethod
    def forward(ctx, x, weights, experts, gate_up, down, tsp: TSPGroup):
        b, l, h = x.shape
        n, k = experts.shape  # N = B*L local tokens, k routed experts per token
        m, f = down.shape[0], down.shape[2]  # experts per rank, expert intermediate size
        x2 = x.reshape(n, h)
        order, bounds, tok, w_rows, counts = sort_rows(experts, weights, m * tsp.size)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        out = torch.zeros(n * k, h, dtype=acc_dtype, device=x.device)  # gate-weighted expert outputs, sorted
        saved_gu = x.new_empty(n * k, 2 * f)  # gate|up pre-activations of every sorted row
        shapes = [gate_up.shape, down.shape]
        xs = x2[tok]  # [N*k, h] rows sorted by expert
        for s, buf in ring_shards(tsp, pack([gate_up, down], x.dtype)):
            w_gu, w_d = unpack(buf, shapes)  # [E/D, 2F, h], [E/D, h, F]
            lo, hi = bounds[s * m], bounds[(s + 1) * m]
            if lo == hi:  # no local token routed to this shard's experts (the ring hop still happens)
                continue
            groups = shard_groups(bounds, counts, s * m, m, x)
            experts_forward(groups, xs[lo:hi], w_gu, w_d, saved_gu[lo:hi], out[lo:hi])
        del xs
        out *= w_rows
        y = combine_rows(out, order, n, k, x.dtype)
        ctx.tsp, ctx.bounds, ctx.shapes = tsp, bounds, shapes
        ctx.save_for_backward(x, weights, order, gate_up, down, saved_gu, counts)
        return y.view(b, l, h)

    @staticmethod
    def backward(ctx, dy):
        x, weights, order, gate_up, down, saved_gu, counts = ctx.saved_tensors
        tsp, bounds, shapes = ctx.tsp, ctx.bounds, ctx.shapes
        b, l, h = x.shape
        n, k = weights.shape
        m = down.shape[0]
        x2, dy2 = x.reshape(n, h), dy.reshape(n, h).to(x.dtype)
        tok = order // k
        w_rows = weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)  # [N*k, 1]
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        dx_rows = torch.zeros(n * k, h, dtype=acc_dtype, device=x.device)  # input gradient of each sorted row
        dw_rows = torch.zeros(n * k, dtype=acc_dtype, device=x.device)  # gradient of each combination weight
        local = pack([gate_up, down], x.dtype)
        ring = RingGradPass(tsp, local, local.numel(), x.device, acc_dtype)
        xs, dys = x2[tok], dy2[tok]  # [N*k, h] rows sorted by expert
        for s, buf, acc in ring:
            w_gu, w_d = unpack(buf, shapes)
            acc_gu, acc_d = unpack(acc, shapes)  # views: the partials are added in place
            lo, hi = bounds[s * m], bounds[(s + 1) * m]
            if lo == hi:
                continue
            experts_backward(shard_groups(bounds, counts, s * m, m, x), xs[lo:hi], dys[lo:hi],
                             w_rows[lo:hi], saved_gu[lo:hi], w_gu, w_d, dx_rows[lo:hi], dw_rows[lo:hi], acc_gu, acc_d)
        dx = combine_rows(dx_rows, order, n, k, x.dtype).view(b, l, h)
        d_weights = torch.empty_like(dw_rows)
        d_weights[order] = dw_rows
        g_gu, g_d = unpack(ring.grad, shapes)
        return dx, d_weights.view(n, k).to(weights.dtype), None, g_gu.to(gate_up.dtype), g_d.to(down.dtype), None


def all_to_all_rows(t: Tensor, out_splits: list[int], in_splits: list[int], tsp: TSPGroup) -> Tensor:
    """Variable-size all-to-all of the rows of ``t`` (``in_splits[p]`` rows to member p, ``out_splits[p]`` from p).

    Zero-row splits are fine (every member still takes part). Identity on a group of one.
    """
    if tsp.size == 1:
        return t
    out = t.new_empty(sum(out_splits), *t.shape[1:])
    dist.all_to_all_single(out, t.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                           group=tsp.group)
    return out


class DispatchExperts(torch.autograd.Function):
    """Expert dispatch (expert parallelism over the TSP axis): the same function as :class:`RingExperts`.

    Expert weights stay on their owners. Each rank sends its routed (token, slot) rows, sorted by expert, to the
    experts' owners in one variable-size all-to-all (per-expert counts exchanged first); each owner runs one GEMM
    pair per local expert on the rows it received and returns the unscaled outputs (accumulation dtype) with a
    second all-to-all; the token's rank scales them by the combination weights and sums the k slots exactly as
    the ring does. Backward: output gradients (and combination weights) go to the owners, which compute the
    input, combination-weight and expert-weight gradients locally; the first two come back in one all-to-all.
    """

    @staticmethod
    def forward(ctx, x, weights, experts, gate_up, down, tsp: TSPGroup):
        b, l, h = x.shape
        n, k = experts.shape
        m, f = down.shape[0], down.shape[2]
        d = tsp.size
        x2 = x.reshape(n, h)
        order, bounds, tok, w_rows, counts = sort_rows(experts, weights, m * d)
        acc_dtype = torch.promote_types(x.dtype, torch.float32)
        # rows to owner p: experts [p*m, (p+1)*m), contiguous after the sort
        send_splits = [bounds[(p + 1) * m] - bounds[p * m] for p in range(d)]
        if d > 1:  # recv_counts[p, j]: rows member p sends for my local expert j
            recv_counts = torch.empty_like(counts)
            dist.all_to_all_single(recv_counts, counts, group=tsp.group)
        else:
            recv_counts = counts
        recv_counts = recv_counts.view(d, m)
        host = recv_counts.tolist()  # one host sync for the exchanged counts
        recv_splits = [sum(row) for row in host]
        xr = all_to_all_rows(x2[tok], recv_splits, send_splits, tsp)  # [R, h], by source then expert
        # the owner's rows grouped by local expert (one GEMM per expert); perm: grouped row -> received row
        eid = torch.arange(m, device=x.device).repeat(d).repeat_interleave(recv_counts.reshape(-1),
                                                                         output_size=sum(recv_splits))
        perm = torch.argsort(eid, stable=True)
        ebounds = [0]
        for j in range(m):
            ebounds.append(ebounds[-1] + sum(row[j] for row in host))
        local_counts = recv_counts.sum(0)  # [m] rows per local expert, on the device
        xs = xr[perm]
        r = xs.shape[0]
        saved_gu = x.new_empty(r, 2 * f)
        ys = torch.empty(r, h, dtype=acc_dtype, device=x.device)
        w_gu, w_d = gate_up.to(x.dtype), down.to(x.dtype)  # the compute dtype, as the ring's packed shards
        experts_forward(shard_groups(ebounds, local_counts, 0, m, x), xs, w_gu, w_d, saved_gu, ys)
        yr = torch.empty_like(ys)
        yr[perm] = ys
        out = all_to_all_rows(yr, send_splits, recv_splits, tsp)  # [N*k, h] sorted rows, unscaled
        out *= w_rows
        y = combine_rows(out, order, n, k, x.dtype)
        ctx.tsp, ctx.ebounds, ctx.splits = tsp, ebounds, (send_splits, recv_splits)
        ctx.save_for_backward(weights, order, gate_up, down, xs, saved_gu, perm, local_counts)
        ctx.x_shape = x.shape
        return y.view(b, l, h)

    @staticmethod
    def backward(ctx, dy):
        weights, order, gate_up, down, xs, saved_gu, perm, local_counts = ctx.saved_tensors
        tsp, ebounds, (send_splits, recv_splits) = ctx.tsp, ctx.ebounds, ctx.splits
        b, l, h = ctx.x_shape
        n, k = weights.shape
        m = down.shape[0]
        dtype = xs.dtype
        tok = order // k
        dy2 = dy.reshape(n, h).to(dtype)
        w_rows = weights.reshape(-1)[order].unsqueeze(1).to(dtype)
        acc_dtype = torch.promote_types(dtype, torch.float32)
        # output gradient and combination weight of each row, to the owners (one message)
        gr = all_to_all_rows(torch.cat([dy2[tok], w_rows], 1), recv_splits, send_splits, tsp)[perm]
        dye, we = gr[:, :h], gr[:, h:]
        r = xs.shape[0]
        dx_back = torch.zeros(r, h, dtype=acc_dtype, device=xs.device)  # input gradient per grouped row
        dw_back = torch.zeros(r, dtype=acc_dtype, device=xs.device)  # combination-weight gradient per row
        g_gu = torch.zeros(gate_up.shape, dtype=acc_dtype, device=xs.device)
        g_d = torch.zeros(down.shape, dtype=acc_dtype, device=xs.device)
        w_gu, w_d = gate_up.to(dtype), down.to(dtype)
        experts_backward(shard_groups(ebounds, local_counts, 0, m, xs), xs, dye.contiguous(), we, saved_gu, w_gu,
                         w_d, dx_back, dw_back, g_gu, g_d)
        br = torch.empty(r, h + 1, dtype=acc_dtype, device=xs.device)  # [dx | d weight], one message
        br[perm] = torch.cat([dx_back, dw_back.unsqueeze(1)], 1)
        rows = all_to_all_rows(br, send_splits, recv_splits, tsp)  # [N*k, h+1] sorted rows
        dx = combine_rows(rows[:, :h].contiguous(), order, n, k, dtype).view(b, l, h)
        d_weights = torch.empty(n * k, dtype=acc_dtype, device=rows.device)
        d_weights[order] = rows[:, h]
        return dx, d_weights.view(n, k).to(weights.dtype), None, g_gu.to(gate_up.dtype), g_d.to(down.dtype), None


class TSPExperts(nn.Module):
    """This rank's E/D experts, stacked (Hugging Face >= 5 layout); global experts [rank*E/D, (rank+1)*E/D)."""

    tsp_shard_dims = {"gate_up_proj": 0, "down_proj": 0}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tsp: TSPGroup,
                 device=None, dtype=None, schedule: str = "ring", top_k: int = 1):
        super().__init__()
        if schedule not in SCHEDULES:
            raise TSPConfigError(f"schedule={schedule!r}; choose one of {SCHEDULES}")
        self.tsp, self.schedule, self.top_k = tsp, schedule, top_k
        m = num_experts // tsp.size
        kw = dict(device=device, dtype=dtype)
        self.gate_up_proj = nn.Parameter(torch.empty(m, 2 * intermediate_size, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(m, hidden_size, intermediate_size, **kw))
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's default init per expert (uniform in +-1/sqrt(fan_in)); models re-initialise anyway."""
        for w in (self.gate_up_proj, self.down_proj):
            bound = 1 / math.sqrt(w.shape[-1])
            w.uniform_(-bound, bound)

    def forward(self, x: Tensor, weights: Tensor, experts: Tensor) -> Tensor:
        """x [B, L, h] local tokens, weights/experts [B*L, k] -> [B, L, h] gate-weighted sum of routed experts."""
        fn = RingExperts if self.schedule_for(experts.numel(), x.dtype) == "ring" else DispatchExperts
        return fn.apply(x, weights, experts, local_tensor(self.gate_up_proj), local_tensor(self.down_proj), self.tsp)

    def schedule_for(self, rows: int, dtype: torch.dtype) -> str:
        """The schedule that runs ``rows`` routed (token, slot) rows per rank: the configured one, or for
        ``"auto"`` the cheaper one by the cost model (:func:`lightning_tsp.planning.moe.choose_expert_schedule`;
        every rank holds as many rows, so every rank makes the same choice)."""
        if self.schedule != "auto":
            return self.schedule
        if self.tsp.size == 1:
            return "ring"  # no traffic either way
        from lightning_tsp.planning.moe import choose_expert_schedule

        m, h, f = self.down_proj.shape
        return choose_expert_schedule(num_experts=m * self.tsp.size, hidden_size=h, intermediate_size=f,
                                      top_k=self.top_k, tokens=rows // self.top_k, tsp_size=self.tsp.size,
                                      compute_bytes=torch.empty((), dtype=dtype).element_size(),
                                      training=torch.is_grad_enabled())


def check_moe_shape(*, tsp_size: int, num_experts: int, top_k: int, shared_intermediate_size: int,
                    gating: str, schedule: str = "ring") -> None:
    """Invariants of :class:`TSPMoE` (raised at construction, before any collective)."""
    if gating not in GATINGS:
        raise TSPConfigError(f"gating={gating!r}; choose one of {GATINGS}")
    if schedule not in SCHEDULES:
        raise TSPConfigError(f"schedule={schedule!r}; choose one of {SCHEDULES}")
    if num_experts < 1 or num_experts % tsp_size != 0:
        raise TSPConfigError(
            f"num_experts={num_experts} is not divisible by tsp_size={tsp_size}: both expert schedules give each rank "
            f"num_experts/D whole experts. Choose a tsp_size that divides {num_experts}."
        )
    if not 1 <= top_k <= num_experts:
        raise TSPConfigError(f"top_k={top_k} must be between 1 and num_experts={num_experts}")
    if shared_intermediate_size < 0 or shared_intermediate_size % tsp_size != 0:
        raise TSPConfigError(
            f"shared_intermediate_size={shared_intermediate_size} is not divisible by tsp_size={tsp_size}: the "
            f"shared expert runs the dense ring schedule (intermediate_size/D columns per rank). Choose a size that "
            f"is a multiple of {tsp_size}, or 0 for no shared expert."
        )


def router_stats(experts: Tensor, probs: Tensor, num_experts: int) -> Tensor:
    """This rank's routing statistics of one layer [2, E] (at least fp32): routed-slot counts per expert (no
    gradient) and the sums of the router probabilities per expert (with gradient). Summed over layers and ranks
    they give the load-balancing loss (:func:`load_balancing_loss`)."""
    dt = torch.promote_types(probs.dtype, torch.float32)
    counts = torch.bincount(experts.reshape(-1), minlength=num_experts).to(dt)  # [E]
    return torch.stack([counts, probs.sum(0).to(dt)])  # [2, E]


def load_balancing_loss(stats: Tensor, rows: int, tsp: TSPGroup) -> Tensor:
    """Switch / Mixtral auxiliary loss ``E * sum_e f_e * P_e`` over ALL rows of the group.

    ``stats`` [2, E]: this rank's :func:`router_stats`, summed over the layers that share the loss; ``rows``: how
    many (token, layer) rows they cover on this rank (every rank holds as many: zigzag). ``f_e`` = routed slots of
    expert e per row, ``P_e`` = mean router probability of e: Hugging Face's ``load_balancing_loss_func`` (no
    attention mask), which pools the layers before the product. One all-reduce whose backward is the identity (each
    rank differentiates its own partial, like the loss). The same value on every rank.
    """
    if tsp.size > 1:
        stats = SumOverGroup.apply(stats, tsp)
    f, p = stats / (rows * tsp.size)
    return stats.shape[1] * (f * p).sum()


class TSPMoE(nn.Module):
    """Mixture-of-experts SwiGLU MLP under TSP: top-k router, E experts (E/D per rank), optional shared expert.

    ``gating``: ``"mixtral"`` (softmax over the top-k logits) or ``"qwen3"`` (softmax over all E logits, then
    top-k, renormalised to sum 1 iff ``norm_topk_prob``; Qwen3-MoE with ``norm_topk_prob=True`` is the same
    function as Mixtral). No capacity limit, no token dropping, no router jitter. ``forward`` returns
    ``(y, router_stats)``: this rank's routing statistics, from which the model forms the load-balancing loss.

    ``schedule``: ``"ring"`` (:class:`RingExperts`: expert weights circulate, tokens stay), ``"dispatch"``
    (:class:`DispatchExperts`: routed token rows go to the experts' owners by all-to-all, weights stay) or
    ``"auto"`` (the cost model's pick per call). All compute the same function with the same per-row arithmetic and
    combination order.
    """

    tsp_shard_dims: dict[str, int] = {}  # the router is replicated; experts / shared_expert declare their own

    def __init__(self, hidden_size: int, num_experts: int, intermediate_size: int, top_k: int, tsp: TSPGroup,
                 gating: str = "mixtral", norm_topk_prob: bool = False, shared_intermediate_size: int = 0,
                 device=None, dtype=None, schedule: str = "ring"):
        super().__init__()
        check_moe_shape(tsp_size=tsp.size, num_experts=num_experts, top_k=top_k,
                        shared_intermediate_size=shared_intermediate_size, gating=gating, schedule=schedule)
        self.tsp, self.num_experts, self.top_k = tsp, num_experts, top_k
        self.gating, self.norm_topk_prob = gating, norm_topk_prob
        kw = dict(device=device, dtype=dtype)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, **kw)
        self.experts = TSPExperts(num_experts, hidden_size, intermediate_size, tsp, schedule=schedule, top_k=top_k,
                                  **kw)
        self.shared_expert = (TSPGatedMLP(hidden_size, shared_intermediate_size, tsp, **kw)
                              if shared_intermediate_size else None)

    def route(self, x2: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x2 [N, h] -> combination weights [N, k] (x's dtype), expert ids [N, k], router probabilities [N, E]."""
        w = local_tensor(self.gate.weight).to(x2.dtype)
        w = SumGradOverGroup.apply(w, self.tsp) if self.tsp.size > 1 else w
        logits = x2 @ w.T  # [N, E]
        fdt = torch.promote_types(x2.dtype, torch.float32)
        probs = torch.softmax(logits.to(fdt), dim=-1)  # [N, E], also the aux loss's P
        if self.gating == "mixtral":
            top_logits, experts = logits.topk(self.top_k, dim=-1)  # [N, k]
            weights = torch.softmax(top_logits.to(fdt), dim=-1)
        else:
            weights, experts = probs.topk(self.top_k, dim=-1)
            if self.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x2.dtype), experts, probs

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [B, L, h] local (zigzag) tokens -> (y [B, L, h], this rank's :func:`router_stats` [2, E]; the
        load-balancing loss is :func:`load_balancing_loss` of their sum over layers)."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            x = x.to(dtype)
            weights, experts, probs = self.route(x.reshape(-1, x.shape[-1]))
            y = self.experts(x, weights, experts)
            if self.shared_expert is not None:
                y = y + self.shared_expert(x)
            return y, router_stats(experts, probs, self.num_experts)
