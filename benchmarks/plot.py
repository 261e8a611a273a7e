"""Plots from the harness's JSON lines (python -m benchmarks.harness --out X.md writes X.jsonl).

    python -m benchmarks.plot results.jsonl [more.jsonl ...] --out-dir plots/ [--budget-gb 141]

    python -m benchmarks.plot --decode inference.jsonl [hf.jsonl ...] --out-dir plots/

Writes peak_memory.png (peak GB per rank vs sequence length, one line per strategy and layout; OOM rows drawn as
crosses at the top) and throughput.png (tokens/s per GPU per strategy, grouped by sequence length, with the
predicted step including communication drawn as a lighter bar when it is slower). Rows of one model
configuration only (the most frequent one, unless --model/--layers say otherwise); the last row of a
(strategy, layout, checkpointing, seq) wins. ``--decode``: decode.png from benchmarks.inference / hf_decode rows
(batch 1: ms per token vs prompt length per configuration, each with its memory-bandwidth floor dashed).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from benchmarks.runner import seq_label


def load(paths: list[str]) -> list[dict]:
    rows = []
    for p in paths:
        for line in Path(p).read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if "strategy" in row:  # training rows (inference rows share the folder)
                    rows.append(row)
    return rows


def select(rows: list[dict], model: str | None, layers: int | None) -> list[dict]:
    if model is None and layers is None and rows:
        common = Counter((r.get("model"), r.get("layers")) for r in rows).most_common(1)[0][0]
        model, layers = common
    rows = [r for r in rows if (model is None or r.get("model") == model) and (layers is None or r.get("layers") == layers)]
    last = {}
    for r in rows:
        last[(r["strategy"], r.get("layout", ""), r.get("checkpointing", "full"), r["seq_len"])] = r
    return list(last.values())


def label(r: dict) -> str:
    parts = [p for p in (r.get("layout") or "", r.get("checkpointing", "full")) if p and p != "full"]
    return f"{r['strategy']} ({', '.join(parts)})" if parts else r["strategy"]


def plot_decode(rows: list[dict], out: Path, plt) -> Path:
    """ms per token (log) vs prompt length (log2), one line per configuration at batch 1, floors dashed."""
    rows = [r for r in rows if r.get("status") == "ok" and r.get("decode_s_per_token") and r.get("batch", 1) == 1]
    series: dict[str, dict[int, dict]] = {}
    for r in rows:
        series.setdefault(r["config"], {})[r["prompt_len"]] = r
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, by_len in sorted(series.items()):
        lens = sorted(by_len)
        (line,) = ax.plot(lens, [1e3 * by_len[n]["decode_s_per_token"] for n in lens], marker="o", label=name)
        floors = [(n, 1e3 * by_len[n]["decode_floor_s"]) for n in lens if by_len[n].get("decode_floor_s")]
        if floors and not name.startswith("Hugging Face"):
            ax.plot(*zip(*floors), linestyle="--", color=line.get_color(), alpha=0.6, label=f"{name}: floor")
    lens = sorted({r["prompt_len"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(lens, [seq_label(n) for n in lens])
    ax.set_xlabel("prompt length")
    ax.set_ylabel("decode ms per token (batch 1)")
    ax.set_title(f"Decoding, {rows[0].get('model')}, bf16 (dashed: weights + KV cache read once at HBM speed)",
                 fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=120)
    plt.close(fig)
    return out / "decode.png"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plot", description=__doc__.split("\n\n")[0])
    ap.add_argument("jsonl", nargs="+")
    ap.add_argument("--decode", action="store_true", help="decode.png from inference / hf_decode rows")
    ap.add_argument("--out-dir", default="plots")
    ap.add_argument("--model")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--budget-gb", type=float, help="draw a horizontal line at this memory budget")
    args = ap.parse_args(argv)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.decode:
        print(f"wrote {plot_decode(load(args.jsonl), out, plt)}")
        return
    rows = select(load(args.jsonl), args.model, args.layers)
    if not rows:
        raise SystemExit("no rows to plot")
    title = f"{rows[0].get('model')} ({rows[0].get('layers')} layers), one rank of {rows[0].get('world')}"
    series: dict[str, list[dict]] = {}
    for r in rows:
        series.setdefault(label(r), []).append(r)

    # peak memory vs sequence length
    fig, ax = plt.subplots(figsize=(8, 5))
    ok_peaks = [r["peak_gb"] for r in rows if r.get("status") == "ok" and r.get("peak_gb")]
    top = max(ok_peaks + [args.budget_gb or 0]) * 1.08 if ok_peaks else 1.0
    for name, rs in sorted(series.items()):
        rs = sorted(rs, key=lambda r: r["seq_len"])
        pts = [(r["seq_len"], r["peak_gb"]) for r in rs if r.get("status") == "ok" and r.get("peak_gb")]
        line = None
        if pts:
            extrap = any(r.get("extrapolated_from") for r in rs)
            (line,) = ax.plot(*zip(*pts), marker="o", linestyle="--" if extrap else "-",
                              label=name + (" (extrapolated in layers)" if extrap else ""))
        oom = [r["seq_len"] for r in rs if r.get("status") == "OOM"]
        if oom:
            ax.scatter(oom, [top] * len(oom), marker="x", color=line.get_color() if line else "black",
                       label=None if line else f"{name}: OOM")
    if args.budget_gb:
        ax.axhline(args.budget_gb, color="grey", linestyle=":", label=f"budget {args.budget_gb:g} GB")
    ax.set_xscale("log", base=2)
    seqs = sorted({r["seq_len"] for r in rows})
    ax.set_xticks(seqs, [seq_label(s) for s in seqs])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("peak memory per rank (GB)")
    ax.set_title(f"Peak memory: {title}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "peak_memory.png", dpi=120)
    plt.close(fig)

    # tokens/s per GPU, grouped by sequence length
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(seqs)), 5))
    names = sorted(series)
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        by_seq = {r["seq_len"]: r for r in series[name]}
        xs, ys, ys_comm = [], [], []
        for j, s in enumerate(seqs):
            r = by_seq.get(s)
            if r and r.get("tokens_per_s_per_gpu"):
                xs.append(j + (i - (len(names) - 1) / 2) * width)
                ys.append(r["tokens_per_s_per_gpu"])
                step_c = r.get("pred_step_with_comm_s")
                ys_comm.append(r["tokens_per_s_per_gpu"] * r["step_s"] / step_c if step_c else ys[-1])
        if xs:
            bars = ax.bar(xs, ys, width, label=name, alpha=0.35)
            ax.bar(xs, ys_comm, width, color=bars.patches[0].get_facecolor()[:3])
    ax.set_xticks(range(len(seqs)), [seq_label(s) for s in seqs])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(f"Throughput (solid: with predicted communication; light: compute only)\n{title}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=120)
    plt.close(fig)
    print(f"wrote {out / 'peak_memory.png'} and {out / 'throughput.png'}")


if __name__ == "__main__":
    main()
