"""Offloaded generation (CGOPipe) as a user calls it: the same tokens as vanilla ``generate`` for every family, on
the CPU stand-in and on the GPU; options, refusals, logits, checkpoints, the public API and the bench."""

import json

import pytest
import torch

import hf_scatter
from hf_scatter.offload import OffloadedModel, Policy
from hf_scatter.tiny import TINY_BUILDERS, tiny_dbrx, tiny_mixtral

from offload_cases import (  # noqa: F401 - the autouse fixture
    BUILDERS, OFFLOADED, fp32_exact, padded, requests, strip, torch_kernels_on_cpu, vanilla_new_tokens,
)


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
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu",
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


@pytest.mark.parametrize("fraction", [0.0, 0.5])
def test_a_micro_batch_starts_its_next_step_while_the_others_finish_their_last_layer(tmp_path, fraction):
    """Where the first stage's weights stay resident, a micro-batch's layer 0 of the next step is issued right after
    its token is chosen, before the next micro-batch's last layer (so the CPU attends it meanwhile); where they
    stream, that stage waits for the others. Either way the tokens are vanilla's, also when every row stops early
    with a step already issued."""
    model = tiny_mixtral(seed=5)
    reqs = requests()[:4]
    ids, mask = padded(reqs)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", release_weights=False,
                                   policy=Policy(4, 2, weights_gpu_fraction=fraction), progress=False)
    resident = off.pipe.streamer.resident(0) is not None
    assert resident == (fraction > 0)
    trace = tmp_path / "trace.json"
    out = off.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[], progress=False, trace=str(trace))
    assert torch.equal(out, model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                                           pad_token_id=0, eos_token_id=None))
    start = {e["name"]: e["ts"] for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"}
    last = model.config.num_hidden_layers
    next_first = start["pre L0 step 1 stage 0 mb 0"]
    other_last = start[f"post L{last - 1} step 0 stage {last} mb 1"]
    assert (next_first < other_last) == resident
    # every row stops at its second token: the loop ends with step 2's first stage already issued
    second = {row[1] for row in out[:, ids.shape[1]:].tolist()}
    stopped = off.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=sorted(second), progress=False)
    assert torch.equal(stopped, model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                               pad_token_id=0, eos_token_id=sorted(second)))
    off.close()


def test_padding_side_and_prompts_with_a_tokenizer(tokenizer):
    model = tiny_mixtral(seed=3)
    texts = ["hello world", "The quick brown fox jumps over the lazy dog.", "tokens and layers, training"]
    reqs = [torch.tensor(tokenizer(t)["input_ids"]) for t in texts]
    alone = vanilla_new_tokens(model, reqs, 8)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), release_weights=False,
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


def test_offloading_a_model_whose_weights_were_released_is_refused_before_any_work():
    model = tiny_mixtral()
    first = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    with pytest.raises(ValueError, match="meta device") as err:
        hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    for fix in ("reload the model", "reuse the first offloadedmodel", "release_weights=false"):
        assert fix in str(err.value).lower()
    assert first.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, progress=False).shape == (1, 5)
    first.close()
    kept = tiny_mixtral()  # release_weights=False leaves the model whole: it can be offloaded again
    hf_scatter.offload_model(kept, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), release_weights=False,
                             progress=False).close()
    hf_scatter.offload_model(kept, gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False).close()


def test_families_without_offloading_or_with_dense_layers_are_refused_before_any_work():
    with pytest.raises(ValueError, match="offloading supports .*qwen3_moe.* causal LMs; got model_type 'qwen3_next'"):
        hf_scatter.offload_model(TINY_BUILDERS["qwen3_next"](), device="cpu", progress=False)
    model = TINY_BUILDERS["qwen3_moe"](mlp_only_layers=[0])
    with pytest.raises(NotImplementedError, match=r"layers \[0\] of this qwen3_moe model hold a dense MLP"):
        hf_scatter.offload_model(model, device="cpu", progress=False)
    assert all(p.device.type == "cpu" for p in model.parameters()), "the model was touched"


def test_a_closed_offloaded_model_says_so():
    off = hf_scatter.offload_model(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    ids = torch.tensor([[5, 6, 7]])
    off.close()
    off.close()  # twice is harmless
    for run in (lambda: off.generate(ids, max_new_tokens=2, progress=False), lambda: off.logits(ids),
                off.memory, off.describe):
        with pytest.raises(RuntimeError, match=r"closed.*hf_scatter\.offload"):
            run()
    assert "closed" in repr(off)
    with hf_scatter.offload_model(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1),
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
        hf_scatter.offload_model(tiny_mixtral(), gpu_memory="1GiB", cpu_memory=size, device="cpu", policy=Policy(2, 1),
                                 progress=False)


def test_a_pebibyte_is_still_a_size():
    from hf_scatter.offload import parse_bytes

    assert parse_bytes(2**50, "gpu_memory") == parse_bytes("1024TiB") == 2**50
    assert parse_bytes("1e3GB") == 10**12 and parse_bytes(1.5e9) == 1_500_000_000


def test_generation_config_fields_are_defaults_that_keywords_override():
    from transformers import GenerationConfig

    model = tiny_mixtral()
    reqs = requests()
    ids, mask = padded(reqs)
    eos = vanilla_new_tokens(model, reqs[:1], 2, eos_token_id=[])[0][1]
    config = GenerationConfig(max_new_tokens=6, min_new_tokens=3, eos_token_id=eos, pad_token_id=0, do_sample=False)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 2), release_weights=False,
                                   progress=False)
    for kw in ({}, {"max_new_tokens": 4, "min_new_tokens": 0}):
        want = model.generate(ids, attention_mask=mask, generation_config=config, **kw)
        assert torch.equal(off.generate(ids, attention_mask=mask, generation_config=config, progress=False, **kw),
                           want), kw
    # the model's own generation config (use_cache, output_attentions=False, bos ...) is accepted as it is
    off.generate(ids, attention_mask=mask, generation_config=model.generation_config, max_new_tokens=2, progress=False)


def test_unsupported_generation_options_are_named_before_any_work():
    from transformers import GenerationConfig

    off = hf_scatter.offload_model(tiny_mixtral(), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
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


def test_offload_from_a_checkpoint_path(tmp_path):
    model = tiny_dbrx(seed=2)
    model.save_pretrained(tmp_path)
    reqs = requests((8, 3, 14))
    ids, mask = padded(reqs)
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    off = hf_scatter.offload_model(str(tmp_path), gpu_memory="1GiB", device="cpu", policy=Policy(2, 1), progress=False)
    assert torch.equal(off.generate(ids, attention_mask=mask, max_new_tokens=6, progress=False), expected)


def test_offload_model_is_a_plain_function_and_offload_a_plain_package():
    """``hf_scatter.offload_model`` is the function to call and ``hf_scatter.offload`` the subpackage, a plain
    module (not callable); the function's earlier name still imports from it."""
    import types

    from hf_scatter.offload import offload, offload_model, search_policy

    assert isinstance(hf_scatter.offload_model, types.FunctionType) and hf_scatter.offload_model is offload_model
    assert hf_scatter.offload.search_policy is search_policy and hf_scatter.offload.offload is offload is offload_model
    assert type(hf_scatter.offload) is types.ModuleType and not callable(hf_scatter.offload)
    model = tiny_dbrx()
    off = hf_scatter.offload_model(model, "1GiB", device="cpu", profile="h100-host-anchors", progress=False,
                                   release_weights=False)
    assert off.policy.prediction is not None  # planned by the HRM
    assert (off.policy.attention_on_gpu, off.policy.experts_on_gpu) == (False, True)
    assert "weights on the device" in off.describe() and "OffloadedModel(dbrx" in repr(off)
    off.close()


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("family", OFFLOADED)
def test_greedy_tokens_equal_vanilla_generate_on_gpu(family):
    fp32_exact()
    model = BUILDERS[family]()
    reqs = requests()
    ids, mask = padded(reqs)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    # the logits processors on the device: EOS held back, and a penalty and n-grams over each row's history
    eos = batched[0, ids.shape[1] + 1].item()
    held = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0,
                          eos_token_id=eos, min_new_tokens=4)
    penalised = vanilla_new_tokens(model, reqs, 6, eos_token_id=[], repetition_penalty=1.5, no_repeat_ngram_size=2)
    off = hf_scatter.offload_model(model, gpu_memory="256MiB", device="cuda",
                                   policy=Policy(4, 2, weights_gpu_fraction=0.5), progress=False)
    assert off.store.host.pinned and off.store.host.tensor.is_pinned()
    out = off.generate(ids, attention_mask=mask, max_new_tokens=10, return_dict=True, progress=False)
    assert torch.equal(out.sequences, batched)
    # from the third step on, every decode stage of both micro-batches replays a CUDA graph
    assert out.stats["graph_replays"] >= 2 * 2 * model.config.num_hidden_layers * (10 - 3)
    assert torch.equal(off.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, min_new_tokens=4,
                                    progress=False), held)
    assert off.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[], repetition_penalty=1.5,
                        no_repeat_ngram_size=2, return_dict=True, progress=False).tokens == penalised
    a = off.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, seed=5, progress=False)
    b = off.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, seed=5, progress=False)
    assert torch.equal(a, b)
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


@pytest.mark.gpu
@pytest.mark.parametrize("model,shipped,gpu_memory,share", [("gpt-oss-20b", "mxfp4", "6GiB", 0.4),
                                                            ("qwen3-30b-a3b", "fp8", "4GiB", 0.6)])
def test_bench_offload_formats_small(tmp_path, model, shipped, gpu_memory, share):
    """Experts as shipped (GPT-OSS's MXFP4, Qwen3-FP8's block-scaled FP8) against bf16, side by side in one budget:
    each run within it, the quantized layers hold about a quarter (MXFP4) or half (FP8) of the bytes, the ratio is
    reported, and the whole model's plan fits the host as shipped."""
    from hf_scatter.cli import main

    out, png = tmp_path / "formats.json", tmp_path / "formats.png"
    assert main(["bench", "offload", "--model", model, "--layers", "3", "--new-tokens", "4", "--requests", "32",
                 "--weights", shipped, "bf16", "--gpu-memory", gpu_memory, "--cpu-memory", "48GiB", "--profile",
                 "h100-host-anchors", "--out", str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    quantized, bf16 = report["by_weights"][shipped], report["by_weights"]["bf16"]
    assert quantized["expert_format"] == shipped and bf16["expert_format"] == "bf16"
    assert quantized["within_budget"] and bf16["within_budget"]
    stored = quantized["streamed_bytes"] + quantized["resident_bytes"]
    assert stored < share * (bf16["streamed_bytes"] + bf16["resident_bytes"])
    assert report[f"{shipped}_over_bf16"]["measured_tokens_per_s"] > 0
    assert quantized["whole_model"]["fits"] and png.stat().st_size > 0


def test_routed_sweep_rows_render_as_a_table_and_a_plot(tmp_path):
    """The bench's routed sweep on the CPU stand-in: one row per batch size, both ways on one weight store, with
    the HRM's prediction; one row of a top-2 model fetches 2 experts per layer and step."""
    from hf_scatter.bench import offload as bench
    from hf_scatter.offload import ModelSpec, load_profile

    model = BUILDERS["qwen3_moe"](experts=8)
    spec = ModelSpec.from_config(model.config, dtype_bytes=4)
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu", policy=Policy(4, 4), progress=False)
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


def test_routed_sweep_refuses_a_model_whose_streamed_stages_never_leave_their_slots():
    """One layer streams two stages: each keeps a GPU slot, decode reloads nothing, and a routed sweep would
    report equal times with no expert fetched; the bench says so and how to fix it."""
    from hf_scatter.bench import offload as bench

    one = hf_scatter.offload_model(BUILDERS["qwen3_moe"](num_hidden_layers=1), gpu_memory="1GiB", device="cpu",
                                   policy=Policy(4, 4), progress=False)
    assert len(one.store.streamed_stages) == 2
    with pytest.raises(ValueError, match=r"--layers 1 at --gpu-memory 1GiB streams 2 stage\(s\).*more --layers"):
        bench._check_something_streams(one, 1, "1GiB")
    three = hf_scatter.offload_model(BUILDERS["qwen3_moe"](num_hidden_layers=3), gpu_memory="1GiB", device="cpu",
                                     policy=Policy(4, 4), progress=False)
    bench._check_something_streams(three, 3, "1GiB")  # four stages take turns in two slots
    three.close()


@pytest.mark.gpu
def test_bench_offload_routed_sweep_small(tmp_path):
    from hf_scatter.cli import main

    out, png = tmp_path / "routed.json", tmp_path / "routed.png"
    assert main(["bench", "offload", "--model", "qwen3-30b-a3b", "--layers", "3", "--new-tokens", "4", "--requests",
                 "8", "--routed-batches", "1,8", "--gpu-memory", "5GiB", "--profile", "h100-host-anchors", "--out",
                 str(out), "--plot", str(png)]) == 0
    report = json.loads(out.read_text())
    one, eight = report["routed_sweep"]
    # top-8: one row chooses 8 experts per layer, fewer to fetch where some are still in the slot from the step
    # before (three streamed stages take turns in two slots)
    assert 4 <= one["routed"]["experts_per_layer_step"] <= 8 and one["batch_size"] == 1
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
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu",
                                   policy=Policy(3, 2, weights_gpu_fraction=0.5), release_weights=False, progress=False)
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
    off = hf_scatter.offload_model(model, gpu_memory="1GiB", device="cpu",
                                   policy=Policy(3, 2, weights_gpu_fraction=0.5), release_weights=False, progress=False)
    assert {a.window for a in off.pipe.attention} == {6}
    got = off.logits(*padded(reqs, side="right"))
    for i, r in enumerate(reqs):
        torch.testing.assert_close(got[i, :len(r)], want[i], rtol=1e-5, atol=1e-5)
    assert off.generate(*padded(reqs), max_new_tokens=10, return_dict=True, progress=False).tokens == alone
