"""The built-in Llama-style decoder, made of TSP layers.

Parameter names mirror Hugging Face ``LlamaForCausalLM`` (``model.layers.0.self_attn.q_proj.weight``, ...), so a
full Hugging Face state dict loads with :meth:`TSPLlama.load_full_state_dict`. With ``tsp=None`` (D = 1) it is the
plain unsharded model and issues no collective.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal, get_args

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from lightning_tsp.checks import TSPConfigError, check_model_shape
from lightning_tsp.group import TSPGroup
from lightning_tsp.layers import TSPAttention, TSPEmbedding, TSPGatedMLP, TSPLMHead, TSPRMSNorm
from lightning_tsp.layers.attention import Documents
from lightning_tsp.layers.mlp import MLP_ACTIVATIONS, MLP_WEIGHT_GRADS
from lightning_tsp.layers.moe import TSPMoE, check_moe_shape, load_balancing_loss
from lightning_tsp.layers.rope import rope_cos_sin, validate_rope_scaling
from lightning_tsp.graphs import GRAPHED_CHECKPOINTING, GRAPHED_MAX_TOKENS, LayerGraphs
from lightning_tsp.offload import StashChain, stashed_checkpoint
from lightning_tsp.schedules.comm import SumOverGroup, all_reduce_sum, local_tensor
from lightning_tsp.zigzag import IGNORE_INDEX, document_starts, shard_batch


EXPERT_SCHEDULES = ("auto", "ring", "dispatch")


@dataclass
class ModelConfig:
    vocab_size: int = 256
    hidden_size: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    intermediate_size: int = 192
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # scaled RoPE, Hugging Face form: {"rope_type": "llama3" | "yarn" | "linear", ...}
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    head_dim: int | None = None  # default hidden_size // n_heads
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    # mixture of experts (lightning_tsp.layers.moe; num_experts = 0: every MLP dense)
    num_experts: int = 0
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int | None = None  # each expert's SwiGLU width; default intermediate_size
    shared_expert_intermediate_size: int = 0  # a dense SwiGLU added to every MoE layer's output (0: none)
    moe_gating: str = "mixtral"  # "mixtral": softmax over the top-k logits; "qwen3": softmax, top-k, norm_topk_prob
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss added to the training loss
    dense_layers: list[int] = field(default_factory=list)  # layers keeping the dense MLP (Qwen3-MoE mlp_only_layers)
    expert_schedule: str = "auto"  # "ring" | "dispatch" | "auto" (the cost model, per layer call): same function
    # the dense MLP ring's activations: "keep" saves the gate/up pre-activations of every shard for backward;
    # "recompute" saves none (backward re-runs each shard's gate/up GEMM) and sums the output shard by shard: the
    # longest contexts (lightning_tsp.layers.mlp). The same function.
    mlp_activations: str = "keep"
    # the dense MLP ring's weight gradients: "ring" (the fp32 accumulator travels with its shard), "owners" (each
    # shard's activation gradients go to its owner, one GEMM over all tokens there), "auto" (fewer bytes per call:
    # "owners" at short sequences). The same function.
    mlp_weight_grads: str = "auto"

    def __post_init__(self) -> None:
        if self.head_dim is None:
            if self.hidden_size % self.n_heads:
                raise TSPConfigError(
                    f"hidden_size={self.hidden_size} is not divisible by n_heads={self.n_heads}: give head_dim"
                )
            self.head_dim = self.hidden_size // self.n_heads
        self.rope_scaling = validate_rope_scaling(self.rope_scaling, self.head_dim, theta=self.rope_theta)
        if self.mlp_activations not in MLP_ACTIVATIONS:
            raise TSPConfigError(f"mlp_activations={self.mlp_activations!r}; choose one of {MLP_ACTIVATIONS}")
        if self.mlp_weight_grads not in MLP_WEIGHT_GRADS:
            raise TSPConfigError(f"mlp_weight_grads={self.mlp_weight_grads!r}; choose one of {MLP_WEIGHT_GRADS}")
        self.dense_layers = sorted(int(i) for i in self.dense_layers)  # a list: the config round-trips through JSON
        if self.num_experts:
            if self.moe_intermediate_size is None:
                self.moe_intermediate_size = self.intermediate_size
            bad = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
            if bad:
                raise TSPConfigError(
                    f"dense_layers={list(self.dense_layers)} names layers outside 0..{self.n_layers - 1}"
                )
            if self.expert_schedule not in EXPERT_SCHEDULES:
                raise TSPConfigError(f"expert_schedule={self.expert_schedule!r}; choose one of {EXPERT_SCHEDULES}")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    def num_params(self) -> int:
        h, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = 2 * h * q + 2 * h * kv + 2 * h + (q + 2 * kv) * self.attention_bias + 2 * self.head_dim * self.qk_norm
        moe = 0
        if self.num_experts:
            moe = self.num_experts * (h + 3 * h * self.moe_intermediate_size)  # router + experts
            moe += 3 * h * self.shared_expert_intermediate_size
        n_moe = self.n_moe_layers
        mlps = n_moe * moe + (self.n_layers - n_moe) * 3 * h * f
        return self.n_layers * attn + mlps + v * h * (1 if self.tie_embeddings else 2) + h

    def num_active_params(self) -> int:
        """Parameters a token meets (top-k experts of each MoE layer): the 6 N flops-per-token rule's N."""
        if not self.num_experts:
            return self.num_params()
        idle = self.n_moe_layers * (self.num_experts - self.num_experts_per_tok) * 3 * self.hidden_size
        return self.num_params() - idle * self.moe_intermediate_size


CheckpointingMode = Literal["none", "selective", "full", "keep-attention", "offload", "full-offload"]
CHECKPOINTING_MODES: tuple[str, ...] = get_args(CheckpointingMode)

_PRESET_ARGS: dict[str, dict] = {
    # CPU tests and the quick-start demo (byte-level vocabulary).
    "tiny": {},
    # The paper's model: h 4096, 32 layers, 32 query / 32 KV heads, SwiGLU 16384 (about 8.6 B weights + vocab).
    "paper-7b": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=32,
                     intermediate_size=16384),
    # Llama-3-8B shapes (GQA 32/8).
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                      intermediate_size=14336, rope_theta=500000.0),
    # a tiny mixture of experts (CPU tests, the MoE demo): 4 experts, top-2
    "tiny-moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96, router_aux_loss_coef=0.01),
    # Mixtral-8x7B shapes: 8 experts of width 14336, top-2, GQA 32/8
    "mixtral-8x7b": dict(vocab_size=32000, hidden_size=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                         intermediate_size=14336, rope_theta=1e6, norm_eps=1e-5, num_experts=8,
                         num_experts_per_tok=2, router_aux_loss_coef=0.02),
    # Qwen3-30B-A3B shapes: 128 experts of width 768, top-8 renormalised, GQA 32/4, head_dim 128, q/k norms
    "qwen3-30b-a3b": dict(vocab_size=151936, hidden_size=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128,
                          intermediate_size=6144, rope_theta=1e6, norm_eps=1e-6, qk_norm=True, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, moe_gating="qwen3",
                          norm_topk_prob=True, router_aux_loss_coef=0.001),
}
PRESETS: dict[str, ModelConfig] = {name: ModelConfig(**args) for name, args in _PRESET_ARGS.items()}


def get_config(preset: str, **overrides) -> ModelConfig:
    """A preset with some fields changed (derived fields such as head_dim follow the overrides)."""
    if preset not in _PRESET_ARGS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(_PRESET_ARGS)}")
    return ModelConfig(**{**_PRESET_ARGS[preset], **overrides})


class TSPDecoderLayer(nn.Module):
    """Pre-norm decoder layer: broadcast-schedule attention, then the gated MLP (ring schedule) or, when
    ``moe``, the mixture of experts (:class:`~lightning_tsp.layers.moe.TSPMoE`).

    ``forward`` returns ``(x, router_stats)``: the layer output and, for an MoE layer, this rank's routing
    statistics [2, E] (routed-slot counts, router-probability sums) that the model pools into the load-balancing
    loss (None for a dense layer)."""

    def __init__(self, cfg: ModelConfig, tsp: TSPGroup, attention_kernel: str, kv_bucket_heads: int | None = None,
                 moe: bool = False, shard_group: int | str = "auto", device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = TSPRMSNorm(cfg.hidden_size, tsp, cfg.norm_eps, **kw)
        self.self_attn = TSPAttention(cfg.hidden_size, cfg.n_heads, cfg.n_kv_heads, tsp, attention_kernel,
                                      head_dim=cfg.head_dim, bias=cfg.attention_bias, qk_norm=cfg.qk_norm,
                                      norm_eps=cfg.norm_eps, kv_bucket_heads=kv_bucket_heads,
                                      shard_group=shard_group, **kw)
        self.post_attention_layernorm = TSPRMSNorm(cfg.hidden_size, tsp, cfg.norm_eps, **kw)
        if moe:
            self.mlp = TSPMoE(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.num_experts_per_tok,
                              tsp, gating=cfg.moe_gating, norm_topk_prob=cfg.norm_topk_prob,
                              shared_intermediate_size=cfg.shared_expert_intermediate_size,
                              schedule=cfg.expert_schedule, **kw)
        else:
            self.mlp = TSPGatedMLP(cfg.hidden_size, cfg.intermediate_size, tsp, activations=cfg.mlp_activations,
                                   weight_grads=cfg.mlp_weight_grads, **kw)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, documents: Documents | None = None,
                checkpoint_mlp: bool = False) -> tuple[Tensor, Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, documents)
        if checkpoint_mlp:  # "selective": keep attention's activations, recompute the norm + MLP ring in backward
            y, stats = checkpoint(self.feed_forward, x, use_reentrant=False)
        else:
            y, stats = self.feed_forward(x)
        return x + y, stats

    def feed_forward(self, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """The MLP half on the residual stream x (norm included): (output, router statistics or None)."""
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, TSPMoE):
            return self.mlp(h)
        return self.mlp(h), None


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tsp: TSPGroup, attention_kernel: str, kv_bucket_heads: int | None,
                 shard_group: int | str = "auto", device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embed_tokens = TSPEmbedding(cfg.vocab_size, cfg.hidden_size, tsp, **kw)
        self.layers = nn.ModuleList(
            TSPDecoderLayer(cfg, tsp, attention_kernel, kv_bucket_heads, moe=cfg.is_moe_layer(i),
                            shard_group=shard_group, **kw)
            for i in range(cfg.n_layers)
        )
        self.norm = TSPRMSNorm(cfg.hidden_size, tsp, cfg.norm_eps, **kw)


class TSPLlama(nn.Module):
    """Llama-style causal LM whose every weight and every sequence are sharded over one TSP group.

    ``forward`` takes this rank's zigzag slice of the batch (see :meth:`shard_batch`) and returns the loss: the
    mean over all valid target tokens of the TSP group (the same number on every rank), with gradients equal to
    the unsharded model's.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        tsp: TSPGroup | None = None,
        *,
        attention_kernel: str = "auto",
        activation_checkpointing: CheckpointingMode = "none",
        token_chunk: int = 4096,
        kv_bucket_heads: int | None = None,
        shard_group: int | str = "auto",
        cuda_graphs: bool | str = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tsp = tsp or TSPGroup.single()
        any_dense = cfg.n_moe_layers < cfg.n_layers  # intermediate_size matters only to dense MLP layers
        check_model_shape(tsp_size=tsp.size, n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads,
                          hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size if any_dense else None,
                          vocab_size=cfg.vocab_size)
        if cfg.num_experts:
            check_moe_shape(tsp_size=tsp.size, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                            shared_intermediate_size=cfg.shared_expert_intermediate_size, gating=cfg.moe_gating,
                            schedule=cfg.expert_schedule)
        if activation_checkpointing not in CHECKPOINTING_MODES:
            raise TSPConfigError(
                f"activation_checkpointing={activation_checkpointing!r}; choose one of {CHECKPOINTING_MODES}"
            )
        self.cfg, self.tsp, self.activation_checkpointing = cfg, tsp, activation_checkpointing
        self.attention_kernel, self.token_chunk, self.kv_bucket_heads = attention_kernel, token_chunk, kv_bucket_heads
        self.shard_group = shard_group
        check_cuda_graphs(cuda_graphs, activation_checkpointing, cfg)
        self.cuda_graphs = cuda_graphs
        self._layer_graphs: LayerGraphs | None = None
        kw = dict(device=device, dtype=dtype)
        self.model = _Backbone(cfg, tsp, attention_kernel, kv_bucket_heads, shard_group, **kw)
        self.lm_head = TSPLMHead(cfg.vocab_size, cfg.hidden_size, tsp, token_chunk, tied=cfg.tie_embeddings, **kw)
        if device is None or torch.device(device).type != "meta":
            self.init_weights()

    # ---- sharding metadata -------------------------------------------------------------------------------

    def shard_dims(self) -> dict[str, int | None]:
        """Every parameter name -> the dim it is sharded along over the TSP group (None: replicated)."""
        out = {}
        for mod_name, mod in self.named_modules():
            dims = getattr(mod, "tsp_shard_dims", None)
            if dims is None:
                continue
            for p_name, _ in mod.named_parameters():
                out[f"{mod_name}.{p_name}" if mod_name else p_name] = dims.get(p_name)
        return out

    def replicas(self, name: str) -> int:
        """Ranks holding a copy of each shard of parameter ``name`` (> 1 for a KV head replicated over D / n_kv
        ranks; then its full tensor has D / replicas shards)."""
        parts = name.split(".")
        for i in range(len(parts) - 1, 0, -1):  # the innermost module that declares replicas for this name
            table = getattr(self.get_submodule(".".join(parts[:i])), "tsp_replicas", None)
            if table is not None:
                return table.get(".".join(parts[i:]), 1)
        return 1

    def shard_range(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of this rank's shard inside the full tensor of parameter ``name``; None: replicated."""
        dim = self.shard_dims()[name]
        if dim is None:
            return None
        r = self.replicas(name)
        n = local_tensor(self.get_parameter(name)).shape[dim]
        start = (self.tsp.rank // r) * n
        return dim, start, start + n

    def full_shape(self, name: str) -> torch.Size:
        p = local_tensor(self.get_parameter(name))
        dim = self.shard_dims()[name]
        shape = list(p.shape)
        if dim is not None:
            shape[dim] *= self.tsp.size // self.replicas(name)
        return torch.Size(shape)

    def local_slice(self, name: str, full: Tensor) -> Tensor:
        """This rank's shard of the full tensor of parameter ``name``."""
        if tuple(full.shape) != tuple(self.full_shape(name)):
            raise TSPConfigError(
                f"parameter {name!r}: the given tensor has shape {tuple(full.shape)}, the model expects the full "
                f"shape {tuple(self.full_shape(name))}. Is the checkpoint from another model configuration?"
            )
        rng = self.shard_range(name)
        return full if rng is None else full.narrow(rng[0], rng[1], rng[2] - rng[1])

    @torch.no_grad()
    def load_full_state_dict(self, state_dict: dict[str, Tensor], strict: bool = True) -> None:
        """Copy this rank's slices out of a full (unsharded) state dict, e.g. Hugging Face's."""
        names = set(self.shard_dims())
        if strict:
            missing = sorted(names - set(state_dict))
            if missing:
                raise TSPConfigError(f"state dict lacks {len(missing)} parameters, e.g. {missing[:3]}")
        for name in names & set(state_dict):
            local_tensor(self.get_parameter(name)).copy_(self.local_slice(name, state_dict[name]))

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """Normal(0, init_std) weights, ones for norms: the same full model whatever D and dtype (each rank draws
        a parameter's full tensor from a seeded generator and keeps its slice, one parameter at a time)."""
        for i, (name, p) in enumerate(sorted(self.named_parameters())):
            p = local_tensor(p)
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):
                p.zero_()
                continue
            g = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
            # drawn in fp32 whatever the parameter dtype: the same model in every precision
            full = torch.empty(self.full_shape(name), device=p.device, dtype=torch.float32)
            full.normal_(0.0, self.cfg.init_std, generator=g)
            p.copy_(self.local_slice(name, full))

    # ---- forward -----------------------------------------------------------------------------------------

    def shard_batch(self, input_ids: Tensor, labels: Tensor | None = None, position_ids: Tensor | None = None):
        """Global [B, S] batch (Hugging Face label convention) -> this rank's (input_ids, targets, position_ids).

        ``position_ids`` [B, S]: packed documents (positions restart at 0 at each document start); the returned
        position ids are then [B, S/D] and attention stays inside each document."""
        return shard_batch(input_ids, labels, self.tsp.size, self.tsp.rank, position_ids=position_ids)

    def _check_local(self, input_ids: Tensor, targets: Tensor, position_ids: Tensor) -> None:
        b, l = input_ids.shape
        if targets.shape != input_ids.shape or position_ids.shape not in ((l,), (b, l)):
            raise TSPConfigError(
                f"input_ids {tuple(input_ids.shape)}, targets {tuple(targets.shape)} and position_ids "
                f"{tuple(position_ids.shape)} do not match: expected [B, S/D], [B, S/D] and [S/D] (or [B, S/D] "
                f"for packed documents)"
            )
        if self.tsp.size > 1 and l % 2 != 0:
            raise TSPConfigError(
                f"local sequence length {l} is odd: a rank holds two zigzag chunks. Shard the batch with "
                f"TSPLlama.shard_batch (global length a multiple of {2 * self.tsp.size})."
            )

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Final-norm hidden states [B, S/D, h] of this rank's tokens; ``position_ids`` [S/D] (global positions)
        or [B, S/D] (packed documents: positions inside each document, attention restricted to it)."""
        return self._backbone(input_ids, position_ids)[0]

    def _backbone(self, input_ids: Tensor, position_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """(final-norm hidden states, this rank's router statistics [2, E] summed over the MoE layers or None)."""
        x = self.model.embed_tokens(input_ids)
        dev = x.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        cos, sin = self.rope(position_ids, dtype)
        documents = None
        if position_ids.dim() == 2:  # packed documents: positions restart inside the sequence
            documents = Documents(document_starts(position_ids, self.tsp.size, self.tsp.rank), self.tsp)
        router_stats = None
        mode = self.activation_checkpointing if torch.is_grad_enabled() else "none"
        graphs = self._graphs_for(x, cos, documents) if self._graphed(x, mode, documents) else None
        if graphs is not None:
            cos, sin = graphs.begin_step(cos, sin)
        # full: the layer input on the GPU, the whole layer (and its traffic) re-run in backward; keep-attention /
        # offload: the layer input and the attention outputs, on the GPU / in pinned host memory; full-offload: the
        # layer input only, in pinned host memory
        chain = StashChain.for_mode(mode)
        for i, layer in enumerate(self.model.layers):
            if graphs is not None:  # captured once, replayed every step (lightning_tsp.graphs)
                x, stats = graphs(i, x, cos, sin), None
            elif chain is not None:  # checkpointed, keeping what the chain keeps where it keeps it
                x, stats = stashed_checkpoint(layer, chain, x, cos, sin, documents)
            else:
                x, stats = layer(x, cos, sin, documents, checkpoint_mlp=mode == "selective")
            if stats is not None:
                router_stats = stats if router_stats is None else router_stats + stats
        return self.model.norm(x), router_stats

    def _graphed(self, x: Tensor, mode: str, documents: Documents | None) -> bool:
        """Whether this forward runs the layers through CUDA graphs (``cuda_graphs``; ``"auto"``: on CUDA, in a
        graphed checkpointing mode, dense layers, no packed documents, at most ``GRAPHED_MAX_TOKENS`` local tokens,
        where the eager step is host-bound)."""
        if self.cuda_graphs == "auto":
            return (x.is_cuda and mode in GRAPHED_CHECKPOINTING and not self.cfg.n_moe_layers and documents is None
                    and x.shape[0] * x.shape[1] <= GRAPHED_MAX_TOKENS)
        return bool(self.cuda_graphs) and mode != "none"

    def _graphs_for(self, x: Tensor, cos: Tensor, documents: Documents | None) -> LayerGraphs:
        """The layers' CUDA graphs for this step's signature (new ones, released the old, when it changed)."""
        if not x.is_cuda and self._layer_graphs is None:
            warnings.warn(f"cuda_graphs=True on {x.device}: no CUDA graphs there; the graphed layers' code runs "
                          "eagerly every step (the same computation)", stacklevel=3)
        if documents is not None:
            raise TSPConfigError("cuda_graphs=True does not run packed documents (position_ids [B, S/D]: their "
                                 "masks change every step): build the model with cuda_graphs=False")
        dev = x.device.type
        signature = (tuple(x.shape), x.dtype, tuple(cos.shape), cos.dtype, self.activation_checkpointing,
                     torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
        if self._layer_graphs is None or self._layer_graphs.signature != signature:
            self._layer_graphs = None  # release the old graphs (and their memory pool) first
            self._layer_graphs = LayerGraphs(self.model.layers, self.activation_checkpointing == "keep-attention",
                                             signature, capture=x.is_cuda)
        return self._layer_graphs

    def release_cuda_graphs(self) -> None:
        """Drop the captured layer graphs and their memory; the next training step starts a new warm-up."""
        self._layer_graphs = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_layer_graphs"] = None  # graphs are not copied or pickled: a copy captures its own
        return state

    def rope(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin [..., d] of the rotary embedding at the given global positions (training, prefill and decode
        all take their tables from here)."""
        cfg = self.cfg
        return rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, dtype, cfg.rope_scaling)

    def token_losses(self, input_ids: Tensor, targets: Tensor, position_ids: Tensor) -> Tensor:
        """Per-token cross-entropy [B, S/D] (0 where the target is ignored), i.e. minus the target log-prob."""
        self._check_local(input_ids, targets, position_ids)
        h = self.hidden_states(input_ids, position_ids)
        weight = self.model.embed_tokens.weight if self.cfg.tie_embeddings else None
        return self.lm_head(h, targets, weight)

    def forward(self, input_ids: Tensor, targets: Tensor, position_ids: Tensor,
                num_valid_tokens: Tensor | None = None) -> Tensor:
        """Loss = sum of the group's token losses / ``num_valid_tokens`` (default: valid targets of the group), plus
        ``router_aux_loss_coef`` x the load-balancing loss for a mixture of experts.

        Pass ``num_valid_tokens`` to normalise over a larger set (e.g. data-parallel replicas too).
        """
        return self.total_loss(*self.loss_terms(input_ids, targets, position_ids, num_valid_tokens))

    def total_loss(self, loss: Tensor, aux: Tensor | None) -> Tensor:
        """The training loss from :meth:`loss_terms`: ``loss + router_aux_loss_coef * aux``."""
        if aux is None or not self.cfg.router_aux_loss_coef:
            return loss
        return loss + self.cfg.router_aux_loss_coef * aux

    def loss_terms(self, input_ids: Tensor, targets: Tensor, position_ids: Tensor,
                   num_valid_tokens: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(language-model loss, load-balancing loss of the MoE layers or None), both the same on every rank.

        The load-balancing loss is Hugging Face's ``load_balancing_loss_func`` over all MoE layers and all tokens
        of the TSP group's sequences (counts and probabilities pooled over the layers, then multiplied)."""
        self._check_local(input_ids, targets, position_ids)
        h, router_stats = self._backbone(input_ids, position_ids)
        weight = self.model.embed_tokens.weight if self.cfg.tie_embeddings else None
        losses = self.lm_head(h, targets, weight)
        if num_valid_tokens is None:
            num_valid_tokens = (targets != IGNORE_INDEX).sum().to(torch.float64)
            all_reduce_sum(num_valid_tokens, self.tsp)
        total = losses.to(torch.promote_types(losses.dtype, torch.float32)).sum()
        if self.tsp.size > 1:
            total = SumOverGroup.apply(total, self.tsp)
        # an all-ignored batch gives 0 (not 0/0); never clamp a positive count
        n = num_valid_tokens.to(total.dtype)
        loss = total / torch.where(n > 0, n, torch.ones_like(n))
        aux = None
        if router_stats is not None:
            rows = input_ids.numel() * self.cfg.n_moe_layers  # this rank's (token, layer) rows
            aux = load_balancing_loss(router_stats, rows, self.tsp)
        return loss, aux


def check_cuda_graphs(cuda_graphs: bool | str, activation_checkpointing: str, cfg: ModelConfig) -> None:
    """``cuda_graphs`` can run with this checkpointing mode and model, or a TSPConfigError saying what to change."""
    if not isinstance(cuda_graphs, bool) and cuda_graphs != "auto":
        raise TSPConfigError(f"cuda_graphs={cuda_graphs!r}: give True, False or 'auto'")
    if cuda_graphs is not True:  # "auto" graphs only where it can
        return
    if activation_checkpointing not in GRAPHED_CHECKPOINTING:
        raise TSPConfigError(f"cuda_graphs=True with activation_checkpointing={activation_checkpointing!r}: graphed "
                             f"layers are checkpointed layers, choose one of {GRAPHED_CHECKPOINTING}")
    if cfg.n_moe_layers:
        raise TSPConfigError(f"cuda_graphs=True with {cfg.n_moe_layers} mixture-of-experts layer(s): their routing "
                             "changes shapes every step; build the model with cuda_graphs=False")


def gather_full(local: Tensor, dim: int | None, tsp: TSPGroup, replicas: int = 1) -> Tensor:
    """All-gather a sharded tensor back to its full shape (replicated: returned as is; ``replicas`` > 1: one copy
    of each shard, see :meth:`TSPLlama.replicas`). For tests and export."""
    if dim is None or tsp.size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tsp.size)]
    dist.all_gather(parts, local.contiguous(), group=tsp.group)
    return torch.cat(parts[::replicas], dim=dim)
