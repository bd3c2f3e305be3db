"""Offloaded generation (CGOPipe): the same tokens as vanilla ``generate``, on the CPU stand-in and on the GPU;
request batching, the KV cache and CPU attention, paging, sampling, budgets, the trace, the public API."""

import json
import math

import pytest
import torch

import hf_scatter
from hf_scatter.offload import OffloadedModel, PlanError, Policy, plan_batches
from hf_scatter.offload.plan.attention_buckets import length_buckets
from hf_scatter.offload.runtime.cpu_attention import KVCache
from hf_scatter.offload.families.adapter import LayerAttention
from hf_scatter.offload.families.registry import adapter_for
from hf_scatter.offload.runtime.paging import Layout, PageTable, WeightStore, WeightStreamer, split_layer
from hf_scatter.tiny import TINY_BUILDERS, tiny_dbrx, tiny_mixtral



def with_random(model, suffixes: tuple[str, ...], scale: float = 0.1, seed: int = 1):
    """``model`` with every parameter or buffer ending in one of ``suffixes`` random (transformers starts biases
    at zero, which would hide a bias added twice or not at all)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(suffixes):
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * scale)
    return model


def tiny_gpt_oss_with_biases(**config):
    """GPT-OSS with every bias and attention sink random: sinks of the scale of a score, biases of a weight
    row's. Its tiny config has a sliding window of 8 on every other layer, shorter than most test prompts."""
    model = with_random(TINY_BUILDERS["gpt_oss"](**config), ("bias",))
    return with_random(model, ("sinks",), scale=1.0, seed=2)


def tiny_deepseek_v3_with_biases(**config):
    """DeepSeek-V3 with the attention's biases and the router's score-correction bias random (the bias moves the
    choice of experts only)."""
    model = TINY_BUILDERS["deepseek_v3"](attention_bias=True, **config)
    return with_random(with_random(model, ("proj.bias", "proj_with_mqa.bias")), ("e_score_correction_bias",),
                       scale=1.0, seed=3)


def tiny_deepseek_v2_lite_style(**config):
    """DeepSeek-V2 as V2-Lite has it: a full-rank query projection (no q_lora_rank); MLP biases random."""
    return with_random(TINY_BUILDERS["deepseek_v2"](q_lora_rank=None, mlp_bias=True, **config), ("bias",))


def tiny_qwen2_moe_windowed(**config):
    """Qwen2-MoE with a sliding window of 8 on its first layer (``layer_types``), q/k/v biases and the shared
    expert's gate random (transformers starts the biases at zero)."""
    model = TINY_BUILDERS["qwen2_moe"](use_sliding_window=True, sliding_window=8, max_window_layers=1, **config)
    assert model.config.layer_types[0] == "sliding_attention"
    return with_random(model, ("bias", "shared_expert_gate.weight"), scale=0.5)


def with_attention_biases(family, **preset):
    """``family`` with ``attention_bias`` set and the biases random (published Qwen3-MoE and OLMoE checkpoints have
    none, but their configs allow them)."""
    return lambda **config: with_random(TINY_BUILDERS[family](attention_bias=True, **preset, **config), ("bias",),
                                        scale=0.5)


# OLMoE with its clip_qkv set (published checkpoints leave it None), so the clamp after the q/k norms runs
BUILDERS = {**TINY_BUILDERS, "qwen3_moe": with_attention_biases("qwen3_moe"),
            "olmoe": with_attention_biases("olmoe", clip_qkv=0.3),
            "gpt_oss": tiny_gpt_oss_with_biases, "deepseek_v3": tiny_deepseek_v3_with_biases,
            "deepseek_v2": tiny_deepseek_v2_lite_style, "qwen2_moe": tiny_qwen2_moe_windowed,
            "granitemoe": with_attention_biases("granitemoe")}  # its tiny config: every multiplier away from 1
# the families with a pipeline adapter
OFFLOADED = ["mixtral", "dbrx", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3", "deepseek_v2", "qwen2_moe",
             "granitemoe"]


@pytest.fixture(autouse=True)
def torch_kernels_on_cpu(request, monkeypatch):
    """The kernels have their own interpreted tests; here the pipeline is under test, so the CPU stand-in
    runs their torch references (GPU tests keep the Triton kernels). Tiny models run fastest on one thread
    (several spin against each other and against the CPU attention worker on a small CI machine)."""
    if request.node.get_closest_marker("gpu") is not None:
        yield
        return
    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
LENS = (5, 17, 9, 30, 3, 12, 21)


def requests(lens=LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 384, (n,), generator=g) for n in lens]


def padded(reqs, side="left"):
    longest = max(len(r) for r in reqs)
    ids = torch.zeros(len(reqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(reqs):
        sl = slice(longest - len(r), longest) if side == "left" else slice(0, len(r))
        ids[i, sl] = r
        mask[i, sl] = 1
    return ids, mask


def vanilla_new_tokens(model, reqs, max_new_tokens, **kw):
    """Greedy tokens of each request alone (no padding anywhere): the reference."""
    out = []
    for r in reqs:
        seq = model.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, **kw)
        out.append(seq[0, len(r):].tolist())
    return out


def strip(tokens, pad=0, eos=None):
    """HF pads a finished row after its EOS: the generated part up to and including EOS."""
    if eos is not None and eos in tokens:
        return tokens[:tokens.index(eos) + 1]
    return tokens


# ----------------------------------------------------------------------------- equality with vanilla generate
@pytest.mark.parametrize("family", OFFLOADED)
@pytest.mark.parametrize("fraction", [0.0, 0.5, 1.0])
def test_greedy_tokens_equal_vanilla_generate_on_cpu(family, fraction):
    model = BUILDERS[family]()
    reqs = requests()
    ids, mask = padded(reqs)
    alone = vanilla_new_tokens(model, reqs, 10)
    # an end-of-sequence token that one request produces mid-way, so rows finish at different steps
    eos = alone[1][4]
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                             eos_token_id=eos)
    # 7 requests, batches of 3 in micro-batches of 2: three batches, several micro-batches, every stage paged
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu",
                             policy=Policy(3, 2, weights_gpu_fraction=fraction), progress=False)
    assert isinstance(off, OffloadedModel)
    if fraction:
        assert 0 < off.store.layout.fraction <= fraction
    if fraction == 1.0:  # nothing streams
        assert off.store.layout.fraction == 1.0 and off.store.layout.host_bytes == 0
    out = off.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, progress=False)
    assert torch.equal(out, batched)  # same shape, same tokens, pad after each row's EOS
    for i, r in enumerate(reqs):
        assert out[i, ids.shape[1]:].tolist()[:len(strip(alone[i], eos=eos))] == strip(alone[i], eos=eos)
    # the layers' weights moved into the store: the model keeps meta tensors only
    assert all(p.device.type == "meta" for p in model.parameters())


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
    off = hf_scatter.offload(model, gpu_memory="1GiB", device=device, policy=Policy(3, 2, routed_experts=True),
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
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 2, routed_experts=True),
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


def test_padding_side_and_prompts_with_a_tokenizer(tokenizer):
    model = tiny_mixtral(seed=3)
    texts = ["hello world", "The quick brown fox jumps over the lazy dog.", "tokens and layers, training"]
    reqs = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    alone = vanilla_new_tokens(model, reqs, 8)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), release_weights=False,
                             progress=False)
    ids, mask = padded(reqs, side="right")
    right = off.generate(ids, attention_mask=mask, max_new_tokens=8, progress=False, eos_token_id=[])
    assert [right[i, ids.shape[1]:].tolist() for i in range(len(reqs))] == alone  # positions ignore padding
    result = off.generate(prompts=texts, tokenizer=tokenizer, max_new_tokens=8, return_dict=True, progress=False,
                          eos_token_id=[])
    assert result.tokens == alone
    assert result.texts == tokenizer.batch_decode(alone, skip_special_tokens=True)
    assert result.sequences is None
    assert [t.request for t in result.timings] == [0, 1, 2]
    assert all(0 <= t.first_token_s <= t.finish_s and t.new_tokens == 8 for t in result.timings)
    assert result.stats["generated_tokens"] == 24 and result.stats["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="contiguous"):
        off.generate(torch.tensor([[5, 6, 7]]), attention_mask=torch.tensor([[1, 0, 1]]), progress=False)
    with pytest.raises(ValueError, match="either input_ids"):
        off.generate(progress=False)


def test_stop_strings_end_a_request(tokenizer):
    model = tiny_mixtral(seed=3)
    text = "The quick brown fox"
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(1, 1), release_weights=False,
                             progress=False)
    free = off.generate(prompts=[text], tokenizer=tokenizer, max_new_tokens=12, return_dict=True, progress=False,
                        eos_token_id=[])
    decoded = tokenizer.decode(free.tokens[0][:6])
    stop = decoded[-2:] if decoded[-2:].strip() else decoded[-3:]
    stopped = off.generate(prompts=[text], tokenizer=tokenizer, max_new_tokens=12, return_dict=True,
                           progress=False, eos_token_id=[], stop_strings=[stop])
    n = len(stopped.tokens[0])
    assert n < 12 and stopped.tokens[0] == free.tokens[0][:n]
    assert stop in tokenizer.decode(stopped.tokens[0]) and stop not in tokenizer.decode(stopped.tokens[0][:-1])


# ----------------------------------------------------------------------------- sampling
def test_sampling_is_reproducible_with_a_seed():
    model = tiny_dbrx(seed=1)
    ids, mask = padded(requests())
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), release_weights=False,
                             progress=False)
    greedy = off.generate(ids, attention_mask=mask, max_new_tokens=12, progress=False, eos_token_id=[])
    sample = lambda **kw: off.generate(ids, attention_mask=mask, max_new_tokens=12, progress=False,  # noqa: E731
                                       eos_token_id=[], do_sample=True, **kw)
    a, b, c = sample(seed=7), sample(seed=7), sample(seed=8)
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, greedy)
    # processors: top-k 1, or a tiny top-p, leave only the most likely token
    assert torch.equal(sample(seed=3, top_k=1), greedy)
    assert torch.equal(sample(seed=3, top_p=1e-6, temperature=0.7), greedy)
    with pytest.raises(ValueError, match="temperature"):
        sample(seed=1, temperature=0.0)


# ----------------------------------------------------------------------------- budgets and errors
def test_requests_that_cannot_fit_are_refused_with_their_index():
    model = tiny_mixtral()
    off = hf_scatter.offload(model, gpu_memory="1GiB", cpu_memory="4MiB", device="cpu", policy=Policy(4, 2),
                             release_weights=False, progress=False)
    # per token the KV cache takes 2 layers x 2 (K, V) x 32 x 4 bytes = 512 B; ~3.5 MiB are left after the weights
    reqs = [torch.randint(3, 384, (n,)) for n in (10, 20_000, 15)]
    with pytest.raises(PlanError, match=r"request 1 \(20000 prompt tokens"):
        off.generate(prompts=None, input_ids=padded(reqs)[0], attention_mask=padded(reqs)[1], max_new_tokens=4,
                     progress=False)
    with pytest.raises(PlanError, match="gpu_memory|GPU budget"):
        hf_scatter.offload(tiny_mixtral(), gpu_memory="64KiB", device="cpu", policy=Policy(4, 2), progress=False)
    with pytest.raises(ValueError, match="attention on the CPU"):
        hf_scatter.offload(tiny_mixtral(), device="cpu", policy=Policy(4, 2, attention_on_gpu=True), progress=False)
    with pytest.raises(ValueError, match="supports dbrx, deepseek_v2, deepseek_v3, gpt_oss, granitemoe, mixtral"):
        hf_scatter.offload(torch.nn.Linear(2, 2), device="cpu")


def test_batch_shrinks_to_what_host_memory_holds():
    model = tiny_mixtral()
    reqs = requests((40,) * 8)
    ids, mask = padded(reqs)
    alone = vanilla_new_tokens(model, reqs, 4)
    # KV of one request: (40 + 3) tokens x 512 B = 21.5 KiB; ~60 KiB of host memory left fits two at a time
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(8, 4), progress=False,
                             cpu_memory=Layout(adapter_for(model), 0.0).host_bytes + 60 * 1024)
    result = off.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], return_dict=True,
                          progress=False)
    assert result.stats["batch_size"] < 8 and result.stats["batches"] > 1
    assert result.tokens == alone


def test_offloading_a_model_whose_weights_were_released_is_refused_before_any_work():
    model = tiny_mixtral()
    first = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    with pytest.raises(ValueError, match="meta device") as err:
        hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    for fix in ("reload the model", "reuse the first offloadedmodel", "release_weights=false"):
        assert fix in str(err.value).lower()
    assert first.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, progress=False).shape == (1, 5)
    first.close()
    kept = tiny_mixtral()  # release_weights=False leaves the model whole: it can be offloaded again
    hf_scatter.offload(kept, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), release_weights=False,
                       progress=False).close()
    hf_scatter.offload(kept, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False).close()


def test_families_without_offloading_or_with_dense_layers_are_refused_before_any_work():
    with pytest.raises(ValueError, match="offloading supports .*qwen3_moe.* causal LMs; got model_type 'qwen3_next'"):
        hf_scatter.offload(TINY_BUILDERS["qwen3_next"](), device="cpu", progress=False)
    model = TINY_BUILDERS["qwen3_moe"](mlp_only_layers=[0])
    with pytest.raises(NotImplementedError, match=r"layers \[0\] of this qwen3_moe model hold a dense MLP"):
        hf_scatter.offload(model, device="cpu", progress=False)
    assert all(p.device.type == "cpu" for p in model.parameters()), "the model was touched"


def test_a_closed_offloaded_model_says_so():
    off = hf_scatter.offload(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    ids = torch.tensor([[5, 6, 7]])
    off.close()
    off.close()  # twice is harmless
    for run in (lambda: off.generate(ids, max_new_tokens=2, progress=False), lambda: off.logits(ids),
                off.memory, off.describe):
        with pytest.raises(RuntimeError, match=r"closed.*hf_scatter\.offload"):
            run()
    assert "closed" in repr(off)
    with hf_scatter.offload(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1),
                            progress=False) as off:
        off.generate(ids, max_new_tokens=2, progress=False)
    with pytest.raises(RuntimeError, match="closed"):
        off.generate(ids, max_new_tokens=2, progress=False)


@pytest.mark.parametrize("size, problem", [
    (float("inf"), "finite"), ("inf", "finite"), ("Infinity", "finite"), (float("nan"), "finite"), ("nan", "finite"),
    ("1e30GiB", "1 PiB"), (2**50 + 1, "1 PiB"), ("2048TiB", "1 PiB"), pytest.param(10**400, "1 PiB", id="10**400"),
    (-5, "positive"),
])
def test_sizes_must_be_finite_positive_and_below_a_pebibyte(size, problem):
    from hf_scatter.offload import parse_bytes

    with pytest.raises(ValueError, match=f"gpu_memory.*{problem}|{problem}.*gpu_memory"):
        parse_bytes(size, "gpu_memory")
    with pytest.raises(ValueError, match=f"cpu_memory.*{problem}|{problem}.*cpu_memory"):
        hf_scatter.offload(tiny_mixtral(), gpu_memory="1GiB", cpu_memory=size, device="cpu", policy=Policy(2, 1),
                           progress=False)


def test_a_pebibyte_is_still_a_size():
    from hf_scatter.offload import parse_bytes

    assert parse_bytes(2**50, "gpu_memory") == parse_bytes("1024TiB") == 2**50
    assert parse_bytes("1e3GB") == 10**12 and parse_bytes(1.5e9) == 1_500_000_000


# ----------------------------------------------------------------------------- model.generate's keywords
@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
def test_min_new_tokens_hold_back_eos_as_vanilla_generate_does(family):
    model = BUILDERS[family]()
    reqs = requests()
    ids, mask = padded(reqs)
    alone = vanilla_new_tokens(model, reqs, 8, eos_token_id=[])
    # EOS = what greedy picks at step 1 for request 0 and at step 0 (the prefill) for request 2: both would end early
    eos = [alone[0][1], alone[2][0]]
    kw = dict(max_new_tokens=8, eos_token_id=eos, pad_token_id=0)
    vanilla = model.generate(ids, attention_mask=mask, do_sample=False, min_new_tokens=5, **kw)
    free = model.generate(ids, attention_mask=mask, do_sample=False, **kw)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(3, 2, weights_gpu_fraction=0.5),
                             release_weights=False, progress=False)
    assert torch.equal(off.generate(ids, attention_mask=mask, min_new_tokens=5, progress=False, **kw), vanilla)
    assert torch.equal(off.generate(ids, attention_mask=mask, progress=False, **kw), free)
    start = ids.shape[1]
    assert free[0, start + 1].item() in eos and free[2, start].item() in eos  # the constraint bites
    assert vanilla[0, start + 1].item() not in eos and vanilla[2, start].item() not in eos


@pytest.mark.parametrize("family", ["mixtral", "dbrx"])
def test_repetition_penalty_and_no_repeat_ngram_equal_vanilla_generate(family, monkeypatch):
    """Each request against transformers generating it alone: the penalty and the n-grams see the request's own
    tokens, never padding (transformers' batched generate leaves left padding out in 5.23; 5.17 penalised it)."""
    from hf_scatter.offload.runtime import cgopipe

    model = BUILDERS[family](seed=4)
    reqs = requests(seed=1)
    ids, mask = padded(reqs)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), release_weights=False,
                             progress=False)
    # prefill chunks of part of a micro-batch, and the LM head one row at a time: every slice of the history
    monkeypatch.setattr(off.pipe, "chunk_tokens", 20)
    monkeypatch.setattr(cgopipe, "HEAD_ROWS", 1)
    greedy = vanilla_new_tokens(model, reqs, 12, eos_token_id=[])
    for kw in ({"repetition_penalty": 1.8}, {"repetition_penalty": 0.7}, {"no_repeat_ngram_size": 2},
               {"no_repeat_ngram_size": 1, "repetition_penalty": 1.3, "min_new_tokens": 3}):
        want = vanilla_new_tokens(model, reqs, 12, eos_token_id=[], **kw)
        assert want != greedy, kw  # the option changes what greedy picks
        got = off.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=[], return_dict=True,
                           progress=False, **kw)
        assert got.tokens == want, kw


def test_the_token_history_of_a_short_prompt_holds_only_its_own_tokens():
    """A prompt shorter than its micro-batch's longest is padded in the history; the processors must not see that
    padding (here [5, 6, 5] padded with 5s would make (5, 5) a seen bigram and ban 5 after the last 5)."""
    from transformers.generation.logits_process import NoRepeatNGramLogitsProcessor, RepetitionPenaltyLogitsProcessor

    from hf_scatter.offload.runtime.sampling import History, Sampling

    prompts = [torch.tensor([9, 9, 8, 9, 7, 9, 7]), torch.tensor([5, 6, 5])]
    history = History.of(prompts, 2, torch.device("cpu"))
    history.record(slice(None), 0, torch.tensor([3, 4]))
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(0))
    for sampling, hf in ((Sampling(no_repeat_ngram_size=2), NoRepeatNGramLogitsProcessor(2)),
                         (Sampling(repetition_penalty=1.5), RepetitionPenaltyLogitsProcessor(1.5))):
        for new in (0, 1):  # before the first token (the prompts' own ends) and after it
            got = sampling._process(logits, history.view(slice(None), new))
            for i, p in enumerate(prompts):
                want = hf(torch.cat([p, history.tokens[i, 7:7 + new]])[None], logits[i:i + 1])
                assert torch.equal(got[i:i + 1], want), (sampling, new, i)


def test_generation_config_fields_are_defaults_that_keywords_override():
    from transformers import GenerationConfig

    model = tiny_mixtral()
    reqs = requests()
    ids, mask = padded(reqs)
    eos = vanilla_new_tokens(model, reqs[:1], 2, eos_token_id=[])[0][1]
    config = GenerationConfig(max_new_tokens=6, min_new_tokens=3, eos_token_id=eos, pad_token_id=0, do_sample=False)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), release_weights=False,
                             progress=False)
    for kw in ({}, {"max_new_tokens": 4, "min_new_tokens": 0}):
        want = model.generate(ids, attention_mask=mask, generation_config=config, **kw)
        assert torch.equal(off.generate(ids, attention_mask=mask, generation_config=config, progress=False, **kw),
                           want), kw
    # the model's own generation config (use_cache, output_attentions=False, bos ...) is accepted as it is
    off.generate(ids, attention_mask=mask, generation_config=model.generation_config, max_new_tokens=2, progress=False)


def test_unsupported_generation_options_are_named_before_any_work():
    from transformers import GenerationConfig

    off = hf_scatter.offload(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    ids = torch.tensor([[5, 6, 7]])
    with pytest.raises(TypeError, match=r"num_beams.*supported.*min_new_tokens.*repetition_penalty"):
        off.generate(ids, num_beams=4, progress=False)
    with pytest.raises(TypeError, match=r"'output_scores', 'typo_keyword'"):
        off.generate(ids, typo_keyword=1, output_scores=True, progress=False)
    for field, fix in (("num_beams", 4), ("max_length", 30), ("min_length", 5), ("output_scores", True)):
        with pytest.raises(ValueError, match=f"generation_config.*{field}"):
            off.generate(ids, generation_config=GenerationConfig(**{field: fix}), progress=False)
    with pytest.raises(ValueError, match="max_new_tokens"):  # max_length's replacement is named
        off.generate(ids, generation_config=GenerationConfig(max_length=30), progress=False)
    with pytest.raises(TypeError, match="GenerationConfig"):
        off.generate(ids, generation_config={"max_new_tokens": 3}, progress=False)
    for bad in ({"repetition_penalty": 0.0}, {"repetition_penalty": float("nan")}, {"min_new_tokens": -1},
                {"no_repeat_ngram_size": 1.5}, {"min_new_tokens": True}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            off.generate(ids, progress=False, **bad)
    from hf_scatter.offload.runtime.sampling import Sampling

    assert not Sampling().uses_history  # no option, no token history: the decode step stays as it was
    assert not Sampling(min_new_tokens=3).uses_history  # no EOS to hold back
    assert Sampling(repetition_penalty=1.2).uses_history and Sampling(min_new_tokens=3, eos_token_ids=(2,)).uses_history
    off.close()


# ----------------------------------------------------------------------------- the pieces
def test_request_batching_balances_micro_batches_without_losing_requests():
    lens = [77, 3, 120, 40, 40, 9, 300, 64, 15, 88, 1, 52, 33]
    batches = plan_batches(lens, batch_size=6, micro_batch_size=2)
    assert [b.size for b in batches] == [6, 6, 1]
    seen = [r for b in batches for r in b.requests]
    assert sorted(seen) == list(range(len(lens)))
    # longest requests first: every request of batch 0 is at least as long as any of batch 1
    assert min(lens[r] for r in batches[0].requests) >= max(lens[r] for r in batches[1].requests)
    for b in batches:
        for mb in b.micro_batches:
            assert len(mb) <= 2 and list(mb.requests) == sorted(mb.requests, key=lambda r: -lens[r])
            assert mb.tokens == sum(lens[r] for r in mb.requests)
    # Algorithm 2 on one batch: 3 micro-batches of 4, tokens balanced (a plain split in sorted order: 30/14/4)
    one = plan_batches([9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 1], batch_size=12, micro_batch_size=4)[0]
    assert [len(mb) for mb in one.micro_batches] == [4, 4, 4]
    tokens = [mb.tokens for mb in one.micro_batches]
    assert sum(tokens) == 48 and max(tokens) - min(tokens) <= 2
    with pytest.raises(ValueError, match="empty prompt"):
        plan_batches([3, 0], 2, 1)


def reference_attention(q, k, v, window=None, sinks=None, scale=None):
    """float64, K/V expanded per query head: ``q`` [H, d] at the last of ``k``/``v``'s [S, Hkv, d] positions."""
    H, d = q.shape
    S = k.shape[0]
    k = k.double().repeat_interleave(H // k.shape[1], dim=1).transpose(0, 1)  # [H, S, d]
    v = v.double().repeat_interleave(H // v.shape[1], dim=1).transpose(0, 1)
    scale = 1 / math.sqrt(d) if scale is None else scale
    scores = (q.double().unsqueeze(1) @ k.transpose(1, 2)).squeeze(1) * scale  # [H, S]
    if window is not None:
        scores[:, :max(0, S - window)] = float("-inf")
    if sinks is not None:
        probs = torch.cat([scores, sinks.double()[:, None]], 1).softmax(-1)[:, :-1]
    else:
        probs = scores.softmax(-1)
    return (probs.unsqueeze(1) @ v).reshape(-1)


@pytest.mark.parametrize("window, with_sinks, latent", [
    (None, False, False), (7, False, False), (None, True, False), (7, True, False), (None, False, True)])
def test_cpu_attention_over_bucketed_cache_matches_plain_attention(window, with_sinks, latent):
    """``latent``: MLA's absorbed form, one KV head that is also the value (cached once) and its own scale."""
    torch.manual_seed(0)
    H, Hkv, d, layers = 4, (1 if latent else 2), 8, 2
    prompts, new = [30, 29, 26, 13, 12, 4], 5  # longest first
    sinks = torch.randn(H) * 2 if with_sinks else None
    scale = 0.3 if latent else None
    attention = [LayerAttention(), LayerAttention(window=window, sinks=sinks, scale=scale)]
    cache = KVCache([[(p, p + new - 1) for p in prompts]], layers, Hkv, d, H, torch.float32, attention=attention,
                    values_are_keys=latent)
    # the fewest buckets padded at most 1.25x: 34..30 (102 slots for 97 tokens) | 17..8 (51 for 41)
    assert [(b.start, b.end) for b in cache.buckets[0]] == [(0, 3), (3, 6)]
    keys = [torch.randn(p + new - 1, Hkv, d) for p in prompts]
    values = keys if latent else [torch.randn(p + new - 1, Hkv, d) for p in prompts]
    layer = 1
    kv = torch.cat([torch.cat([k[:p].reshape(p, -1)] + ([] if latent else [v[:p].reshape(p, -1)]), 1)
                    for k, v, p in zip(keys, values, prompts)])
    rows, a = [], 0
    for i, p in enumerate(prompts):
        rows.append((i, a, a + p))
        a += p
    cache.write_prompts(layer, 0, rows, kv)
    for step in range(new - 1):
        q = torch.randn(len(prompts), H, d)
        parts = [q, torch.stack([k[p + step] for k, p in zip(keys, prompts)])]
        if not latent:
            parts.append(torch.stack([v[p + step] for v, p in zip(values, prompts)]))
        qkv = torch.cat([t.reshape(len(prompts), -1) for t in parts], 1)
        out = torch.full((len(prompts), H * d), float("nan"))
        cache.attend(layer, 0, step, qkv, out)
        for i, p in enumerate(prompts):
            ref = reference_attention(q[i], keys[i][:p + step + 1], values[i][:p + step + 1], window, sinks, scale)
            torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5)
    planned = KVCache.planned_bytes([[(p, p + new - 1) for p in prompts]], layers, Hkv, d, 4, values_are_keys=latent)
    assert cache.nbytes == planned
    if latent:  # the keys, once
        assert planned == KVCache.planned_bytes([[(p, p + new - 1) for p in prompts]], layers, Hkv, d, 4) // 2
    assert length_buckets([10, 9, 8, 2]) == [(0, 3, 10), (3, 4, 2)]


@pytest.mark.parametrize("latent", [False, True])
def test_prompt_stores_land_in_each_rows_cache_slots(latent):
    """Prompts of equal length go in one copy per run; runs break at a chunk's edge and where prompts are not side
    by side in the token buffer. Every row's slots hold its own keys (and values), the
    slots past its prompt stay untouched."""
    torch.manual_seed(1)
    Hkv, d, new = 2, 4, 3
    prompts = [9, 9, 9, 9, 7, 7, 3, 3, 3]  # longest first; 1.25x slack puts the 3s in a bucket of their own
    cache = KVCache([[(p, p + new - 1) for p in prompts]], 2, Hkv, d, 4, torch.float32, values_are_keys=latent)
    assert len(cache.buckets[0]) >= 2
    width = (1 if latent else 2) * Hkv * d
    sources = {}
    # two chunks, the first ending inside the run of 9s; the second has a gap of garbage tokens between two rows
    chunks = [[0, 1], [2, 3, 4, 5, 6, 7, 8]]
    for rows in chunks:
        spans, a = [], 0
        for r in rows:
            if r == 7:
                a += 5  # tokens of no row, between two prompts of 3
            spans.append((r, a, a + prompts[r]))
            a += prompts[r]
        kv = torch.randn(a, width)
        cache.write_prompts(1, 0, spans, kv)
        sources.update({r: kv[x:y] for r, x, y in spans})
    for r, src in sources.items():
        bucket, i = cache.row_bucket[0][r]
        b, p = cache.buckets[0][bucket], prompts[r]
        torch.testing.assert_close(b.k[1, i, :, :p], src[:, :Hkv * d].view(p, Hkv, d).transpose(0, 1), rtol=0, atol=0)
        if not latent:
            torch.testing.assert_close(b.v[1, i, :, :p], src[:, Hkv * d:].view(p, Hkv, d).transpose(0, 1), rtol=0,
                                       atol=0)
        assert not b.k[1, i, :, p:].any() and not b.k[0].any()


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 2 ** -7)])
def test_fused_decode_with_sinks_matches_the_unfused_softmax(dtype, tol):
    """The fused decode path (SDPA's CPU kernel, then each head rescaled by its sink) against a float64 softmax with
    the sink column, over strided cache slices and a mask, odd sizes; in bf16 within 2^-7 (inputs and output
    each rounded at 2^-9, values of order one)."""
    from hf_scatter.offload.runtime import attention

    if attention._FUSED_WITH_LSE is None:
        pytest.skip("this torch build has no fused CPU attention returning the log-sum-exp")
    torch.manual_seed(3)
    n, H, Hkv, d, cap, S = 5, 6, 2, 16, 13, 11
    q = torch.randn(n, H, d, dtype=torch.float64)
    k_cache, v_cache = torch.randn(2, n, Hkv, cap, d, dtype=torch.float64)
    mask = torch.rand(n, S) > 0.3
    mask[:, -1] = True  # every row sees its own key
    sinks = torch.randn(H) * 2
    k = k_cache[:, :, 1:S + 1].repeat_interleave(H // Hkv, dim=1)  # [n, H, S, d]: query head h reads h // G
    v = v_cache[:, :, 1:S + 1].repeat_interleave(H // Hkv, dim=1)
    for m in (mask, None):
        scores = torch.einsum("nhd,nhsd->nhs", q, k) / math.sqrt(d)
        if m is not None:
            scores = scores.masked_fill(~m[:, None, :], float("-inf"))
        with_sink = torch.cat([scores, sinks.double().view(1, H, 1).expand(n, H, 1)], -1)
        ref = torch.einsum("nhs,nhsd->nhd", with_sink.softmax(-1)[..., :-1], v)
        out = attention.decode_attention(q.to(dtype), k_cache[:, :, 1:S + 1].to(dtype),
                                         v_cache[:, :, 1:S + 1].to(dtype), m, sinks)
        assert out.dtype == dtype and out.shape == (n, H, d)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("lens", [
    [11, 11, 6, 3],  # two prompts of one length share a call
    [12, 11, 10, 10, 9, 5, 4, 1],  # longest first: prompts of near lengths share a padded call
    [3, 9, 9, 5, 12],  # any order: a call per run of one length
])
@pytest.mark.parametrize("window, with_sinks", [(None, False), (5, False), (None, True), (5, True)])
@pytest.mark.parametrize("device, dtype, tol", [
    ("cpu", torch.float32, 1e-5),
    pytest.param("cuda", torch.bfloat16, 2e-2, marks=pytest.mark.gpu),  # bf16 output: 2^-8 relative, a few ulps
])
def test_prompt_attention_with_windows_and_sinks_matches_the_reference(window, with_sinks, lens, device, dtype, tol):
    """The prefill's attention within each prompt of a chunk (fused where no window cuts a prompt, else in blocks
    of queries small enough that the sink path takes several: max_score_bytes), against float64 attention of
    every position of the same inputs."""
    from hf_scatter.offload.families.adapter import Dims
    from hf_scatter.offload.runtime.attention import prompt_attention

    torch.manual_seed(0)
    H, Hkv, d = 4, 2, 8
    dims = Dims(name="t", family="t", hidden=32, layers=1, heads=H, kv_heads=Hkv, head_dim=d, intermediate=8,
                experts=2, top_k=1, vocab=8)
    rows, a = [], 0
    for i, p in enumerate(lens):
        rows.append((i, a, a + p))
        a += p
    qkv = torch.randn(a, dims.qkv_dim).to(dtype)
    sinks = torch.randn(H) * 2 if with_sinks else None
    on = None if sinks is None else sinks.to(device)
    out = prompt_attention(qkv.to(device), rows, dims, LayerAttention(window=window, sinks=sinks), on,
                           max_score_bytes=4 * H * 11 * 2 * 3).cpu()  # 3 queries a block
    for _, a, b in rows:
        q = qkv[a:b, :H * d].view(-1, H, d)
        k = qkv[a:b, H * d:(H + Hkv) * d].view(-1, Hkv, d)
        v = qkv[a:b, (H + Hkv) * d:].view(-1, Hkv, d)
        for t in range(b - a):
            ref = reference_attention(q[t], k[:t + 1], v[:t + 1], window, sinks)
            torch.testing.assert_close(out[a + t].double(), ref, rtol=tol, atol=tol)


def test_prompt_calls_pad_near_lengths_together_within_the_slack():
    """A chunk's prompts (longest first) go in fewer attention calls than it has lengths, each call padded to
    at most 1.25x its real tokens, every real token gathered once and scattered back to its own place."""
    from hf_scatter.offload.runtime.attention import prompt_calls

    lens = [40, 38, 37, 37, 30, 29, 12, 11, 11, 2]
    rows, a = [], 0
    for i, p in enumerate(lens):
        rows.append((i, a, a + p))
        a += p
    calls = prompt_calls(rows)
    assert len(calls) < len(set(lens))
    assert [c.start for c in calls] == sorted(c.start for c in calls) and calls[-1].end == a
    covered = []
    for c in calls:
        real = c.end - c.start
        assert c.count * c.length <= 1.25 * real
        if c.gather is None:
            covered += list(range(c.start, c.end))
            continue
        assert c.gather.shape == (c.count * c.length,) and c.scatter.shape == (real,)
        assert c.gather[c.scatter].tolist() == list(range(c.start, c.end))  # each token lands on itself
        covered += c.gather[c.scatter].tolist()
    assert covered == list(range(a))


def test_cublas_workspace_is_reserved_as_pytorch_sizes_it():
    from hf_scatter.offload.runtime.memory import cublas_workspace_bytes, cublas_workspace_size

    assert cublas_workspace_size("", 9) == 32 * 2**20  # Hopper's default
    assert cublas_workspace_size("", 8) == (4096 * 2 + 16 * 8) * 1024
    assert cublas_workspace_size(":4096:8", 8) == 32 * 2**20 and cublas_workspace_size(":16:8:4096:1", 9) == 4224 * 1024
    assert cublas_workspace_bytes("cpu") == 0
    off = hf_scatter.offload(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    assert off.memory()["device"]["cuBLAS workspace"] == 0


def test_length_buckets_are_the_cheapest_partition_within_the_padding_bound():
    import itertools
    import random

    rng = random.Random(0)
    for trial in range(60):
        caps = sorted((rng.randint(1, 40) for _ in range(rng.randint(1, 8))), reverse=True)
        call_s, token_s, slack = rng.choice([0.0, 1.0, 5.0]), rng.choice([0.0, 0.1, 1.0]), rng.choice([0.0, 0.25, 1.0])
        got = length_buckets(caps, slack, call_s, token_s)
        assert [s for s, _, _ in got] == [0] + [e for _, e, _ in got[:-1]] and got[-1][1] == len(caps)
        assert all(cap == caps[s] for s, _, cap in got)

        def cost(ranges):
            if any((e - s) * caps[s] > (1 + slack) * sum(caps[s:e]) + 1e-9 for s, e in ranges):
                return math.inf
            return sum(call_s + token_s * (e - s) * caps[s] for s, e in ranges)

        best = min(cost(list(zip((0,) + cut, cut + (len(caps),))))
                   for r in range(len(caps)) for cut in itertools.combinations(range(1, len(caps)), r))
        assert cost([(s, e) for s, e, _ in got]) == pytest.approx(best), (caps, call_s, token_s, slack, got)
    with pytest.raises(ValueError, match="longest first"):
        length_buckets([1, 2])


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


def test_one_weight_page_per_micro_batch_and_the_trace(tmp_path):
    model = tiny_mixtral(layers=3)
    ids, mask = padded(requests((6, 9, 4, 7)))
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), progress=False)
    path = tmp_path / "trace.json"
    result = off.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=[], return_dict=True,
                          progress=False, trace=str(path))
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    assert set(lanes) == {"GPU compute", "CPU attention", "H2D hidden", "D2H qkv", "H2D weights"}
    spans = [e for e in events if e["ph"] == "X"]
    by_lane = {name: [e for e in spans if e["tid"] == tid] for name, tid in lanes.items()}
    assert all(by_lane[name] for name in lanes)
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


def test_a_wholly_resident_stage_takes_no_slot_so_the_next_one_streams_during_the_last(tmp_path):
    """Once the dense weights are resident, the first stage streams nothing: the stage after it is copied while
    the previous step's last stage computes (into the slot its predecessor freed), not after, so the link does
    not idle at every step's turn; and the tokens are the model's own."""
    model = tiny_mixtral(layers=3)
    ids, mask = padded(requests((6, 9, 4, 7)))
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2, weights_gpu_fraction=0.1),
                             progress=False)
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


def test_offload_from_a_checkpoint_path(tmp_path):
    model = tiny_dbrx(seed=2)
    model.save_pretrained(tmp_path)
    reqs = requests((8, 3, 14))
    ids, mask = padded(reqs)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    off = hf_scatter.offload(str(tmp_path), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    assert torch.equal(off.generate(ids, attention_mask=mask, max_new_tokens=6, progress=False), expected)


def test_hf_scatter_offload_is_callable_and_still_the_subpackage():
    assert callable(hf_scatter.offload)
    from hf_scatter.offload import offload, search_policy

    assert hf_scatter.offload.search_policy is search_policy and hf_scatter.offload.offload is offload
    model = tiny_dbrx()
    off = hf_scatter.offload(model, "1GiB", device="cpu", profile="h100-host-anchors", progress=False,
                             release_weights=False)
    assert off.policy.prediction is not None  # planned by the HRM
    assert (off.policy.attention_on_gpu, off.policy.experts_on_gpu) == (False, True)
    assert "weights on the device" in off.describe() and "OffloadedModel(dbrx" in repr(off)
    off.close()


# ----------------------------------------------------------------------------- GPU
def _fp32_exact():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


@pytest.mark.gpu
@pytest.mark.parametrize("family", OFFLOADED)
def test_greedy_tokens_equal_vanilla_generate_on_gpu(family):
    _fp32_exact()
    model = BUILDERS[family]()
    reqs = requests()
    ids, mask = padded(reqs)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    # the logits processors on the device: EOS held back, and a penalty and n-grams over each row's history
    eos = batched[0, ids.shape[1] + 1].item()
    held = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=eos, min_new_tokens=4)
    penalised = vanilla_new_tokens(model, reqs, 6, eos_token_id=[], repetition_penalty=1.5, no_repeat_ngram_size=2)
    off = hf_scatter.offload(model, gpu_memory="256MiB", device="cuda",
                             policy=Policy(4, 2, weights_gpu_fraction=0.5), progress=False)
    assert off.store.host.pinned and off.store.host.tensor.is_pinned()
    out = off.generate(ids, attention_mask=mask, max_new_tokens=10, progress=False)
    assert torch.equal(out, batched)
    assert torch.equal(off.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, min_new_tokens=4,
                                    progress=False), held)
    assert off.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], repetition_penalty=1.5,
                        no_repeat_ngram_size=2, return_dict=True, progress=False).tokens == penalised
    a = off.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, seed=5, progress=False)
    b = off.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, seed=5, progress=False)
    assert torch.equal(a, b)
    off.close()


@pytest.mark.gpu
@pytest.mark.parametrize("family", OFFLOADED)
def test_routed_streaming_on_gpu(family, monkeypatch):
    _fp32_exact()
    check_routed_streaming(family, "cuda", monkeypatch)


@pytest.mark.gpu
def test_gpu_memory_stays_within_the_budget_and_transfers_overlap(tmp_path):
    """A bf16 model of ~0.4 GB in a 192 MiB budget (32 of them cuBLAS's workspace on Hopper): most of every
    layer streams through the double buffer."""
    model = tiny_mixtral(hidden=512, intermediate=2048, experts=8, top_k=2, heads=8, kv_heads=2, layers=8,
                         vocab=2048, dtype=torch.bfloat16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 192 * 2**20
    assert weights > 2 * budget
    reqs = [torch.randint(3, 2048, (n,)) for n in torch.randint(20, 120, (48,)).tolist()]
    ids, mask = padded(reqs)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    off = hf_scatter.offload(model, gpu_memory=budget, device="cuda", policy=Policy(32, 8, weights_gpu_fraction=0.1),
                             progress=False)
    assert 0 < off.store.layout.fraction <= 0.1
    result = off.generate(ids, attention_mask=mask, max_new_tokens=16, return_dict=True, progress=False,
                          trace=str(tmp_path / "trace.json"))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak <= budget, f"peak {peak / 2**20:.1f} MiB > budget {budget / 2**20:.0f} MiB"
    assert result.stats["batches"] == 2 and len(result.tokens) == 48
    trace = result.stats["trace"]
    assert trace["weight_transfer_overlap"] > 0.3, trace  # copies run while the GPU or the CPU computes
    off.close()


@pytest.mark.gpu
@pytest.mark.parametrize("model, layers", [("mixtral-8x7b", 3), ("gpt-oss-20b", 4)])
def test_bench_offload_end_to_end_small(tmp_path, model, layers):
    from hf_scatter.cli import main

    out, png, trace = tmp_path / "offload.json", tmp_path / "offload.png", tmp_path / "trace.json"
    assert main(["bench", "offload", "--model", model, "--layers", str(layers), "--new-tokens", "4", "--requests",
                 "64", "--gpu-memory", "8GiB", "--profile", "h100-host-anchors", "--trace", str(trace), "--out",
                 str(out), "--plot", str(png), "--validate-tokens", "0"]) == 0
    report = json.loads(out.read_text())
    assert report["model"] == model and report["within_budget"] and report["accelerate"]["layers_on_gpu"] < layers
    assert report["hf_scatter"]["tokens_per_s"] > 0 and report["accelerate"]["tokens_per_s"] > 0
    assert png.stat().st_size > 0 and trace.stat().st_size > 0


def test_routed_sweep_rows_render_as_a_table_and_a_plot(tmp_path):
    """The bench's routed sweep on the CPU stand-in: one row per batch size, both ways on one weight store, with
    the HRM's prediction; one row of a top-2 model fetches 2 experts per layer and step."""
    from hf_scatter.bench import offload as bench
    from hf_scatter.offload import ModelSpec, load_profile

    model = BUILDERS["qwen3_moe"](experts=8)
    spec = ModelSpec.from_config(model.config, dtype_bytes=4)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 4), progress=False)
    prof = load_profile("h100-host-anchors")
    reqs = requests((5, 9, 7, 4))
    rows = [bench.routed_row(off, reqs[:n], prof, spec, 2**30, 3) for n in (1, 4)]
    off.close()
    assert [r["batch_size"] for r in rows] == [1, 4]
    assert rows[0]["routed"]["experts_per_layer_step"] == 2 and rows[0]["all"]["experts_per_layer_step"] is None
    assert 2 <= rows[1]["routed"]["experts_per_layer_step"] <= 8
    assert rows[0]["expected_experts"] == pytest.approx(2.0)
    for r in rows:
        assert r["routed"]["predicted_layer_s"] > 0 and r["hrm_choice"] in ("routed", "all")
    report = {"model": "qwen3-30b-a3b", "layers": 2, "published_layers": 48, "gpu_budget": 2**30, "device": "cpu",
              "weights_gpu_fraction": 0.0, "experts": 8, "top_k": 2, "routed_sweep": rows}
    text = bench.to_markdown(report)
    assert "| rows N | experts fetched per layer (of 8): measured / uniform |" in text and "| 1 | 2.0 / 2.0 |" in text
    png = tmp_path / "routed.png"
    bench.plot(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="--routed-batches 64 exceeds --requests 8"):
        bench.check_flags(model="qwen3-30b-a3b", layers=2, routed_batches=[1, 64], requests=8)


@pytest.mark.gpu
def test_bench_offload_routed_sweep_small(tmp_path):
    from hf_scatter.cli import main

    out, png = tmp_path / "routed.json", tmp_path / "routed.png"
    assert main(["bench", "offload", "--model", "qwen3-30b-a3b", "--layers", "2", "--new-tokens", "4", "--requests",
                 "8", "--routed-batches", "1,8", "--gpu-memory", "8GiB", "--profile", "h100-host-anchors", "--out",
                 str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    one, eight = report["routed_sweep"]
    assert one["routed"]["experts_per_layer_step"] == 8 and one["batch_size"] == 1  # top-8: one row, 8 experts
    assert 8 < eight["routed"]["experts_per_layer_step"] <= 64
    assert png.stat().st_size > 0


@pytest.mark.parametrize("family", OFFLOADED)
def test_logits_of_every_position_equal_the_models_own(family):
    """What a log-likelihood evaluation reads: fp32 logits through the offloaded pipeline, padded rows too."""
    model = BUILDERS[family]()
    reqs = requests()
    ids, mask = padded(reqs, side="right")
    with torch.no_grad():
        want = [model(r.unsqueeze(0)).logits[0] for r in reqs]
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(3, 2, weights_gpu_fraction=0.5),
                             release_weights=False, progress=False)
    got = off.logits(ids, attention_mask=mask)
    assert got.shape == (*ids.shape, model.config.vocab_size) and got.dtype == torch.float32
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i, :len(r)], want[i], rtol=1e-5, atol=1e-5)
        assert not got[i, len(r):].any(), "padded positions stay zero"
    # the same pipeline still generates afterwards (the weight stream's stage order is kept)
    sequence = off.generate(ids[:1, :len(reqs[0])], max_new_tokens=3, progress=False)[0]
    assert sequence[len(reqs[0]):].tolist() == vanilla_new_tokens(model, reqs[:1], 3)[0]


def test_a_sliding_window_on_every_layer_holds_in_prefill_and_decode():
    """Mixtral's config-wide sliding_window (shorter than the prompts here): logits of every position, and greedy
    tokens past the window, as the model's own."""
    model = tiny_mixtral(sliding_window=6)
    reqs = requests()
    with torch.no_grad():
        want = [model(r.unsqueeze(0)).logits[0] for r in reqs]
    alone = vanilla_new_tokens(model, reqs, 10)
    off = hf_scatter.offload(model, gpu_memory="1GiB", device="cpu", policy=Policy(3, 2, weights_gpu_fraction=0.5),
                             release_weights=False, progress=False)
    assert {a.window for a in off.pipe.attention} == {6}
    got = off.logits(*padded(reqs, side="right"))
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i, :len(r)], want[i], rtol=1e-5, atol=1e-5)
    assert off.generate(*padded(reqs), max_new_tokens=10, return_dict=True, progress=False).tokens == alone


def test_prefill_chunks_are_not_shrunk_by_a_large_vocabulary():
    """The LM head's slice is the same for every chunk: with Qwen3's 152k vocabulary it took a quarter of 1.4 GiB
    of activations by itself and left 256-token chunks (measured: prefill 47 s against 0.5 s planned)."""
    from hf_scatter.common.shapes import builtin_config
    from hf_scatter.offload.families.adapter import Dims
    from hf_scatter.offload.runtime.memory import (_chunk_tokens, head_bytes, prefill_bytes, stage_bytes,
                                                   workspace_bytes)

    d = Dims.of(builtin_config("qwen3-30b-a3b", num_hidden_layers=24), None)
    available = int(1.39 * 2**30)
    chunk = _chunk_tokens(d, 1024, available, 2)
    assert chunk == 2048 and workspace_bytes(d, 512, 2) > available // 4  # head included, 512 was too many
    assert stage_bytes(d, chunk, 2) <= (available - head_bytes(d, chunk, 2)) // 4
    assert prefill_bytes(d, 1024, chunk, chunk, 2) <= available
