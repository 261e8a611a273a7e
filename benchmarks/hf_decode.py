"""Hugging Face ``generate`` decode speed on one GPU: the rival rows of benchmarks/inference.py's D = 1 rows.

The same shapes as a lightning_tsp preset (random weights, bf16), ``LlamaForCausalLM`` with SDPA attention, greedy.
Per-token time = (time of ``generate`` with N2 new tokens - time with N1) / (N2 - N1), median over repeats: the
prefill and the first token cancel. Two cache modes: ``dynamic`` (eager, the default cache) and ``static``
(``cache_implementation="static"``, which Hugging Face compiles on its own: ``generation_config.compile_config``,
CUDA graphs). Wrapping the forward in ``torch.compile(mode="reduce-overhead")`` by hand instead fails inside
``generate`` (a CUDA-graph output read after the next replay overwrote it; transformers 5.17, torch 2.11).

    python -m benchmarks.hf_decode --model paper-7b --prompt-lens 2048 32768 --modes dynamic static
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import time
from pathlib import Path


def hf_model(preset: str, layers: int | None, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_tsp.models.llama import get_config

    cfg = get_config(preset, **({} if layers is None else {"n_layers": layers}))
    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                     num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
                     max_position_embeddings=1 << 21, tie_word_embeddings=cfg.tie_embeddings,
                     rms_norm_eps=cfg.norm_eps, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(hf)
    model = model.to_empty(device="cuda").to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.model.rotary_emb.__init__(hf, device="cuda")  # buffers lost by to_empty
    return model.eval(), cfg


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.hf_decode", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="paper-7b")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--modes", nargs="+", choices=("dynamic", "static"), default=["dynamic", "static"])
    ap.add_argument("--new-tokens", type=int, nargs=2, default=[8, 40], metavar=("N1", "N2"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    import torch

    model, cfg = hf_model(args.model, args.layers, torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for mode in args.modes:
        for s in args.prompt_lens:
            cmd = ["python", "-m", "benchmarks.hf_decode", "--model", args.model, "--prompt-lens", str(s), "--modes",
                   mode, "--new-tokens", *map(str, args.new_tokens), "--repeats", str(args.repeats)]
            row = {"config": f"Hugging Face generate ({mode} cache{', compiled' if mode == 'static' else ''})",
                   "model": args.model, "prompt_len": s, "command": shlex.join(cmd), "status": "ok"}
            try:
                ids = torch.randint(0, cfg.vocab_size, (1, s), device="cuda")
                kw = dict(do_sample=False, pad_token_id=0)
                if mode == "static":
                    kw.update(cache_implementation="static")

                def run(n):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                    torch.cuda.synchronize()
                    return time.perf_counter() - t0

                with torch.no_grad():
                    run(args.new_tokens[1])  # warm-up (compilation)
                    n1, n2 = args.new_tokens
                    per = [(run(n2) - run(n1)) / (n2 - n1) for _ in range(args.repeats)]
                row["decode_s_per_token"] = statistics.median(per)
                row["decode_floor_s"] = (weights + 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * s * 2) / 4.8e12
                row["decode_x_floor"] = row["decode_s_per_token"] / row["decode_floor_s"]
            except Exception as exc:  # noqa: BLE001 - a failed rival row says why
                row["status"] = "error"
                row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
            rows.append(row)
            print("HF_ROW " + json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a", encoding="utf-8") as f:
                    f.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()
    print("| config | prompt | status | decode ms/token | x floor |")
    for r in rows:
        t, x = r.get("decode_s_per_token"), r.get("decode_x_floor")
        cells = [r["config"], f"{r['prompt_len']:,}", r["status"], "" if t is None else f"{1e3 * t:.2f}",
                 "" if x is None else f"{x:.2f}"]
        print("| " + " | ".join(cells) + " |")

if __name__ == "__main__":
    main()
