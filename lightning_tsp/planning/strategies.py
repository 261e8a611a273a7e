"""Per-strategy analytical model: memory, communication, FLOPs and step time of one layout.

Strategies (``Layout.strategy``), each with its model-parallel degrees; the remaining GPUs are data-parallel
replicas (``dp = gpus / model_parallel``), meshes laid out with the model-parallel axes innermost:
  dp       plain data parallelism (replicated weights and optimizer)
  fsdp     ZeRO-3 / FSDP over ``fsdp`` ranks (hybrid-sharded when fsdp < gpus)
  tp       plain tensor parallelism (Megatron column/row pairs, two all-reduces per layer each way)
  tp_sp    TP with Megatron-style sequence parallelism on the same 1-D group (AG before / RS after each block)
  sp       sequence / context parallelism, replicated weights, zigzag shards, all-gather K/V
  tp_x_sp  TP (size tp, inner) x SP (size sp) on a 2-D grid
  tsp      TSP (broadcast schedule + MLP ring + vocab rings) over ``tsp`` ranks
All memory numbers are bytes on one GPU; communication is what one GPU issues.

Mixture-of-experts models: each strategy shards the experts the way it shards its MLP. DP, SP: replicated.
FSDP: every parameter 1/f, a layer gathered whole (all its experts). TP, TP-SP, TPxSP: every expert's columns
split over T (expert tensor parallelism: the same activation collectives as a dense MLP, every rank runs all
routed rows on its slice); the router is replicated. TSP: E/D whole experts per rank, the expert ring or expert
dispatch (the cheaper one, ``planning.moe``). Activations: a token's k experts (and the shared expert) stand in
for the dense SwiGLU width (k*F_e + F_s); routing is assumed balanced.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import collectives as C
from .flops import training_flops
from .grouping import mlp_grads_by_owners, step_kv_heads
from .hardware import (ALL_TO_ALL_LATENCY_S, HOST_SYNC_S, INTER_LATENCY_S, INTRA_LATENCY_S, TSP_STEP_PASS_S,
                       Hardware)
from .model import ModelShape
from .moe import choose_expert_schedule, crossover_tokens
from .precision import Precision

__all__ = ["STRATEGIES", "STRATEGY_LABELS", "Layout", "CommEntry", "Estimate", "estimate", "memory_breakdown",
           "tsp_expert_schedule", "tsp_expert_crossover_seq"]

STRATEGIES = ("dp", "fsdp", "tp", "tp_sp", "sp", "tp_x_sp", "tsp")
STRATEGY_LABELS = {
    "dp": "DP",
    "fsdp": "FSDP",
    "tp": "TP",
    "tp_sp": "TP-SP",
    "sp": "SP",
    "tp_x_sp": "TPxSP",
    "tsp": "TSP",
}


@dataclass(frozen=True)
class Layout:
    strategy: str
    gpus: int
    gpus_per_node: int
    tp: int = 1
    sp: int = 1
    tsp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}: use one of {', '.join(STRATEGIES)}")
        if self.gpus % self.model_parallel:
            raise ValueError(f"{self.gpus} GPUs are not a multiple of the model-parallel size {self.model_parallel}")
        if self.strategy == "fsdp" and self.gpus % self.fsdp:
            raise ValueError(f"{self.gpus} GPUs are not a multiple of the FSDP degree {self.fsdp}")

    @property
    def model_parallel(self) -> int:
        """GPUs that share one micro-batch (FSDP ranks each process their own)."""
        return self.tp * self.sp * self.tsp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: distinct micro-batches per step."""
        return self.gpus // self.model_parallel

    @property
    def label(self) -> str:
        base = STRATEGY_LABELS[self.strategy]
        if self.strategy in ("dp", "fsdp") or self.dp == 1:
            return base
        return base + " x DP"

    @property
    def degrees(self) -> str:
        s = self.strategy
        if s == "dp":
            return f"dp={self.dp}"
        if s == "fsdp":
            rep = self.gpus // self.fsdp
            return f"shard={self.fsdp}" + (f" rep={rep}" if rep > 1 else "")
        if s in ("tp", "tp_sp"):
            return f"T={self.tp}"
        if s == "sp":
            return f"S={self.sp}"
        if s == "tp_x_sp":
            return f"T={self.tp} S={self.sp}"
        return f"D={self.tsp}"


def _link(size: int, stride: int, gpn: int) -> str:
    """A group of ``size`` ranks spaced ``stride`` apart (ranks numbered node by node) stays inside one node iff
    it spans at most one node; otherwise its traffic is charged to the inter-node links."""
    return "intra" if size * stride <= gpn else "inter"


@dataclass
class CommEntry:
    """One kind of collective. ``bytes``/``calls`` are per occurrence; ``per_layer`` entries occur n_layers times
    per step, the others once per step."""

    phase: str  # "forward" | "backward"
    op: str  # one of collectives.OPS
    group: str  # "tsp" | "tp" | "sp" | "dp" | "fsdp" | "replicate"
    group_size: int
    link: str  # "intra" | "inter"
    bytes: int
    calls: int
    overlap: bool  # can run behind compute
    per_layer: bool
    what: str = ""
    layers: int | None = None  # per-layer entries of only some layers (MoE or dense ones): how many

    def occurrences(self, n_layers: int) -> int:
        if not self.per_layer:
            return 1
        return n_layers if self.layers is None else self.layers

    @property
    def wire(self) -> float:
        return C.wire_bytes(self.op, self.bytes, self.group_size)


@dataclass
class Estimate:
    layout: Layout
    shape: ModelShape
    hardware: Hardware
    precision: Precision
    micro_batch: int
    seq_len: int
    checkpointing: str
    memory: dict[str, float]  # component -> bytes; "peak" is the total
    comm: list[CommEntry]
    flops: dict[str, float]  # per device per step: "model", "hardware" (= "hardware_matmul" + "hardware_attention")
    compute_s: float
    comm_overlap_s: float
    comm_exposed_s: float
    step_s: float
    headroom: float = 0.9
    notes: list[str] = field(default_factory=list)
    expert_schedule: str | None = None  # TSP on an MoE model: "ring" or "dispatch"
    shard_group: int | None = None  # TSP: owners per broadcast-schedule step ("auto" as the model resolves it)
    fixed_s: float = 0.0  # TSP: fitted fixed cost beyond the FLOPs (tsp_fixed_s); not in step_s, see step_fitted_s
    optimizer: str = "foreach"  # the AdamW implementation whose step the memory counts (OPTIMIZERS)

    @property
    def step_fitted_s(self) -> float:
        """The step with TSP's fitted fixed cost (launches, small kernels, host time) added to its compute. The
        ranking keeps ``step_s``: the other strategies' fixed costs are not modelled, and adding TSP's alone
        would rank the strategies on different bases."""
        return max(self.compute_s + self.fixed_s, self.comm_overlap_s) + self.comm_exposed_s

    @property
    def peak_bytes(self) -> float:
        return self.memory["peak"]

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.headroom * self.hardware.hbm_bytes

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq_len * self.layout.dp

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else float("inf")

    def comm_bytes(self, *, per_layer: bool | None = None, phase: str | None = None, link: str | None = None,
                   wire: bool = False, group: str | None = None) -> dict[str, float]:
        """Bytes by op, filtered. Per-layer entries count once each (not x n_layers) when ``per_layer=True``;
        with ``per_layer=None`` everything of one step is summed (layers x n_layers)."""
        out = {op: 0.0 for op in C.OPS}  # + "all_to_all" when expert dispatch issues it
        for e in self.comm:
            if per_layer is not None and e.per_layer != per_layer:
                continue
            if (phase and e.phase != phase) or (link and e.link != link) or (group and e.group != group):
                continue
            k = 1 if per_layer is not None else e.occurrences(self.shape.n_layers)
            out[e.op] = out.get(e.op, 0.0) + k * (e.wire if wire else e.bytes)
        return out

    def step_wire(self, link: str) -> float:
        """Bytes one GPU puts on ``link`` ("intra"/"inter") per step."""
        return sum(self.comm_bytes(link=link, wire=True).values())


# ----------------------------------------------------------------------------------------------------------------
# Parameters held by one GPU
# ----------------------------------------------------------------------------------------------------------------

def _kv_local(n_kv: int, T: int) -> int:
    return n_kv // T if n_kv % T == 0 else 1


def _sharded_params(shape: ModelShape, T: int) -> int:
    """Head/column-sharded layers over T ranks (TP, TSP): attention by heads, MLP by intermediate columns,
    embedding / LM head by vocab (padded), norms replicated. MoE layers: experts 1/T (TSP: E/T whole experts,
    TP: every expert's columns), the shared expert by columns, the router replicated."""
    h, hd = shape.hidden_size, shape.hd
    attn = 2 * (shape.n_heads // T) * hd * h + 2 * _kv_local(shape.n_kv_heads, T) * hd * h
    mlp = 3 * shape.intermediate_size // T * h
    moe = (shape.num_experts * shape.expert_params + shape.shared_expert_params) // T + shape.router_params
    vocab = -(-shape.vocab_size // T) * h * (1 if shape.tie_word_embeddings else 2)
    layers = sum(n * (attn + (moe if is_moe else mlp) + shape.norm_params) for n, is_moe in shape.layer_kinds())
    return layers + vocab + h


def local_params(shape: ModelShape, layout: Layout) -> int:
    s = layout.strategy
    if s in ("dp", "sp"):
        return shape.total_params
    if s == "fsdp":
        return -(-shape.total_params // layout.fsdp)
    if s in ("tp", "tp_sp", "tp_x_sp"):
        return _sharded_params(shape, layout.tp)
    return _sharded_params(shape, layout.tsp)


# ----------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------

def _layer_activations(shape: ModelShape, p: Precision, mode: str, *, T_res: float, T_norm: float, T_tok: float,
                       q_heads: int, kv_heads: int, F_loc: int, kv_gathered: float, norm_gathered: bool,
                       mlp_saved: int) -> tuple[float, float]:
    """(full, saved) activation bytes of one layer on one GPU.

    Saved for backward without checkpointing:
      RMSNorm x2: its input and the normalised tensor (residual dtype, T_res tokens) and its output cast to the
        compute dtype (the projections' saved input; T_norm tokens: the full sequence when gathered, TP-SP);
      attention: q, k, v (after RoPE), output o, and an fp32 log-sum-exp per head (flash-style kernels keep no
        S x S scores);
      SwiGLU: ``mlp_saved`` tensors of width F_loc: 4 with plain autograd (gate, silu(gate), up, their product),
        2 in TSP's ring MLP (gate and up; silu and the product are recomputed in backward);
      gathered full-sequence K/V, where a strategy keeps them (SP, TPxSP).
    ``selective`` recomputes the norms (unless their output was gathered: that needs communication) and the
    SwiGLU elementwise ops (keeps 2 F-wide tensors); for TSP (``mlp_saved == 2``) it keeps the attention half and
    re-runs the second norm and the MLP ring from the block's input; ``full`` keeps only the layer input;
    ``keep-attention`` keeps it and the attention outputs (o in the compute dtype, an fp32 log-sum-exp per head);
    ``offload`` keeps both in host memory, ``full-offload`` the layer input only (nothing on the GPU).
    """
    h, hd, a, r = shape.hidden_size, shape.hd, p.compute, p.residual
    norm_in = 2 * h * r * T_res  # both norms' inputs
    normalised = 2 * h * r * T_res
    norm_out = 2 * h * a * T_norm
    attn = (2 * q_heads + 2 * kv_heads) * hd * a * T_tok + q_heads * 4 * T_tok
    mlp = mlp_saved * F_loc * a * T_tok
    kvg = kv_gathered * a
    full = norm_in + normalised + norm_out + attn + mlp + kvg
    if mode == "none":
        saved = full
    elif mode == "selective" and mlp_saved == 2:  # TSP: keeps the attention half, re-runs norm + MLP block
        saved = (norm_in + normalised + norm_out) / 2 + attn + h * r * T_res
    elif mode == "selective":
        saved = norm_in + (norm_out if norm_gathered else 0) + attn + 2 * F_loc * a * T_tok + kvg
    elif mode == "full":
        saved = h * r * T_res
    elif mode == "keep-attention":
        saved = h * r * T_res + q_heads * (hd * a + 4) * T_tok
    elif mode in C.OFFLOADED:  # what keep-attention / full keep, in pinned host memory instead
        saved = 0
    else:
        raise ValueError(f"checkpointing must be one of {C.CHECKPOINTING}, got {mode!r}")
    return full, saved


# AdamW implementations the memory model knows: torch.optim.AdamW on CUDA defaults to "foreach", which
# materialises one temporary per parameter of the state dtype (half the optimizer-state bytes) during the step;
# "fused" (AdamW(fused=True), torchtitan's default) updates in place; "forloop" one parameter at a time (no
# temporary worth counting)
OPTIMIZERS = ("foreach", "fused", "forloop")

LM_HEAD_TOKEN_CHUNK = 4096  # tokens per logit block in TSP's ring cross-entropy (TSPLMHead's default)


def ring_transient_bytes(M: int, tokens: float, hidden: int, D: int, w: int, a: int, ffn: int | None = None) -> float:
    """A TSP ring's backward working set for a shard of M elements: own packed shard + current + next (3 M, compute
    dtype ``w``) and the fp32 accumulator + the one arriving (2 M). For a gated MLP of width ``ffn`` whose backward
    sends its activation gradients to the shards' owners (``mlp_grads_by_owners``: short sequences) instead: one
    fp32 gradient (M), the gathered x and dy (2 D ``tokens`` h), every rank's gate/up and hidden gradients for this
    shard (D ``tokens`` 3F/D) and this rank's D-1 sent ones until they are waited, in the activation dtype ``a``."""
    g = C.G_BYTES
    if ffn is not None and mlp_grads_by_owners("auto", int(tokens), hidden, ffn // D, D, a, g):
        return 3 * M * w + M * g + (2 * D * hidden + (2 * D - 1) * 3 * (ffn // D)) * tokens * a
    return 3 * M * w + 2 * M * g


def memory_breakdown(shape: ModelShape, layout: Layout, p: Precision, B: int, S: int, checkpointing: str,
                     expert_schedule: str | None = None, shard_group: int | str = "auto",
                     optimizer: str = "foreach") -> dict[str, float]:
    """Peak bytes on one GPU and its parts.

    train_peak = weights + compute_copy + optimizer
               + max(n_layers * saved_per_layer + max(layer_working, head_working),   (start of backward)
                     grads + layer_working)                                             (end of backward)
    optimizer_step_peak = weights + grads + 1.5 * optimizer       (``optimizer="foreach"``: AdamW's temporary;
                                                                   1.0 * optimizer for "fused" / "forloop")
    peak = max(train_peak, optimizer_step_peak)
    layer_working: one layer's activations that are not saved (recomputed in backward) + the strategy's transient
    buffers during a layer; head_working: the LM-head stage (logits + vocab buffers), which runs while every
    layer's saved activations are alive and before any layer is recomputed.
    MoE layers: activations with the SwiGLU width a token meets (k*F_e + F_s); TSP's transient buffers of the
    ``expert_schedule`` ("ring": the expert ring's shards; "dispatch": the routed rows in flight; None: the larger).
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: the memory model knows {OPTIMIZERS}")
    s, h, V = layout.strategy, shape.hidden_size, shape.vocab_size
    a, w = p.compute, p.compute
    n = local_params(shape, layout)
    T = B * S
    resident = s not in ("fsdp", "tsp")  # weights used in place (autocast casts and keeps a low-precision copy)
    mem: dict[str, float] = {
        "weights": n * p.weight,
        "compute_copy": n * p.compute_copy if resident else 0,
        "grads": n * p.grad,
        "optimizer": n * p.optimizer,
    }
    nq, nkv, F = shape.n_heads, shape.n_kv_heads, shape.intermediate_size
    layer_transient = 0.0
    head_transient = 0.0
    split = layout.tp if s in ("tp", "tp_sp", "tp_x_sp") else 1  # the MLP's column split
    kw = dict(norm_gathered=False, kv_gathered=0.0, mlp_saved=4)
    if s in ("dp", "fsdp"):
        kw.update(T_res=T, T_norm=T, T_tok=T, q_heads=nq, kv_heads=nkv)
        logits_bytes = T * V * (a + 4)  # logits (compute dtype) + fp32 log-softmax kept for backward
        if s == "fsdp":
            lp = shape.layer_params
            layer_transient = 2 * lp * w + lp * p.grad  # gathered layer + prefetched next + unsharded grads
            vp = V * h
            head_transient = vp * w + vp * p.grad
    elif s in ("tp", "tp_sp"):
        t = layout.tp
        seq_sharded = s == "tp_sp"
        kw.update(T_res=T / t if seq_sharded else T, T_norm=T, T_tok=T, q_heads=nq // t,
                  kv_heads=_kv_local(nkv, t), norm_gathered=seq_sharded)
        logits_bytes = T * -(-V // t) * (a + 4)  # vocab-parallel cross-entropy
    elif s == "sp":
        sig = layout.sp
        kw.update(T_res=T / sig, T_norm=T / sig, T_tok=T / sig, q_heads=nq, kv_heads=nkv,
                  kv_gathered=2 * T * nkv * shape.hd)
        logits_bytes = T / sig * V * (a + 4)
    elif s == "tp_x_sp":
        t, sig = layout.tp, layout.sp
        kvl = _kv_local(nkv, t)
        kw.update(T_res=T / sig, T_norm=T / sig, T_tok=T / sig, q_heads=nq // t, kv_heads=kvl,
                  kv_gathered=2 * T * kvl * shape.hd)
        logits_bytes = T / sig * -(-V // t) * (a + 4)
    else:  # tsp
        D = layout.tsp
        T_loc = T / D
        kw.update(T_res=T_loc, T_norm=T_loc, T_tok=T_loc, q_heads=nq, kv_heads=nkv, mlp_saved=2)
        # ring cross-entropy: one [chunk, V/D] fp32 logit block (+ fp32 exp / softmax block, compute-dtype grad)
        logits_bytes = min(T_loc, LM_HEAD_TOKEN_CHUNK) * -(-V // D) * (4 + 4 + a)
        if D > 1:
            A = C.tsp_attn_shard_numel(shape, D)
            sg = C.resolve_shard_group(shape, B, S, D, a, shard_group)  # owners per broadcast-schedule step
            _, kv_own = C.tsp_local_heads(shape, D)
            kv_step = step_kv_heads(sg, kv_own, D // C.tsp_kv_groups(shape, D))
            if shape.kv_bucket_heads:  # head bucketing: that many KV heads' K/V gathered at a time
                kv_step = min(kv_step, shape.kv_bucket_heads)
            kv = C.tsp_kv_gather_numel(shape, B, S, D) * kv_step // kv_own  # one step's gathered K/V
            Vs = C.tsp_vocab_shard_numel(shape, D)
            g = C.G_BYTES
            # attention (backward is the larger phase): own packed shard + the step's shards computing + the next
            # step's in flight (A + 2 sg A, compute dtype), the step's fp32 weight-grad partials being reduced +
            # the own result ((sg + 1) A fp32), the step's gathered K/V (compute dtype), fp32 dK/dV in gather
            # order (reduce-scattered in place) and the kernel's dK/dV output of one call (compute dtype)
            attn_tr = (1 + 2 * sg) * A * w + (sg + 1) * A * g + kv * a + kv * g + kv * a
            def ring(M: int, ffn: int | None = None) -> float:
                return ring_transient_bytes(M, T_loc, h, D, w, a, ffn)
            mlp_tr = 0.0
            if shape.n_moe_layers < shape.n_layers:  # the dense MLP ring
                # backward, besides the ring: the fp32 input-gradient accumulator [T, h], the incoming gradient
                # cast to the compute dtype where the residual stream is wider, and per shard the SwiGLU
                # backward's [T, F/D] tensors beyond the activations term (the down-projection's input gradient,
                # hid, the elementwise temporaries; "keep" also the gate/up gradient [T, 2F/D]): 5 or 7 of them
                # (a memory snapshot of the 7B at 512K tokens, D = 8)
                f_loc = F // D
                extra = 5 if shape.mlp_activations == "recompute" else 7
                mlp_tr = (ring(C.tsp_mlp_shard_numel(shape, D), F) + T_loc * h * g
                          + (T_loc * h * a if p.residual > a else 0) + extra * T_loc * f_loc * a)
            if shape.is_moe:
                Me = C.tsp_expert_shard_numel(shape, D)
                rows = T_loc * shape.experts_per_token
                # dispatch: own experts cast to the compute dtype, rows out + in (compute dtype) and outputs out +
                # in (fp32), routing balanced
                tr = {"ring": ring(Me), "dispatch": Me * w + rows * h * (2 * w + 2 * g)}
                moe_tr = tr[expert_schedule] if expert_schedule else max(tr.values())
                shared_tr = (ring(C.tsp_shared_expert_shard_numel(shape, D), shape.shared_expert_intermediate_size)
                             if shape.shared_expert_params else 0)
                mlp_tr = max(mlp_tr, moe_tr, shared_tr)  # the shared expert runs after the routed ones
            layer_transient = max(attn_tr, mlp_tr)  # attention and MLP run one after the other
            head_transient = 3 * Vs * w + 2 * Vs * g + T_loc * h * 4  # LM-head ring + fp32 dx
    kinds = []  # (layers, full, saved) of the dense and the MoE layers
    for n, moe in shape.layer_kinds():
        width = shape.experts_per_token * shape.expert_intermediate_size + shape.shared_expert_intermediate_size
        kw["F_loc"] = (width if moe else F) // split
        full, saved = _layer_activations(shape, p, checkpointing, **kw)
        if s == "tsp" and not moe and shape.mlp_activations == "recompute":
            # the ring keeps no pre-activations: one shard's gate/up and their gradient [T, 2F/D] each at a time
            # instead of every shard's gate/up [T, 2F]; a layer that saves its activations saves that much less
            less = (2 - 4 / layout.tsp) * F * a * kw["T_tok"]
            full, saved = full - less, saved - (less if checkpointing == "none" else 0)
        kinds.append((n, full, saved))
    final_hidden = kw["T_res"] * h * p.residual
    mem["activations"] = sum(n * saved for n, _, saved in kinds)
    mem["layer_working"] = max(full - saved for _, full, saved in kinds) + layer_transient
    if checkpointing in C.OFFLOADED:
        # what a layer keeps in host memory comes back to the GPU for its recomputation, and the next layer's is
        # prefetched meanwhile: two layers' kept tensors on the GPU (one in a 1-layer model)
        kept = _layer_activations(shape, p, C.OFFLOADS[checkpointing], **kw)[1]
        mem["layer_working"] += min(shape.n_layers, 2) * kept
    mem["head_working"] = logits_bytes + final_hidden + head_transient
    mem["transient_buffers"] = max(layer_transient, head_transient)  # informational (included above)
    states = mem["weights"] + mem["compute_copy"] + mem["grads"] + mem["optimizer"]
    mem["model_states"] = states
    # Gradients are allocated while backward runs (zero_grad(set_to_none=True), the PyTorch and Lightning
    # default) and saved activations are freed as it goes, layer by layer: both are linear in the layers done,
    # so the peak is at one end: all activations (LM head / first recomputed layer) or all gradients (last layer).
    resident_states = mem["weights"] + mem["compute_copy"] + mem["optimizer"]
    mem["train_peak"] = resident_states + max(
        mem["activations"] + max(mem["layer_working"], mem["head_working"]),
        mem["grads"] + mem["layer_working"],
    )
    # optimizer step: activations and autocast copies are gone; foreach AdamW materialises one temporary of the
    # state dtype per parameter (sqrt of exp_avg_sq), i.e. half the optimizer-state bytes
    temporary = 0.5 if optimizer == "foreach" else 0.0
    mem["optimizer_step_peak"] = mem["weights"] + mem["grads"] + mem["optimizer"] * (1.0 + temporary)
    mem["peak"] = max(mem["train_peak"], mem["optimizer_step_peak"])
    return mem


# ----------------------------------------------------------------------------------------------------------------
# Communication
# ----------------------------------------------------------------------------------------------------------------

def _tsp_comm(shape: ModelShape, layout: Layout, p: Precision, B: int, S: int, mode: str,
              expert_schedule: str = "ring", shard_group: int | str = "auto") -> list[CommEntry]:
    D, gpn = layout.tsp, layout.gpus_per_node
    link = _link(D, 1, gpn)
    out: list[CommEntry] = []

    def add(tb: C.Tally, tc: C.Tally, per_layer: bool, what: str, layers: int | None = None) -> None:
        for ph in C.PHASES:
            for op, v in tb[ph].items():
                if v:  # expert dispatch's all-to-alls block the next GEMM: not overlapped
                    out.append(CommEntry(ph, op, "tsp", D, link, v, tc[ph][op], op != "all_to_all", per_layer,
                                         what, layers))

    w = p.compute
    for n, moe in shape.layer_kinds():
        kw = dict(moe=moe, expert_schedule=expert_schedule, shard_group=shard_group)
        add(C.tsp_layer_collectives(shape, B, S, D, w, True, mode, **kw),
            C.tsp_layer_collectives(shape, B, S, D, w, True, mode, what="calls", **kw), True,
            f"MoE layer ({expert_schedule})" if moe else "layer", None if n == shape.n_layers else n)
    add(C.tsp_embedding_collectives(shape, D, p.weight), C.tsp_embedding_collectives(shape, D, p.weight, what="calls"),
        False, "embedding")
    add(C.tsp_lm_head_collectives(shape, D, w), C.tsp_lm_head_collectives(shape, D, w, what="calls"), False,
        "lm_head")
    add(C.tsp_final_norm_collectives(shape, D), C.tsp_final_norm_collectives(shape, D, what="calls"), False,
        "final_norm")
    add(C.tsp_loss_collectives(D), C.tsp_loss_collectives(D, what="calls"), False, "loss")
    return out


def _grad_sync(n_params: int, p: Precision, size: int, stride: int, gpn: int, group: str) -> list[CommEntry]:
    if size <= 1:
        return []
    return [CommEntry("backward", "all_reduce", group, size, _link(size, stride, gpn), n_params * p.grad, 1,
                      True, False, "gradient all-reduce")]


def communication(shape: ModelShape, layout: Layout, p: Precision, B: int, S: int, mode: str,
                  expert_schedule: str = "ring", shard_group: int | str = "auto") -> list[CommEntry]:
    """Everything one GPU issues per step. Logical bytes follow the collectives.py convention.
    ``expert_schedule``: TSP's MoE layers ("ring" or "dispatch")."""
    s, gpn, h, a = layout.strategy, layout.gpus_per_node, shape.hidden_size, p.compute
    T = B * S
    out: list[CommEntry] = []
    n_local = local_params(shape, layout)
    full = mode in C.RECOMPUTING

    def E(phase, op, group, size, stride, nbytes, calls, overlap, per_layer, what, layers=None):
        if size > 1 and nbytes:
            out.append(CommEntry(phase, op, group, size, _link(size, stride, gpn), int(nbytes), calls, overlap,
                                 per_layer, what, layers))

    if s == "dp":
        out += _grad_sync(n_local, p, layout.dp, 1, gpn, "dp")
    elif s == "fsdp":
        f = layout.fsdp
        other = shape.embedding_params + shape.lm_head_params + h
        parts = [(True, shape.moe_layer_params if moe else shape.dense_layer_params,
                  "MoE layer weights" if moe else "layer weights", None if n == shape.n_layers else n)
                 for n, moe in shape.layer_kinds()]
        for per_layer, n_el, what, layers in parts + [(False, other, "embedding/head weights", None)]:
            E("forward", "all_gather_into_tensor", "fsdp", f, 1, n_el * a, 1, True, per_layer, what, layers)
            E("backward", "all_gather_into_tensor", "fsdp", f, 1, n_el * a, 1, True, per_layer, what, layers)
            E("backward", "reduce_scatter_tensor", "fsdp", f, 1, n_el * p.grad, 1, True, per_layer, what, layers)
        out += _grad_sync(n_local, p, layout.gpus // f, f, gpn, "replicate")
    elif s in ("tp", "tp_sp", "tp_x_sp"):
        t = layout.tp
        sig = layout.sp if s == "tp_x_sp" else 1
        act = T // sig * h * a  # one [B, S/sig, h] activation in the compute dtype
        reps = 2 if full else 1  # full checkpointing re-runs the forward collectives in backward
        if s == "tp_sp":
            for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
                E("forward", op, "tp", t, 1, 2 * act, 2, False, True, "block AG/RS")
                E("backward", op, "tp", t, 1, 2 * act * reps, 2 * reps, False, True, "block AG/RS (+recompute)")
            E("forward", "reduce_scatter_tensor", "tp", t, 1, act, 1, False, False, "embedding output")
            E("forward", "all_gather_into_tensor", "tp", t, 1, act, 1, False, False, "LM head input")
            E("backward", "reduce_scatter_tensor", "tp", t, 1, act, 1, False, False, "LM head input grad")
            E("backward", "all_reduce", "tp", t, 1, (2 * shape.n_layers + 1) * h * 4, 1, True, False,
              "sequence-sharded norm weight grads")
        else:
            E("forward", "all_reduce", "tp", t, 1, 2 * act, 2, False, True, "attention/MLP output")
            E("backward", "all_reduce", "tp", t, 1, 2 * act * reps, 2 * reps, False, True,
              "attention/MLP input grad (+recompute)")
            E("forward", "all_reduce", "tp", t, 1, act, 1, False, False, "vocab-parallel embedding")
            E("backward", "all_reduce", "tp", t, 1, act, 1, False, False, "LM head input grad")
        E("forward", "all_reduce", "tp", t, 1, 3 * (T // sig) * 4, 3, False, False,
          "vocab-parallel cross-entropy (max, sum-exp, target logit)")
        if s == "tp_x_sp":
            kv = 2 * T * _kv_local(shape.n_kv_heads, t) * shape.hd * a
            E("forward", "all_gather_into_tensor", "sp", sig, t, kv, 1, False, True, "K/V all-gather")
            if mode in C.ATTENTION_RECOMPUTED:  # the other recomputing modes replay the attention outputs
                E("backward", "all_gather_into_tensor", "sp", sig, t, kv, 1, False, True, "K/V recompute")
            E("backward", "reduce_scatter_tensor", "sp", sig, t, kv, 1, False, True, "dK/dV reduce-scatter")
            E("forward", "all_reduce", "sp", sig, t, 16, 2, False, False, "loss")
            out += _grad_sync(n_local, p, layout.gpus // t, t, gpn, "dp")
        else:
            out += _grad_sync(n_local, p, layout.dp, t, gpn, "dp")
    elif s == "sp":
        sig = layout.sp
        kv = 2 * T * shape.kv_dim * a
        E("forward", "all_gather_into_tensor", "sp", sig, 1, kv, 1, False, True, "K/V all-gather")
        if mode in C.ATTENTION_RECOMPUTED:
            E("backward", "all_gather_into_tensor", "sp", sig, 1, kv, 1, False, True, "K/V recompute")
        E("backward", "reduce_scatter_tensor", "sp", sig, 1, kv, 1, False, True, "dK/dV reduce-scatter")
        E("forward", "all_reduce", "sp", sig, 1, 16, 2, False, False, "loss")
        out += _grad_sync(n_local, p, layout.gpus, 1, gpn, "dp")  # weights replicated over sp x dp
    else:  # tsp
        out += _tsp_comm(shape, layout, p, B, S, mode, expert_schedule, shard_group)
        out += _grad_sync(n_local, p, layout.dp, layout.tsp, gpn, "dp")
    return out


# ----------------------------------------------------------------------------------------------------------------
# Everything together
# ----------------------------------------------------------------------------------------------------------------

def _comm_time(e: CommEntry, hw: Hardware, n_layers: int) -> float:
    if e.link == "inter":
        bw, lat = hw.inter_bw, INTER_LATENCY_S
    else:
        bw, lat = (hw.intra_p2p_bw if e.op == "send" else hw.intra_bw), INTRA_LATENCY_S
    if e.op == "all_to_all":
        lat = max(lat, ALL_TO_ALL_LATENCY_S)
    return e.occurrences(n_layers) * (e.wire / bw + e.calls * lat)


def tsp_fixed_s(shape: ModelShape, D: int, shard_group: int, checkpointing: str) -> float:
    """TSP's fixed cost per training step beyond its FLOPs: ``TSP_STEP_PASS_S`` per broadcast-schedule step
    (D / shard_group) and ring hop (D) of each layer and pass (forward, backward counted twice, and the recomputed
    forward unless ``checkpointing="none"``)."""
    if D == 1:
        return 0.0
    passes = 3 if checkpointing == "none" else 4
    return shape.n_layers * passes * (D // shard_group + D) * TSP_STEP_PASS_S


def estimate(shape: ModelShape, layout: Layout, hw: Hardware, p: Precision, B: int, S: int,
             checkpointing: str = "full", overlap: bool = True, headroom: float = 0.9,
             optimizer: str = "foreach") -> Estimate:
    """Memory, communication, FLOPs and an estimated step time (one micro-batch per replica, no gradient
    accumulation, optimizer step not timed; ``optimizer``: the AdamW implementation, :data:`OPTIMIZERS`).

    step = max(compute, overlappable comm) + exposed comm   (``overlap=False``: compute + all comm)
    Overlappable: TSP's prefetched weight broadcasts / ring sends / K/V all-gathers, FSDP's prefetched
    all-gathers and reduce-scatters, data-parallel gradient all-reduces. Exposed: TP / TP-SP activation
    collectives and SP's K/V all-gathers (on the critical path of the next matmul), loss all-reduces, expert
    dispatch's all-to-alls. TSP on an MoE model runs the expert schedule ``planning.moe`` picks for this layout.
    """
    schedule = None
    if layout.strategy == "tsp" and shape.is_moe:
        schedule = tsp_expert_schedule(shape, layout, hw, p, B, S)
    mem = memory_breakdown(shape, layout, p, B, S, checkpointing, schedule, optimizer=optimizer)
    comm = communication(shape, layout, p, B, S, checkpointing, schedule or "ring")
    tf = training_flops(shape, B, S, checkpointing)
    if layout.strategy == "tsp":
        # unit: one [h x F] GEMM of every dense MLP over the micro-batch. A layer re-run in backward skips the
        # MLP's forward (gate, up, down: 3 units) and the backward ring re-runs gate/up (2 units): -1 unit. With
        # no re-run, mlp_activations="recompute" adds that backward gate/up (+2 units).
        unit = 2 * B * S * shape.hidden_size * shape.intermediate_size * (shape.n_layers - shape.n_moe_layers)
        if checkpointing in C.RECOMPUTING:
            extra = -unit
        else:
            extra = 2 * unit if shape.mlp_activations == "recompute" else 0
        tf = {**tf, "hardware": tf["hardware"] + extra, "hardware_matmul": tf["hardware_matmul"] + extra}
    mp = layout.model_parallel
    flops = {k: tf[k] / mp for k in ("model", "hardware", "hardware_matmul", "hardware_attention")}
    slow = 1 if p.compute == 2 else 2  # fp32 compute: assume TF32 tensor cores at half the bf16 rate
    compute_s = slow * (flops["hardware_matmul"] / hw.sustained_flops
                        + flops["hardware_attention"] / hw.attention_flops)
    group = C.resolve_shard_group(shape, B, S, layout.tsp, p.compute, "auto") if layout.strategy == "tsp" else None
    fixed = tsp_fixed_s(shape, layout.tsp, group, checkpointing) if group is not None else 0.0
    ov = sum(_comm_time(e, hw, shape.n_layers) for e in comm if e.overlap and overlap)
    ex = sum(_comm_time(e, hw, shape.n_layers) for e in comm if not (e.overlap and overlap))
    if schedule is not None and layout.tsp > 1:  # host syncs on routing counts: 1 (ring) or 2 (dispatch) per
        runs = 1 if checkpointing == "none" else 2  # MoE forward, which checkpointing re-runs in backward
        ex += shape.n_moe_layers * runs * (1 if schedule == "ring" else 2) * HOST_SYNC_S
    step = max(compute_s, ov) + ex
    return Estimate(layout, shape, hw, p, B, S, checkpointing, mem, comm, flops, compute_s, ov, ex, step,
                    headroom, expert_schedule=schedule, shard_group=group, fixed_s=fixed, optimizer=optimizer)


def _moe_args(shape: ModelShape, layout: Layout, hw: Hardware, p: Precision) -> dict:
    """Keyword arguments of ``planning.moe``'s functions for a TSP layout of an MoE model (all but tokens)."""
    return dict(num_experts=shape.num_experts, hidden_size=shape.hidden_size,
                intermediate_size=shape.expert_intermediate_size, top_k=shape.experts_per_token,
                tsp_size=layout.tsp, compute_bytes=p.compute, hardware=hw,
                link=_link(layout.tsp, 1, layout.gpus_per_node))


def tsp_expert_schedule(shape: ModelShape, layout: Layout, hw: Hardware, p: Precision, B: int, S: int) -> str:
    """The expert schedule (``"ring"`` / ``"dispatch"``) the cost model picks for this TSP layout and batch."""
    return choose_expert_schedule(tokens=B * S // layout.tsp, **_moe_args(shape, layout, hw, p))


def tsp_expert_crossover_seq(shape: ModelShape, layout: Layout, hw: Hardware, p: Precision, B: int) -> int | None:
    """The sequence length S from which the expert ring beats expert dispatch for this TSP layout and micro-batch
    (dispatch below it); None when one schedule always wins."""
    n = crossover_tokens(**_moe_args(shape, layout, hw, p))
    return None if n is None else -(-n * layout.tsp // B)
