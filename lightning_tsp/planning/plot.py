"""Memory vs sequence length per strategy (matplotlib, imported lazily)."""

from __future__ import annotations

from .hardware import GiB, Hardware
from .model import ModelShape
from .planner import _head_ok, divisors
from .precision import Precision
from .strategies import STRATEGY_LABELS, Layout, memory_breakdown

__all__ = ["MissingMatplotlib", "memory_curves", "plot_memory_vs_seq"]


class MissingMatplotlib(RuntimeError):
    pass


def _layouts_for_node(shape: ModelShape, gpus: int, gpn: int, seq_lens: list[int]) -> list[Layout]:
    """One layout per strategy using one node's worth of model parallelism (the largest valid degree <= gpus
    per node), so the curves compare strategies on the same devices."""
    cap = min(gpn, gpus)
    ds = [d for d in divisors(gpus) if 2 <= d <= cap]
    heads = [d for d in ds if _head_ok(shape, d)]
    ok_seq = lambda d: all(s % (2 * d) == 0 for s in seq_lens)
    out = [Layout("dp", gpus, gpn)]
    if cap >= 2:
        out.append(Layout("fsdp", gpus, gpn, fsdp=cap))
    if heads:
        t = max(heads)
        out += [Layout("tp", gpus, gpn, tp=t), Layout("tp_sp", gpus, gpn, tp=t)]
    tsp = [d for d in ds if ok_seq(d) and _head_ok(shape, d, whole_experts=True)]  # MoE: E/D whole experts
    if tsp:
        out.append(Layout("tsp", gpus, gpn, tsp=max(tsp)))
    sp = [d for d in ds if ok_seq(d)]
    if sp:
        out.append(Layout("sp", gpus, gpn, sp=max(sp)))
    grid = [(t, cap // t) for t in heads if cap % t == 0 and cap // t >= 2 and ok_seq(cap // t)]
    if grid:
        t, s = max(grid)  # the largest TP degree (TP inside, SP outside), e.g. T=4 x S=2 on 8 GPUs
        out.append(Layout("tp_x_sp", gpus, gpn, tp=t, sp=s))
    return out


def memory_curves(shape: ModelShape, precision: Precision, gpus: int, gpus_per_node: int, micro_batch: int,
                  checkpointing: str, seq_lens: list[int]) -> dict[str, list[float]]:
    """label -> peak GiB per sequence length."""
    curves: dict[str, list[float]] = {}
    for lay in _layouts_for_node(shape, gpus, gpus_per_node, seq_lens):
        label = f"{STRATEGY_LABELS[lay.strategy]} ({lay.degrees})"
        curves[label] = [memory_breakdown(shape, lay, precision, micro_batch, s, checkpointing)["peak"] / GiB
                         for s in seq_lens]
    return curves


def default_seq_lens(seq_len: int, gpus_per_node: int) -> list[int]:
    step = 2 * max(1, gpus_per_node)
    hi = max(seq_len * 4, 8192)
    out, s = [], 4096
    while s <= hi:
        if s % step == 0:
            out.append(s)
        s *= 2
    return out or [seq_len]


def plot_memory_vs_seq(path: str, shape: ModelShape, hw: Hardware, precision: Precision, gpus: int,
                       gpus_per_node: int, micro_batch: int, checkpointing: str, seq_len: int,
                       headroom: float = 0.9) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingMatplotlib("--plot needs matplotlib: pip install matplotlib") from exc
    seq_lens = default_seq_lens(seq_len, gpus_per_node)
    curves = memory_curves(shape, precision, gpus, gpus_per_node, micro_batch, checkpointing, seq_lens)
    fig, ax = plt.subplots(figsize=(10, 5))
    for label, ys in curves.items():
        ax.plot(seq_lens, ys, marker="o", linewidth=2.5 if label.startswith("TSP") else 1.5, label=label)
    ax.axhline(hw.hbm_bytes / GiB, color="k", linestyle="--", linewidth=1, label=f"{hw.name} HBM")
    ax.axhline(headroom * hw.hbm_bytes / GiB, color="gray", linestyle=":", linewidth=1,
               label=f"usable ({headroom:.0%})")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seq_lens)
    ax.set_xticklabels([f"{s // 1024}K" for s in seq_lens])
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("estimated peak memory per GPU (GiB)")
    ax.set_title(f"{shape.name}: {precision.name}, checkpointing={checkpointing}, micro-batch {micro_batch}, "
                 f"{min(gpus_per_node, gpus)} GPUs per model replica", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
