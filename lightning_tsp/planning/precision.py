"""Bytes per element for each training precision (Lightning's precision names)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Precision", "PRECISIONS", "get_precision"]


@dataclass(frozen=True)
class Precision:
    name: str
    compute: int  # matmul inputs/outputs, activations, weights on the wire
    weight: int  # the stored (master) parameter
    grad: int  # stored gradient (and the dtype of data-parallel gradient reductions)
    optimizer: int  # AdamW exp_avg + exp_avg_sq, per parameter
    compute_copy: int  # extra low-precision copy of resident weights (autocast's cast cache / saved bf16 weights)
    residual: int  # the residual stream between layers (what full checkpointing stores)


PRECISIONS: dict[str, Precision] = {
    # fp32 everything: 4 + 4 + 8 = 16 B/param.
    "32-true": Precision("32-true", compute=4, weight=4, grad=4, optimizer=8, compute_copy=0, residual=4),
    # torch.autocast(bf16) over fp32 parameters: fp32 master weights, fp32 grads, fp32 AdamW states
    # (4 + 4 + 8 = 16 B/param) plus bf16 copies of resident weights made by autocast (2 B/param) for strategies
    # whose weights stay on the device. The embedding output is fp32, so the residual stream stays fp32.
    "bf16-mixed": Precision("bf16-mixed", compute=2, weight=4, grad=4, optimizer=8, compute_copy=2, residual=4),
    # bf16 parameters, gradients and AdamW states (2 + 2 + 4 = 8 B/param).
    "bf16-true": Precision("bf16-true", compute=2, weight=2, grad=2, optimizer=4, compute_copy=0, residual=2),
}


def get_precision(name: str | Precision) -> Precision:
    if isinstance(name, Precision):
        return name
    if name not in PRECISIONS:
        raise ValueError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
