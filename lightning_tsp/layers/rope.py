"""Rotary position embeddings on GLOBAL positions (Llama's rotate-half convention), optionally scaled.

Scaled RoPE follows the Hugging Face form of the scaling dict (``config.rope_parameters`` in transformers 5,
``config.rope_scaling`` before): ``{"rope_type": "linear" | "llama3" | "yarn", ...}``. Only the inverse frequencies
(and, for YaRN, one constant multiplying cos and sin) change, and they depend on nothing but the configuration, so
the table of a token is a function of its global position: every rank of a TSP group, training, prefill and
decoding all compute the same angles. Types whose angles depend on the current sequence length (``dynamic``,
``longrope``) are refused by name.

The arithmetic is Hugging Face's: inverse frequencies in fp32 on the CPU (once per configuration and device),
angles ``position * inv_freq`` in fp32, cos/sin times the attention factor in fp32, then one cast.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.kernels.fused import fused_on_cuda, rows_heads

__all__ = ["SUPPORTED_ROPE_TYPES", "apply_rope", "apply_rope_backward", "rope_cos_sin", "validate_rope_scaling"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")

_LENGTH_DEPENDENT = {
    "dynamic": (
        "dynamic NTK scaling recomputes the frequencies from the CURRENT sequence length, so a token's rotation "
        "depends on how long the sequence is when it is computed: generation with a KV cache sharded over the TSP "
        "group cannot reproduce it exactly (cached keys keep the angles of the length they were written at)"
    ),
    "longrope": (
        "LongRoPE switches between its short and long frequency factors with the current sequence length, so a "
        "token's rotation depends on how long the sequence is when it is computed: the sharded KV cache of "
        "generation cannot reproduce it exactly"
    ),
}
_HOW = ("Use a model with rope_type 'default', 'linear', 'llama3' or 'yarn', or convert the checkpoint to one of "
        "them.")


def _number(value: Any, name: str, where: str, *, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TSPConfigError(f"{where}[{name!r}]={value!r} is not a finite number")
    if positive and value <= 0:
        raise TSPConfigError(f"{where}[{name!r}]={value!r} must be > 0")
    return float(value)


def validate_rope_scaling(scaling: dict | None, head_dim: int | None = None, *, theta: float | None = None,
                          max_position_embeddings: int | None = None, where: str = "rope_scaling") -> dict | None:
    """Check a Hugging Face RoPE scaling dict and return its normalised form (None for plain RoPE).

    The normalised dict holds exactly the values the computation uses, defaults filled in as Hugging Face does:

    * ``{"rope_type": "linear", "factor"}``
    * ``{"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``
    * ``{"rope_type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "truncate",
      "attention_factor"}`` (the attention factor resolved from ``mscale``/``mscale_all_dim`` or ``factor``)

    It is a fixed point (validating it again returns it unchanged). ``max_position_embeddings`` supplies the
    defaults Hugging Face takes from the model config (``original_max_position_embeddings`` for llama3/yarn, a
    missing yarn ``factor``); ``theta``, when given, must agree with a ``rope_theta`` inside the dict. Anything else
    (``dynamic``, ``longrope``, unknown types, ``partial_rotary_factor`` != 1, per-layer-type dicts) raises
    :class:`TSPConfigError` naming the value.
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise TSPConfigError(f"{where}={scaling!r} must be a dict (Hugging Face rope_parameters form) or None")
    nested = sorted(k for k, v in scaling.items() if isinstance(v, dict))
    if nested:
        raise TSPConfigError(
            f"{where} holds per-layer-type dicts ({nested}): TSP applies one rotary embedding to every layer. Give "
            f"one flat dict (the layers' common rope parameters)."
        )
    if head_dim is not None and (head_dim <= 0 or head_dim % 2):
        raise TSPConfigError(f"head_dim={head_dim}: rotary embeddings need an even head dimension")
    prf = scaling.get("partial_rotary_factor")
    if prf not in (None, 1, 1.0):
        raise TSPConfigError(
            f"{where}['partial_rotary_factor']={prf}: TSP rotates the full head dimension only. Use a model with "
            f"partial_rotary_factor=1."
        )
    if theta is not None and scaling.get("rope_theta") not in (None, theta, float(theta)):
        raise TSPConfigError(
            f"{where}['rope_theta']={scaling['rope_theta']} differs from the model's rope_theta={theta}: set "
            f"rope_theta to the value in the rope parameters."
        )
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type in (None, "default"):
        return None
    if rope_type in _LENGTH_DEPENDENT:
        raise TSPConfigError(f"{where}['rope_type']={rope_type!r} is not supported: {_LENGTH_DEPENDENT[rope_type]}. "
                             f"{_HOW}")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise TSPConfigError(
            f"{where}['rope_type']={rope_type!r} is not supported: TSP computes the rotary embedding types "
            f"{list(SUPPORTED_ROPE_TYPES)} only, and {rope_type!r} would give other angles. {_HOW}"
        )

    def required(name: str) -> Any:
        if scaling.get(name) is None:
            raise TSPConfigError(f"{where}['rope_type']={rope_type!r} needs {where}[{name!r}], which is missing")
        return scaling[name]

    def original_max() -> int:
        value = scaling.get("original_max_position_embeddings")
        if value is None:
            if max_position_embeddings is None:
                raise TSPConfigError(
                    f"{where}['rope_type']={rope_type!r} needs 'original_max_position_embeddings' (the pretraining "
                    f"context length): add it to {where}."
                )
            value = max_position_embeddings
        _number(value, "original_max_position_embeddings", where)
        return int(value) if float(value).is_integer() else value

    if rope_type == "linear":
        return {"rope_type": "linear", "factor": _number(required("factor"), "factor", where)}

    if rope_type == "llama3":
        out = {
            "rope_type": "llama3",
            "factor": _number(required("factor"), "factor", where),
            "low_freq_factor": _number(required("low_freq_factor"), "low_freq_factor", where),
            "high_freq_factor": _number(required("high_freq_factor"), "high_freq_factor", where),
            "original_max_position_embeddings": original_max(),
        }
        if out["high_freq_factor"] <= out["low_freq_factor"]:
            raise TSPConfigError(
                f"{where}: high_freq_factor={out['high_freq_factor']} must be greater than "
                f"low_freq_factor={out['low_freq_factor']} (the llama3 band between them is interpolated)"
            )
        return out

    # yarn
    orig = original_max()
    factor = scaling.get("factor")
    if factor is None:  # Hugging Face: the ratio of the extended to the original context
        if max_position_embeddings is None:
            raise TSPConfigError(f"{where}['rope_type']='yarn' needs {where}['factor'], which is missing")
        factor = max_position_embeddings / orig
    factor = _number(factor, "factor", where)
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, _number(mscale, "mscale", where, positive=False)) / _yarn_mscale(
                factor, _number(mscale_all_dim, "mscale_all_dim", where, positive=False))
        else:
            attention = _yarn_mscale(factor)
    truncate = scaling.get("truncate", True)
    if not isinstance(truncate, bool):
        raise TSPConfigError(f"{where}['truncate']={truncate!r} must be True or False")
    out = {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": orig,
        "beta_fast": _number(scaling.get("beta_fast") or 32, "beta_fast", where),  # falsy -> default, as in HF
        "beta_slow": _number(scaling.get("beta_slow") or 1, "beta_slow", where),
        "truncate": truncate,
        "attention_factor": _number(attention, "attention_factor", where),
    }
    return out


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction sqrt(1/t) = 0.1 * ln(s) + 1 (scaled by mscale); 1 when not extending."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _default_inv_freq(head_dim: int, theta: float) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _llama3_inv_freq(inv_freq: Tensor, s: dict) -> Tensor:
    """Llama 3.1: wavelengths shorter than orig/high_freq_factor keep their frequency, those longer than
    orig/low_freq_factor are divided by ``factor``, and the band in between blends the two linearly in
    orig/wavelength."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    orig = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long_wave = orig / low  # wavelengths above this one get the full factor
    short_wave = orig / high  # wavelengths below this one are left alone
    scaled = torch.where(wavelen > long_wave, inv_freq / factor, inv_freq)
    smooth = (orig / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = (wavelen >= short_wave) & (wavelen <= long_wave)
    return torch.where(in_band, blended, scaled)


def _yarn_inv_freq(head_dim: int, theta: float, s: dict) -> Tensor:
    """YaRN ("NTK-by-parts"): dimensions that rotate more than beta_fast times over the original context keep
    their frequency (extrapolation), those rotating fewer than beta_slow times are divided by ``factor``
    (interpolation), and a linear ramp over the dimension index blends the two in between."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]
    base_pow = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    extrapolated = 1.0 / base_pow
    interpolated = 1.0 / (factor * base_pow)

    def dim_of(rotations: float) -> float:  # the dimension index whose wavelength fits `rotations` times in orig
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = dim_of(s["beta_fast"]), dim_of(s["beta_slow"])
    if s["truncate"]:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, head_dim - 1)
    if lo == hi:
        hi += 0.001  # a zero-width ramp would divide by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    keep = 1 - ramp  # weight of the extrapolated (unscaled) frequency
    return interpolated * (1 - keep) + extrapolated * keep


def _freeze(value: Any) -> Any:
    """A hashable key for a scaling dict (same key for the same contents, whatever the order)."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_freeze(v) for v in value))
    return value


# (head_dim, theta, frozen scaling, device) -> (inv_freq, factor). Never evicted: a captured CUDA graph (a kept
# decoder's step) reads inv_freq by address, so a table must live as long as the process; each is head_dim / 2
# floats, one per configuration and device a process meets.
_TABLES: dict[tuple, tuple[Tensor, float]] = {}


def _table(head_dim: int, theta: float, scaling: dict | None, device: torch.device) -> tuple[Tensor, float]:
    """(inv_freq fp32 on ``device``, attention factor) of one configuration; validated and computed once."""
    key = (head_dim, theta, None if not scaling else _freeze(scaling), device)
    hit = _TABLES.get(key)
    if hit is not None:
        return hit
    scaling = validate_rope_scaling(scaling, head_dim, theta=theta)
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor even if first built under inference_mode
        if scaling is None:
            inv_freq, attention = _default_inv_freq(head_dim, theta), 1.0
        elif scaling["rope_type"] == "linear":
            inv_freq, attention = _default_inv_freq(head_dim, theta) / scaling["factor"], 1.0
        elif scaling["rope_type"] == "llama3":
            inv_freq, attention = _llama3_inv_freq(_default_inv_freq(head_dim, theta), scaling), 1.0
        else:
            inv_freq, attention = _yarn_inv_freq(head_dim, theta, scaling), scaling["attention_factor"]
        inv_freq = inv_freq.to(device)
    _TABLES[key] = (inv_freq, attention)
    return inv_freq, attention


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None) -> tuple[Tensor, Tensor]:
    """cos, sin [..., head_dim] for the given global positions [...] (computed in fp32, then cast).

    ``scaling``: a Hugging Face RoPE scaling dict (see :func:`validate_rope_scaling`); None is plain RoPE. The
    inverse frequencies are validated and computed once per configuration and device.
    """
    inv_freq, attention = _table(int(head_dim), float(theta), scaling, positions.device)
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention != 1.0:
        cos, sin = cos * attention, sin * attention
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


@fused_on_cuda(rows_heads)
def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, L, n, d] (heads second to last) rotated by the angles of its tokens' positions; cos/sin broadcast
    against it."""
    return x * cos + _rotate_half(x) * sin


@fused_on_cuda(rows_heads)
def apply_rope_backward(grad: Tensor, cos: Tensor, sin: Tensor, out: Tensor | None = None) -> Tensor:
    """The transpose of :func:`apply_rope` (a rotation by the opposite angle); with ``out`` (a view of a larger
    gradient buffer, say) written there in ``out``'s dtype and returned, with no intermediate tensor."""
    d = grad * cos - _rotate_half(grad * sin)
    return d if out is None else out.copy_(d)
