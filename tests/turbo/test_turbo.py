"""The variable-length BERT runtime: varlen attention, packing, the packed encoder behind the patched model,
the memory planner and the CUDA-graph runtime."""

import copy
import random
import re

import numpy as np
import pytest
import torch

import hf_scatter
from hf_scatter.kernels import varlen_attention as va
from hf_scatter.kernels.varlen_attention import varlen_attention
from hf_scatter.models.bert import UNPADDED
from hf_scatter.tiny import tiny_bert
from hf_scatter.turbo.packing import pack_padded, pack_sequences
from hf_scatter.turbo.planner import MemoryPlanner, UsageRecord, plan_records, record_usage
from hf_scatter.turbo.runtime import PADDED_ROWS_LIMIT, UnpaddedRuntime, token_bucket
from hf_scatter.kernels.skinny_linear import SkinnyWorkspace
from hf_scatter.turbo import unpadded
from hf_scatter.turbo.unpadded import encode

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}

# On the CPU the runtime's tests (packing, heads, planning, scheduling, ordering) take the kernels' torch reference;
# the varlen attention kernel and the patched base model keep the Triton interpreter
pytestmark = pytest.mark.kernel_bodies("reference")


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


# ------------------------------------------------------------------------------------ varlen attention
@pytest.mark.kernel_bodies("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("lengths,heads,head_dim", [([1, 7, 40, 0, 33], 3, 16), ([64, 64], 2, 24), ([1], 1, 8)])
def test_varlen_attention_matches_float64_per_sequence_attention(dtype, lengths, heads, head_dim, device):
    T = sum(lengths) + 5  # trailing rows belong to no sequence and must stay untouched
    qkv = torch.randn(T, 3, heads, head_dim, device=device).to(dtype)  # q, k, v are strided views of one buffer
    q, k, v = qkv.unbind(1)
    out = torch.full((T, heads, head_dim), float("nan"), device=device, dtype=dtype)
    varlen_attention(q, k, v, lengths, out=out)
    want = torch.zeros(T, heads, head_dim, dtype=torch.float64, device=device)
    for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths):  # softmax(q k^T / sqrt(d)) v per sequence
        s = slice(int(start), int(start) + n)
        scores = torch.einsum("qhd,khd->hqk", q[s].double(), k[s].double()) / head_dim ** 0.5
        want[s] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s].double())
    n = sum(lengths)
    assert not out[:n].isnan().any(), "every real row must be written"
    assert _rel(out[:n], want[:n]) < TOL[dtype]
    assert out[n:].isnan().all(), "rows past the sequences must not be written"


@pytest.mark.kernel_bodies("interpreted")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_varlen_attention_with_a_key_mask_matches_float64_masked_attention(dtype, device):
    """Padded rows run as sequences: only keys marked 1 count, for every query (padding too); a row with no
    real key gives zeros, never NaN."""
    lengths, heads, head_dim = [37, 5, 70, 3], 2, 24
    g = torch.Generator().manual_seed(1)
    T = sum(lengths) + 3
    qkv = torch.randn(T, 3, heads, head_dim, generator=g).to(device, dtype)
    q, k, v = qkv.unbind(1)
    keys = (torch.rand(T, generator=g) < 0.6).to(device)
    keys[37:42] = False  # the second sequence has no real key
    keys[42:42 + 35] = False  # the third's first tiles are all padding: its running max starts at -inf
    keys[-3:] = True
    out = torch.full((T, heads, head_dim), float("nan"), device=device, dtype=dtype)
    varlen_attention(q, k, v, lengths, out=out, key_mask=keys.to(torch.int64) if dtype == torch.float16 else keys)
    want = torch.zeros(T, heads, head_dim, dtype=torch.float64, device=device)
    for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths):
        s = slice(int(start), int(start) + n)
        scores = torch.einsum("qhd,khd->hqk", q[s].double(), k[s].double()) / head_dim ** 0.5
        scores = scores.masked_fill(~keys[s][None, None], float("-inf"))
        weights = scores.softmax(-1).nan_to_num(0.0)  # a row of -inf only: zeros
        want[s] = torch.einsum("hqk,khd->qhd", weights, v[s].double())
    n = sum(lengths)
    assert not out[:n].isnan().any()
    assert (out[37:42] == 0).all(), "no real key: zeros"
    assert _rel(out[:n], want[:n]) < TOL[dtype]
    assert out[n:].isnan().all()
    with pytest.raises(ValueError, match="key_mask must be a contiguous"):
        varlen_attention(q, k, v, lengths, key_mask=keys.float())


def test_block_table_covers_every_row_once_and_pads_to_capacity():
    lengths = [5, 0, 64, 65, 1]
    table = va.block_table(lengths, 32, capacity=va.max_blocks(sum(lengths), len(lengths), 32))
    count = table[0, 0]
    covered = np.zeros(sum(lengths), dtype=int)
    for first, start, end in table[1:1 + count]:
        covered[first:min(first + 32, end)] += 1
        assert start <= first < end
    assert (covered == 1).all() and count == 1 + 2 + 3 + 1
    assert (table[1 + count:] == 0).all() and len(table) == 1 + va.max_blocks(135, 5, 32)
    with pytest.raises(ValueError, match="do not fit a capacity"):
        va.block_table(lengths, 32, capacity=3)
    stale = np.full_like(table, 7)  # a graph's staging still holding a larger batch's table
    assert va.block_table(lengths, 32, capacity=len(table) - 1, out=stale) is stale
    assert np.array_equal(stale, table)
    assert va.block_table([], 32).tolist() == [[0, 0, 0]]


def test_varlen_attention_rejects_bad_input():
    q = torch.randn(10, 2, 8)
    with pytest.raises(ValueError, match="lengths add up to 12 tokens but q has only 10 rows"):
        varlen_attention(q, q, q, [6, 6])
    with pytest.raises(ValueError, match="must share shape"):
        varlen_attention(q, q[:, :1], q, [4])
    with pytest.raises(ValueError, match="head_dim must be contiguous"):
        varlen_attention(q.transpose(1, 2).contiguous().transpose(1, 2), q, q, [4])
    with pytest.raises(ValueError, match=">= 0"):
        varlen_attention(q, q, q, [-1, 4])


# ----------------------------------------------------------------------------------------- packing
def test_pack_padded_keeps_hf_positions_and_unpack_restores_the_layout():
    ids = torch.arange(1, 13).view(3, 4)
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]])  # right, left and no padding
    batch = pack_padded(ids, mask)
    assert batch.lengths == [3, 2, 4]
    assert batch.input_ids.tolist() == [1, 2, 3, 7, 8, 9, 10, 11, 12]
    assert batch.position_ids.tolist() == [0, 1, 2, 2, 3, 0, 1, 2, 3], "a token's position is its padded column"
    back = batch.unpack(batch.input_ids.float()[:, None])[..., 0]
    assert torch.equal(back, (ids * mask).float())
    assert [s.tolist() for s in batch.split(batch.input_ids)] == [[1, 2, 3], [7, 8], [9, 10, 11, 12]]
    with pytest.raises(ValueError, match="attention_mask must be a"):
        pack_padded(ids, mask[:, :2])


# -------------------------------------------------------------------------------- the patched model
def _batch(lengths, S=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    S = S or max(lengths)
    ids = torch.randint(3, 380, (len(lengths), S), generator=g)
    mask = (torch.arange(S)[None] < torch.tensor(lengths)[:, None]).long()
    types = torch.randint(0, 2, (len(lengths), S), generator=g)
    return ids, mask, types


@pytest.mark.parametrize("head", ["base", "sequence-classification", "token-classification", "masked-lm"])
def test_patched_bert_inference_is_packed_and_equals_vanilla_at_real_positions(head, device, kernel_bodies):
    kernel_bodies(head == "base")  # the other heads add their vanilla head on the same encoder
    vanilla = tiny_bert(hidden=72, heads=4, intermediate=100, head=head).to(device)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    assert UNPADDED in hf_scatter.patch_report(patched).values()
    key = "last_hidden_state" if head == "base" else "logits"
    # run row for row (at most PADDED_ROWS_LIMIT positions) and packed (the last: 1150 positions)
    for lengths in ([1, 64, 17, 33, 2], [9, 9, 9], [1], list(range(1, 9)), [230, 7, 220, 64, 1]):
        ids, mask, types = (t.to(device) for t in _batch(lengths))
        with torch.inference_mode():
            want = vanilla(ids, attention_mask=mask, token_type_ids=types)
            got = patched(ids, attention_mask=mask, token_type_ids=types)
        w, g = want[key], got[key]
        if w.dim() == 3:  # per-token outputs: only real positions are defined
            keep = mask.bool()
            w, g = w[keep], g[keep]
        assert _rel(g, w) < 1e-5, (head, lengths)
        if head == "base":
            assert _rel(got.pooler_output, want.pooler_output) < 1e-5
            assert (got.last_hidden_state[~mask.bool()] == 0).all(), "padded positions come back as zeros"
            from hf_scatter.turbo.hf_forward import packed_outputs
            with torch.inference_mode():
                batch, rows, _ = packed_outputs(patched, ids, mask, types)
            assert _rel(rows, got.last_hidden_state[mask.bool()]) < 1e-6, "the packed rows, in row order"
    runtime = (patched.bert if head != "base" else patched).__dict__["_hf_scatter_runtime"]
    assert runtime.stats()["plans"] >= 1, "the calls ran packed, on planned memory"


def test_weights_changed_in_place_are_used_by_the_next_call(device, tmp_path):
    """The runtime reads Q, K and V through one tensor per layer, which their parameters become views of: a
    load_state_dict, a write through ``.data`` (a LoRA merge's; it moves no version counter) or an optimizer step
    between calls reaches the next call, the model still trains, and a checkpoint saves and loads as before."""
    vanilla = tiny_bert(hidden=72, heads=4, intermediate=100).to(device)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    ids, mask, types = (t.to(device) for t in _batch([7, 3, 12]))
    with torch.inference_mode():
        patched(ids, attention_mask=mask)
    attn = patched.encoder.layer[1].attention.self
    assert attn.query.weight.untyped_storage().data_ptr() == attn.value.weight.untyped_storage().data_ptr()
    other = tiny_bert(seed=1, hidden=72, heads=4, intermediate=100).to(device)
    patched.load_state_dict(other.state_dict())
    delta = torch.randn_like(attn.value.weight) * 0.1
    for m in (patched, other):  # a LoRA merge's write
        m.encoder.layer[1].attention.self.value.weight.data += delta
        m.encoder.layer[0].attention.self.key.bias.data.mul_(2)
        m.eval()

    def agree():
        with torch.inference_mode():
            got, want = (m(ids, attention_mask=mask, token_type_ids=types) for m in (patched, other))
        keep = mask.bool()
        assert _rel(got.last_hidden_state[keep], want.last_hidden_state[keep]) < 1e-5
        assert _rel(got.pooler_output, want.pooler_output) < 1e-5

    agree()
    for m in (patched, other):  # one optimizer step on each (eval mode: no dropout): the views train as before
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(ids, attention_mask=mask).last_hidden_state.square().mean().backward()
        assert m.encoder.layer[1].attention.self.query.weight.grad.abs().sum() > 0
        opt.step()
    agree()
    patched.save_pretrained(tmp_path)
    reloaded = type(other).from_pretrained(tmp_path).to(device).eval()
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, patched.state_dict()[name]), name


def test_qkv_weights_of_mixed_layers_are_concatenated_per_call():
    """Q/K/V the runtime cannot regroup (mixed dtypes, a missing bias) are concatenated per call, a missing bias
    as zeros, and the parameters are left alone."""
    from hf_scatter.turbo.unpadded import QkvWeights

    model = tiny_bert(hidden=32, heads=2, intermediate=48, layers=2)
    attn = model.encoder.layer[0].attention.self
    attn.key.bias = None
    model.encoder.layer[1].attention.self.value.double()
    before = [p.data_ptr() for p in model.parameters()]
    qkv = QkvWeights(model)
    assert [p.data_ptr() for p in model.parameters()] == before
    weight, bias = qkv.of_layer(0)
    assert torch.equal(weight, torch.cat([attn.query.weight, attn.key.weight, attn.value.weight]))
    assert torch.equal(bias, torch.cat([attn.query.bias, torch.zeros(32), attn.value.bias]))
    assert qkv.of_layer(1)[0].dtype == torch.float64


def test_peft_adapters_take_the_padded_forward_until_merged():
    """PEFT wraps its target layers: the packed encoder reads plain weights and would drop the adapters, so a
    wrapped model takes transformers' forward (the Encoder refuses it by name); merged, it runs packed again."""
    from peft import LoraConfig, get_peft_model

    from hf_scatter.turbo import Encoder

    base = tiny_bert(hidden=64, heads=4, intermediate=96)
    config = LoraConfig(r=4, target_modules=["query", "value", "dense"], init_lora_weights=False)
    vanilla = get_peft_model(copy.deepcopy(base), config).eval()
    patched = hf_scatter.patch_model(copy.deepcopy(base))
    ids, mask, _ = _batch([9, 4])
    with torch.no_grad():
        patched(input_ids=ids, attention_mask=mask)  # a runtime exists before the adapters come
    patched = get_peft_model(patched, config).eval()
    patched.load_state_dict(vanilla.state_dict())
    with torch.no_grad():
        want = vanilla(input_ids=ids, attention_mask=mask).last_hidden_state
        got = patched(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    assert _rel(got[keep], want[keep]) < 1e-5, "the adapters count"
    with pytest.raises(ValueError, match=r"query: .*not a plain layer.*merge_and_unload"):
        Encoder(patched.base_model.model, progress=False).encode([[5, 6, 7]])
    merged = patched.merge_and_unload()
    runtime = merged.__dict__["_hf_scatter_runtime"]
    with torch.no_grad():
        again = merged(input_ids=ids, attention_mask=mask).last_hidden_state
    assert runtime.wrapped is None and runtime.stats()["plans"] >= 1, "merged: packed again"
    assert _rel(again[keep], want[keep]) < 1e-5 and (again[~keep] == 0).all()


def test_padded_positions_are_zeros_and_patch_report_says_so(device):
    """The one difference from vanilla a patched BERT shows: packed calls return zero hidden states at padded
    positions (a head reads zero rows there), where vanilla computes those positions attending over the real
    tokens at every layer, the padded work packing skips. patch_report's entry for the model says so; real
    positions equal vanilla's, and calls on the padded forward return vanilla's values at padded positions."""
    vanilla = tiny_bert(hidden=72, heads=4, intermediate=100, head="token-classification").to(device)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    entry = hf_scatter.patch_report(patched)["bert"]
    assert entry == UNPADDED and "zero hidden states at padded positions, attention_mask == 0" in entry
    ids, mask, types = (t.to(device) for t in _batch([7, 3, 12, 1]))
    real, pad = mask.bool(), ~mask.bool()
    kwargs = dict(attention_mask=mask, token_type_ids=types)
    with torch.inference_mode():
        want, got = (m.bert(ids, **kwargs).last_hidden_state for m in (vanilla, patched))
        want_logits, got_logits = (m(ids, **kwargs).logits for m in (vanilla, patched))
    assert _rel(got[real], want[real]) < 1e-5 and _rel(got_logits[real], want_logits[real]) < 1e-5
    assert (got[pad] == 0).all(), "padded positions come back as zeros"
    assert (want[pad].abs().amax(-1) > 0.1).all(), "vanilla computes a value at every padded position"
    assert torch.equal(got_logits[pad], patched.classifier.bias.detach().expand_as(got_logits[pad])), "head(0)"
    padded_forward = patched.bert(ids, **kwargs).last_hidden_state  # gradients enabled: the padded forward
    assert _rel(padded_forward[pad], want[pad]) < 1e-5
    hf_scatter.patch_model(patched, unpadded=False)
    assert not any("padded positions" in impl for impl in hf_scatter.patch_report(patched).values())


def test_calls_the_packed_path_cannot_serve_exactly_take_the_padded_forward():
    vanilla = tiny_bert(hidden=72, heads=4, intermediate=100)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    ids, mask, _ = _batch([5, 3])
    big_ids, big_mask, _ = _batch([230, 220, 3, 190, 180])  # more positions than a batch run row for row
    assert big_mask.numel() > PADDED_ROWS_LIMIT >= mask.numel()
    left = big_mask.flip(1)
    with torch.no_grad():  # left padding: vanilla pools the padded first column, which packing never computes
        assert _rel(patched(big_ids, attention_mask=left).pooler_output,
                    vanilla(big_ids, attention_mask=left).pooler_output) < 1e-5
        hidden = patched(ids, attention_mask=mask, output_hidden_states=True)
        assert len(hidden.hidden_states) == 3 and _rel(hidden.hidden_states[1][mask.bool()], vanilla(
            ids, attention_mask=mask, output_hidden_states=True).hidden_states[1][mask.bool()]) < 1e-5
    out = patched(ids, attention_mask=mask)  # gradients enabled: the padded path, with autograd
    assert out.last_hidden_state.requires_grad
    ran_packed = lambda: patched.__dict__.get("_hf_scatter_runtime") and patched._hf_scatter_runtime.stats()["plans"]  # noqa: E731
    assert not ran_packed(), "none of these calls ran packed"
    with torch.no_grad():  # return_dict=False is served packed, as a tuple
        as_tuple = patched(ids, attention_mask=mask, return_dict=False)
        assert isinstance(as_tuple, tuple) and torch.equal(as_tuple[0], patched(ids, attention_mask=mask)[0])
    assert ran_packed()
    with torch.no_grad():  # a small left-padded batch runs row for row, which computes the padded first column
        small_left = mask.flip(1)
        assert _rel(patched(ids, attention_mask=small_left).pooler_output,
                    vanilla(ids, attention_mask=small_left).pooler_output) < 1e-5
    hf_scatter.patch_model(patched, unpadded=False)
    assert UNPADDED not in hf_scatter.patch_report(patched).values()


def test_more_positions_than_max_position_embeddings_raise_vanillas_error():
    vanilla = tiny_bert(hidden=32, heads=2, intermediate=48, layers=1)
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    S = vanilla.config.max_position_embeddings + 1
    ids, mask, types = _batch([S, 5], S=S)
    for kwargs in ({}, {"attention_mask": mask}, {"token_type_ids": types}):
        with torch.no_grad(), pytest.raises(Exception) as want:
            vanilla(ids, **kwargs)
        with torch.no_grad(), pytest.raises(type(want.value), match=re.escape(str(want.value))):
            patched(ids, **kwargs)
    assert "_hf_scatter_runtime" not in patched.__dict__, "refused before any packed work"


@pytest.mark.parametrize("head", ["base", "masked-lm"])
def test_inputs_embeds_give_the_same_outputs_as_input_ids(head):
    """transformers' test_inputs_embeds_matches_input_ids: one model, one answer, padded positions included."""
    model = hf_scatter.patch_model(tiny_bert(hidden=72, heads=4, intermediate=100, head=head)).eval()
    ids, mask, types = _batch([5, 3, 7])
    if head == "masked-lm":  # no pooler: left padding and holes pack too
        mask[1] = torch.tensor([0, 0, 1, 1, 0, 1, 1])
    embeds = model.get_input_embeddings()(ids)
    with torch.no_grad():
        from_ids = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
        from_embeds = model(inputs_embeds=embeds, attention_mask=mask, token_type_ids=types)
    torch.testing.assert_close(from_embeds[0], from_ids[0], rtol=0, atol=0)
    if head == "base":
        torch.testing.assert_close(from_embeds.pooler_output, from_ids.pooler_output, rtol=0, atol=0)
        assert (from_embeds.last_hidden_state[~mask.bool()] == 0).all(), "both ran packed"


def test_patched_bert_forward_has_vanillas_signature_and_attention_outputs():
    import inspect

    from transformers import BertModel

    vanilla = tiny_bert(hidden=32, heads=2, intermediate=48)
    vanilla.set_attn_implementation("eager")
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    assert type(patched).forward is not BertModel.forward
    assert inspect.signature(patched.forward) == inspect.signature(vanilla.forward)
    kwargs = inspect.signature(patched.forward).parameters["kwargs"].annotation  # how transformers' tests decide
    assert "output_attentions" in kwargs.__args__[0].__annotations__, "output_attentions support"
    ids, mask, _ = _batch([5, 3])
    for kw in ({"output_attentions": True}, {"output_hidden_states": True, "return_dict": False},
               {"output_attentions": True, "output_hidden_states": True}):
        with torch.no_grad():
            want, got = vanilla(ids, attention_mask=mask, **kw), patched(ids, attention_mask=mask, **kw)
        assert type(got) is type(want) and len(got) == len(want), kw
        for w, g in zip(want.to_tuple() if hasattr(want, "to_tuple") else want,
                        got.to_tuple() if hasattr(got, "to_tuple") else got):
            for wt, gt in zip(w if isinstance(w, tuple) else (w,), g if isinstance(g, tuple) else (g,)):
                assert _rel(gt, wt) < 1e-5, kw


# ---------------------------------------------------------------------------------- memory planner
def _random_records(rng: random.Random, n: int) -> list[UsageRecord]:
    records = []
    for i in range(n):
        first = rng.randrange(0, 60)
        size = rng.choice([512, 4096, rng.randrange(1, 3 << 20)])
        records.append(UsageRecord(i, f"t{i}", first, first + rng.randrange(0, 20), -(-size // 512) * 512))
    return records


@pytest.mark.parametrize("seed", range(25))
def test_planner_never_overlaps_live_tensors_and_never_needs_more_than_the_naive_sum(seed):
    rng = random.Random(seed)
    records = _random_records(rng, rng.randrange(1, 60))
    existing = {0: 2 << 20} if seed % 2 else {}
    placements, chunks = plan_records(records, existing)
    again = plan_records(records, existing)
    assert (placements, chunks) == again, "plans are deterministic"
    assert set(existing.items()) <= set(chunks.items()), "existing chunks are kept and tried first"
    by_index = {r.index: r for r in records}
    for i, a in by_index.items():
        pa = placements[i]
        assert pa.offset >= 0 and pa.offset + a.size <= chunks[pa.chunk], "inside its chunk"
        for j, b in by_index.items():
            pb = placements[j]
            if i < j and pa.chunk == pb.chunk and a.overlaps(b):
                assert pa.offset + a.size <= pb.offset or pb.offset + b.size <= pa.offset, (a, b)
    used = {}
    for r in records:
        p = placements[r.index]
        used[p.chunk] = max(used.get(p.chunk, 0), p.offset + r.size)
    assert sum(used.values()) <= sum(r.size for r in records)
    for cid in set(chunks) - set(existing):  # a new chunk is max(2 MB, 1.2 x the tensor that opened it)
        opener = max((r for r in records if placements[r.index].chunk == cid), key=lambda r: r.size)
        assert chunks[cid] == max(2 << 20, -(-int(1.2 * opener.size) // 512) * 512)


@pytest.mark.kernel_bodies("interpreted")
def test_a_short_request_with_a_workspace_runs_every_projection_on_the_few_rows_kernel(monkeypatch):
    """What the graphed runtime does at most 64 tokens (there on a GPU, here under the interpreter): the four
    projections of every layer and the pooler's go to skinny_linear, the FFN's GELU in its epilogue and its output
    projection's K split over programs, and the encoder answers as the cuBLAS path does, within fp16 rounding."""
    model = tiny_bert(hidden=64, heads=4, intermediate=800, layers=2).half()  # the FFN's K of 800 splits in two
    batch = pack_sequences([list(range(3, 40)), list(range(7, 12))])
    workspaces = []
    kernel = unpadded.skinny_linear
    monkeypatch.setattr(unpadded, "runs_skinny", lambda x: x.shape[0] <= 64 and x.dtype == torch.float16)
    monkeypatch.setattr(unpadded, "skinny_linear", lambda *a, **k: workspaces.append(k["workspace"]) or kernel(*a, **k))
    workspace = SkinnyWorkspace()
    with torch.inference_mode():
        want, want_pooled = encode(model, batch)
        assert not workspaces, "without a workspace the projections stay on torch's GEMMs"
        got, got_pooled = encode(model, batch, skinny=workspace)
    assert len(workspaces) == 4 * 2 + 1 and all(w is workspace for w in workspaces)
    assert workspace._buffers, "no projection split its K"
    assert _rel(got, want) < 1e-2 and _rel(got_pooled, want_pooled) < 1e-2


def test_usage_records_come_from_the_real_computation_and_plans_reuse_memory():
    model = tiny_bert(hidden=64, heads=4, intermediate=96, layers=3)
    batch = pack_sequences([list(range(3, 40)), list(range(5, 20))])
    with torch.inference_mode():
        real, (hidden, _) = record_usage(lambda alloc: encode(model, batch, alloc), lambda r: [r[0]], fake=False)
        assert torch.equal(hidden, encode(model, batch)[0]), "the recording runs the computation itself"
        records, _ = record_usage(lambda alloc: encode(model, batch, alloc), lambda r: [r[0]])  # on fake tensors
    assert [(r.name, r.size) for r in records] == [(r.name, r.size) for r in real]
    names = [r.name for r in records]
    assert names.count("attention.qkv") == 3 and names[-2:] == ["pooler.cls", "pooler.out"]
    qkv, context = records[names.index("attention.qkv")], records[names.index("attention.context")]
    assert qkv.first_op < context.first_op <= qkv.last_op < context.last_op, "qkv dies once attention read it"
    last_norm = [r for r in records if r.name == "ffn.norm"][-1]
    assert last_norm.last_op == max(r.last_op for r in records), "the output lives to the end"
    planner = MemoryPlanner("cpu", chunk_bytes=64 << 10, max_plans=1)
    big = pack_sequences([list(range(3, 300))] * 3)
    with torch.inference_mode():
        planner.plan("a", lambda alloc: encode(model, batch, alloc), lambda r: [r[0]])
        plan = planner.plans["a"]
        assert plan.used_bytes() < plan.naive_bytes / 2, "three layers' intermediates share memory"
        planner.plan("b", lambda alloc: encode(model, big, alloc), lambda r: [r[0]])
    assert list(planner.plans) == ["b"] and planner.footprint_bytes == sum(
        c.numel() for cid, c in planner.chunks.items() if cid in planner.plans["b"].chunk_ids()), \
        "chunks of evicted plans that no kept plan uses are released"


def test_runtime_serves_every_batch_of_a_bucket_from_one_plan_and_replans_when_weights_move():
    model = tiny_bert(hidden=64, heads=4, intermediate=96)
    runtime = UnpaddedRuntime(model, chunk_bytes=64 << 10)
    with torch.inference_mode():
        for lengths in ([30, 2, 9], [1, 1, 1, 1], [40]):  # all in the 64-token bucket
            seqs = [torch.randint(3, 380, (n,)) for n in lengths]
            hidden, pooled = runtime.run(pack_sequences(seqs))
            for s, h, p in zip(seqs, torch.split(hidden, lengths), pooled):
                ref = model(s[None])
                assert _rel(h, ref.last_hidden_state[0]) < 1e-5 and _rel(p, ref.pooler_output[0]) < 1e-5
        assert runtime.stats()["plans"] == 1 and token_bucket(40) == 64, "one plan serves the 64-token bucket"
        planner = runtime.planner
        model.double()
        hidden, _ = runtime.run(pack_sequences([list(range(3, 20))]))
        assert hidden.dtype == torch.float64 and runtime.planner is not planner, "new parameters: planned afresh"
    for n in [1, 63, 64, 65, 1023, 1024, 1025, *range(1100, 40000, 997)]:  # graphs pad at most ~6% rows
        bucket = token_bucket(n)
        assert bucket >= n and bucket % 64 == 0 and bucket <= max(n + 63, int(1.0625 * n) + 64), n


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
def test_cuda_graph_replays_equal_vanilla_for_changing_batches():
    from transformers import AutoModel

    config = tiny_bert(hidden=256, heads=4, intermediate=512, layers=4).config
    vanilla = AutoModel.from_config(config, attn_implementation="sdpa").cuda().half().eval()
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    rng = random.Random(0)
    batches = [[rng.randrange(1, 200) for _ in range(rng.randrange(1, 12))] for _ in range(10)]
    runtime, captures = None, None
    for rerun in range(3):  # the arena grows to the largest batch during the first pass (dropping graphs)
        for step, lengths in enumerate(batches):
            ids, mask, types = (t.cuda() for t in _batch(lengths, seed=step))
            # the graphs' inputs are reused: types, then none (zeros), given positions, int32 ids, no padding
            extra = [{"token_type_ids": types}, {}, {"position_ids": torch.arange(ids.shape[1], device="cuda")[None]
                                                     .flip(1)}, {"token_type_ids": types.int()}][step % 4]
            if step % 4 == 3:
                ids = ids.int()
            if step == 5:
                mask = torch.ones_like(mask)
            with torch.inference_mode():
                want = vanilla(ids, attention_mask=mask, **extra)
                got = patched(ids, attention_mask=mask, **extra)
            keep = mask.bool()
            assert (got.last_hidden_state[~keep] == 0).all()
            assert _rel(got.last_hidden_state[keep], want.last_hidden_state[keep]) < 1e-2, lengths
            assert _rel(got.pooler_output, want.pooler_output) < 1e-2, lengths
        runtime = patched.__dict__["_hf_scatter_runtime"]
        if rerun == 1:
            captures = runtime.stats()["captures"]
    assert runtime.stats()["graphs"] >= 1 and runtime.stats()["captures"] == captures, "third pass: replays only"
    with torch.inference_mode():  # inputs_embeds run eagerly on the graphs' arena: the same answer
        from_ids = patched(ids, attention_mask=mask, token_type_ids=types)
        from_embeds = patched(inputs_embeds=patched.get_input_embeddings()(ids), attention_mask=mask,
                              token_type_ids=types)
    assert _rel(from_embeds.last_hidden_state, from_ids.last_hidden_state) < 1e-3
    assert runtime.stats()["captures"] == captures
    from hf_scatter.turbo import Encoder  # host-packed requests go through pinned staging, asynchronously
    reqs = [list(range(3, 3 + n)) for n in (5, 77, 130, 1, 64)]
    outs = Encoder(patched, progress=False).encode(reqs)
    with torch.inference_mode():
        for r, out in zip(reqs, outs):
            want = vanilla(torch.tensor([r], device="cuda")).last_hidden_state[0]
            assert _rel(out["last_hidden_state"], want) < 1e-2


@pytest.mark.gpu
def test_a_short_request_replays_its_projections_on_the_few_rows_kernel():
    """One request of 40 tokens (the 64-token bucket): the graph runs every projection on skinny_linear, the FFN's
    output projection split over programs, and the answer is vanilla's."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModel

    config = tiny_bert(hidden=256, heads=4, intermediate=1024, layers=2).config
    vanilla = AutoModel.from_config(config, attn_implementation="sdpa").cuda().half().eval()
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    ids, mask, types = (t.cuda() for t in _batch([40]))
    with torch.inference_mode():
        patched(ids, attention_mask=mask, token_type_ids=types)  # captures the bucket's graph
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got = patched(ids, attention_mask=mask, token_type_ids=types)
            torch.cuda.synchronize()
        want = vanilla(ids, attention_mask=mask, token_type_ids=types)
    launched = [e.name for e in prof.events() if "skinny_linear" in e.name]
    assert len(launched) == 4 * 2 + 1, launched
    assert patched.__dict__["_hf_scatter_runtime"].skinny._buffers, "the FFN's K of 1024 was not split"
    assert _rel(got.last_hidden_state, want.last_hidden_state) < 1e-2
    assert _rel(got.pooler_output, want.pooler_output) < 1e-2


@pytest.mark.gpu
def test_a_small_padded_batch_runs_without_waiting_for_the_device():
    """A small padded batch runs row for row: no device-to-host copy of its mask, no synchronisation, so the host
    can queue the next call while the GPU runs this one (a packed batch must read its mask on the host)."""
    config = tiny_bert(hidden=256, heads=4, intermediate=512, layers=2).config
    from transformers import AutoModel

    vanilla = AutoModel.from_config(config, attn_implementation="sdpa").cuda().half().eval()
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    ids, mask, types = (t.cuda() for t in _batch([40, 3, 17]))
    mask[1] = torch.tensor([0] * 20 + [1] * 20, device="cuda")  # left padding: its pooled column is padding
    big_ids, big_mask, _ = (t.cuda() for t in _batch([400, 380, 300]))
    with torch.inference_mode():
        patched(ids, attention_mask=mask, token_type_ids=types)  # captures the bucket's graph
        patched(big_ids, attention_mask=big_mask)
        other_ids, other_mask, _ = (t.cuda() for t in _batch([5, 40, 1], seed=3))  # the same shape: staged once
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = patched(ids, attention_mask=mask, token_type_ids=types)
            got_other = patched(other_ids, attention_mask=other_mask)
            with pytest.raises(RuntimeError, match="synchroniz"):  # the check sees a packed batch's wait
                patched(big_ids, attention_mask=big_mask)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        want = vanilla(ids, attention_mask=mask, token_type_ids=types)
        want_other = vanilla(other_ids, attention_mask=other_mask)
    for got, want, mask in ((got, want, mask), (got_other, want_other, other_mask)):
        keep = mask.bool()
        assert (got.last_hidden_state[~keep] == 0).all()
        assert _rel(got.last_hidden_state[keep], want.last_hidden_state[keep]) < 1e-2
        assert _rel(got.pooler_output, want.pooler_output) < 1e-2


# ----------------------------------------------------------------------------------- batch scheduler
def _contiguous_partitions(n):
    if n == 0:
        yield []
        return
    for first in range(1, n + 1):
        for rest in _contiguous_partitions(n - first):
            yield [first] + rest


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("padded", [False, True])
def test_dp_schedule_equals_brute_force(seed, padded):
    from hf_scatter.turbo.scheduler import BatchScheduler, CostTable, dp_schedule

    rng = random.Random(seed)
    lengths_grid, batches_grid = [8, 64, 256, 512], [1, 2, 4, 8]
    ms = [[0.2 + 0.004 * L * b ** rng.uniform(0.5, 1.0) + rng.uniform(0, 0.3) for b in batches_grid]
          for L in lengths_grid]
    table = CostTable(lengths_grid, batches_grid, ms, padded=padded)
    scheduler = BatchScheduler(table, max_batch=rng.choice([3, 5, 64]), max_tokens=None)
    lengths = [rng.randrange(5, 500) for _ in range(rng.randrange(1, 10))]
    groups = dp_schedule(lengths, scheduler.group_costs, scheduler.max_batch)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths))), "every request exactly once"
    ordered = sorted(lengths)
    best = min(sum(table.group_cost(ordered[sum(p[:k]):sum(p[:k + 1])]) for k in range(len(p)))
               for p in _contiguous_partitions(len(lengths)) if max(p) <= scheduler.max_batch)
    got = sum(table.group_cost(sorted(lengths[i] for i in g)) for g in groups)
    assert got == pytest.approx(best, rel=1e-12)


def test_scheduler_edge_cases_and_policies(tmp_path):
    from hf_scatter.turbo.scheduler import BatchScheduler, CostTable, dp_schedule

    table = CostTable([8, 512], [1, 8], [[1.0, 2.0], [3.0, 20.0]])
    assert dp_schedule([], table.group_costs) == []
    assert dp_schedule([7], table.group_costs) == [[0]]
    path = tmp_path / "costs.json"
    table.save(path)
    assert CostTable.load(path).ms == table.ms
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        CostTable.load(path)
    with pytest.raises(ValueError, match="table of positive"):
        CostTable([8], [1, 2], [[1.0, -1.0]])
    lazy = BatchScheduler(table, policy="lazy", max_batch=4, timeout_ms=10, latency_budget_ms=30)
    assert not lazy.ready([], 100) and not lazy.ready([10, 20], 1.0)
    assert lazy.ready([10] * 4, 0.0) and lazy.ready([10], 10.0), "full batch or timeout"
    assert lazy.ready([500] * 3, 15.0), "waiting longer would break the latency budget"
    assert BatchScheduler(table).ready([10], 0.0), "hungry takes whatever is queued"
    with pytest.raises(ValueError, match="policy"):
        BatchScheduler(table, policy="eager")


# -------------------------------------------------------------------------------------------- Encoder
@pytest.mark.parametrize("head", ["base", "sequence-classification", "token-classification", "masked-lm"])
def test_encoder_returns_each_requests_outputs_in_request_order(head, tokenizer):
    from hf_scatter.turbo import Encoder

    model = tiny_bert(hidden=64, heads=4, intermediate=96, head=head)
    rng = random.Random(0)
    reqs = [[rng.randrange(3, 380) for _ in range(n)] for n in (1, 40, 3, 64, 7, 7, 22)]
    enc = Encoder(model, max_batch=3, max_tokens=80, progress=False)
    assert enc.batches([len(r) for r in reqs]) == [[0, 2, 4], [5, 6, 1], [3]], "greedy by length, within limits"
    assert any(p.requires_grad for p in model.parameters())  # a model straight from from_pretrained
    assert enc.warmup() >= 0 and enc.runtime.stats()["footprint_bytes"] > 0, "the arena is planned up front"
    outs = enc.encode(reqs)
    key = "last_hidden_state" if head == "base" else "logits"
    with torch.inference_mode():
        for r, out in zip(reqs, outs):
            want = model(torch.tensor([r]))[key][0]
            assert out[key].shape == want.shape and _rel(out[key], want) < 1e-5
    assert enc.encode([]) == []
    text = Encoder(model, tokenizer=tokenizer, progress=False).encode(["hello world", "mixture of experts"])
    assert len(text) == 2
    with pytest.raises(ValueError, match="request 1 is empty"):
        enc.encode([[5], []])
    with pytest.raises(ValueError, match="got text"):
        enc.encode(["no tokenizer"])
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        enc.encode(reqs)


def test_encoder_rejects_token_ids_outside_the_vocabulary():
    from hf_scatter.turbo import Encoder

    enc = Encoder(tiny_bert(hidden=32, heads=2, intermediate=48, layers=1), progress=False)
    with pytest.raises(ValueError, match=r"request 1 has token id 384; the vocabulary has 384 ids \(0\.\.383\)"):
        enc.encode([[5], [7, 384, 3]])
    with pytest.raises(ValueError, match=r"request 0 has token id -1; the vocabulary has 384 ids"):
        enc.encode([torch.tensor([-1, 5])])


def test_encoder_calibrates_saves_and_reloads_its_cost_table(tmp_path, monkeypatch):
    from hf_scatter.turbo import Encoder
    from hf_scatter.turbo.scheduler import cost_table_path

    monkeypatch.setenv("HF_SCATTER_CACHE", str(tmp_path))
    model = tiny_bert(hidden=32, heads=2, intermediate=48, layers=1)
    enc = Encoder(model, progress=False)
    assert enc.scheduler is None
    scheduler = enc.calibrate(lengths=(8, 32), batches=(1, 4))
    assert cost_table_path(enc.cost_key()).exists()
    again = Encoder(model, progress=False)
    assert again.scheduler is not None and again.scheduler.table.ms == scheduler.table.ms, "reloaded on restart"
    outs = again.encode([[5, 6, 7]] * 5)
    assert len(outs) == 5 and all(torch.equal(o["last_hidden_state"], outs[0]["last_hidden_state"]) for o in outs)


def test_serving_simulation_advances_a_virtual_clock_by_each_batchs_real_time():
    from hf_scatter.bench.serve import simulate

    arrivals = np.array([0.0, 1.0, 1.5, 10.0])
    ran = []

    def execute(batch):
        ran.append(list(batch))
        return 2.0 * len(batch)

    free = lambda: 0.0  # noqa: E731  (scheduling takes no time)
    done = simulate(arrivals, [5, 5, 5, 5], execute, lambda queue: [[queue[0]]], free)  # FIFO, one at a time
    assert done.tolist() == [2.0, 4.0, 6.0, 12.0] and ran == [[0], [1], [2], [3]]
    ran.clear()
    done = simulate(arrivals, [5, 5, 5, 5], execute, lambda queue: [list(queue)], free)  # all that is queued
    assert ran == [[0], [1, 2], [3]] and done.tolist() == [2.0, 6.0, 6.0, 12.0]
    ticks = iter(range(100))
    slow = lambda: next(ticks) * 1e-3  # noqa: E731  (every decision takes 1 ms)
    done = simulate(arrivals, [5, 5, 5, 5], execute, lambda queue: [list(queue)], slow)
    assert done.tolist() == [3.0, 8.0, 8.0, 13.0], "the scheduler's own time is on the clock"


def test_ffn_runs_in_row_chunks_that_bound_the_arena(monkeypatch):
    from hf_scatter.turbo import unpadded

    model = tiny_bert(hidden=64, heads=4, intermediate=96)
    seqs = [torch.randint(3, 380, (n,)) for n in (70, 33, 90)]  # 193 tokens: the 256-token bucket
    with torch.inference_mode():
        want = [model(s[None]).last_hidden_state[0] for s in seqs]
        whole = UnpaddedRuntime(model)
        whole.run(pack_sequences(seqs))
        monkeypatch.setattr(unpadded, "FFN_CHUNK_ROWS", 48)
        chunked = UnpaddedRuntime(model)
        hidden, _ = chunked.run(pack_sequences(seqs))
    for h, w in zip(torch.split(hidden, [70, 33, 90]), want):
        assert _rel(h, w) < 1e-5
    size = lambda rt: next(r.nbytes for r in rt.planner.plans[256].records if r.name == "ffn.intermediate")  # noqa: E731
    assert size(chunked) == 48 * 96 * 4 and size(whole) == 256 * 96 * 4
