"""Decode attention kernels on one GPU: one new token's queries against a KV cache slice, masked to the filled
slots, returning the partial output and its log-sum-exp (what a TSP decode step merges across ranks).

Times each candidate (CUDA events, median of repeats) at several cache lengths, with the bytes it must read
(the cache once) as an effective bandwidth, and its error against fp64 explicit attention.

    python -m benchmarks.decode_kernels --lens 2048 16384 131072 --heads 32 32
    python -m benchmarks.decode_kernels --profile-step   # + a torch.profiler table of one paper-7b decode step
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

from lightning_tsp.inference.decode import cache_attention, partial_attention


def bf16_score_attention(q, k, v, slot_pos):
    """cache_attention with bf16 GEMM outputs (scores rounded to bf16 before the softmax): the speed reference for
    the fp32-output GEMVs, less accurate."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)
    s = torch.matmul(qg, k.transpose(-1, -2)).float() * (1.0 / math.sqrt(d))  # [B, Hkv, g, T]
    s = s.masked_fill((slot_pos < 0)[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).to(q.dtype)
    o = torch.matmul(p, v).float()
    return o.reshape(b, hq, d), lse.reshape(b, hq)


def _flex_call(q, k, v, slot_pos, enable_gqa):
    from torch.nn.attention import flex_attention as fa

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(slot_pos[b, kv_idx] >= 0, score, -float("inf"))

    o, aux = fa.flex_attention(q, k, v, score_mod=score_mod, enable_gqa=enable_gqa, return_aux=fa.AuxRequest(lse=True))
    return o, aux.lse


_flex_compiled = None


def flex_attention(q, k, v, slot_pos):
    """Compiled FlexAttention (its decoding path) with the slot mask as a score_mod: the measured alternative."""
    global _flex_compiled
    if _flex_compiled is None:
        _flex_compiled = torch.compile(_flex_call, dynamic=False)
    o, lse = _flex_compiled(q.unsqueeze(2), k, v, slot_pos, q.shape[1] != k.shape[1])
    return o.squeeze(2).float(), lse.squeeze(2).float()


def efficient_attention(q, k, v, slot_pos):
    b, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.view(b, hkv, hq // hkv, d)
    bias = torch.zeros(slot_pos.shape, dtype=q.dtype, device=q.device).masked_fill(slot_pos < 0, float("-inf"))
    bias = bias[:, None, None, :].expand(b, hkv, hq // hkv, -1)
    o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qg, k, v, bias, True)[:2]
    return o.float().reshape(b, hq, d), lse[..., : hq // hkv].reshape(b, hq)


CANDIDATES = {"cache_attention (fp32-output GEMVs)": cache_attention, "bf16-score GEMVs": bf16_score_attention,
              "flex": flex_attention, "efficient": efficient_attention}


def bench(fn, *args, repeats=20):
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeats):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) / 1e3)
    return statistics.median(times)


def kernels(args):
    print("| kernel | T | Hq/Hkv | ms | GB/s (cache read once) | max rel err o | max abs err lse |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    hq, hkv = args.heads
    for t in args.lens:
        g = torch.Generator(device="cuda").manual_seed(t)
        q = torch.randn(args.batch, hq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(args.batch, hkv, t, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "kv")
        slot_pos = torch.arange(t, device="cuda").repeat(args.batch, 1)
        slot_pos[:, int(0.9 * t):] = -1
        small = slice(0, min(t, 4096))
        ref = partial_attention(q.double(), k[:, :, small].double(), v[:, :, small].double(),
                                slot_pos[:, small] >= 0)
        nbytes = 2 * k.numel() * k.element_size()
        for name, fn in CANDIDATES.items():
            try:
                o, lse = fn(q, k[:, :, small].contiguous(), v[:, :, small].contiguous(), slot_pos[:, small].contiguous())
                err_o = ((o.double() - ref[0]).norm() / ref[0].norm()).item()
                err_l = (lse.double() - ref[1]).abs().max().item()
                s = bench(fn, q, k, v, slot_pos)
                print(f"| {name} | {t} | {hq}/{hkv} | {1e3 * s:.3f} | {nbytes / s / 1e9:,.0f} | {err_o:.1e} | "
                      f"{err_l:.1e} |", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"| {name} | {t} | {hq}/{hkv} | error: {type(exc).__name__}: {str(exc)[:120]} | | | |")


def profile_step(args):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from lightning_tsp import TSPGroup, TSPLlama
    from lightning_tsp.inference import prefill
    from lightning_tsp.inference.decode import Decoder
    from lightning_tsp.models.llama import get_config

    d = args.profile_tsp
    if d > 1:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=d)
        tsp = TSPGroup.from_process_group(dist.group.WORLD)
    else:
        tsp = None
    cfg = get_config(args.profile_model)
    model = TSPLlama(cfg, tsp, device="meta", dtype=torch.bfloat16)
    model.to_empty(device="cuda")
    model.init_weights()
    model.requires_grad_(False).eval()
    s = args.profile_len
    ids = torch.randint(0, cfg.vocab_size, (1, s), device="cuda")
    with torch.no_grad():
        cache, _ = prefill(model, ids, torch.tensor([s], device="cuda"), decode_steps=16)
        dec = Decoder(model, cache, graphs=False)
        tok = torch.zeros(1, dtype=torch.long, device="cuda")
        for _ in range(3):
            dec(tok)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(2):
                dec(tok)
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.profile_rows))


def main():
    ap = argparse.ArgumentParser(prog="python -m benchmarks.decode_kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[2048, 16384, 131072])
    ap.add_argument("--heads", type=int, nargs=2, default=[32, 32], metavar=("HQ", "HKV"))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--profile-step", action="store_true")
    ap.add_argument("--profile-model", default="paper-7b")
    ap.add_argument("--profile-tsp", type=int, default=8)
    ap.add_argument("--profile-len", type=int, default=2048)
    ap.add_argument("--profile-rows", type=int, default=18, help="kernels listed in the profile table")
    args = ap.parse_args()
    kernels(args)
    if args.profile_step:
        profile_step(args)


if __name__ == "__main__":
    main()
