"""``generate`` called in a loop keeps its decoder (KV cache buffers; CUDA graph on GPUs) across calls of the same
shapes: every call gives exactly what a new decoder gives (tokens and the whole cache state), on real gloo groups
(D = 2, 3) and unsharded (D = 1, also against Hugging Face); the pool holds at most its limit, least recently used
evicted first; ``release`` empties it; nothing keeps a deleted model alive."""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from lightning_tsp import TSPConfigError
from lightning_tsp.inference import decoder_pool, generate, release
from tests.dist_utils import run_distributed
from tests.reference import world_tsp
from tests.test_inference import CFG, build

HAS_HF = importlib.util.find_spec("transformers") is not None
ROOT = Path(__file__).resolve().parent.parent
N_NEW = 6


def _prompts(seed: int, lens) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lens]


# (prompts, max_new_tokens, sampling): A, B and D have the same shapes (3 prompts padded to 12 tokens for D = 1, 2,
# 3; 6 new tokens) but other prompts and other lengths per sequence (a sequence that was 1 token long becomes 12
# long: stale positions, lengths or slots would show); C has another batch size; E another max_new_tokens.
CALLS = [
    ("A", _prompts(1, (5, 11, 1)), N_NEW, {}),
    ("B", _prompts(2, (9, 3, 12)), N_NEW, {}),
    ("C", _prompts(3, (7, 4)), N_NEW, {}),
    ("D", _prompts(4, (2, 12, 6)), N_NEW, {}),
    ("D sampled", _prompts(4, (2, 12, 6)), N_NEW, dict(do_sample=True, seed=9, top_k=20)),
    ("E", _prompts(5, (5, 11, 1)), N_NEW - 2, {}),
]


def fresh_outputs(model) -> dict:
    """Each call with a new decoder (``keep_decoder=False``): the reference for the loop."""
    return {name: generate(model, p, n, keep_decoder=False, **kw).tokens for name, p, n, kw in CALLS}


def same_cache(a, b) -> bool:
    return (a.step == b.step and a.capacity == b.capacity and torch.equal(a.slot_pos, b.slot_pos)
            and torch.equal(a.prompt_lens, b.prompt_lens) and torch.equal(a.step_t, b.step_t)
            and all(torch.equal(x, y) for x, y in zip(a.k + a.v, b.k + b.v)))


def run_loop(model, want: dict) -> None:
    """The loop of CALLS with a pool of 2: tokens and caches equal a new decoder's every time; shapes that match
    reuse the kept cache, others do not; LRU eviction; release."""
    pool = decoder_pool(model)
    release(model)
    pool.limit = 2
    seen = {}
    for name, p, n, kw in CALLS:
        out = generate(model, p, n, **kw)
        assert torch.equal(out.tokens, want[name]), (name, out.tokens, want[name])
        fresh = generate(model, p, n, keep_decoder=False, **kw)
        assert same_cache(out.cache, fresh.cache), f"{name}: the kept cache differs from a new decoder's"
        seen[name] = out.cache
        assert len(pool) <= pool.limit
    # A, B, D and "D sampled" share one decoder (sampling runs after the step: not part of the key); C and E do not
    assert seen["A"] is seen["B"] is seen["D"] is seen["D sampled"]
    assert seen["C"] is not seen["A"] and seen["E"] is not seen["A"] and seen["E"] is not seen["C"]
    # E evicted the least recently used (C); A's shapes are still kept
    assert len(pool) == 2 and [k.batch for k in pool.keys()] == [3, 3]
    assert [k.decode_steps for k in pool.keys()] == [N_NEW - 1, N_NEW - 3]
    name, p, n, kw = CALLS[0]
    assert generate(model, p, n).cache is seen["A"]

    # calls that end early (every sequence at EOS) leave decode slots unwritten: empty, as in a new cache
    p_eos, eos = [CALLS[3][1][1]] * 3, int(want["D"][1, 1])
    for _ in range(2):
        out = generate(model, p_eos, N_NEW, eos_token_id=eos)
        fresh = generate(model, p_eos, N_NEW, eos_token_id=eos, keep_decoder=False)
        assert out.cache is seen["A"] and out.tokens.shape[1] < N_NEW
        assert torch.equal(out.tokens, fresh.tokens) and same_cache(out.cache, fresh.cache)

    # an interrupted call keeps nothing of its decoder; the next call of those shapes builds a new one
    def boom(step, tokens):
        if step == 2:
            raise KeyboardInterrupt

    try:
        generate(model, p, n, streamer=boom)
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        pass
    assert len(pool) == 1
    again = generate(model, p, n)
    assert again.cache is not seen["A"] and torch.equal(again.tokens, want[name])

    # prompts padded to a bucket: other longest prompts, one padded length, one decoder; tokens as without padding
    bucket = [(_prompts(6, (5, 11, 1)), 24), (_prompts(7, (3, 20, 7)), 24)]
    kept = None
    for q, mult in bucket:
        out = generate(model, q, n, pad_to_multiple_of=mult)
        fresh = generate(model, q, n, pad_to_multiple_of=mult, keep_decoder=False)
        assert torch.equal(out.tokens, fresh.tokens) and same_cache(out.cache, fresh.cache)
        assert torch.equal(out.tokens, generate(model, q, n, keep_decoder=False).tokens)
        assert out.cache.prefill_slots * model.tsp.size == 24 and (kept is None or out.cache is kept)
        kept = out.cache

    # release: empty, then a later call works (and is kept again)
    assert release(model) == 2 and len(pool) == 0
    assert torch.equal(generate(model, p, n).tokens, want[name]) and len(pool) == 1
    pool.limit = 0  # keep none
    assert len(pool) == 0 and torch.equal(generate(model, p, n).tokens, want[name]) and len(pool) == 0


def _worker(rank: int, world_size: int, want: dict) -> None:
    run_loop(build(world_tsp()), want)  # want: the unsharded model's new-decoder tokens


@pytest.mark.parametrize("d", [2, 3])
def test_generate_loop_under_tsp(d):
    run_distributed(_worker, d, fresh_outputs(build()), timeout=120)


def test_generate_loop_unsharded_equals_hugging_face():
    model = build()
    want = fresh_outputs(model)
    if HAS_HF:
        from tests.test_inference import _hf

        hf = _hf(model)
        for name, p, n, kw in CALLS:
            if kw:
                continue
            width = max(map(len, p))  # one left-padded batch (tests/test_inference.py: equals prompt by prompt)
            ids = torch.tensor([[0] * (width - len(x)) + x for x in p])
            mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in p])
            got = hf.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False)
            assert torch.equal(got[:, width:], want[name]), name
    run_loop(model, want)


def test_pool_limit_and_model_lifetime():
    model = build()
    with pytest.raises(ValueError, match="limit"):
        decoder_pool(model).limit = -1
    with pytest.raises(TSPConfigError, match="pad_to_multiple_of=0"):
        generate(model, [[1]], 2, pad_to_multiple_of=0)
    generate(model, CALLS[0][1], N_NEW)
    assert len(decoder_pool(model)) == 1
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None, "a kept decoder keeps its model alive"


def test_benchmark_times_whole_generate_calls(tmp_path):
    """benchmarks/inference.py --new-tokens: first call, calls 2..N and new-decoder calls beside the steady step."""
    out = tmp_path / "gen.jsonl"
    args = ["--device", "cpu", "--model", "tiny", "--dtype", "float32", "--tsp-size", "2", "--no-baseline",
            "--prompt-lens", "10", "--decode-steps", "2", "--decode-warmup", "0", "--repeats", "1", "--warmup-len", "0",
            "--new-tokens", "2", "4", "--calls", "3", "--fresh-calls", "1", "--max-seconds", "120", "--out", str(out)]
    proc = subprocess.run([sys.executable, "-m", "benchmarks.inference", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=170, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["status"] == "ok" and "--new-tokens 2 4 --calls 3 --fresh-calls 1" in row["command"]
    assert [g["new_tokens"] for g in row["generate"]] == [2, 4]
    for g in row["generate"]:
        assert len(g["calls"]) == 3 and len(g["fresh_calls"]) == 1
        assert all(0 < c["ttft_s"] <= c["total_s"] for c in g["calls"] + g["fresh_calls"])
        assert g["ms_per_token"] == pytest.approx(1e3 * g["rest_s"] / g["new_tokens"])
        assert g["x_steady"] == pytest.approx(g["ms_per_token"] / (1e3 * row["decode_s_per_token"]))
    # the row, then its two generate lines
    assert "x steady" in proc.stdout and proc.stdout.count("| 1 | TSP D=2 rank 0 | 10 |") == 3


def test_prefill_benchmark_runs_both_schedules():
    """benchmarks/prefill_graph.py on CPU (eager only there): the grouped prefill and --one-owner-per-step."""
    for extra in ([], ["--one-owner-per-step"]):
        args = ["--device", "cpu", "--model", "tiny", "--tsp-size", "2", "--prompt-len", "64", "--repeats", "1", *extra]
        proc = subprocess.run([sys.executable, "-m", "benchmarks.prefill_graph", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=170, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        assert "eager prefill median" in proc.stdout and "Decoder.prefill graphed=False" in proc.stdout
        assert ("one owner per step" in proc.stdout) == bool(extra)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kept_cuda_graph_replays_exactly(dtype):
    """On CUDA the kept decoder's graph (captured in the first call) is replayed from the first decode step of the
    next calls, and its prefill (a short prompt batch) is captured in the second call and replayed from the third:
    tokens and whole caches equal a new decoder's (eager prefill and warm-up steps, then its own capture), with
    other prompts of the same shapes, and the same graph objects serve every call."""
    from lightning_tsp import TSPLlama
    from lightning_tsp.group import TSPGroup
    from lightning_tsp.models.llama import ModelConfig

    cfg = ModelConfig(vocab_size=512, hidden_size=256, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=512,
                      init_std=0.05)
    model = TSPLlama(cfg, TSPGroup.single(), dtype=dtype, device="cuda")
    model.load_full_state_dict(TSPLlama(cfg, None, dtype=torch.float64).state_dict())
    pool = decoder_pool(model)
    graph = prefill_graph = None
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        lens = [(300, 7, 64), (250, 299, 1), (5, 120, 299), (299, 300, 2)][seed]  # all padded to 300
        prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]
        out = generate(model, prompts, 24)
        fresh = generate(model, prompts, 24, keep_decoder=False)
        assert torch.equal(out.tokens, fresh.tokens) and same_cache(out.cache, fresh.cache), seed
        (decoder,) = pool.decoders()
        assert decoder.graph is not None and (graph is None or decoder.graph is graph)
        graph = decoder.graph
        assert decoder.prefill_graph_error is None, decoder.prefill_graph_error
        assert decoder.graphs_prefill and (decoder.prefill_graph is None) == (seed == 0), seed
        assert prefill_graph is None or decoder.prefill_graph is prefill_graph
        prefill_graph = decoder.prefill_graph
    assert release(model) == 1 and len(pool) == 0
