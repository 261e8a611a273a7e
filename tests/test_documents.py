"""Packed documents: document-masked attention kernels against attention computed document by document, the
zigzag batch side (per-document targets, validation, document starts), the strategy's batch sharding and the
data module's position ids. CPU only, no process group (nothing here issues a collective)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_tsp.checks import TSPConfigError
from lightning_tsp.group import TSPGroup
from lightning_tsp.kernels.attention import (
    CudnnSplitAttention,
    DocumentMask,
    FlashAttention,
    FlexDocumentAttention,
    MathAttention,
    SDPAAttention,
    merge_pieces,
    select_attention_kernel,
)
from lightning_tsp.layers.attention import gather_order, zigzag_calls
from lightning_tsp.zigzag import (
    IGNORE_INDEX,
    check_packed_positions,
    document_starts,
    shard_batch,
    shift_labels,
    zigzag_positions,
    zigzag_shard,
    zigzag_unshard,
)
from tests.reference import assert_close

S = 24  # = 2 * D * c for D = 1 (c = 12), 2 (c = 6) and 3 (c = 4)
# Row 0, explicit: a one-token document [4, 5), a document [5, 13) spanning chunk boundaries (and ranks) for
# every D, a document [13, 20) starting inside a chunk (its queries see no prefix key), a last one-token document.
STARTS_ROW0 = [0, 4, 5, 13, 20, 23]


def positions_from_starts(starts: list[int], s: int = S) -> torch.Tensor:
    pos = torch.empty(s, dtype=torch.long)
    bounds = sorted(starts) + [s]
    for a, e in zip(bounds[:-1], bounds[1:]):
        pos[a:e] = torch.arange(e - a)
    return pos


def packed_positions(seed: int = 0) -> torch.Tensor:
    """[2, S]: row 0 the explicit documents, row 1 random ones."""
    g = torch.Generator().manual_seed(seed)
    starts = [0] + sorted(set((torch.randperm(S - 1, generator=g)[:5] + 1).tolist()))
    return torch.stack([positions_from_starts(STARTS_ROW0), positions_from_starts(starts)])


def brute_force_starts(pos: torch.Tensor) -> torch.Tensor:
    """Global index of each token's document start, by scanning."""
    out = torch.empty_like(pos)
    for b in range(pos.shape[0]):
        start = 0
        for t in range(pos.shape[1]):
            if pos[b, t] == 0:
                start = t
            out[b, t] = start
    return out


def per_document_attention(q, k, v, pos):
    """The reference: every document of every row attended on its own (square causal, SDPA math, fp64)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    rows = []
    for b in range(q.shape[0]):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [q.shape[2]]
        docs = [F.scaled_dot_product_attention(q[b : b + 1, :, a:e], k[b : b + 1, :, a:e], v[b : b + 1, :, a:e],
                                               is_causal=True) for a, e in zip(starts[:-1], starts[1:])]
        rows.append(torch.cat(docs, dim=2))
    return torch.cat(rows, dim=0)


def run_zigzag_calls(kernel, q, k, v, do, pos, d, backward=True):
    """Every rank's zigzag calls (D = d) with their DocumentMask, as the layer makes them: keys as slices of the
    gathered buffer in gather order, document starts from the LOCAL position ids. Returns the natural-order
    output, lse and gradients (dK/dV summed over all calls of all ranks)."""
    s = q.shape[2]
    l = s // d
    key_index = gather_order(torch.arange(s), d, 0)  # global index of every row of the gathered buffer
    kg, vg = gather_order(k, d, 2), gather_order(v, d, 2)
    o, dq = torch.zeros_like(q), torch.zeros_like(q)
    lse = torch.zeros(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for p in range(d):
        glob = zigzag_positions(s, d, p)
        starts = document_starts(zigzag_shard(pos, d, p), d, p)  # [B, L], local
        q_loc = zigzag_shard(q, d, p, dim=2)
        for rows, own, pre in zigzag_calls(l, TSPGroup(None, p, d)):
            mask = DocumentMask.for_call(starts[:, rows], key_index, own, pre)
            args = (q_loc[:, :, rows], kg[:, :, own], vg[:, :, own],
                    None if pre is None else kg[:, :, pre], None if pre is None else vg[:, :, pre])
            o_c, lse_c = kernel.forward(*args, mask=mask)
            gi = glob[rows]
            o[:, :, gi] = o_c
            if lse_c is not None:
                lse[:, :, gi] = lse_c
            if not backward:
                continue
            dq_c, dk_own, dv_own, dk_pre, dv_pre = kernel.backward(do[:, :, gi], *args, o_c, lse_c, mask=mask)
            dq[:, :, gi] = dq_c
            dk[:, :, key_index[own]] += dk_own
            dv[:, :, key_index[own]] += dv_own
            if pre is not None:
                dk[:, :, key_index[pre]] += dk_pre
                dv[:, :, key_index[pre]] += dv_pre
    return o, lse, dq, dk, dv


class DenseFlex(FlexDocumentAttention):
    """FlexDocumentAttention's own structure (two pieces, its mask_mods, its fp32 merge, the default backward
    through ``differentiable``), each piece computed densely from the mask_mod with flex's conventions (a row
    without a visible key: output 0, lse -inf). CPU flex has no backward, so this is what checks the merge's
    gradients, -inf rows included."""

    def block_mask(self, kind, mask_mod, b, lq, lk, q):
        return mask_mod  # the dense stand-in evaluates the mask_mod itself

    def attend(self, kind, q, k, v, mask_mod):
        b, hq, lq, hd = q.shape
        lk = k.shape[2]
        g = hq // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        if mask_mod is None:
            keep = torch.ones(1, 1, lq, lk, dtype=torch.bool)
        else:
            keep = mask_mod(torch.arange(b)[:, None, None, None], torch.arange(hq)[None, :, None, None],
                            torch.arange(lq)[None, None, :, None], torch.arange(lk)[None, None, None, :])
        keep = keep.expand(b, hq, lq, lk)
        empty = ~keep.any(-1)
        s = s.masked_fill(~keep, float("-inf")).masked_fill(empty[..., None], 0.0)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).masked_fill(~keep, 0.0)
        return p @ v, lse.masked_fill(empty, float("-inf"))


def _qkvdo(hq, hkv, dtype=torch.float64, seed=0, hd=8):
    g = torch.Generator().manual_seed(seed)
    q, do = (torch.randn(2, hq, S, hd, generator=g, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, hkv, S, hd, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, do


# ---- kernels -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hq,hkv", [(4, 2), (2, 2)])
def test_document_masked_calls_equal_attention_document_by_document(hq, hkv):
    """Math, SDPA and the flex-doc structure (dense pieces), every rank's calls for D = 1, 2, 3, forward and
    backward in fp64, against each document attended on its own (GQA, prefix present and absent, documents
    across chunk and rank boundaries, queries whose document starts inside their own chunk)."""
    q, k, v, do = _qkvdo(hq, hkv)
    pos = packed_positions()
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = per_document_attention(*leaves, pos)
    ref_grads = torch.autograd.grad(ref, leaves, do)
    for d in (1, 2, 3):
        for kernel in (MathAttention(), SDPAAttention(), DenseFlex()):
            o, lse, dq, dk, dv = run_zigzag_calls(kernel, q, k, v, do, pos, d)
            what = f"{kernel.name} D={d}"
            assert_close(f"{what} out", o, ref)
            for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
                assert_close(f"{what} {name}", got, want)
            if d == 2 and not isinstance(kernel, SDPAAttention):
                math_lse = run_zigzag_calls(MathAttention(), q, k, v, do, pos, d, backward=False)[1]
                assert_close(f"{what} lse", lse, math_lse)


def test_one_document_mask_equals_no_mask():
    q, k, v, do = _qkvdo(4, 2)
    n = 8
    qc, ko, vo, kp, vp = q[:, :, -n:], k[:, :, -n:], v[:, :, -n:], k[:, :, : S - n], v[:, :, : S - n]
    mask = DocumentMask(torch.zeros(2, n, dtype=torch.long), torch.arange(S - n, S), torch.arange(S - n))
    for kernel in (MathAttention(), SDPAAttention(), DenseFlex()):
        want = kernel.forward(qc, ko, vo, kp, vp)
        got = kernel.forward(qc, ko, vo, kp, vp, mask=mask)
        assert_close(f"{kernel.name} out", got[0], want[0])
        g_want = kernel.backward(do[:, :, -n:], qc, ko, vo, kp, vp, *want)
        g_got = kernel.backward(do[:, :, -n:], qc, ko, vo, kp, vp, *got, mask=mask)
        for a, b in zip(g_got, g_want):
            assert_close(f"{kernel.name} grad", a, b)


def test_merge_of_a_prefix_row_without_visible_keys_is_the_own_piece():
    g = torch.Generator().manual_seed(0)
    own_o, pre_o = torch.randn(1, 2, 3, 4, generator=g).bfloat16(), torch.randn(1, 2, 3, 4, generator=g).bfloat16()
    own_lse, pre_lse = torch.randn(1, 2, 3, generator=g), torch.randn(1, 2, 3, generator=g)
    pre_lse[0, :, 1] = float("-inf")
    pre_o[0, :, 1] = float("nan")  # whatever a backend leaves there must not leak
    o, lse = merge_pieces(own_o, own_lse, pre_o, pre_lse, torch.bfloat16)
    assert torch.equal(o[0, :, 1], own_o[0, :, 1]) and torch.equal(lse[0, :, 1], own_lse[0, :, 1])
    assert torch.isfinite(o).all() and lse.dtype == torch.float32
    leaves = [t.float().requires_grad_(True) for t in (own_o, own_lse, pre_o, pre_lse)]
    out, out_lse = merge_pieces(*leaves, torch.float32)
    (out.sum() + out_lse.sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in leaves[:2])
    assert leaves[2].grad[0, :, 1].eq(0).all() and leaves[3].grad[0, :, 1].eq(0).all()


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_eager_on_cpu_matches_math():
    """The real flex_attention (eager on CPU: forward only) with the kernel's block masks, mask_mods and merge,
    fp32, against MathAttention; D = 2 (row 0 has prefix rows without a visible key); and without a mask."""
    q, k, v, do = _qkvdo(4, 2, dtype=torch.float32, hd=16)
    pos = packed_positions()
    flex = FlexDocumentAttention(compiled=False)
    o, lse, *_ = run_zigzag_calls(flex, q, k, v, do, pos, 2, backward=False)
    o_ref, lse_ref, *_ = run_zigzag_calls(MathAttention(), q, k, v, do, pos, 2, backward=False)
    assert_close("flex out", o, o_ref, rtol=1e-5, atol=1e-6)
    assert_close("flex lse", lse, lse_ref, rtol=1e-5, atol=1e-6)
    n = 8  # no document mask: own chunk causal, prefix fully visible
    args = (q[:, :, -n:], k[:, :, -n:], v[:, :, -n:], k[:, :, : S - n], v[:, :, : S - n])
    for got, want in zip(flex.forward(*args), MathAttention().forward(*args)):
        assert_close("flex causal", got, want, rtol=1e-5, atol=1e-6)


def test_block_masks_are_cached_on_the_document_mask():
    q, k, v, do = _qkvdo(2, 2)
    n = 8
    mask = DocumentMask(torch.full((2, n), 3, dtype=torch.long), torch.arange(S - n, S), torch.arange(S - n))
    args = (q[:, :, -n:], k[:, :, -n:], v[:, :, -n:], k[:, :, : S - n], v[:, :, : S - n])
    kernel = DenseFlex()
    o, lse = kernel.forward(*args, mask=mask)
    assert {key[0] for key in mask.cache} == {"own", "prefix"}
    kernel.backward(do[:, :, -n:], *args, o, lse, mask=mask)
    assert len(mask.cache) == 2


def test_kernels_without_document_masks_refuse_them():
    q, k, v, _ = _qkvdo(2, 2)
    n = 8
    mask = DocumentMask(torch.zeros(2, n, dtype=torch.long), torch.arange(n))
    for kernel in (CudnnSplitAttention(), FlashAttention()):
        assert not kernel.supports_document_mask
        with pytest.raises(TSPConfigError, match=f"{kernel.name}' does not support document masks"):
            kernel.forward(q[:, :, :n], k[:, :, :n], v[:, :, :n], mask=mask)
        with pytest.raises(TSPConfigError, match="does not support document masks"):
            kernel.backward(q[:, :, :n], q[:, :, :n], k[:, :, :n], v[:, :, :n], None, None, q[:, :, :n], None,
                            mask=mask)
    for name in ("cudnn-split", "flash-attn"):
        for device in ("cpu", "cuda"):
            with pytest.raises(TSPConfigError, match="does not support document masks"):
                select_attention_kernel(device, name, documents=True)
    assert isinstance(select_attention_kernel("cpu", documents=True), SDPAAttention)
    assert isinstance(select_attention_kernel("cpu", "math", documents=True), MathAttention)
    assert isinstance(select_attention_kernel("cpu", "flex-doc", documents=True), FlexDocumentAttention)
    # CUDA half precision picks flex (decided without touching a GPU); fp32 the SDPA mask
    assert isinstance(select_attention_kernel("cuda", "auto", torch.bfloat16, documents=True), FlexDocumentAttention)
    assert isinstance(select_attention_kernel("cuda", "auto", torch.float32, documents=True), SDPAAttention)
    assert not isinstance(select_attention_kernel("cpu"), FlexDocumentAttention)


def test_document_mask_validation():
    with pytest.raises(TSPConfigError, match="int64"):
        DocumentMask(torch.zeros(1, 4, dtype=torch.int32), torch.arange(4))
    with pytest.raises(TSPConfigError, match="q_lo must be"):
        DocumentMask(torch.zeros(1, 4, dtype=torch.long), torch.arange(5))
    q = torch.zeros(2, 1, 4, 8)
    mask = DocumentMask(torch.zeros(1, 4, dtype=torch.long), torch.arange(4))
    with pytest.raises(TSPConfigError, match="does not match"):
        MathAttention().forward(q, q, q, mask=mask)
    mask = DocumentMask(torch.zeros(2, 4, dtype=torch.long), torch.arange(4))
    with pytest.raises(TSPConfigError, match="0 prefix key indices, the call has 4"):
        MathAttention().forward(q, q, q, q, q, mask=mask)


# ---- zigzag batch side ---------------------------------------------------------------------------------------


def test_shard_batch_with_packed_positions():
    pos = packed_positions()
    ids = torch.randint(0, 100, (2, S), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[1, 7] = IGNORE_INDEX
    want = shift_labels(labels)
    want[:, :-1][pos[:, 1:] == 0] = IGNORE_INDEX  # no target across a document boundary
    for t in (3, 4, 12, 19, 22):  # last tokens of row 0's documents
        assert want[0, t] == IGNORE_INDEX
    assert want[0, 5] == ids[0, 6] and want[1, 6] == IGNORE_INDEX  # inside a document / an ignored label
    starts = brute_force_starts(pos)
    for d in (1, 2, 3):
        parts = [shard_batch(ids, labels, d, p, position_ids=pos) for p in range(d)]
        assert torch.equal(zigzag_unshard([i for i, _, _ in parts]), ids)
        assert torch.equal(zigzag_unshard([t for _, t, _ in parts]), want)
        assert torch.equal(zigzag_unshard([q for _, _, q in parts]), pos)
        for p, (_, _, local_pos) in enumerate(parts):
            assert local_pos.shape == (2, S // d) and local_pos.dtype == torch.long
            assert torch.equal(document_starts(local_pos, d, p), zigzag_shard(starts, d, p))
    # without position_ids: unchanged (global positions [S/D])
    i, t, p = shard_batch(ids, None, 2, 1)
    assert torch.equal(p, zigzag_positions(S, 2, 1)) and torch.equal(t, zigzag_shard(shift_labels(ids), 2, 1))
    # one document from 0 is the plain causal batch
    plain = torch.arange(S).expand(2, S)
    assert torch.equal(shard_batch(ids, None, 2, 1, position_ids=plain)[1], t)


@pytest.mark.parametrize("edit,match", [
    (lambda p: p[1, 0].fill_(3), r"position_ids\[1, 0\] = 3: every sequence must start a document"),
    (lambda p: p[0, 6].fill_(7), r"position_ids\[0, 6\] = 7 after position_ids\[0, 5\] = 0"),
    (lambda p: p[1, 9].fill_(-1), r"position_ids\[1, 9\] = -1 after"),
])
def test_bad_packed_positions_are_named(edit, match):
    pos = packed_positions()
    edit(pos)
    with pytest.raises(TSPConfigError, match=match):
        check_packed_positions(pos)
    with pytest.raises(TSPConfigError, match="Hugging Face's convention"):
        shard_batch(torch.zeros(2, S, dtype=torch.long), None, 2, 0, position_ids=pos)


def test_packed_positions_shape_and_dtype():
    ids = torch.zeros(2, S, dtype=torch.long)
    with pytest.raises(TSPConfigError, match="shaped like input_ids"):
        shard_batch(ids, None, 2, 0, position_ids=torch.arange(S))
    with pytest.raises(TSPConfigError, match="integer tensor"):
        check_packed_positions(packed_positions().float())


def test_strategy_shards_position_ids():
    from lightning_tsp.strategy import TSPStrategy

    strategy = TSPStrategy(tsp_size=2)
    strategy._tsp_group = TSPGroup(None, 1, 2)
    pos = packed_positions()
    ids = torch.arange(2 * S).view(2, S)
    out = strategy.shard_batch({"input_ids": ids, "position_ids": pos})
    assert torch.equal(out["position_ids"], zigzag_shard(pos, 2, 1))
    want_targets = shard_batch(ids, None, 2, 1, position_ids=pos)[1]
    assert torch.equal(out["targets"], want_targets)
    for bad, match in [(pos.float(), "integer tensor shaped like"), (pos[:, :12], "integer tensor shaped like"),
                       (pos + 1, r"position_ids\[0, 0\] = 1")]:
        with pytest.raises(TSPConfigError, match=match):
            strategy.shard_batch({"input_ids": ids, "position_ids": bad})


# ---- data ----------------------------------------------------------------------------------------------------


def test_packed_dataset_and_datamodule_position_ids(tmp_path):
    from lightning_tsp.data import PackedTextDataset
    from lightning_tsp.datamodule import TextDataModule

    for name, text in (("a.txt", "ab"), ("b.txt", "cde"), ("c.txt", "fghij"), ("d.txt", "k")):
        (tmp_path / name).write_text(text)
    # bytes: a b \0 c | d e \0 f | g h i j | \0 k \0 (dropped)
    plain = PackedTextDataset([tmp_path], seq_len=4)
    assert set(plain[0]) == {"input_ids"}
    ds = PackedTextDataset([tmp_path], seq_len=4, document_mask=True)
    assert len(ds) == 3
    assert [ds[i]["position_ids"].tolist() for i in range(3)] == [[0, 1, 2, 0], [0, 1, 2, 0], [0, 1, 2, 3]]
    assert torch.equal(ds[1]["input_ids"], plain[1]["input_ids"])
    dm = TextDataModule(source=str(tmp_path), seq_len=4, batch_size=2, val_fraction=0.0, shuffle=False,
                        document_mask=True)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"input_ids", "position_ids"} and batch["position_ids"].shape == (2, 4)
    check_packed_positions(batch["position_ids"])
    dm = TextDataModule(source=str(tmp_path), seq_len=4, batch_size=2, val_fraction=0.0, shuffle=False)
    dm.setup("fit")
    assert set(next(iter(dm.train_dataloader()))) == {"input_ids"}


# ---- Hugging Face models ---------------------------------------------------------------------------------------


def test_hugging_face_global_batch_with_position_ids_equals_documents_one_by_one():
    """TSPCausalLM(input_ids, labels, position_ids=[B, S]) (D = 1) gives Hugging Face's loss and gradients for the
    documents run one by one; the strategy's sharded keyword form gives the same loss."""
    pytest.importorskip("transformers")
    from tests.test_convert import convert_one, hf_model

    hf = hf_model("Llama")
    ref_params = dict(hf.named_parameters())
    model = convert_one(hf_model("Llama"))
    pos = packed_positions()
    ids = torch.randint(0, model.cfg.vocab_size, (2, S), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[1, 7] = IGNORE_INDEX
    total, count = 0.0, 0
    for b in range(2):
        starts = (pos[b] == 0).nonzero().flatten().tolist() + [S]
        for a, e in zip(starts[:-1], starts[1:]):
            n_valid = int((labels[b, a + 1 : e] != IGNORE_INDEX).sum())
            if n_valid == 0:
                continue
            out = hf(input_ids=ids[b : b + 1, a:e], labels=labels[b : b + 1, a:e])
            total = total + out.loss * n_valid
            count += n_valid
    want = total / count
    want.backward()
    got = model(input_ids=ids, labels=labels, position_ids=pos).loss
    got.backward()
    assert_close("loss", got.detach(), want.detach(), 2e-6)
    for name, p in model.named_parameters():
        assert_close(f"grad {name}", p.grad, ref_params[name].grad, 2e-6)
    i, t, p = model.shard_batch(ids, labels, position_ids=pos)
    again = model(input_ids=i, targets=t, position_ids=p).loss
    assert_close("loss (strategy kwargs)", again.detach(), got.detach(), 1e-12)
