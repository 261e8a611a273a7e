"""Hugging Face Llama-family causal LMs under TSP: config mapping, the conversion plan, sharded weight loading.

Supported (exact classes): ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM`` and the mixtures of experts ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM``.
:func:`convert_hf_causal_lm` turns one into an unsharded :class:`TSPCausalLM` with the same
parameters (the same tensors, not a copy; on the meta device if the Hugging Face model was), which
:class:`~lightning_tsp.strategy.TSPStrategy` then shards. Everything TSP cannot compute exactly is rejected with a
:class:`~lightning_tsp.checks.TSPConfigError` (see docs/converting.md); any other ``PreTrainedModel`` found in a
LightningModule is rejected too, never silently replicated.

Pretrained weights are read from a LOCAL directory of ``*.safetensors`` files (``save_pretrained`` output, sharded
or not) slice by slice: :func:`load_pretrained_shards` reads only this rank's rows/columns of every tensor, so no
rank ever holds the full model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.layers.rope import validate_rope_scaling
from lightning_tsp.models.llama import CheckpointingMode, ModelConfig, TSPLlama
from lightning_tsp.schedules.comm import local_tensor
from lightning_tsp.sharding import aux_loss_coef, refuse_padding_with_aux_loss
from lightning_tsp.zigzag import IGNORE_INDEX

__all__ = [
    "HFModelConfig",
    "PLANS",
    "SUPPORTED_CLASSES",
    "TSPCausalLM",
    "convert_hf_causal_lm",
    "load_pretrained_shards",
    "model_config_from_hf",
    "set_pretrained_path",
]

# exact Hugging Face class name -> its config's model_type
SUPPORTED_CLASSES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_SUPPORTED_TYPES = frozenset(SUPPORTED_CLASSES.values())
_SILU = ("silu", "swish")  # the same function in transformers' ACT2FN
_PATH_ATTR = "_tsp_pretrained_path"


# ---- config ----------------------------------------------------------------------------------------------------


@dataclass
class HFModelConfig(ModelConfig):
    """A :class:`ModelConfig` that remembers where it came from.

    It travels with the model: :class:`TSPStrategy` rebuilds the sharded model from ``module.cfg``, so the Hugging
    Face config, the pretrained directory and the runtime checks survive sharding.
    """

    hf_config: Any = field(default=None, repr=False, compare=False)  # the transformers config object
    pretrained_path: str | None = None  # local directory of *.safetensors: init_weights() loads this rank's slices
    sliding_window: int | None = None  # an attention window that applies once the sequence is longer than it
    attention_dropout: float = 0.0  # > 0 is refused in training (TSP attention has no dropout)


def _get(cfg: Any, name: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(name, default)
    return getattr(cfg, name, default)


def _rope(hf_cfg: Any, head_dim: int) -> tuple[float, dict | None]:
    """(rope_theta, normalised RoPE scaling dict or None) from ``rope_parameters`` (transformers 5) or
    ``rope_theta``/``rope_scaling`` (older). ``linear``, ``llama3`` and ``yarn`` scaling are mapped (defaults filled
    in as Hugging Face does); ``dynamic``, ``longrope`` and unknown types are refused by
    :func:`~lightning_tsp.layers.rope.validate_rope_scaling`."""
    params = _get(hf_cfg, "rope_parameters")
    where = "rope_parameters"
    if params is None:
        params, where = _get(hf_cfg, "rope_scaling"), "rope_scaling"
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type: must all be the same
        values = list(params.values())
        if any(v != values[0] for v in values[1:]):
            raise TSPConfigError(
                f"{where} differs between layer types ({sorted(params)}): TSP applies one rotary embedding to every "
                f"layer. Use a model whose layers share one rope configuration."
            )
        params = dict(values[0])
    factor = params.get("partial_rotary_factor", _get(hf_cfg, "partial_rotary_factor", 1.0))
    if factor not in (None, 1, 1.0):
        raise TSPConfigError(f"partial_rotary_factor={factor}: TSP rotates the full head dimension only")
    theta = params.get("rope_theta", _get(hf_cfg, "rope_theta"))
    theta = 10000.0 if theta is None else float(theta)
    rope_type = params.get("rope_type", params.get("type", "default"))
    original = _get(hf_cfg, "original_max_position_embeddings")
    if rope_type in ("llama3", "yarn") and original is not None:  # as Hugging Face: the config attribute wins
        params["original_max_position_embeddings"] = original
    params.pop("partial_rotary_factor", None)  # checked above (it may come from the config, not the dict)
    scaling = validate_rope_scaling(params, head_dim, theta=theta,
                                    max_position_embeddings=_get(hf_cfg, "max_position_embeddings"), where=where)
    return theta, scaling


def _sliding_window(hf_cfg: Any, model_type: str) -> int | None:
    """The attention window some layers use (None: plain causal attention everywhere)."""
    window = _get(hf_cfg, "sliding_window")
    if window is None:
        return None
    layer_types = _get(hf_cfg, "layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if model_type in ("qwen2", "qwen3", "qwen3_moe"):  # older transformers: no layer_types
        if not _get(hf_cfg, "use_sliding_window", False):
            return None
        first = _get(hf_cfg, "max_window_layers", 0)
        return int(window) if first < _get(hf_cfg, "num_hidden_layers") else None
    return int(window)  # mistral, mixtral: every layer


def _moe_fields(hf_config: Any, model_type: str) -> dict[str, Any]:
    """The mixture-of-experts fields of :class:`ModelConfig` (Mixtral, Qwen3-MoE; empty for dense families)."""
    if model_type not in ("mixtral", "qwen3_moe"):
        return {}
    jitter = float(_get(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter > 0:
        raise TSPConfigError(
            f"router_jitter_noise={jitter}: the TSP router has no jitter (it changes the routing randomly in "
            f"training). "
            f"Set config.router_jitter_noise=0.0 before converting the model."
        )
    n_layers = _get(hf_config, "num_hidden_layers")
    coef = float(_get(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    fields = dict(
        num_experts=_get(hf_config, "num_local_experts") or _get(hf_config, "num_experts"),
        num_experts_per_tok=_get(hf_config, "num_experts_per_tok"),
        # Hugging Face adds the load-balancing loss to the loss only with output_router_logits
        router_aux_loss_coef=coef if _get(hf_config, "output_router_logits", False) else 0.0,
    )
    if model_type == "mixtral":  # softmax over the top-k logits; every layer sparse, experts as wide as intermediate
        return dict(fields, moe_gating="mixtral", moe_intermediate_size=_get(hf_config, "intermediate_size"))
    step = _get(hf_config, "decoder_sparse_step", 1) or 1
    only = set(_get(hf_config, "mlp_only_layers", None) or [])
    dense = [i for i in range(n_layers) if i in only or (i + 1) % step != 0]
    return dict(fields, moe_gating="qwen3", norm_topk_prob=bool(_get(hf_config, "norm_topk_prob", False)),
                moe_intermediate_size=_get(hf_config, "moe_intermediate_size"), dense_layers=dense)


def model_config_from_hf(hf_config: Any, *, pretrained_path: str | os.PathLike | None = None) -> HFModelConfig:
    """Map a Hugging Face Llama / Mistral / Qwen2 / Qwen3 / Mixtral / Qwen3-MoE config to a :class:`HFModelConfig`.

    Raises :class:`TSPConfigError` for settings TSP cannot compute exactly: rope scaling other than ``linear``,
    ``llama3`` and ``yarn`` (those are mapped to ``rope_scaling``),
    MLP biases, an ``o_proj`` bias (``attention_bias=True`` on Llama and Qwen3), activations other than SiLU. A
    sliding window and attention dropout are checked when the model runs (they only matter for sequences longer
    than the window, and in training).
    """
    model_type = _get(hf_config, "model_type")
    if model_type not in _SUPPORTED_TYPES:
        raise TSPConfigError(
            f"Hugging Face model_type={model_type!r} is not supported by the built-in conversion (supported: "
            f"{sorted(_SUPPORTED_TYPES)}). Register a plan for it with lightning_tsp.convert.register_conversion."
        )
    act = _get(hf_config, "hidden_act", "silu")
    if act not in _SILU:
        raise TSPConfigError(
            f"hidden_act={act!r}: the TSP gated MLP is SwiGLU (silu) only. Use a model with hidden_act='silu'."
        )
    if _get(hf_config, "mlp_bias", False):
        raise TSPConfigError(
            "mlp_bias=True: the TSP gated MLP has no biases (gate/up/down projections are bias-free). Use a model "
            "with mlp_bias=False."
        )
    attention_bias = bool(_get(hf_config, "attention_bias", False))
    if model_type == "qwen2":
        attention_bias = True  # Qwen2 always has q/k/v biases and no o_proj bias
    elif attention_bias:  # Llama and Qwen3 put the bias on o_proj too
        raise TSPConfigError(
            f"attention_bias=True on a {model_type!r} model also gives o_proj a bias, which TSP attention does not "
            f"have (only q/k/v biases, as in Qwen2). Use a model with attention_bias=False."
        )
    n_heads = _get(hf_config, "num_attention_heads")
    hidden = _get(hf_config, "hidden_size")
    n_kv = _get(hf_config, "num_key_value_heads") or n_heads
    head_dim = _get(hf_config, "head_dim") or hidden // n_heads
    rope_theta, rope_scaling = _rope(hf_config, head_dim)
    dropout = float(_get(hf_config, "attention_dropout", 0.0) or 0.0)
    return HFModelConfig(
        vocab_size=_get(hf_config, "vocab_size"),
        hidden_size=hidden,
        n_layers=_get(hf_config, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        intermediate_size=_get(hf_config, "intermediate_size"),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        norm_eps=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        tie_embeddings=bool(_get(hf_config, "tie_word_embeddings", False)),
        init_std=float(_get(hf_config, "initializer_range", 0.02)),
        head_dim=head_dim,
        attention_bias=attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        hf_config=hf_config,
        pretrained_path=None if pretrained_path is None else os.fspath(pretrained_path),
        sliding_window=_sliding_window(hf_config, model_type),
        attention_dropout=dropout,
        **_moe_fields(hf_config, model_type),
    )


# ---- the model ---------------------------------------------------------------------------------------------------


class TSPCausalLM(TSPLlama):
    """A :class:`TSPLlama` that behaves like a Hugging Face causal LM where training needs it.

    * ``forward`` takes the strategy's keyword arguments (``input_ids``, ``targets``, ``position_ids``,
      ``num_valid_tokens``: this rank's zigzag slice) or a global Hugging Face batch (``input_ids``, ``labels``,
      optional right-padding ``attention_mask``), and returns ``CausalLMOutputWithPast(loss=...)`` (``logits`` is
      None: the LM head never materialises them). A ``training_step`` returning ``self.model(**batch).loss``
      trains unchanged.
    * ``hf_config`` (alias ``config``): the Hugging Face config it was built from (None for a plain ModelConfig).
    * ``init_weights()`` loads this rank's slices from ``cfg.pretrained_path`` when set (random init otherwise);
      the strategy calls it on the shards of a model converted on the meta device.

    Same constructor as :class:`TSPLlama`: everything Hugging Face-specific travels inside ``cfg``
    (:class:`HFModelConfig`).
    """

    @property
    def hf_config(self) -> Any:
        return getattr(self.cfg, "hf_config", None)

    @property
    def config(self) -> Any:
        return self.hf_config

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        tsp: TSPGroup | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        attention_kernel: str = "auto",
        activation_checkpointing: CheckpointingMode = "none",
        token_chunk: int = 4096,
        cuda_graphs: bool | str = False,
        mlp_activations: str = "keep",
    ) -> "TSPCausalLM":
        """Build from a LOCAL Hugging Face directory (config.json + *.safetensors), reading only this rank's slices.

        ``tsp=None`` gives the unsharded model (all slices are the full tensors). ``dtype`` defaults to
        ``torch.get_default_dtype()`` (the checkpoint's tensors are cast on load); ``device`` to CPU.
        ``mlp_activations``: :attr:`ModelConfig.mlp_activations` ("recompute" at the longest contexts).
        """
        from transformers import AutoConfig

        path = Path(path)
        if not path.is_dir():
            raise TSPConfigError(f"{str(path)!r} is not a local directory: TSPCausalLM.from_pretrained reads a "
                                 f"directory written by save_pretrained (nothing is downloaded)")
        hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
        cfg = model_config_from_hf(hf_config, pretrained_path=path)
        if mlp_activations != cfg.mlp_activations:
            cfg = dataclasses.replace(cfg, mlp_activations=mlp_activations)  # validated again
        model = cls(cfg, tsp, attention_kernel=attention_kernel, activation_checkpointing=activation_checkpointing,
                    token_chunk=token_chunk, cuda_graphs=cuda_graphs, device="meta", dtype=dtype)
        model.to_empty(device=device if device is not None else "cpu")
        model.init_weights()
        return model

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> None:
        """This rank's slices of the pretrained weights when ``cfg.pretrained_path`` is set, else random init."""
        path = getattr(self.cfg, "pretrained_path", None)
        if path:
            load_pretrained_shards(self, path)
        else:
            super().init_weights(seed)

    def _check_runtime(self, global_len: int) -> None:
        window = getattr(self.cfg, "sliding_window", None)
        if window is not None and global_len > window:
            raise TSPConfigError(
                f"sequence length {global_len} exceeds the model's sliding_window={window}: Hugging Face would "
                f"restrict attention to the last {window} tokens, TSP attends to the full causal prefix. Train with "
                f"sequences of at most {window} tokens, or set sliding_window=None (Mistral) / "
                f"use_sliding_window=False (Qwen) in the config if full attention is what you want."
            )
        dropout = getattr(self.cfg, "attention_dropout", 0.0)
        if self.training and dropout > 0:
            raise TSPConfigError(
                f"attention_dropout={dropout} in training: TSP attention has no dropout. Set "
                f"config.attention_dropout=0.0 before converting the model (or call model.eval())."
            )

    def forward(  # type: ignore[override]
        self,
        input_ids: Tensor,
        targets: Tensor | None = None,
        position_ids: Tensor | None = None,
        num_valid_tokens: Tensor | None = None,
        *,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
    ):
        from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

        if targets is None:  # a global Hugging Face batch (position_ids [B, S]: packed documents)
            if labels is None:
                raise TSPConfigError(
                    "TSPCausalLM computes the loss only (it never materialises logits): pass labels (Hugging Face "
                    "convention, unshifted, -100 = no loss; labels=input_ids for plain language modelling)"
                )
            if attention_mask is not None:
                mask = attention_mask.bool()
                if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
                    raise TSPConfigError("attention_mask has padding before real tokens: right padding only")
                refuse_padding_with_aux_loss(mask, aux_loss_coef(self.cfg))
                labels = labels.masked_fill(~mask, IGNORE_INDEX)
            self._check_runtime(input_ids.shape[1])
            # position_ids [B, S] (packed documents) are validated there: targets shifted per document, local
            # position ids [B, S/D]
            input_ids, targets, position_ids = self.shard_batch(input_ids, labels, position_ids=position_ids)
        else:
            if labels is not None or attention_mask is not None:
                raise TSPConfigError("pass either the sharded batch (targets, position_ids) or a global one "
                                     "(labels, attention_mask), not both")
            if position_ids is None:
                raise TSPConfigError("targets without position_ids: pass the zigzag position_ids of these tokens")
            self._check_runtime(input_ids.shape[1] * self.tsp.size)
        loss, aux = self.loss_terms(input_ids, targets, position_ids, num_valid_tokens)
        if aux is None:
            return CausalLMOutputWithPast(loss=loss, logits=None)
        return MoeCausalLMOutputWithPast(loss=self.total_loss(loss, aux), aux_loss=aux, logits=None)


# ---- pretrained weights ------------------------------------------------------------------------------------------


def _safe_open(file: Path):
    from safetensors import safe_open

    return safe_open(str(file), framework="pt", device="cpu")


def _weight_map(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    if path.is_file():
        files = [path]
    else:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            with open(index) as f:
                return {name: path / file for name, file in json.load(f)["weight_map"].items()}
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise TSPConfigError(
            f"no *.safetensors weights in {str(path)!r}: TSP reads safetensors only (slices without loading whole "
            f"tensors). Re-save the model with save_pretrained(dir) (safetensors is its default format)."
        )
    out: dict[str, Path] = {}
    for file in files:
        with _safe_open(file) as handle:
            for name in handle.keys():
                out[name] = file
    return out


# per-expert checkpoint layouts (the Hub's Mixtral and Qwen3-MoE files; save_pretrained writes them too):
# (module holding the experts, gate-half name, up-half name, down name)
_EXPERT_LAYOUTS = (
    ("block_sparse_moe", "w1", "w3", "w2"),  # Mixtral
    ("mlp", "gate_proj", "up_proj", "down_proj"),  # Qwen3-MoE
)


def _checkpoint_key(name: str, weight_map: dict[str, Path]) -> str | None:
    for key in (name, name.removeprefix("model.")):
        if key in weight_map:
            return key
    if name.endswith(".mlp.gate.weight"):  # Mixtral's router in the per-expert layout
        key = name.replace(".mlp.gate.weight", ".block_sparse_moe.gate.weight")
        return key if key in weight_map else None
    return None


def _expert_keys(name: str, experts: range, weight_map: dict[str, Path]) -> list[list[str]] | None:
    """Per-expert checkpoint names of the stacked parameter ``...mlp.experts.gate_up_proj`` (each expert's [gate,
    up] weights) or ``...mlp.experts.down_proj`` ([down]) for the given experts; None if the checkpoint has none."""
    layer, _, param = name.rpartition(".mlp.experts.")
    if param not in ("gate_up_proj", "down_proj"):
        return None
    for module, gate, up, down in _EXPERT_LAYOUTS:
        halves = (gate, up) if param == "gate_up_proj" else (down,)
        keys = [[f"{layer}.{module}.experts.{e}.{w}.weight" for w in halves] for e in experts]
        if all(k in weight_map for ks in keys for k in ks):
            return keys
    return None


@torch.no_grad()
def load_pretrained_shards(model: TSPLlama, path: str | os.PathLike) -> None:
    """Copy this rank's slices of a Hugging Face safetensors checkpoint into ``model`` (any TSPLlama, sharded or not).

    ``path``: a local directory (``model.safetensors``, or shards listed in ``model.safetensors.index.json``) or
    one ``.safetensors`` file. Each tensor is read with ``get_slice`` restricted to this rank's rows (dim 0) or
    columns (dim 1), so a rank reads 1/D of every sharded weight and never the full model. Mixture-of-experts
    weights are read in the stacked layout (``mlp.experts.gate_up_proj``) or the per-expert one of the Hub's
    Mixtral / Qwen3-MoE files (``experts.{e}.w1`` ... / ``experts.{e}.gate_proj`` ...), in which a rank reads only
    its own experts. Works on materialised parameters and on DTensor parameters (their local shard). Checkpoint
    tensors are cast to the parameters' dtype. Raises TSPConfigError if a parameter is missing or has another full
    shape.
    """
    path = Path(path)
    weight_map = _weight_map(path)
    size = model.tsp.size
    plan: list[tuple[str, str | None, list[list[str]] | None]] = []  # (param, key, per-expert keys)
    missing = []
    for name in model.shard_dims():
        key = _checkpoint_key(name, weight_map)
        experts = None
        if key is None:
            rng = model.shard_range(name)
            first, stop = (rng[1], rng[2]) if rng is not None else (0, model.full_shape(name)[0])
            experts = _expert_keys(name, range(first, stop), weight_map)
            if experts is None:
                missing.append(name)
                continue
        plan.append((name, key, experts))
    if missing:
        raise TSPConfigError(
            f"the checkpoint in {str(path)!r} lacks {len(missing)} parameters of the model, e.g. {missing[:3]}. Is it "
            f"a checkpoint of this architecture (Hugging Face names, *ForCausalLM)?"
        )
    with contextlib.ExitStack() as files:
        handles: dict[Path, Any] = {}

        def piece(key: str):
            file = weight_map[key]
            if file not in handles:
                handles[file] = files.enter_context(_safe_open(file))
            return handles[file].get_slice(key)

        for name, key, experts in plan:
            param = local_tensor(model.get_parameter(name))
            if experts is not None:  # this rank's experts, each [gate; up] or [down] stacked on dim 0
                tensor = torch.stack([torch.cat([piece(k)[:] for k in ks]) for ks in experts])
                if tensor.shape != param.shape:
                    raise TSPConfigError(
                        f"{name!r}: the per-expert weights {experts[0]} give shape {tuple(tensor.shape)} on this "
                        f"rank, the model expects {tuple(param.shape)}: the checkpoint is from another configuration"
                    )
                param.copy_(tensor)
                continue
            want = tuple(model.full_shape(name))
            src = piece(key)
            shape = tuple(src.get_shape())
            if shape != want:
                raise TSPConfigError(
                    f"{name!r} in {weight_map[key].name} has shape {shape}, the model expects {want}: the checkpoint "
                    f"is from another model configuration"
                )
            rng = model.shard_range(name)  # this rank's rows/columns (one copy of a replicated KV head)
            if rng is None or size == 1:
                tensor = src[:]
            else:
                dim, rows = rng[0], slice(rng[1], rng[2])
                tensor = src[rows] if dim == 0 else src[(slice(None),) * dim + (rows,)]
            param.copy_(tensor)


def set_pretrained_path(model: nn.Module, path: str | os.PathLike | None) -> nn.Module:
    """Point a (meta-device) Hugging Face model at a local checkpoint directory for TSP conversion.

    The converted model's ``init_weights`` then loads this rank's slices from ``path`` (``None``: random init,
    even when ``model.config.name_or_path`` is a local checkpoint). Returns ``model``.
    """
    setattr(model, _PATH_ATTR, None if path is None else os.fspath(path))
    return model


def _pretrained_path(module: nn.Module, on_meta: bool) -> str | None:
    if hasattr(module, _PATH_ATTR):
        return getattr(module, _PATH_ATTR)
    if not on_meta:
        return None  # materialised: the module's own weights are used
    name = getattr(getattr(module, "config", None), "name_or_path", None) or getattr(module, "name_or_path", None)
    if name and Path(name).is_dir() and (any(Path(name).glob("*.safetensors"))):
        return os.fspath(name)
    return None


# ---- conversion plans ------------------------------------------------------------------------------------------


def _hf_loaded() -> bool:
    return "transformers" in sys.modules  # no Hugging Face model can exist before transformers is imported


def _is_supported(module: nn.Module) -> bool:
    cls = type(module)
    if cls.__name__ not in SUPPORTED_CLASSES or not _hf_loaded() or not cls.__module__.startswith("transformers."):
        return False
    import transformers

    return getattr(transformers, cls.__name__, None) is cls


def convert_hf_causal_lm(module: nn.Module) -> TSPCausalLM:
    """A Hugging Face Llama/Mistral/Qwen2/Qwen3 ``*ForCausalLM`` -> the unsharded :class:`TSPCausalLM`.

    The parameters are the module's own tensors (no copy; ``requires_grad`` kept); a model on the meta device
    gives a meta TSPCausalLM whose ``init_weights`` loads ``module._tsp_pretrained_path`` (see
    :func:`set_pretrained_path`) or else ``config.name_or_path`` when that is a local safetensors directory, and
    does a random init otherwise. Gradient checkpointing enabled on the Hugging Face model becomes
    ``activation_checkpointing="full"``.
    """
    params = dict(module.named_parameters())
    if not params:
        raise TSPConfigError(f"{type(module).__name__} has no parameters")
    on_meta = {n for n, p in params.items() if p.is_meta}
    if on_meta and len(on_meta) != len(params):
        raise TSPConfigError(
            f"{type(module).__name__} is partly on the meta device ({sorted(on_meta)[:3]} ...): build it entirely on "
            f"meta (weights then come from a pretrained directory or a random init) or entirely materialised"
        )
    cfg = model_config_from_hf(module.config, pretrained_path=_pretrained_path(module, bool(on_meta)))
    dtype = next(iter(params.values())).dtype
    flag = "is_activation_checkpointing" if hasattr(type(module), "is_activation_checkpointing") else (
        "is_gradient_checkpointing")  # renamed in transformers 5
    checkpointing = "full" if getattr(module, flag, False) else "none"
    new = TSPCausalLM(cfg, None, activation_checkpointing=checkpointing, device="meta", dtype=dtype)
    ours = dict(new.named_parameters())
    if set(ours) != set(params):
        extra, lacking = sorted(set(params) - set(ours)), sorted(set(ours) - set(params))
        raise TSPConfigError(
            f"{type(module).__name__} does not have the standard parameters of its class (unexpected: {extra[:4]}, "
            f"missing: {lacking[:4]}): adapters (e.g. LoRA), untied weights or other modifications cannot be "
            f"converted. Merge or remove them first, or register your own plan."
        )
    for name, p in params.items():
        if tuple(p.shape) != tuple(ours[name].shape):
            raise TSPConfigError(
                f"{name}: shape {tuple(p.shape)} does not match its config ({tuple(ours[name].shape)})"
            )
    if not on_meta:
        new.load_state_dict(params, strict=True, assign=True)  # the same Parameter objects
    else:
        for name, p in new.named_parameters():
            p.requires_grad_(params[name].requires_grad)
    new.train(module.training)
    return new


def _user_plan_matches_inside(module: nn.Module) -> bool:
    from lightning_tsp.convert import _PLANS

    user = [m for m, c in _PLANS if not getattr(c, "_tsp_builtin", False)]
    if not user:
        return False
    return any(matches(sub) for _, sub in list(module.named_modules())[1:] for matches in user)


def _is_unsupported_hf(module: nn.Module) -> bool:
    if not _hf_loaded() or _is_supported(module):
        return False
    from transformers import PreTrainedModel

    return isinstance(module, PreTrainedModel) and not _user_plan_matches_inside(module)


def reject_unsupported_hf(module: nn.Module) -> nn.Module:
    cls = type(module)
    base = next((c.__name__ for c in cls.__mro__[1:] if c.__name__ in SUPPORTED_CLASSES), None)
    why = (
        f"it subclasses {base}, and a subclass may change forward (only the exact classes are converted)"
        if base is not None
        else f"TSP converts only {', '.join(SUPPORTED_CLASSES)}"
    )
    raise TSPConfigError(
        f"the LightningModule holds a Hugging Face {cls.__name__} ({cls.__module__}), which TSPStrategy cannot shard: "
        f"{why}. Left as is it would be replicated and run on 1/D of every sequence, giving wrong results. Register "
        f"a conversion plan with lightning_tsp.convert.register_conversion(matches, convert) that turns it into a "
        f"lightning_tsp TSPLlama subclass (for an unchanged Llama-family subclass: "
        f"register_conversion(lambda m: isinstance(m, {cls.__name__}), lightning_tsp.convert.hf.convert_hf_causal_lm)"
        f"), or keep it out of the LightningModule. See docs/converting.md."
    )


def _convert_supported(module: nn.Module) -> TSPCausalLM:
    # a distinct function object: the registry marks built-in converters, and users may register
    # convert_hf_causal_lm itself for their own subclasses
    return convert_hf_causal_lm(module)


PLANS = [
    (_is_supported, _convert_supported),
    (_is_unsupported_hf, reject_unsupported_hf),
]
