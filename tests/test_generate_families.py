"""Generation is exact for every supported Hugging Face family, from every checkpoint kind, at D = 1, 2, 3, 4.

Tiny random Llama (GQA 24/12), Mistral (MHA 12/12, a sliding window longer than the text), Qwen2 (q/k/v biases,
tied embeddings) and Qwen3 (q/k norms, GQA 24/12, head_dim 8 != hidden/heads = 2) models in fp64, norms and
biases perturbed away from their init: the greedy tokens of ``lightning_tsp.generate`` on the model that
``lightning_tsp.inference.loading.load_model`` builds, and those printed by ``lightning-tsp generate DIR``
(``cli.main`` in-process), equal Hugging Face ``model.generate(do_sample=False)`` for a batch of prompts of
lengths 5, 11 and 1, from the ``save_pretrained`` directory and from a sharded (DCP) checkpoint written at D = 1
(so D = 2, 3, 4 reshard it). The Hugging Face tokens are computed once, in the test process; each D > 1 is one
spawn of D gloo processes running every family (D = 2 shares the Trainer test's spawn).

A checkpoint written by ``Trainer(strategy=TSPStrategy(tsp_size=2))`` is read directly (D = 1 and 2, Python and
CLI) and gives the tokens of the model the Trainer just trained and of its consolidated copy.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import warnings

import pytest
import torch
import torch.nn as nn

HAS_HF = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("safetensors") is not None
pytestmark = pytest.mark.skipif(not HAS_HF, reason="needs transformers and safetensors")

from lightning_tsp import TSPConfigError  # noqa: E402
from lightning_tsp.inference import cli, generate, prefill  # noqa: E402
from lightning_tsp.inference.loading import load_model, resolve_checkpoint  # noqa: E402
from lightning_tsp.inference.prompts import pad_right  # noqa: E402
from lightning_tsp.models.llama import ModelConfig, gather_full  # noqa: E402
from lightning_tsp.schedules.comm import local_tensor  # noqa: E402
from tests.dist_utils import run_distributed  # noqa: E402
from tests.reference import assert_close, world_tsp  # noqa: E402

PROMPT_LENS = (5, 11, 1)  # none a multiple of 2D for D = 1..4
N_NEW = 8
VOCAB = 240
# head counts divisible by 2, 3 and 4; a large init range keeps greedy choices far from ties (checked)
FAMILIES: dict[str, dict] = {
    "Llama": dict(hidden_size=96, num_attention_heads=24, num_key_value_heads=12),
    # one KV head (MQA): replicated on every rank at D = 2, 3, 4 (copies of its k/v projection)
    "Mistral": dict(hidden_size=48, num_attention_heads=12, num_key_value_heads=1, sliding_window=64),
    "Qwen2": dict(hidden_size=96, num_attention_heads=12, num_key_value_heads=12, tie_word_embeddings=True),
    "Qwen3": dict(hidden_size=48, num_attention_heads=24, num_key_value_heads=12, head_dim=8),
}
DCP_FAMILIES = ("Qwen2", "Qwen3")  # at D > 1 (time): every kind of parameter (biases, q/k norms, tied, GQA)
MIN_MARGIN = 1e-3  # smallest top-1 minus top-2 logit of the reference generations


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def make_hf(family: str):
    from tests.test_convert import hf_model

    args = dict(vocab_size=VOCAB, intermediate_size=96, num_hidden_layers=2, initializer_range=0.2,
                rope_theta=20000.0 + 10000 * len(family), max_position_embeddings=64)
    hf = hf_model(family, torch.float64, seed=len(family), **{**args, **FAMILIES[family]})
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf.eval()


def save_dcp_at_d1(hf, path: str) -> None:
    """A sharded checkpoint as TSPStrategy lays it out (``state_dict.model.<name>`` + tsp_model.json), written
    at D = 1 without a process group: loading it at D > 1 reshards it."""
    import torch.distributed.checkpoint as dcp

    from lightning_tsp import checkpoint as ckpt
    from lightning_tsp.convert.hf import convert_hf_causal_lm

    holder = nn.Module()
    holder.model = convert_hf_causal_lm(hf)
    state = {f"model.{k}": v for k, v in holder.model.state_dict().items()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": intended, no process group
        warnings.filterwarnings("ignore", message=".*torch.distributed.*")
        dcp.save({ckpt.STATE_DICT_KEY: state}, checkpoint_id=path, no_dist=True)
    ckpt.write_module_metadata(path, ckpt.module_metadata(holder))


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """Per family: the save_pretrained directory, a D = 1 DCP checkpoint, Hugging Face's greedy tokens per
    prompt, and (Qwen) the final hidden state of every prompt's last token from the model's own forward."""
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in FAMILIES:
        hf = make_hf(family)
        hf_dir, dcp_dir = str(root / family), str(root / f"{family}-dcp")
        hf.save_pretrained(hf_dir)
        save_dcp_at_d1(hf, dcp_dir)
        tokens, margin = [], float("inf")
        for p in prompts():
            got = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                              max_new_tokens=N_NEW, do_sample=False, output_scores=True,
                              return_dict_in_generate=True)
            tokens.append(got.sequences[0, len(p):].tolist())
            for s in got.scores:
                top = s[0].topk(2).values
                margin = min(margin, (top[0] - top[1]).item())
        assert margin > MIN_MARGIN, f"{family}: greedy is too close to a tie ({margin:.2e}) to compare tokens"
        assert all(len(set(t)) > 2 for t in tokens), f"{family}: degenerate generations {tokens}"
        hidden = None
        if family.startswith("Qwen"):
            with torch.no_grad():
                hidden = torch.stack([hf.model(torch.tensor([p])).last_hidden_state[0, -1] for p in prompts()])
        out[family] = dict(hf_dir=hf_dir, dcp_dir=dcp_dir, tokens=tokens, hidden=hidden)
    return out


def cli_tokens(argv: list[str]) -> list[list[int]] | None:
    """Run ``lightning-tsp generate`` in-process; rank 0's printed sequences ([i] ids ...), None elsewhere."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(argv)
    assert rc == 0, argv
    text = buf.getvalue()
    if not text:
        return None
    lines = text.strip().splitlines()
    assert [ln.split()[0] for ln in lines] == [f"[{i}]" for i in range(len(PROMPT_LENS))], text
    return [[int(t) for t in ln.split()[1:]] for ln in lines]


def cli_args(path: str) -> list[str]:
    args = [path, "--max-new-tokens", str(N_NEW), "--dtype", "float64"]
    for p in prompts():
        args += ["--prompt-ids", " ".join(map(str, p))]
    return args


def check_family(family: str, ref: dict, tsp, rank: int) -> None:
    """Python API and CLI, from the Hugging Face directory and from the DCP checkpoint: HF's tokens."""
    tag = f"{family} D={1 if tsp is None else tsp.size}"
    model = load_model(ref["hf_dir"], tsp, torch.float64)
    assert type(model).__name__ == "TSPCausalLM", tag
    assert model.cfg.qk_norm == (family == "Qwen3") and model.cfg.attention_bias == (family == "Qwen2"), tag
    got = generate(model, prompts(), N_NEW).tokens.tolist()
    assert got == ref["tokens"], f"{tag} generate: {got} != HF {ref['tokens']}"
    printed = cli_tokens(cli_args(ref["hf_dir"]))
    assert rank != 0 or printed == ref["tokens"], f"{tag} CLI: {printed} != HF {ref['tokens']}"
    if tsp is None or family in DCP_FAMILIES:  # a DCP checkpoint written at D = 1: resharded for D > 1
        from_dcp = load_model(ref["dcp_dir"], tsp, torch.float64)
        assert type(from_dcp).__name__ == "TSPCausalLM", tag
        for name, p in model.named_parameters():  # DCP read exactly this rank's slices: the same tokens follow
            assert torch.equal(local_tensor(from_dcp.get_parameter(name)), local_tensor(p)), f"{tag} DCP {name}"
        if tsp is None:
            assert generate(from_dcp, prompts(), N_NEW).tokens.tolist() == ref["tokens"], f"{tag} from DCP"
    if ref["hidden"] is not None:  # the prefill's last hidden state is the model's own (HF's, fp32 norms)
        ids, lens = pad_right(prompts(), 1 if tsp is None else tsp.size, 0)
        _, hidden = prefill(model, ids, lens, decode_steps=0)
        assert_close(f"{tag} prefill hidden vs HF", hidden, ref["hidden"], 2e-6, 1e-6)


# ---- D = 1 --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
def test_unsharded_generation_matches_hugging_face(families, family):
    check_family(family, families[family], None, 0)


@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_qwen_prefill_hidden_state_equals_forward(families, family):
    """The bug report's symptom: the prefill's final hidden state of each prompt's last token is the model's own
    forward (``hidden_states``) exactly, and Hugging Face's up to its fp32 RMSNorm."""
    ref = families[family]
    model = load_model(ref["hf_dir"], None, torch.float64)
    ids, lens = pad_right(prompts(), 1, 0)
    _, hidden = prefill(model, ids, lens, decode_steps=0)
    with torch.no_grad():
        for b, p in enumerate(prompts()):
            own = model.hidden_states(torch.tensor([p]), torch.arange(len(p)))[0, -1]
            assert_close(f"{family} prompt {b} prefill vs forward", hidden[b], own, 1e-12, 1e-13)
    assert_close(f"{family} prefill vs HF", hidden, ref["hidden"], 2e-6, 1e-6)


# ---- D = 2, 3, 4: one spawn per D, every family -------------------------------------------------------------


def _families_worker(rank: int, world_size: int, refs: dict) -> None:
    import torch.distributed as dist

    tsp = world_tsp()
    for family, ref in refs.items():
        check_family(family, ref, tsp, rank)
    dist.barrier()


@pytest.mark.parametrize("d", [3, 4])  # D = 2: inside the Trainer test's spawn below (one spawn fewer)
def test_tsp_generation_matches_hugging_face(families, d):
    run_distributed(_families_worker, d, families, timeout=150)


def test_every_source_kind_gives_the_same_model(families, tmp_path):
    """Sharded safetensors index, pytorch_model.bin, single files with a config beside or given, a full Lightning
    checkpoint file, a consolidated directory: every kind is detected and loads exactly the same parameters."""
    from safetensors.torch import save_file

    from lightning_tsp import checkpoint as ckpt

    ref = families["Qwen3"]
    want = dict(load_model(ref["hf_dir"], dtype=torch.float64).named_parameters())
    hf = make_hf("Qwen3")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    config = os.path.join(ref["hf_dir"], "config.json")

    def loads(path, kind, **kw):
        assert resolve_checkpoint(path, **kw).kind == kind, path
        model = load_model(path, dtype=torch.float64, **kw)
        assert type(model).__name__ == "TSPCausalLM" and model.cfg.qk_norm and model.cfg.head_dim == 8, path
        for name, p in model.named_parameters():
            assert torch.equal(p, want[name]), (path, name)

    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    loads(tmp_path / "sharded", "hf")
    (tmp_path / "bin").mkdir()
    torch.save(state, tmp_path / "bin" / "pytorch_model.bin")
    shutil.copy(config, tmp_path / "bin")
    loads(tmp_path / "bin", "hf")
    loads(tmp_path / "bin" / "pytorch_model.bin", "torch")  # config.json beside the file
    save_file(state, str(tmp_path / "w.safetensors"))
    loads(tmp_path / "w.safetensors", "safetensors", config=config)
    holder = nn.Module()
    holder.lm = load_model(ref["hf_dir"], dtype=torch.float64)
    torch.save({ckpt.STATE_DICT_KEY: {f"lm.{k}": v for k, v in holder.lm.state_dict().items()},
                ckpt.METADATA_KEY: ckpt.module_metadata(holder)}, tmp_path / "full.ckpt")
    loads(tmp_path / "full.ckpt", "lightning")
    ckpt.consolidate(ref["dcp_dir"], tmp_path / "consolidated")
    loads(tmp_path / "consolidated", "consolidated")


# ---- refusals -----------------------------------------------------------------------------------------------


def _cli_error(argv: list[str], capsys) -> str:
    capsys.readouterr()
    assert cli.main(argv) == 2, argv
    return capsys.readouterr().err


def test_unsupported_configurations_are_refused(families, tmp_path, capsys):
    base = json.loads(open(os.path.join(families["Llama"]["hf_dir"], "config.json")).read())
    ids = ["--prompt-ids", "1 2 3", "--max-new-tokens", "2"]

    def write(name: str, cfg: dict) -> str:
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(cfg))
        shutil.copy(os.path.join(families["Llama"]["hf_dir"], "model.safetensors"), d)
        return str(d)

    no_type = write("no-type", {k: v for k, v in base.items() if k != "model_type"})
    assert "no 'model_type' key" in _cli_error([no_type, *ids], capsys)
    with pytest.raises(TSPConfigError, match="model_type"):
        load_model(no_type)
    assert "model_type='gemma' is not supported" in _cli_error([write("gemma", {**base, "model_type": "gemma"}),
                                                              *ids], capsys)
    dynamic = {**base, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}
    assert "'dynamic'" in _cli_error([write("dynamic", dynamic), *ids], capsys)
    assert "o_proj" in _cli_error([write("bias", {**base, "attention_bias": True}), *ids], capsys)
    # a Llama checkpoint declared as Qwen3: the q/k norm weights are missing, never silently skipped
    err = _cli_error([write("as-qwen3", {**base, "model_type": "qwen3", "head_dim": 4}), *ids], capsys)
    assert "q_norm" in err or "k_norm" in err, err
    # Mistral: prompt + new tokens beyond the sliding window would attend differently from Hugging Face
    mistral = families["Mistral"]["hf_dir"]
    assert "sliding_window=64" in _cli_error([mistral, "--prompt-ids", "1 2 3", "--max-new-tokens", "70"], capsys)
    assert resolve_checkpoint(mistral).kind == "hf"
    # sharded checkpoints: a model class generation does not compute; configurations that disagree
    from lightning_tsp import checkpoint as ckpt

    for name, edit, match in [
        ("custom", lambda m: m.update({"class": "my_project.MyTSPModel"}), "my_project.MyTSPModel"),
        ("disagree", lambda m: m["hf_config"].update({"num_key_value_heads": 6}), "n_kv_heads=6 .* disagree"),
    ]:
        dcp_dir = tmp_path / name
        shutil.copytree(families["Llama"]["dcp_dir"], dcp_dir)
        meta = ckpt.read_module_metadata(dcp_dir)
        edit(meta["modules"][0])
        ckpt.write_module_metadata(dcp_dir, meta)
        with pytest.raises(TSPConfigError, match=match):
            load_model(dcp_dir)


# ---- a checkpoint written by Trainer(strategy=TSPStrategy(tsp_size=2)) --------------------------------------

# one KV head (MQA): at tsp_size 2 the checkpoint holds both ranks' copies of it; D = 1 and 2 read it back
TRAIN_CFG = ModelConfig(vocab_size=VOCAB, hidden_size=48, n_layers=2, n_heads=12, n_kv_heads=1, intermediate_size=96,
                        init_std=0.2)


def _trainer_worker(rank: int, world_size: int, tmp: str, refs: dict) -> None:
    from torch.utils.data import DataLoader

    from tests.test_strategy import make_dataset
    from tests.test_strategy_eval import lightning_module_class, make_trainer

    trainer = make_trainer(world_size, 2, max_steps=2, default_root_dir=tmp)
    module = lightning_module_class()(TRAIN_CFG, optimizer="adamw")
    trainer.fit(module, train_dataloaders=DataLoader(make_dataset(TRAIN_CFG, 4), batch_size=2))
    ckdir = os.path.join(tmp, "ck")
    trainer.save_checkpoint(ckdir)
    trained = module.model
    in_memory = generate(trained, prompts(), N_NEW).tokens  # right after fit, DTensor parameters, fp32
    loaded = load_model(ckdir, trained.tsp, torch.float32)
    assert type(loaded).__name__ == "TSPLlama"
    for name, p in trained.named_parameters():
        assert torch.equal(local_tensor(loaded.get_parameter(name)), local_tensor(p)), name
    assert torch.equal(generate(loaded, prompts(), N_NEW).tokens, in_memory)
    tokens64 = generate(load_model(ckdir, trained.tsp, torch.float64), prompts(), N_NEW).tokens
    printed = cli_tokens(cli_args(ckdir))  # the CLI detects the DCP directory
    assert rank != 0 or printed == tokens64.tolist(), (printed, tokens64)
    dims = trained.shard_dims()  # full weights, one copy of the replicated KV head
    full = {n: gather_full(local_tensor(p), dims[n], trained.tsp, trained.replicas(n))
            for n, p in trained.named_parameters()}
    if rank == 0:
        torch.save({"in_memory": in_memory, "tokens64": tokens64, "full": full}, os.path.join(tmp, "d2.pt"))
    # the Hugging Face families at D = 2 (the process group is the Trainer's world of 2)
    _families_worker(rank, world_size, refs)


@pytest.mark.timeout(200)
def test_trainer_checkpoint_and_hugging_face_families_at_d2(families, tmp_path):
    """Greedy tokens from a TSPStrategy DCP checkpoint read directly (D = 2 in the training processes, D = 1
    here) equal the in-memory trained model's and the consolidated copy's; every family equals HF at D = 2."""
    from lightning_tsp import checkpoint as ckpt
    from tests.test_strategy import run_ranks

    run_ranks(_trainer_worker, 2, str(tmp_path), families, timeout=180.0)
    ckdir = tmp_path / "ck"
    assert ckpt.read_module_metadata(ckdir)["tsp_size"] == 2
    d2 = torch.load(tmp_path / "d2.pt")
    source = resolve_checkpoint(ckdir)
    assert (source.kind, source.prefix, source.saved_tsp_size) == ("dcp", "model", 2)
    # D = 1, no process group: DCP reshards 2 -> 1
    at_d1 = load_model(ckdir)
    for name, p in at_d1.named_parameters():
        assert torch.equal(p, d2["full"][name]), name
    assert torch.equal(generate(at_d1, prompts(), N_NEW).tokens, d2["in_memory"])
    assert torch.equal(generate(load_model(ckdir, dtype=torch.float64), prompts(), N_NEW).tokens, d2["tokens64"])
    # the consolidated copy (model.safetensors + tsp_config.json) gives the same tokens
    ckpt.consolidate(ckdir, tmp_path / "full")
    consolidated = load_model(tmp_path / "full", dtype=torch.float64)
    assert resolve_checkpoint(tmp_path / "full").kind == "consolidated"
    assert torch.equal(generate(consolidated, prompts(), N_NEW).tokens, d2["tokens64"])
    assert cli_tokens(cli_args(str(tmp_path / "full"))) == d2["tokens64"].tolist()
