"""Inference under TSP: prefill + decode with weights and KV cache at 1/D per rank give exactly the tokens of the
unsharded model and of Hugging Face ``LlamaForCausalLM.generate`` (fp64, real gloo groups, D = 2, 3, 4)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os

import pytest
import torch
import torch.distributed as dist

from lightning_tsp import TSPConfigError, TSPLlama
from lightning_tsp.inference import TokenChooser, SamplingConfig, full_log_probs, generate, local_logits, prefill
from lightning_tsp.inference import cli
from lightning_tsp.inference.cache import decode_slots
from lightning_tsp.inference.collectives import all_gather_stack
from lightning_tsp.inference.costs import decode_step_collectives
from lightning_tsp.inference.decode import decode_step
from lightning_tsp.inference.prompts import pad_right
from lightning_tsp.inference.vocab import vocab_offset
from lightning_tsp.models.llama import ModelConfig
from tests.dist_utils import run_distributed
from tests.reference import assert_close, world_tsp

HAS_HF = importlib.util.find_spec("transformers") is not None

# One model for every D (heads divisible by 2, 3 and 4; GQA 2:1); a larger init spreads the logits so that
# greedy choices are far from ties and the generated text is not one repeated token.
CFG = ModelConfig(vocab_size=240, hidden_size=96, n_layers=2, n_heads=24, n_kv_heads=12, intermediate_size=96,
                  init_std=0.1)
PROMPT_LENS = (5, 11, 1)  # none a multiple of 2D for D = 1..4; different lengths in one batch
N_NEW = 8
SAMPLERS = [
    dict(do_sample=True, seed=3),
    dict(do_sample=True, seed=4, top_k=5),
    dict(do_sample=True, seed=5, top_p=0.5),
    dict(do_sample=True, seed=6, top_k=20, top_p=0.8, temperature=0.7),
]


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


def chooser_logits() -> torch.Tensor:
    return torch.randn(3, CFG.vocab_size, generator=torch.Generator().manual_seed(7), dtype=torch.float64) * 3


def build(tsp=None) -> TSPLlama:
    return TSPLlama(CFG, tsp, dtype=torch.float64)


def slot_bytes(cfg: ModelConfig, b: int, itemsize: int = 8) -> int:
    """Bytes of one token slot of the cache over all layers, k and v, all heads, the whole batch."""
    return cfg.n_layers * 2 * b * cfg.n_kv_heads * cfg.head_dim * itemsize


@functools.lru_cache(maxsize=None)
def reference() -> dict:
    """Everything the unsharded model (D = 1, no process group) produces; computed once in the test process."""
    model = build()
    out = generate(model, prompts(), N_NEW)
    ids, lens = pad_right(prompts(), 1, 0)
    cache, hidden = prefill(model, ids, lens, decode_steps=0)
    ref = {
        "greedy": out.tokens,
        "cache_bytes": out.cache.nbytes(used_only=False),
        "log_probs": full_log_probs(local_logits(model, hidden), model.tsp),
        "sampled": [generate(model, prompts(), N_NEW, **kw).tokens for kw in SAMPLERS],
        "chooser": TokenChooser(SamplingConfig(True, 0.9, None, 0.7, seed=11), CFG.vocab_size, model.tsp)(
            chooser_logits(), 0),
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
    }
    return ref


# ---- D = 1 against Hugging Face -------------------------------------------------------------------------


def _hf(model: TSPLlama):
    from tests.test_equivalence import hf_model

    hf = hf_model(CFG, model)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


@pytest.mark.skipif(not HAS_HF, reason="transformers not installed")
def test_unsharded_generation_matches_hugging_face():
    """Greedy tokens equal LlamaForCausalLM.generate(do_sample=False), per prompt and as a left-padded batch;
    the prefill's next-token log-probs equal HF's (its RMSNorm runs in fp32: fp32 round-off)."""
    ref = reference()
    hf = _hf(build())
    ps = prompts()
    for i, p in enumerate(ps):
        got = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          max_new_tokens=N_NEW, do_sample=False)
        assert got[0, len(p):].tolist() == ref["greedy"][i].tolist(), f"prompt {i}"
        logits = hf(torch.tensor([p])).logits[0, -1]
        assert_close(f"prompt {i} log-probs", ref["log_probs"][i], torch.log_softmax(logits, -1), 2e-6, 1e-6)
    width = max(PROMPT_LENS)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    got = hf.generate(ids, attention_mask=mask, max_new_tokens=N_NEW, do_sample=False)
    assert torch.equal(got[:, width:], ref["greedy"])


def test_bad_inputs_raise_before_any_collective():
    model = build()
    cases = [
        (dict(input_ids=[]), "empty prompt batch"),
        (dict(input_ids=[[3, 4], []]), "prompt 1 is empty"),
        (dict(input_ids=[[1] * 20], max_seq_len=16), "more than max_seq_len"),
        (dict(input_ids=[[1] * 10], max_seq_len=16), "exceeds max_seq_len"),
        (dict(input_ids=[[1, 240]]), "outside"),
        (dict(input_ids=[[1, 2]], max_new_tokens=0), "max_new_tokens"),
    ]
    for kwargs, msg in cases:
        kwargs = {"max_new_tokens": 8, **kwargs}
        with pytest.raises(TSPConfigError, match=msg):
            generate(model, **kwargs)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [[1]], 2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [[1]], 2, do_sample=True, top_p=1.5)


def test_interrupted_generation_leaves_model_usable():
    model = build()
    before = {n: type(v) for m in model.modules() for n, v in vars(m).items()}

    def boom(step, tokens):
        if step == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        generate(model, prompts(), N_NEW, streamer=boom)
    assert {n: type(v) for m in model.modules() for n, v in vars(m).items()} == before
    assert torch.equal(generate(model, prompts(), N_NEW).tokens, reference()["greedy"])


def _cli_tokens(argv) -> list[int]:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    assert rc == 0
    return [int(t) for t in buf.getvalue().split()]


def test_cli_loads_checkpoints_and_streams(tmp_path, capsys):
    ref = reference()
    p0 = " ".join(map(str, prompts()[0]))
    args = ["--prompt-ids", p0, "--max-new-tokens", str(N_NEW), "--dtype", "float64"]
    want = ref["greedy"][0].tolist()
    # torch.save of a full state dict + a Hugging Face config.json
    torch.save(ref["state_dict"], tmp_path / "full.pt")
    cfg_json = {"model_type": "llama", "vocab_size": CFG.vocab_size, "hidden_size": CFG.hidden_size,
                "num_hidden_layers": CFG.n_layers, "num_attention_heads": CFG.n_heads,
                "num_key_value_heads": CFG.n_kv_heads, "intermediate_size": CFG.intermediate_size,
                "rms_norm_eps": CFG.norm_eps, "rope_theta": CFG.rope_theta, "tie_word_embeddings": False}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg_json))
    assert _cli_tokens([str(tmp_path / "full.pt"), "--config", str(tmp_path / "cfg.json"), *args]) == want
    # a Hugging Face directory (config.json + model.safetensors as save_pretrained writes them)
    if HAS_HF:
        _hf(build()).save_pretrained(tmp_path / "hf")
        assert _cli_tokens([str(tmp_path / "hf"), *args]) == want
    # a checkpoint of another shape: a clear error, exit code 2
    bad = dict(cfg_json, intermediate_size=48)
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    capsys.readouterr()
    assert cli.main([str(tmp_path / "full.pt"), "--config", str(tmp_path / "bad.json"), *args]) == 2
    assert "expects the full shape" in capsys.readouterr().err
    assert cli.main([str(tmp_path / "full.pt"), "--config", str(tmp_path / "cfg.json"), "--prompt-ids", ""]) == 2


# ---- D = 2, 3, 4 ----------------------------------------------------------------------------------------


def _same_on_every_rank(t: torch.Tensor, tsp) -> None:
    allr = all_gather_stack(t, tsp)
    assert all(torch.equal(allr[0], a) for a in allr), "ranks disagree"


@contextlib.contextmanager
def count_collectives():
    """Tally (calls, buffer bytes) per collective; anything that could move weights counts as 'other'."""
    tally: dict[str, list[int]] = {}
    names = {"all_reduce": ("all_reduce", 0), "all_gather_single": ("all_gather", 0),
             "all_gather_into_tensor": ("all_gather", 0), "all_to_all_single": ("all_to_all", 1),
             "broadcast": ("other", 0), "batch_isend_irecv": ("other", None), "all_gather": ("other", None),
             "reduce_scatter_tensor": ("other", None), "reduce": ("other", None)}
    originals = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

    def wrap(fn, op, idx):
        def wrapped(*args, **kwargs):
            t = args[idx] if idx is not None else None
            entry = tally.setdefault(op, [0, 0])
            entry[0] += 1
            entry[1] += 0 if t is None else t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return wrapped

    for n, fn in originals.items():
        setattr(dist, n, wrap(fn, *names[n]))
    try:
        yield tally
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)


def _check_decode_traffic(model, world_size: int) -> None:
    """One decode step + greedy choice moves exactly the documented collectives, and no weights."""
    ids, lens = pad_right(prompts(), world_size, 0)
    cache, hidden = prefill(model, ids, lens, decode_steps=1)
    choose = TokenChooser(SamplingConfig(), CFG.vocab_size, model.tsp)
    tok = choose(local_logits(model, hidden), vocab_offset(model))
    with count_collectives() as tally:
        choose(local_logits(model, decode_step(model, cache, tok)), vocab_offset(model))
    want = decode_step_collectives(CFG, len(PROMPT_LENS), world_size, torch.float64)
    assert {k: tuple(v) for k, v in tally.items()} == want, (tally, want)


def _worker(rank: int, world_size: int, ref: dict, ckpt: str) -> None:
    tsp = world_tsp()
    model = build(tsp)
    b = len(PROMPT_LENS)

    # greedy: the unsharded model's tokens
    out = generate(model, prompts(), N_NEW)
    assert torch.equal(out.tokens, ref["greedy"]), (rank, out.tokens, ref["greedy"])

    # KV cache: all heads, this rank's tokens (+ one always-empty scratch slot), 1/D of the unsharded cache
    # (measured on the tensors)
    k0 = out.cache.k[0]
    assert k0.shape[:2] == (b, CFG.n_kv_heads) and k0.shape[3] == CFG.head_dim
    mine = out.cache.nbytes(used_only=False)
    padded = -(-max(PROMPT_LENS) // (2 * world_size)) * (2 * world_size)
    assert mine == slot_bytes(CFG, b) * (padded // world_size + decode_slots(rank, world_size, N_NEW - 1) + 1)
    assert abs(mine - ref["cache_bytes"] / world_size) <= 4 * slot_bytes(CFG, b), (mine, ref["cache_bytes"])
    total = all_gather_stack(torch.tensor([mine]), tsp).sum().item()
    assert abs(total - ref["cache_bytes"]) <= 3 * world_size * slot_bytes(CFG, b)

    _check_decode_traffic(model, world_size)

    # the prefill's next-token distribution
    ids, lens = pad_right(prompts(), world_size, 0)
    _, hidden = prefill(model, ids, lens, decode_steps=0)
    assert_close(f"D={world_size} log-probs", full_log_probs(local_logits(model, hidden), tsp), ref["log_probs"], 1e-10)

    # sampling with a seed: the same tokens on every rank and for every D
    for kw, want in zip(SAMPLERS, ref["sampled"]):
        got = generate(model, prompts(), N_NEW, **kw).tokens
        _same_on_every_rank(got, tsp)
        assert torch.equal(got, want), (kw, got, want)

    # top-p with few candidates per rank: the exchange repeats until the nucleus is certain
    logits = chooser_logits()
    v_loc = CFG.vocab_size // world_size
    chooser = TokenChooser(SamplingConfig(True, 0.9, None, 0.7, seed=11, top_p_candidates=2), CFG.vocab_size, tsp)
    assert torch.equal(chooser(logits[:, rank * v_loc:(rank + 1) * v_loc], vocab_offset(model)), ref["chooser"])

    # bad inputs raise on every rank before any collective, and the group stays in step afterwards
    for kwargs in (dict(input_ids=[[]]), dict(input_ids=[[1] * 20], max_seq_len=16)):
        try:
            generate(model, max_new_tokens=4, **kwargs)
            raise AssertionError("no error")
        except TSPConfigError:
            pass

    # interrupted mid-way (every rank at the same step), then usable again
    def boom(step, tokens):
        if step == 2:
            raise KeyboardInterrupt

    try:
        generate(model, prompts(), N_NEW, streamer=boom)
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        pass
    assert torch.equal(generate(model, prompts(), N_NEW).tokens, ref["greedy"])

    # the CLI inside an existing process group: loads the full checkpoint, rank 0 streams
    if ckpt:
        buf = io.StringIO()
        argv = [ckpt, "--config", os.path.join(os.path.dirname(ckpt), "cfg.json"), "--dtype", "float64",
                "--prompt-ids", " ".join(map(str, prompts()[1])), "--max-new-tokens", str(N_NEW)]
        with contextlib.redirect_stdout(buf):
            assert cli.main(argv) == 0
        if rank == 0:
            assert [int(t) for t in buf.getvalue().split()] == ref["greedy"][1].tolist()
        else:
            assert buf.getvalue() == ""
    dist.barrier()


@pytest.mark.parametrize("d", [2, 3, 4])
def test_tsp_generation_matches_unsharded(d, tmp_path):
    ref = reference()
    ckpt = ""
    if d == 2:
        ckpt = str(tmp_path / "full.safetensors")
        from safetensors.torch import save_file

        save_file(ref["state_dict"], ckpt)
        cfg_json = {"model_type": "llama", "vocab_size": CFG.vocab_size, "hidden_size": CFG.hidden_size,
                    "num_hidden_layers": CFG.n_layers, "num_attention_heads": CFG.n_heads,
                    "num_key_value_heads": CFG.n_kv_heads, "intermediate_size": CFG.intermediate_size,
                    "rms_norm_eps": CFG.norm_eps, "rope_theta": CFG.rope_theta}
        (tmp_path / "cfg.json").write_text(json.dumps(cfg_json))
    run_distributed(_worker, d, ref, ckpt, timeout=120)
