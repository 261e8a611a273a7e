"""TSP on a real multi-GPU group (NCCL) against the single-device model: what part (a) of benchmarks/multi_gpu.sh
used to check. Skipped without the GPUs; the same check also runs on CPU over gloo at a tiny size.

For D in {2, 4, 8} (D GPUs visible; NVLink multicast off), D spawned processes form one TSP group and train a small
Llama-style model (4 layers, hidden 512, SwiGLU 1536, vocab 32000, 2 x 4096 tokens, a few ignored targets), GQA (2
query heads per KV head, max(4, D) KV heads) and MHA (max(8, D) heads), with full activation checkpointing (the
recompute re-issues every broadcast, ring hop and K/V gather). Rank 0 also runs the reference (TSPLlama with D = 1,
same weights by construction, no checkpointing) on its own device. Error = max |TSP - reference| / max |reference|
per tensor:

| check                                                                  | tolerance |
| weights identical (gathered TSP shards vs reference)                   | 0         |
| fp32 loss and every gathered gradient (TF32 off in matmuls and cuDNN)  | 1e-5      |
| the same under bf16 autocast, against the reference under autocast     | 2e-2      |
| loss curve of 4 AdamW steps (lr 1e-3, two alternating batches), fp32   | 1e-4      |
| the same loss curve under bf16 autocast                                | 2e-2      |

The fp32 curve tolerance is looser on purpose: Adam normalises each update, so round-off in near-zero gradient
elements becomes a full-size update difference and compounds over the steps. fp64 equivalence at every D on gloo is
tests/test_equivalence.py; this file adds real NCCL, bf16 autocast and the optimizer under both.

    python -m pytest tests/test_multi_gpu.py -v -s        # -s prints every check's error
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import exit_after_success, spawn_with_timeout

NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
PRESETS = {"small": dict(layers=4, hidden=512, vocab=32000, seq=4096, kv=4, mha=8),
           "tiny": dict(layers=2, hidden=64, vocab=256, seq=64, kv=2, mha=4)}
BATCH, STEPS = 2, 4
RTOL = {"fp32": 1e-5, "bf16": 2e-2}
RTOL_CURVE = {"fp32": 1e-4, "bf16": 2e-2}


def check_config(d: int, attn: str, preset: str):
    """GQA: 2 query heads per KV head, max(kv, D) KV heads (TSP needs n_kv % D == 0); MHA: max(mha, D) heads."""
    from lightning_tsp.models.llama import ModelConfig

    p = PRESETS[preset]
    n_kv = max(p["kv"], d) if attn == "gqa" else max(p["mha"], d)
    return ModelConfig(vocab_size=p["vocab"], hidden_size=p["hidden"], n_layers=p["layers"],
                       n_heads=2 * n_kv if attn == "gqa" else n_kv, n_kv_heads=n_kv, intermediate_size=3 * p["hidden"])


def _batch(cfg, s: int, seed: int):
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, cfg.vocab_size, (BATCH, s), generator=g)
    labels = ids.clone()
    labels[0, torch.randperm(s, generator=g)[:5]] = -100  # some positions carry no loss
    return ids, labels


def rel_err(got, want) -> float:
    """max |got - want| / max |want|."""
    err = (got.double() - want.double()).abs().max().item()
    scale = want.double().abs().max().item()
    return err / scale if scale > 0 else err


def _autocast(dev: str, prec: str):
    return torch.autocast(torch.device(dev).type, dtype=torch.bfloat16) if prec == "bf16" else contextlib.nullcontext()


def _loss_and_grads(model, ids, labels, prec: str, dev: str, keep: bool):
    """Loss and every gathered (full) parameter gradient; the gathers are collectives of the model's group."""
    from lightning_tsp.models.llama import gather_full

    model.zero_grad(set_to_none=True)
    with _autocast(dev, prec):
        loss = model(*[x.to(dev) for x in model.shard_batch(ids, labels)])
    loss.backward()
    dims = model.shard_dims()
    grads = {}
    for name, p in model.named_parameters():
        full = gather_full(p.grad, dims[name], model.tsp)
        if keep:
            grads[name] = full
    model.zero_grad(set_to_none=True)
    return loss.detach().float(), grads


def _loss_curve(model, cfg, s: int, prec: str, dev: str) -> list[float]:
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    curve = []
    for step in range(STEPS):
        ids, labels = _batch(cfg, s, seed=step % 2)  # two batches, alternating
        with _autocast(dev, prec):
            loss = model(*[x.to(dev) for x in model.shard_batch(ids, labels)])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(float(loss.detach().float()))
    model.init_weights()
    return curve


def _check(rank: int, d: int, dev: str, preset: str) -> list[str]:
    """Every check on every rank (the gathers are collectives); rank 0 compares. Returns the failures."""
    from lightning_tsp import TSPGroup, TSPLlama
    from lightning_tsp.models.llama import gather_full

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    tsp = TSPGroup.from_process_group(dist.group.WORLD)
    lead = rank == 0
    seq = PRESETS[preset]["seq"]
    failures = []

    def record(label, what, err, tol):
        print(f"D={d} {label} {what}: {err:.2e} (tolerance {tol:.0e})", flush=True)
        if not err <= tol:
            failures.append(f"D={d} {label} {what}: error {err:.3e} > {tol:.0e}")

    for attn in ("gqa", "mha"):
        cfg = check_config(d, attn, preset)
        label = f"{attn.upper()} {cfg.n_heads}/{cfg.n_kv_heads}"
        ids, labels = _batch(cfg, seq, seed=0)
        model = TSPLlama(cfg, tsp, activation_checkpointing="full", device=dev, dtype=torch.float32)
        ref = TSPLlama(cfg, None, device=dev, dtype=torch.float32) if lead else None
        # same weights: each rank draws every full tensor from the same seed and keeps its slice
        dims = model.shard_dims()
        full = {n: gather_full(p.detach(), dims[n], tsp) for n, p in model.named_parameters()}
        if lead:
            record(label, "weights identical", max(rel_err(full[n], ref.get_parameter(n)) for n in full), 0.0)
        del full
        for prec in ("fp32", "bf16"):
            loss, grads = _loss_and_grads(model, ids, labels, prec, dev, keep=lead)
            if lead:
                rloss, rgrads = _loss_and_grads(ref, ids, labels, prec, dev, keep=True)
                record(label, f"{prec} loss", rel_err(loss, rloss), RTOL[prec])
                assert set(grads) == set(rgrads) and len(grads) == len(list(model.parameters()))
                record(label, f"{prec} grads ({len(grads)} tensors)",
                       max(rel_err(grads[n], rgrads[n]) for n in rgrads), RTOL[prec])
        for prec in ("fp32", "bf16"):
            curve = _loss_curve(model, cfg, seq, prec, dev)
            if lead:
                rcurve = _loss_curve(ref, cfg, seq, prec, dev)
                err = max(abs(a - r) for a, r in zip(curve, rcurve)) / max(abs(x) for x in rcurve)
                record(label, f"{prec} loss curve ({STEPS} AdamW steps)", err, RTOL_CURVE[prec])
        del model, ref
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    return failures


def _entry(rank: int, world: int, init_file: str, backend: str, preset: str) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if backend == "nccl":
        torch.cuda.set_device(rank)
        dev = f"cuda:{rank}"
    else:
        torch.set_num_threads(1)
        dev = "cpu"
    kw = {"device_id": torch.device(dev)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300), **kw)
    try:
        failures = _check(rank, world, dev, preset)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    assert not failures, "\n".join(failures)
    exit_after_success()


def _run(d: int, backend: str, preset: str, timeout: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        spawn_with_timeout(_entry, (d, os.path.join(tmp, "store"), backend, preset), d, timeout,
                           f"TSP D={d} on {backend}")


@pytest.mark.parametrize("d", [2, 4, 8])
@pytest.mark.timeout(600)
def test_tsp_matches_single_gpu_model_on_nccl(d):
    if torch.cuda.device_count() < d:
        pytest.skip(f"needs {d} GPUs")
    _run(d, "nccl", "small", timeout=560)


@pytest.mark.timeout(200)
def test_tsp_matches_single_device_model_on_gloo():
    """The same checks on CPU (gloo, D = 2, tiny model), so that they run everywhere."""
    _run(2, "gloo", "tiny", timeout=180)


def test_check_configs():
    from lightning_tsp import TSPLlama

    assert [check_config(d, "gqa", "small").n_kv_heads for d in (2, 4, 8)] == [4, 4, 8]
    assert check_config(4, "gqa", "small").n_heads == 8 and check_config(8, "mha", "small").n_heads == 8
    assert len(list(TSPLlama(check_config(2, "gqa", "tiny")).parameters())) == 21  # 2 x 9 + embedding, norm, head
