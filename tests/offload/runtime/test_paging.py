"""Weights through the device (runtime/paging.py): the resident/streamed split, pages per micro-batch, the
double buffer over the stages, routed expert streaming."""

import json

import pytest
import torch

import hf_scatter
from hf_scatter.offload import Policy
from hf_scatter.offload.families.registry import adapter_for
from hf_scatter.offload.runtime.paging import Layout, PageTable, WeightStore, WeightStreamer, split_layer
from hf_scatter.tiny import tiny_mixtral

from offload_cases import (  # noqa: F401 - the autouse fixture
    BUILDERS, OFFLOADED, fp32_exact, padded, requests, torch_kernels_on_cpu, vanilla_new_tokens,
)


@pytest.mark.parametrize("family", OFFLOADED)
def test_routed_streaming_fetches_only_the_chosen_experts_and_keeps_every_token(family, monkeypatch):
    check_routed_streaming(family, "cpu", monkeypatch)


def check_routed_streaming(family, device, monkeypatch):
    """Decode stages load without their streamed expert columns; each micro-batch's chosen experts arrive after
    its router. The columns of the experts no row chose are NaN (poisoned as each stage is entered), so
    reading one would change the tokens. 8 experts, top-2: one row fetches exactly 2 per layer and step."""
    model = BUILDERS[family](experts=8)
    reqs = requests()
    ids, mask = padded(reqs)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    first_alone = vanilla_new_tokens(model, reqs[:1], 6)[0]
    enter = WeightStreamer.enter

    def enter_poisoned(self, stage):
        weights = enter(self, stage)
        load = self.slot_load[self.current] if self.current is not None else None
        if load is not None and load.present == set():  # a routed stage, nothing fetched yet
            a, b = self.store.expert_spans[stage]
            self.store.slots[self.current][a:b].fill_(255)  # every float NaN (on the compute stream)
        return weights

    monkeypatch.setattr(WeightStreamer, "enter", enter_poisoned)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device=device, policy=Policy(3, 2, routed_experts=True),
                                   progress=False)
    if off.profile is not None:  # a saved profile would price the smaller batches again ("auto")
        off.expert_streaming = "routed"
    result = off.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict=True, progress=False)
    assert torch.equal(result.sequences, batched)
    k = off.dims.top_k
    assert result.stats["routed_batches"] == 3  # 7 requests in batches of 3, 3 and 1
    assert k <= result.stats["routed_experts_per_layer_step"] <= 3 * k
    one = off.generate(ids[:1, -len(reqs[0]):], max_new_tokens=6, return_dict=True, progress=False)
    assert one.tokens[0] == first_alone
    assert one.stats["routed_experts_per_layer_step"] == k
    off.expert_streaming = "all"  # every expert paged ahead: nothing fetched after routing, nothing poisoned
    every = off.generate(ids, attention_mask=mask, max_new_tokens=6, return_dict=True, progress=False)
    assert torch.equal(every.sequences, batched)
    assert every.stats["routed_batches"] == 0 and every.stats["routed_experts_fetched"] == 0
    with pytest.raises(ValueError, match="expert_streaming must be one of 'auto', 'routed', 'all'"):
        off.expert_streaming = "some"
    off.close()


def test_a_one_layer_model_keeps_its_whole_stages_and_reports_no_routed_batch():
    """Two stages in two slots never reload: decode reuses the prefill's whole stages, so nothing is fetched
    after routing and no batch is reported as routed."""
    model = tiny_mixtral(layers=1, experts=8)
    ids, mask = padded(requests((6, 9)))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 2, routed_experts=True),
                                   progress=False)
    result = off.generate(ids, attention_mask=mask, max_new_tokens=4, return_dict=True, progress=False)
    assert torch.equal(result.sequences, expected)
    assert result.stats["routed_batches"] == 0 and result.stats["routed_experts_fetched"] == 0
    assert "routed_experts_per_layer_step" not in result.stats


def test_routed_pages_skip_the_expert_columns_and_nothing_else():
    table = PageTable()
    table.add("post.o", (100,), torch.float32)
    table.add("streamed.gate_up", (8, 64), torch.float32)
    table.add("streamed.down", (8, 32), torch.float32)
    table.add("pre.qkv", (300,), torch.float32)
    a, b = table.span("streamed.")
    assert (a, b) == (table.entries["streamed.gate_up"].offset,
                      table.entries["streamed.down"].offset + table.entries["streamed.down"].nbytes)
    pages = table.pages(3, skip=(a, b))
    covered = sorted(pages)
    assert all(q[1] <= a or q[0] >= b for q in covered)  # nothing of the experts
    assert covered[0][0] == 0 and covered[-1][1] == table.nbytes
    assert sum(q[1] - q[0] for q in covered) == table.nbytes - (b - a)  # everything else, once
    assert table.span("resident.") is None
    interleaved = PageTable()
    for name in ("streamed.a", "post.o", "streamed.b"):
        interleaved.add(name, (4,), torch.float32)
    with pytest.raises(ValueError, match="not contiguous"):
        interleaved.span("streamed.")


def test_resident_and_streamed_parts_rebuild_every_layer():
    model = tiny_mixtral(intermediate=96)
    family = adapter_for(model)
    layout = Layout(family, 0.5)
    split = layout.splits[0]
    assert split.resident_bytes <= 0.5 * split.layer_bytes and 0 < split.columns < 96 and split.columns % 16 == 0
    store = WeightStore(layout, torch.device("cpu"))
    for stage in (1, 2):  # layer l = stage - 1: its post-attention part and experts, the next layer's QKV
        l = stage - 1
        table, start = store.stage_tables[stage], store.stage_offsets[stage]
        store.slots[stage % 2][:table.nbytes].copy_(store.host.tensor[start:start + table.nbytes])
        w = store.stage_weights(stage, stage % 2)
        resident, streamed = w.experts
        experts = model.model.layers[l].mlp.experts
        gate_up = experts.gate_up_proj.view(4, 2, 96, 64)
        assert torch.equal(torch.cat([resident["gate_up"], streamed["gate_up"]], dim=2), gate_up)
        assert torch.equal(torch.cat([resident["down"], streamed["down"]], dim=2), experts.down_proj)
        assert torch.equal(w.post["router"], model.model.layers[l].mlp.gate.weight)
        if stage < 2:
            attn = model.model.layers[stage].self_attn
            qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            assert torch.equal(w.pre["qkv"], qkv)
    # pages: equal byte ranges that tile the stage exactly
    table = PageTable()
    table.add("a", (1000,), torch.float32)
    table.add("b", (333, 3), torch.bfloat16)
    pages = table.pages(3)
    assert len(pages) == 3 and pages[0][0] == 0 and pages[-1][1] == table.nbytes
    assert all(p[1] == q[0] for p, q in zip(pages, pages[1:]))
    assert split_layer({"x": 100}, 10, 50, 0.0).resident_bytes == 0
    assert split_layer({"x": 100}, 10, 50, 1.0).columns == 50


def test_mxfp4_experts_split_on_whole_groups_of_32_and_their_parts_sum_to_the_layer():
    """MXFP4's down projection holds its input columns in groups of 32 under one scale: every resident or
    streamed part, and every tensor-parallel rank's share, is whole groups; the parts, run as experts, sum to
    the whole layer's experts; and the tokens at a split in the middle of the layer are generate's."""
    from hf_scatter.moe.routing import flatten_sort_count
    from hf_scatter.offload.families.sharding import Shard

    model = BUILDERS["gpt_oss_mxfp4"](intermediate=128)
    whole = adapter_for(model)
    columns = [Layout(whole, x / 20).splits[0].columns for x in range(21)]
    assert all(c % 32 == 0 for c in columns) and any(0 < c < 128 for c in columns), columns
    x = next(x / 20 for x, c in enumerate(columns) if 0 < c < 128)
    layout = Layout(whole, x)
    assert layout.splits[0].resident_bytes <= x * layout.splits[0].layer_bytes
    # the parts of layer 0 as the store holds them, and two ranks' shares, each run as experts
    store = WeightStore(layout, torch.device("cpu"))
    table, start = store.stage_tables[1], store.stage_offsets[1]
    store.slots[1][:table.nbytes].copy_(store.host.tensor[start:start + table.nbytes])
    parts = store.stage_weights(1, 1).experts
    ranks = [adapter_for(model, Shard(rank, 2)).shard_expert_tensors(model.model.layers[0]) for rank in (0, 1)]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 64, generator=g)
    experts = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(5)])
    gates = torch.rand(5, 2, generator=g)
    routing = flatten_sort_count(experts, 4, validate=False)
    mlp = lambda part: whole._experts(part, hidden, experts, gates, routing)  # noqa: E731
    full = mlp(whole.expert_tensors(model.model.layers[0]))
    for split in (parts, ranks):
        assert split[0]["down_blocks"].shape[2] * 32 + split[1]["down_blocks"].shape[2] * 32 == 128
        torch.testing.assert_close(mlp(split[0]) + mlp(split[1]), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="3 groups of 32 expert columns"):  # 48 columns a rank: not whole groups
        adapter_for(BUILDERS["gpt_oss_mxfp4"](intermediate=96), Shard(0, 2))
    reqs = requests()
    ids, mask = padded(reqs)
    want = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(3, 2, weights_gpu_fraction=x),
                                   progress=False)
    assert off.store.layout.splits[0].columns == layout.splits[0].columns
    assert torch.equal(off.generate(ids, attention_mask=mask, max_new_tokens=6, progress=False), want)


def test_one_weight_page_per_micro_batch_and_the_trace(tmp_path):
    model = tiny_mixtral(layers=3)
    ids, mask = padded(requests((6, 9, 4, 7)))
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), progress=False)
    path = tmp_path / "trace.json"
    result = off.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[], return_dict=True,
                          progress=False, trace=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    assert set(lanes) == {"GPU compute", "CPU attention", "H2D hidden", "D2H qkv", "H2D weights", "Driver"}
    spans = [e for e in events if e["ph"] == "X"]
    by_lane = {name: [e for e in spans if e["tid"] == tid] for name, tid in lanes.items()}
    assert all(by_lane[name] for name in lanes)
    # the issuing thread: where it waited (for attention, for a stage's pages) and how long it took to issue work
    driver = {" ".join(e["name"].split()[:2]) for e in by_lane["Driver"]}
    assert driver == {"wait attention", "wait stage", "issue post", "issue pre", "issue prefill", "wait prompt"}, driver
    # the prefill: one issue per chunk and stage (3 layers and the head), each inside the prefill's window
    assert sum(e["name"].startswith("issue prefill") for e in by_lane["Driver"]) == 2 * 4
    # 2 micro-batches: every stage arrives in 2 pages, once for the prefill and once for each of the 2 decode
    # steps; stage 0 once more, prefetched during the last stage for the next call
    stages = [int(e["name"].split()[1]) for e in by_lane["H2D weights"]]
    assert [stages.count(s) for s in range(4)] == [4 * 2, 3 * 2, 3 * 2, 3 * 2]
    summary = result.stats["trace"]
    assert summary["weight_transfer_s"] > 0
    # the prefill's window: its own spans inside it, the first decode attention after it
    prefill = [e for e in spans if e["name"].startswith("prefill")]
    decode_attention = [e for e in by_lane["CPU attention"] if not e["name"].startswith("store prompt")]
    ends = max(e["ts"] + e["dur"] for e in prefill) / 1e6
    assert 0 < summary["prefill_s"] <= summary["span_s"] and ends <= min(e["ts"] for e in spans) / 1e6 + \
        summary["prefill_s"] + 1e-9 <= min(e["ts"] for e in decode_attention) / 1e6 + 1e-9
    assert 0 < summary["prefill_busy_s"]["GPU compute"] <= summary["prefill_s"] + 1e-9
    assert 0 < summary["prefill_issue_s"] <= summary["prefill_s"] + 1e-9
    # the driver's issuing per micro-batch and decode stage (what the planner's launch cost is measured from): a
    # "pre" for each layer's attention input, a "post" for each layer's output, per step and micro-batch
    issue = summary["driver_issue_s"]
    assert issue["stages"] == {"pre": 2 * 2 * 3, "post": 2 * 2 * 3}
    posts = sorted(e["dur"] / 1e6 for e in by_lane["Driver"] if e["name"].startswith("issue post"))
    assert issue["post"] == pytest.approx((posts[5] + posts[6]) / 2, rel=1e-6) and issue["pre"] > 0


def test_a_wholly_resident_stage_takes_no_slot_so_the_next_one_streams_during_the_last(tmp_path):
    """Once the dense weights are resident, the first stage streams nothing: the stage after it is copied while
    the previous step's last stage computes (into the slot its predecessor freed), not after, so the link does
    not idle at every step's turn; and the tokens are the model's own."""
    model = tiny_mixtral(layers=3)
    ids, mask = padded(requests((6, 9, 4, 7)))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu",
                                   policy=Policy(4, 2, weights_gpu_fraction=0.1), progress=False)
    assert [t.nbytes > 0 for t in off.store.stage_tables] == [False, True, True, True]
    path = tmp_path / "trace.json"
    out = off.generate(ids, attention_mask=mask, max_new_tokens=4, progress=False, trace=str(path))
    assert torch.equal(out, expected)
    spans = sorted((e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"), key=lambda e: e["ts"])
    lanes = {e["args"]["name"]: e["tid"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "M"}
    for t in range(3):  # every decode step but the last is followed by another
        last_stage = next(i for i, e in enumerate(spans) if e["name"] == f"post L2 step {t} stage 3 mb 0")
        copied = [e["name"] for e in spans[:last_stage] if e["tid"] == lanes["H2D weights"]]
        assert copied[-1].startswith("stage 1 "), copied[-3:]


@pytest.mark.gpu
@pytest.mark.parametrize("family", OFFLOADED)
def test_routed_streaming_on_gpu(family, monkeypatch):
    fp32_exact()
    check_routed_streaming(family, "cuda", monkeypatch)
