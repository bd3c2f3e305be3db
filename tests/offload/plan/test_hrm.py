"""HRM performance model and policy search (CPU only): roofline arithmetic against hand-computed values on
synthetic hardware, the model description against real parameter counts, the search's guarantees
(memory limits, monotonicity, clear errors), and the `plan` / `profile` commands end to end."""

import dataclasses
import json
import math
import time

import numpy as np
import pytest

from hf_scatter.cli import main
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import (
    HardwareProfile, HierarchicalRoofline, ModelSpec, PlanError, Policy, ProfileError, Roofs, Workload,
    decode_layer_time, load_profile, operating_points, parse_bytes, plot_roofline, predict, search_policy,
    turning_points,
)
from hf_scatter.offload.plan.cost_model import Lin
from hf_scatter.offload.plan.hrm import attention_shape
from hf_scatter.offload.plan.pwl import minimize

GiB = 2**30


def synthetic(**overrides) -> HardwareProfile:
    """Round numbers, no calibration terms: every time below can be computed by hand."""
    fields = dict(name="synthetic", gpu_flops=100e12, gpu_bandwidth=1e12, gpu_memory=64 * GiB, h2d_pinned=10e9,
                  d2h_pinned=10e9, cpu_flops_bf16=1e12, cpu_bandwidth=100e9, cpu_memory=1024 * GiB)
    fields.update(overrides)
    return HardwareProfile(**fields)


def small_moe() -> ModelSpec:
    return ModelSpec(name="small-moe", family="mixtral", hidden=1024, layers=4, heads=8, kv_heads=2, head_dim=128,
                     intermediate=2048, experts=8, top_k=2, vocab=1000)


MIXTRAL = ModelSpec.from_config("mixtral-8x7b")
ANCHORS = load_profile("h100-host-anchors")


# ----- roofline arithmetic -----
def test_turning_points_match_hand_computed_values():
    tp = turning_points(Roofs.from_profile(synthetic()))
    assert tp.gpu_ridge == pytest.approx(100.0)  # 100 TFLOP/s / 1 TB/s
    assert tp.cpu_ridge == pytest.approx(10.0)  # 1 TFLOP/s / 100 GB/s
    assert tp.cpu_gpu == pytest.approx(100.0)  # P1: CPU compute roof meets the 10 GB/s link roof
    assert tp.link_gpu == pytest.approx(10_000.0)  # P2: GPU roof meets the link roof
    # P2 for a kernel that reaches only 20 TFLOP/s
    assert turning_points(Roofs.from_profile(synthetic()), gpu_perf=20e12).link_gpu == pytest.approx(2000.0)
    # A link as fast as CPU memory: shipping to the GPU never loses; a GPU slower than the CPU: it always loses
    assert turning_points(Roofs.from_profile(synthetic(h2d_pinned=100e9))).cpu_gpu == 0.0
    assert turning_points(Roofs.from_profile(synthetic(gpu_flops=0.5e12))).cpu_gpu == math.inf


def test_p1_separates_where_cpu_and_gpu_win():
    roofs = Roofs.from_profile(synthetic())
    p1 = turning_points(roofs).cpu_gpu
    for intensity in (1.0, 10.0, 0.9 * p1):
        assert roofs.cpu(intensity) > roofs.cross(intensity)
    for intensity in (1.1 * p1, 1000.0, 1e5):
        assert roofs.cross(intensity) > roofs.cpu(intensity)


def test_balance_point_is_where_streaming_meets_ffn_compute():
    hrm = HierarchicalRoofline(synthetic())
    model = small_moe()
    # mu = 4096: the FFN reads all 8 experts and computes 4096*2 rows: 1024 FLOP/B, above the GPU ridge, so it
    # runs at 100 TFLOP/s; P2 = 1e4 FLOP per link byte; the FFN's link intensity is 2 N k / ((1 - x) E b).
    assert hrm.ffn_gpu_performance(model, 4096) == pytest.approx(100e12)
    assert hrm.balance_batch_size(model, 4096) == pytest.approx(1e4 * 8 * 2 / (2 * 2))
    assert hrm.balance_batch_size(model, 4096, weights_gpu_fraction=0.5) == pytest.approx(20_000)
    assert hrm.balance_batch_size(model, 4096, weights_gpu_fraction=1.0) == math.inf
    # At the balance point, streaming the FFN weights takes exactly as long as computing the batch on the GPU.
    n = hrm.balance_batch_size(model, 4096)
    ffn = model.decode_ops(n, 1)["ffn"]
    assert model.ffn_weight_bytes / 10e9 == pytest.approx(ffn.flops / 100e12)


def test_calibration_terms_interpolate_measurements():
    prof = synthetic(gemm_efficiency=[[16, 0.5], [2048, 0.6]], cpu_attention=[
        # time = 1 ms + batch * bytes_per_seq / 20 GB/s at context 512; 10 GB/s at context 2048, no overhead
        dict(batch=b, context=512, q_heads=8, kv_heads=2, head_dim=128, dtype_bytes=2,
             seconds=1e-3 + b * 512 * 2 * 128 * 2 * 2 / 20e9) for b in (4, 64)] + [
        dict(batch=64, context=2048, q_heads=8, kv_heads=2, head_dim=128, dtype_bytes=2,
             seconds=64 * 2048 * 2 * 128 * 2 * 2 / 10e9)])
    hrm = HierarchicalRoofline(prof)
    assert hrm.gemm_efficiency(math.sqrt(16 * 2048)) == pytest.approx(0.55)  # log-linear between the points
    assert hrm.gemm_efficiency(1) == pytest.approx(0.5) and hrm.gemm_efficiency(1e6) == pytest.approx(0.6)
    rate, overhead = hrm.cpu_attention_rate(512)
    assert rate == pytest.approx(20e9, rel=1e-6) and overhead == pytest.approx(1e-3 / 2, rel=1e-6)  # median of 1 ms, 0
    assert hrm.cpu_attention_rate(1024)[0] == pytest.approx(math.sqrt(20e9 * 10e9), rel=1e-6)
    assert HierarchicalRoofline(synthetic()).gemm_efficiency(16) == 1.0
    assert any("gemm_efficiency" in u for u in HierarchicalRoofline(synthetic()).uncalibrated)
    # the expert FFN of a MoE model takes the measured expert-kernel curve where there is one
    ffn = MIXTRAL.decode_ops(64, 100)["ffn"]
    assert ffn.moe and ffn.rows == 16
    moe = HierarchicalRoofline(synthetic(gemm_efficiency=[[16, 0.5]], moe_efficiency=[[4, 0.2], [64, 0.4]]))
    assert moe.gemm_efficiency(16, moe=True) == pytest.approx(0.3) and moe.gemm_efficiency(16) == 0.5
    assert moe.gpu_seconds(ffn) == pytest.approx(moe.gpu_seconds(dataclasses.replace(ffn, moe=False)) * 0.5 / 0.3)
    with pytest.raises(ProfileError, match="moe_efficiency"):
        HierarchicalRoofline(synthetic(moe_efficiency=[[4, 1.5]]))
    # MXFP4 experts take their own measured curve (decoding in registers), and are named where it is missing
    shipped = ModelSpec.from_config("gpt-oss-120b")
    mx = shipped.decode_ops(512, 100)["ffn"]
    assert mx.weight_format == "mxfp4" and mx.rows == 16
    both = HierarchicalRoofline(synthetic(moe_efficiency=[[16, 0.4]], mxfp4_moe_efficiency=[[16, 0.1]]))
    bf16_curve = HierarchicalRoofline(synthetic(moe_efficiency=[[16, 0.4]]))
    assert both.gpu_seconds(mx) == pytest.approx(bf16_curve.gpu_seconds(mx) * 0.4 / 0.1)
    assert both.calibrates("mxfp4") and not bf16_curve.calibrates("mxfp4") and bf16_curve.calibrates("")
    policy = Policy(512, 512, weights_gpu_fraction=0.2)
    assert not any("mxfp4" in u for u in predict(policy, shipped, both, Workload(77, 8)).uncalibrated)
    assert any("mxfp4_moe_efficiency" in u for u in predict(policy, shipped, synthetic(moe_efficiency=[[16, 0.4]]),
                                                              Workload(77, 8)).uncalibrated)
    # FP8 experts likewise: their own curve, bf16's where the profile has none
    fp8 = ModelSpec.from_config("qwen3-30b-a3b", weights="fp8").decode_ops(2048, 100)["ffn"]
    assert fp8.weight_format == "fp8" and fp8.rows == 128
    both = HierarchicalRoofline(synthetic(moe_efficiency=[[128, 0.4]], fp8_moe_efficiency=[[128, 0.2]]))
    assert both.gpu_seconds(fp8) == pytest.approx(bf16_curve.gpu_seconds(fp8) * 0.4 / 0.2)
    assert both.calibrates("fp8") and not both.calibrates("mxfp4") and not bf16_curve.calibrates("fp8")


def test_expert_kernels_are_priced_on_the_models_own_experts_where_the_profile_measured_them(tmp_path):
    """A curve measured on a model's own experts (hidden x intermediate, in one format) prices that model's expert
    FFN; other shapes and formats keep the general curves, and a saved profile keeps the curves."""
    gpt_oss = ModelSpec.from_config("gpt-oss-120b")  # MXFP4 experts of 2880 x 2880
    ffn = gpt_oss.prefill_ops(2048, 76)["ffn"]
    assert ffn.expert_shape == (2880, 2880) and ffn.rows == 64
    own = [{"hidden": 2880, "intermediate": 2880, "format": "mxfp4", "points": [[16, 0.05], [256, 0.25]]}]
    general = synthetic(moe_efficiency=[[64, 0.4]], mxfp4_moe_efficiency=[[64, 0.3]])
    shaped = dataclasses.replace(general, moe_efficiency_by_shape=own)
    hrm, before = HierarchicalRoofline(shaped), HierarchicalRoofline(general)
    assert hrm.gemm_efficiency(64, True, "mxfp4", (2880, 2880)) == pytest.approx(0.15)  # half way in log rows
    assert hrm.gpu_seconds(ffn) == pytest.approx(before.gpu_seconds(ffn) * 0.3 / 0.15)
    # the same shape in bf16, another shape in MXFP4, and a dense GEMM: the curves they had
    bf16 = ModelSpec.from_config("gpt-oss-120b", weights="bf16").prefill_ops(2048, 76)["ffn"]
    assert hrm.gpu_seconds(bf16) == pytest.approx(before.gpu_seconds(bf16))
    assert hrm.gemm_efficiency(64, True, "mxfp4", (2880, 1440)) == pytest.approx(0.3)
    assert hrm.gemm_efficiency(64, False, "", (2880, 2880)) == before.gemm_efficiency(64)
    # a format measured only on a model's experts counts as calibrated
    assert HierarchicalRoofline(synthetic(moe_efficiency_by_shape=own)).calibrates("mxfp4")
    # a tensor-parallel rank computes 1/N of each expert's columns: that share's curve, else the general ones
    half = [{"hidden": 2880, "intermediate": 1440, "format": "mxfp4", "points": [[64, 0.1]]}]
    pair = HierarchicalRoofline(dataclasses.replace(general, gpus=2, moe_efficiency_by_shape=own + half), gpus=2)
    pair_general = HierarchicalRoofline(dataclasses.replace(general, gpus=2), gpus=2)
    assert pair.gpu_seconds(ffn) == pytest.approx(pair_general.gpu_seconds(ffn) * 0.3 / 0.1)
    pair_full = HierarchicalRoofline(dataclasses.replace(shaped, gpus=2), gpus=2)
    assert pair_full.gpu_seconds(ffn) == pytest.approx(pair_general.gpu_seconds(ffn))
    # saved and read back: the same prices
    path = shaped.save(str(tmp_path / "profile.json"))
    assert HierarchicalRoofline(load_profile(path)).gpu_seconds(ffn) == pytest.approx(hrm.gpu_seconds(ffn))
    # entries that cannot price anything are refused, naming the field
    for bad in ([{"hidden": 2880, "format": "mxfp4", "points": [[16, 0.1]]}],
                [{"hidden": 2880, "intermediate": 2880, "format": "int4", "points": [[16, 0.1]]}],
                [{"hidden": 2880, "intermediate": 2880, "format": "mxfp4", "points": [[16, 1.5]]}]):
        with pytest.raises(ProfileError, match="moe_efficiency_by_shape"):
            HierarchicalRoofline(synthetic(moe_efficiency_by_shape=bad))


# ----- model description -----
@pytest.mark.parametrize("family", ["mixtral", "dbrx", "llama", "deepseek_v3", "deepseek_v2", "granitemoe"])
def test_model_spec_weight_bytes_equal_the_real_parameter_count(family, tmp_path):
    """Through config.json, as a user passes it. DeepSeek: latent attention (V3 with a low-rank query, V2 without),
    shared experts and a first dense layer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_scatter.tiny import tiny_dbrx_config, tiny_decoder_config, tiny_mixtral_config

    config = {"mixtral": lambda: tiny_mixtral_config(hidden=48, experts=6, top_k=3, intermediate=40),
              "dbrx": lambda: tiny_dbrx_config(hidden=48, experts=5, intermediate=40),
              "llama": lambda: LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=100),
              "deepseek_v3": lambda: tiny_decoder_config("deepseek_v3", hidden=48, experts=6, top_k=3, intermediate=40),
              "deepseek_v2": lambda: tiny_decoder_config("deepseek_v2", hidden=48, experts=6, top_k=3, intermediate=40,
                                                         q_lora_rank=None),
              "granitemoe": lambda: tiny_decoder_config("granitemoe", hidden=48, experts=6, top_k=3, intermediate=40)
              }[family]()
    config.save_pretrained(tmp_path)
    spec = ModelSpec.from_config(str(tmp_path))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert spec.weight_bytes == pytest.approx(sum(p.numel() * 2 for p in model.parameters()), rel=1e-12)
    if family.startswith("deepseek"):  # one latent of rank 16 and a rotary key of 8 per token, keys = values
        assert spec.kv_bytes_per_token == (16 + 8) * 2 and spec.values_are_keys
        assert spec.largest_layer_weight_bytes > spec.layer_weight_bytes  # the dense first layer is narrower
    else:
        assert spec.kv_bytes_per_token == 2 * 2 * 12 * 2  # K and V, 2 KV heads of 48 / 4 = 12, bf16
        assert spec.largest_layer_weight_bytes == spec.layer_weight_bytes
    assert spec.is_moe == (family != "llama")


def test_builtin_models_match_published_sizes():
    assert MIXTRAL.weight_bytes / 2 == pytest.approx(46.7e9, rel=0.002)  # Mixtral-8x7B: 46.7B parameters
    assert ModelSpec.from_config("dbrx").weight_bytes / 2 == pytest.approx(132e9, rel=0.005)  # DBRX: 132B
    assert ModelSpec.from_config("llama-3-8b").weight_bytes / 2 == pytest.approx(8.03e9, rel=0.002)
    lite, v3 = ModelSpec.from_config("deepseek-v2-lite"), ModelSpec.from_config("deepseek-v3")
    assert lite.weight_bytes / 2 == pytest.approx(15.7e9, rel=0.003)  # DeepSeek-V2-Lite: 15.7B parameters
    assert v3.weight_bytes / 2 == pytest.approx(671e9, rel=0.002)  # DeepSeek-V3: 671B without its MTP module
    assert lite.kv_bytes_per_token == (512 + 64) * 2  # the latent and the rotary key, cached once
    ops = lite.decode_ops(1, 100)  # every token runs the 2 shared experts; 26 of 27 layers route
    assert ops["mlp"].flops == pytest.approx(2 * 3 * 2048 * (2 * 1408 * 26 + 10944) / 27)
    assert ops["ffn"].flops == pytest.approx(2 * 6 * 3 * 2048 * 1408 * 26 / 27)
    assert MIXTRAL.kv_bytes_per_token * MIXTRAL.layers == 128 * 1024  # 2 x 8 heads x 128 x bf16 x 32 layers
    ops = MIXTRAL.decode_ops(1, 100)
    assert ops["ffn"].flops == 2 * 2 * 3 * 4096 * 14336  # top-2 experts, three GEMMs
    assert ops["attention"].kv_bytes == 100 * 8 * 128 * 2 * 2
    assert MIXTRAL.active_experts(1) == pytest.approx(2) and MIXTRAL.active_experts(1000) == pytest.approx(8)
    with pytest.raises(ValueError, match="neither a built-in"):
        ModelSpec.from_config("no-such-model")


def test_experts_are_priced_in_the_format_the_checkpoint_ships():
    """GPT-OSS ships MXFP4 experts (4 bits a value, 8 bits a group of 32); a config that declares it prices them so,
    and --weights bf16 prices the dequantized load. Everything else stays in the model's dtype."""
    shipped, bf16 = ModelSpec.from_config("gpt-oss-120b"), ModelSpec.from_config("gpt-oss-120b", weights="bf16")
    assert shipped.expert_format == "mxfp4" and bf16.expert_format == ""
    assert shipped.expert_weight_bytes == 3 * 2880 * 2880 * 4.25 / 8
    assert bf16.expert_weight_bytes == 3 * 2880 * 2880 * 2
    assert bf16.weight_bytes / 2 == pytest.approx(116.8e9, rel=0.002)  # GPT-OSS-120B: 116.8B parameters
    assert shipped.weight_bytes / 2**30 == pytest.approx(60.8, rel=0.01)  # the published checkpoint's 60.8 GiB
    assert shipped.qkv_weight_bytes == bf16.qkv_weight_bytes  # attention, router, embeddings: bf16 as shipped
    assert shipped.decode_ops(1, 10)["ffn"].flops == bf16.decode_ops(1, 10)["ffn"].flops
    config = {**builtin_config("gpt-oss-20b").to_dict(), "quantization_config": {"quant_method": "mxfp4"}}
    assert ModelSpec.from_config(config).expert_format == "mxfp4"
    assert ModelSpec.from_config(builtin_config("gpt-oss-20b")).expert_format == ""  # a bf16 model as built
    assert ModelSpec.from_config("mixtral-8x7b").expert_format == ""
    with pytest.raises(ValueError, match="weights must be one of shipped, bf16, fp8"):
        ModelSpec.from_config("gpt-oss-120b", weights="int4")


def test_block_scaled_fp8_experts_are_priced_at_a_byte_and_a_scale_per_block():
    """Qwen3-30B-A3B-FP8 and DeepSeek-V3 ship e4m3 experts with a float32 per 128 x 128 block: a config that
    declares it, or --weights fp8, prices them so; a dequantized load (dequantize=True) in the model's dtype."""
    fp8, bf16 = ModelSpec.from_config("qwen3-30b-a3b", weights="fp8"), ModelSpec.from_config("qwen3-30b-a3b")
    assert fp8.expert_format == "fp8" and bf16.expert_format == ""
    assert fp8.expert_weight_bytes == 3 * 2048 * 768 * (1 + 4 / 128**2)
    assert fp8.qkv_weight_bytes == bf16.qkv_weight_bytes  # the runtime decodes the dense FP8 layers into bf16
    config = {**builtin_config("qwen3-30b-a3b").to_dict(), "quantization_config": {"quant_method": "fp8"}}
    assert ModelSpec.from_config(config).expert_format == "fp8"
    dequantized = {**config, "quantization_config": {"quant_method": "fp8", "dequantize": True}}
    assert ModelSpec.from_config(dequantized).expert_format == ""


def test_plan_for_gpt_oss_120b_fits_a_128_gb_host_as_shipped_and_not_dequantized(capsys):
    argv = ["plan", "--model", "gpt-oss-120b", "--profile", "h100-host-anchors", "--gpu-memory", "16GiB",
            "--cpu-memory", "80GiB", "--placement", "cgopipe"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "in MXFP4" in out and "predicted throughput" in out and "as hf_scatter.offload streams them" in out
    assert main(argv + ["--weights", "bf16"]) != 0
    assert "218 GiB of weights" in capsys.readouterr().err


# ----- cost model against hand computation -----
def test_decode_layer_time_by_hand_all_resident_and_all_streamed():
    model, prof = small_moe(), synthetic()
    resident = Policy(64, 64, attention_on_gpu=True, experts_on_gpu=True, weights_gpu_fraction=1.0,
                      kv_gpu_fraction=1.0)
    t = decode_layer_time(resident, model, prof, context_len=100)
    expected = sum(max(op.flops / 100e12, op.bytes / 1e12) for op in model.decode_ops(64, 100).values())
    assert t.seconds == pytest.approx(expected) and t.bottleneck == "gpu_compute"
    assert t.terms["h2d"] == pytest.approx(0, abs=1e-15) and t.terms["cpu"] == 0
    streamed = dataclasses.replace(resident, weights_gpu_fraction=0.0)
    t = decode_layer_time(streamed, model, prof, context_len=100)
    assert t.bottleneck == "h2d" and t.seconds == pytest.approx(model.layer_weight_bytes / 10e9)
    assert t.link_weight_bytes == pytest.approx(model.layer_weight_bytes)


def test_experts_on_cpu_split_by_the_resident_fraction_by_hand():
    model, prof = small_moe(), synthetic()
    policy = Policy(64, 64, attention_on_gpu=True, experts_on_gpu=False, weights_gpu_fraction=0.25, kv_gpu_fraction=1.0)
    t = decode_layer_time(policy, model, prof, context_len=100)
    ffn = model.decode_ops(64, 100)["ffn"]
    assert t.terms["cpu"] == pytest.approx(0.75 * max(ffn.flops / 1e12, ffn.bytes / 100e9))  # CPU: its 75%
    assert t.ops["ffn (GPU share)"].seconds == pytest.approx(0.25 * max(ffn.flops / 100e12, ffn.bytes / 1e12))
    assert t.ops["ffn"].flops + t.ops["ffn (GPU share)"].flops == pytest.approx(ffn.flops)
    # non-expert weights stream (75% of them), hidden states go to the CPU experts and their output comes back
    streamed = 0.75 * (model.layer_weight_bytes - model.ffn_weight_bytes)
    assert t.terms["h2d"] == pytest.approx((streamed + 64 * 1024 * 2) / 10e9)
    assert t.terms["d2h"] == pytest.approx(64 * 1024 * 2 / 10e9)


def test_one_micro_batch_serialises_gpu_and_cpu():
    model, prof = small_moe(), synthetic()
    one = decode_layer_time(Policy(256, 256, weights_gpu_fraction=1.0), model, prof, 2000)
    four = decode_layer_time(Policy(256, 64, weights_gpu_fraction=1.0), model, prof, 2000)
    assert one.terms["dependency_chain"] >= one.terms["gpu_compute"] + one.terms["cpu"]
    assert one.bottleneck == "dependency_chain"
    assert four.terms["dependency_chain"] < one.terms["dependency_chain"] / 2
    assert four.seconds < one.seconds


def test_policy_and_workload_reject_bad_input():
    with pytest.raises(ValueError, match="micro_batch_size"):
        Policy(8, 16)
    with pytest.raises(ValueError, match="attention_on_gpu"):
        Policy(8, 8, attention_on_gpu=False, kv_gpu_fraction=0.5)
    with pytest.raises(ValueError, match="weights_gpu_fraction"):
        Policy(8, 8, weights_gpu_fraction=1.5)
    with pytest.raises(ValueError, match="generation length"):
        Workload(100, 0)
    w = Workload.from_prompts([100, 300], gen_len=10)
    assert (w.prompt_len, w.prompt_len_sq, w.prompt_len_max, w.num_requests) == (200, 50000, 300, 2)
    assert parse_bytes("16GiB") == 16 * GiB and parse_bytes("1.5 GB") == 1_500_000_000
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("sixteen gigs")


# ----- exact placement LP -----
def test_pwl_minimize_is_exact_against_a_dense_grid():
    assert minimize([(1.0, [Lin(1, -1), Lin(0, 1)])], [], fix_y=True)[::2] == pytest.approx((0.5, 0.5))
    assert minimize([(1.0, [Lin(1, -1), Lin(0, 1)])], [Lin(-0.3, 1)], fix_y=True)[::2] == pytest.approx((0.3, 0.7))
    assert minimize([(1.0, [Lin(1)])], [Lin(0.5)]) is None  # infeasible
    rng = np.random.default_rng(0)
    grid = np.stack(np.meshgrid(np.linspace(0, 1, 401), np.linspace(0, 1, 401)), -1).reshape(-1, 2)
    for _ in range(20):
        groups = [(float(rng.uniform(0.5, 3)), [Lin(*rng.normal(size=3)) for _ in range(rng.integers(1, 5))])
                  for _ in range(3)]
        cons = [Lin(-0.8, *rng.uniform(0, 1, size=2))]
        x, y, value = minimize(groups, cons)
        assert cons[0].at(x, y) <= 1e-9
        assert value == pytest.approx(sum(w * max(p.at(x, y) for p in ps) for w, ps in groups))
        at = lambda lin: lin.c + lin.cx * grid[:, 0] + lin.cy * grid[:, 1]  # noqa: E731
        cost = sum(w * np.max([at(p) for p in ps], axis=0) for w, ps in groups)
        assert value <= cost[at(cons[0]) <= 0].min() + 1e-9


# ----- policy search -----
def test_search_mixtral_16gib_is_fast_fits_and_explains_itself():
    start = time.perf_counter()
    policy = search_policy(MIXTRAL, ANCHORS, Workload(512, 64), "16GiB")
    assert time.perf_counter() - start < 10
    pred = policy.prediction
    assert pred.fits and pred.gpu_memory_total <= 16 * GiB * 0.95 * (1 + 1e-9)
    assert pred.cpu_memory_total <= pred.cpu_limit * (1 + 1e-9)
    assert policy.tokens_per_s == pytest.approx(policy.batch_size * 64 / pred.batch_s)
    # Mixtral's 93 GB cannot sit in 16 GiB: most weights stream, and the link or the CPU bounds the layer
    assert 0 < policy.weights_gpu_fraction < 0.2
    assert policy.bottleneck in ("h2d", "cpu")
    assert pred.decode_layer.seconds >= MIXTRAL.layer_weight_bytes * (1 - policy.weights_gpu_fraction) / 55e9
    # the searched optimum is no worse than hand-picked policies within the same memory
    for other in (Policy(64, 64), Policy(256, 32), Policy(128, 128, attention_on_gpu=True)):
        alt = predict(other, MIXTRAL, ANCHORS, Workload(512, 64), 16 * GiB)
        if alt.fits:
            assert alt.tokens_per_s <= policy.tokens_per_s * (1 + 1e-9)
    text = policy.explain()
    assert "bottleneck" in text and "tokens/s" in text and "\n" not in text
    table = policy.to_markdown()
    assert "| batch N / micro-batch mu (micro-batches) |" in table and "predicted throughput" in table
    json.dumps(policy.to_dict())  # serialisable


@pytest.mark.parametrize("profile,cpu", [(ANCHORS, None), (synthetic(), "256GiB")])
def test_more_gpu_memory_never_predicts_less_throughput_and_limits_hold(profile, cpu):
    previous = 0.0
    for gib in (8, 12, 16, 24, 40, 64):
        policy = search_policy(MIXTRAL, profile, Workload(256, 32, num_requests=2048), f"{gib}GiB", cpu)
        pred = policy.prediction
        assert pred.gpu_memory_total <= gib * GiB * 0.95 * (1 + 1e-9), gib
        assert pred.cpu_memory_total <= pred.cpu_limit * (1 + 1e-9), gib
        assert all(v >= -1e-6 for v in list(pred.gpu_memory.values()) + list(pred.cpu_memory.values()))
        assert policy.tokens_per_s >= previous * (1 - 1e-9), gib
        previous = policy.tokens_per_s


def test_more_link_bandwidth_never_slows_a_plan_and_spare_gpu_memory_holds_weights():
    """The paper's bandwidth ablation: throughput follows the link, and a fast link frees GPU memory for other
    uses (here attention on the GPU, with its KV staged). Where a step is bound by the CPU, resident weights do
    not shorten it, yet the plan fills the GPU with them rather than stream them over the link for nothing."""
    fractions, speeds = [], []
    for gbps in (4, 8, 16, 32, 64):  # PCIe Gen3 x4 .. Gen5 x16
        prof = dataclasses.replace(ANCHORS, h2d_pinned=gbps * 1e9, d2h_pinned=gbps * 1e9, duplex_pinned=2 * gbps * 1e9,
                                   cpu_memory=1024 * GiB)  # room for any batch: the link decides
        policy = search_policy(MIXTRAL, prof, Workload(512, 64), "16GiB", "1TiB")
        fractions.append(policy.weights_gpu_fraction)
        speeds.append(policy.tokens_per_s)
        pred = policy.prediction
        if pred.decode_layer.bottleneck == "cpu":
            assert pred.gpu_memory_total == pytest.approx(pred.gpu_usable, rel=1e-6), (gbps, pred.gpu_memory)
    assert all(b <= a + 1e-9 for a, b in zip(fractions, fractions[1:])), fractions
    assert fractions[-1] < fractions[0]
    assert all(b >= a for a, b in zip(speeds, speeds[1:])), speeds


def test_the_search_chooses_the_prefill_chunk_the_memory_can_spare():
    """A prefill chunk is a choice: 4096-token chunks take fewer kernel calls but reserve activation memory. In
    16 GiB, GPT-OSS-120B's bf16 experts need most of it as their double buffer: the plan takes smaller chunks
    and keeps the batch of 1024 (with room reserved for 4096-token chunks, nothing above 16 requests fit); MXFP4
    experts leave room for larger ones. The plan's memory holds the chunk it prices."""
    from hf_scatter.offload.plan.activations import PREFILL_CHUNK_TOKENS
    from hf_scatter.offload.plan.cost_model import CostOptions, memory_use

    workload = Workload(76, 32, num_requests=1024, prompt_len_max=114)
    chunks = {}
    for weights in ("bf16", "shipped"):
        spec = dataclasses.replace(ModelSpec.from_config("gpt-oss-120b", weights=weights), layers=10)
        policy = search_policy(spec, ANCHORS, workload, "16GiB", "80GiB", placements=[(False, True)])
        pred = policy.prediction
        chunks[weights] = pred.prefill_chunk_tokens
        assert policy.batch_size == 1024 and pred.gpu_memory_total <= pred.gpu_usable
        widest = memory_use(spec, policy, workload, CostOptions(prefill_chunk_tokens=PREFILL_CHUNK_TOKENS))[0]
        over = sum(v.at(policy.weights_gpu_fraction, 0.0) for v in widest.values()) > pred.gpu_usable
        assert over == (pred.prefill_chunk_tokens < PREFILL_CHUNK_TOKENS)
        assert f"prefill per batch ({pred.prefill_chunk_tokens:,}-token chunks)" in policy.to_markdown()
    assert chunks["bf16"] < PREFILL_CHUNK_TOKENS and chunks["shipped"] > chunks["bf16"]
    # a budget with room for the smallest chunk only still plans: 3 bf16 Qwen3-30B-A3B layers in 4 GiB, where the
    # embedding and LM head and one layer's double buffer take 3.5 of its 3.8 usable GiB
    qwen3 = dataclasses.replace(ModelSpec.from_config("qwen3-30b-a3b", weights="bf16"), layers=3)
    tight = search_policy(qwen3, ANCHORS, Workload(40, 4, num_requests=32), "4GiB", "48GiB", placements=[(False, True)])
    assert tight.prediction.prefill_chunk_tokens <= 64
    assert tight.prediction.gpu_memory_total <= tight.prediction.gpu_usable


def test_infeasible_requests_give_clear_errors():
    with pytest.raises(PlanError, match="weights but the GPU .* and CPU .* budgets together hold only"):
        search_policy(MIXTRAL, ANCHORS, Workload(512, 64), "16GiB", cpu_memory="32GiB")
    with pytest.raises(PlanError, match="too small for mixtral-8x7b.*double buffer"):
        search_policy(MIXTRAL, ANCHORS, Workload(512, 64), "4GiB")
    with pytest.raises(PlanError, match="exceeds the .* of the GPU"):
        search_policy(MIXTRAL, ANCHORS, Workload(512, 64), "100GiB")
    with pytest.raises(ProfileError, match="lacks gpu_flops"):
        search_policy(MIXTRAL, HardwareProfile(name="cpu only", cpu_flops_bf16=1e11, cpu_bandwidth=1e10,
                                               cpu_memory=64 * GiB), Workload(512, 64), "16GiB")


def test_dense_model_that_fits_needs_no_streaming():
    policy = search_policy("llama-3-8b", ANCHORS, Workload(256, 32, num_requests=256), "40GiB")
    assert policy.prediction.fits and policy.bottleneck not in ("h2d", "link_duplex")


# ----- profiles -----
def test_profile_json_round_trip_and_validation(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = ANCHORS.save()  # default location, keyed by host and device
    assert path.startswith(str(tmp_path)) and "H100" in path
    assert load_profile(path) == ANCHORS
    report = tmp_path / "report.json"  # a bench report holds the profile it ran on
    report.write_text(json.dumps({"tokens_per_s": 1.0, "profile": ANCHORS.to_dict()}))
    assert load_profile(str(report)) == ANCHORS
    data = ANCHORS.to_dict()
    data["gpu_flopz"] = 1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown field.*gpu_flopz"):
        load_profile(str(bad))
    data = ANCHORS.to_dict()
    data["gpu_flops"] = -3
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="gpu_flops must be a positive number"):
        load_profile(str(bad))
    with pytest.raises(FileNotFoundError, match="known profile"):
        load_profile(str(tmp_path / "missing.json"))
    t4 = ANCHORS.with_gpu("t4")
    assert (t4.gpu_flops, t4.h2d_pinned, t4.cpu_bandwidth) == (65e12, 15.75e9, ANCHORS.cpu_bandwidth)
    assert "spec sheet" in t4.notes["gpu_flops"] and t4.gemm_efficiency == []
    # what the profiled GPU's kernels reached says nothing of another GPU's: no efficiency curve is carried over
    curves = dict(moe_efficiency=[[16, 0.5]], mxfp4_moe_efficiency=[[16, 0.2]], fp8_moe_efficiency=[[16, 0.3]],
                  moe_efficiency_by_shape=[{"hidden": 2880, "intermediate": 2880, "format": "bf16",
                                            "points": [[16, 0.4]]}])
    l4 = dataclasses.replace(ANCHORS, **curves).with_gpu("l4")
    assert all(getattr(l4, name) == [] for name in curves)


def test_profile_command_measures_cpu_terms_and_plan_uses_them(tmp_path, capsys):
    import torch

    out = tmp_path / "prof.json"
    assert main(["profile", "--quick", "--no-progress", "--model", "deepseek-v2-lite", "--out", str(out)]) == 0
    prof = load_profile(str(out))
    assert prof.cpu_flops_fp32 > 0 and prof.cpu_bandwidth > 0 and prof.cpu_memory > 0 and prof.cpu_op_s > 0
    grid = {(b, c) for b in (1, 4, 32) for c in (256, 2048)}
    shapes = {}
    for p in prof.cpu_attention:  # the standard shape, then DeepSeek-V2-Lite's latent
        shapes.setdefault((p["q_heads"], p["kv_heads"], p["head_dim"], p.get("values_are_keys", False)),
                          set()).add((p["batch"], p["context"]))
    assert shapes == {(32, 8, 128, False): grid, (16, 1, 576, True): {(b, c) for b in (4, 32, 256) for c in (256, 2048)}}
    rate, _ = HierarchicalRoofline(dataclasses.replace(
        prof, gpu_flops=1e14, gpu_bandwidth=1e12, h2d_pinned=1e10)).cpu_attention_rate(1024)
    assert rate > 0
    if not torch.cuda.is_available():
        assert prof.gpu_flops is None and "GPU and PCIe terms not measured" in prof.notes["gpu"]
        assert "not measured" in capsys.readouterr().out
    assert main(["profile", "--quick", "--model", "no-such-model", "--out", str(out)]) == 2
    assert "--model: model 'no-such-model' is neither a built-in" in capsys.readouterr().err


def test_plan_command_prints_table_and_draws_roofline(tmp_path, capsys):
    png, out = tmp_path / "roof.png", tmp_path / "plan.json"
    rc = main(["plan", "--model", "mixtral-8x7b", "--gpu-memory", "16GiB", "--profile", "h100-host-anchors",
               "--prompt-len", "128,256,512", "--gen-len", "32", "--plot", str(png), "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| predicted throughput |" in text and "bottleneck" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    report = json.loads(out.read_text())
    assert report["turning_points"]["P2_link_gpu"] == pytest.approx(778e12 / 55e9)
    assert report["policy"]["prediction"]["fits"] is True
    assert main(["plan", "--model", "not-a-model", "--profile", "h100-host-anchors"]) == 2
    assert "neither a built-in" in capsys.readouterr().err


def test_cpu_attention_measured_at_a_models_own_shape_replaces_the_query_head_scaling():
    """DeepSeek's latent (16 query heads on one 576-wide head that is also the value): the query-head scaling
    would price it at 4x the standard shape's cost per KV byte; where the profile measured that shape, its own
    points are the price. Other models keep the standard shape."""
    from hf_scatter.offload.plan.cost_model import decode_terms

    lite = ModelSpec.from_config("deepseek-v2-lite")
    standard = [dict(batch=b, context=c, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2,
                     seconds=2.5e-4 + b * c * 4096 / 50e9) for b in (1, 32) for c in (64, 512)]
    latent = [dict(batch=b, context=c, q_heads=16, kv_heads=1, head_dim=576, dtype_bytes=2, values_are_keys=True,
                   seconds=1e-4 + b * c * 2304 / 80e9) for b in (1, 32) for c in (64, 512)]
    scaled, measured = HierarchicalRoofline(synthetic(cpu_attention=standard)), \
        HierarchicalRoofline(synthetic(cpu_attention=standard + latent))
    assert scaled.cpu_attention_bytes_per_token(lite) == 4 * 2 * 576 * 2
    assert measured.cpu_attention_bytes_per_token(lite) == 2 * 576 * 2
    assert measured.cpu_attention_rate(512, lite)[0] == pytest.approx(80e9, rel=1e-6)
    assert measured.cpu_attention_rate(512, MIXTRAL)[0] == pytest.approx(50e9, rel=1e-6)
    assert measured.cpu_attention_rate(512)[0] == pytest.approx(50e9, rel=1e-6)  # the standard shape by default
    policy = Policy(64, 32)
    cpu = [decode_terms(h, lite, policy, 300.0).evaluate(0, 0).terms["cpu"] for h in (scaled, measured)]
    per_call = [1e-4 + 32 * 300 * 2304 / 80e9, 2.5e-4 + 32 * 300 * 4 * 2304 / 50e9]  # two micro-batches of 32
    assert cpu[1] == pytest.approx(per_call[0] * 2, rel=1e-6) and cpu[0] == pytest.approx(per_call[1] * 2, rel=1e-6)
    # Mixtral's price is the same whether or not another shape was measured
    assert decode_terms(measured, MIXTRAL, policy, 300.0).evaluate(0, 0).terms["cpu"] == pytest.approx(
        decode_terms(scaled, MIXTRAL, policy, 300.0).evaluate(0, 0).terms["cpu"], rel=1e-12)


def test_sinks_are_part_of_the_attention_shape_measured_and_priced():
    """GPT-OSS's sinks make each CPU attention call longer: the profile measures a GPT-OSS shape with them (the
    point says so), and only a model with sinks is priced by those points."""
    from hf_scatter.offload.measure import _cpu_attention_point
    from hf_scatter.offload.runtime.cpu_attention import AttentionWorker

    gpt_oss = ModelSpec.from_config("gpt-oss-120b")
    assert gpt_oss.attention_sinks and not MIXTRAL.attention_sinks
    assert attention_shape(gpt_oss) == (64, 8, 64, False, True)
    worker = AttentionWorker(1)
    try:
        point = _cpu_attention_point(worker, 4, 16, (8, 2, 16, False, True))
    finally:
        worker.close()
    assert point["sinks"] is True and attention_shape(point) == (8, 2, 16, False, True) and point["seconds"] > 0
    standard = [dict(batch=b, context=c, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2,
                     seconds=2.5e-4 + b * c * 4096 / 50e9) for b in (1, 32) for c in (64, 512)]
    plain, with_sinks = ([dict(batch=b, context=c, q_heads=64, kv_heads=8, head_dim=64, dtype_bytes=2,
                               seconds=1e-4 + b * c * 2048 / rate, **extra) for b in (1, 32) for c in (64, 512)]
                         for rate, extra in ((60e9, {}), (45e9, {"sinks": True})))
    hrm = HierarchicalRoofline(synthetic(cpu_attention=standard + plain + with_sinks))
    assert hrm.cpu_attention_rate(512, gpt_oss)[0] == pytest.approx(45e9, rel=1e-6)
    without = dataclasses.replace(gpt_oss, family="mixtral")  # the same shape, no sinks
    assert hrm.cpu_attention_rate(512, without)[0] == pytest.approx(60e9, rel=1e-6)
    # a profile measured before sinks were: the shape without them prices GPT-OSS, not the standard shape scaled
    older = HierarchicalRoofline(synthetic(cpu_attention=standard + plain))
    assert older.cpu_attention_rate(512, gpt_oss)[0] == pytest.approx(60e9, rel=1e-6)


def test_cpu_attention_points_are_medians_of_passes_taken_in_turn(monkeypatch):
    """Each point of the profile's CPU attention is the median of passes over every point in turn, so a slow
    second of the host moves one sample of several points, not the whole of one; the points keep the cases'
    order and shapes."""
    from hf_scatter.offload import measure
    from hf_scatter.offload.runtime.cpu_attention import AttentionWorker

    order, slow = [], {(0, 1): 9.0, (1, 0): 7.0}  # (pass, case) -> a slow spell's sample
    cases = [(2, 16, (4, 2, 8, False, False)), (3, 32, (8, 2, 8, False, True))]

    def fake_median(call, budget_s):
        call()  # the real call, through the worker
        pass_, case = divmod(len(order), len(cases))
        order.append(case)
        return slow.get((pass_, case), 1.0 + case + 0.1 * pass_)

    monkeypatch.setattr(measure, "_median_s", fake_median)
    worker = AttentionWorker(1)
    try:
        points = measure._cpu_attention_points(worker, cases, passes=3)
    finally:
        worker.close()
    assert order == [0, 1, 0, 1, 0, 1]
    assert [p["seconds"] for p in points] == pytest.approx([1.2, 2.2])  # each point's slow sample left out
    assert [(p["batch"], p["context"], attention_shape(p)) for p in points] == cases


def test_plan_reads_deepseek_latent_attention_shared_experts_and_dense_layers(capsys):
    assert main(["plan", "--model", "deepseek-v2-lite", "--gpu-memory", "16GiB", "--profile", "h100-host-anchors"]) == 0
    text = capsys.readouterr().out
    assert "64 experts, top-6 + shared experts of width 2816, 1 dense layer first, latent attention (rank 512)" in text
    assert "| predicted throughput |" in text


def test_plot_roofline_directly(tmp_path):
    policy = search_policy(small_moe(), synthetic(), Workload(64, 8, num_requests=64), "1GiB", "16GiB")
    path = plot_roofline(policy, small_moe(), HierarchicalRoofline(synthetic()), str(tmp_path / "r.png"))
    assert (tmp_path / "r.png").stat().st_size > 20_000 and path.endswith("r.png")
    points = {p["name"]: p for p in operating_points(policy, 10e9)}
    assert set(points) >= {"qkv", "attention", "o_proj", "router", "ffn"}
    for p in points.values():  # nothing runs above its roof
        roof = 100e12 if p["device"] == "gpu" else 1e12
        assert p["flops_per_s"] <= roof * (1 + 1e-9)
        if "link_intensity" in p:
            assert p["link_flops_per_s"] <= 10e9 * p["link_intensity"] * (1 + 1e-9)


def test_cpu_attention_is_priced_per_length_bucket_as_the_runtime_splits_it():
    from hf_scatter.offload.plan.cost_model import attention_calls, decode_terms

    spread = Workload.from_prompts(list(range(40, 115)), 16)  # MTBench-like: 40..114 tokens
    same = Workload.from_prompts([77] * 75, 16)
    assert attention_calls(32, same, 4096, 2.5e-4, 1 / 50e9) == ((32.0, 0.0),)
    for call_s in (0.0, 2.5e-4, 1.0):
        calls = attention_calls(32, spread, 4096, call_s, 1 / 50e9)
        spreads = [d for _, d in calls]  # each call reads up to its longest prompt: above the mean first
        assert sum(r for r, _ in calls) == pytest.approx(32) and spreads == sorted(spreads, reverse=True) > [0.0]
    # free calls: buckets as tight as the padding bound allows; costly calls: the fewest that bound allows
    free, costly = (attention_calls(32, spread, 4096, call_s, 1 / 50e9) for call_s in (0.0, 1.0))
    assert len(free) > len(costly) >= 2
    prof = synthetic(cpu_attention=[dict(batch=b, context=c, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2,
                                         seconds=2.5e-4 + b * c * 4096 / 50e9) for b in (1, 32) for c in (64, 512)])
    hrm = HierarchicalRoofline(prof)
    policy = Policy(64, 32)
    one = decode_terms(hrm, MIXTRAL, policy, 120.0).evaluate(0, 0).terms["cpu"]
    bucketed = decode_terms(hrm, MIXTRAL, policy, 120.0, spread).evaluate(0, 0).terms["cpu"]
    assert bucketed > one  # every extra call pays the overhead, and each bucket reads to its longest row


def test_cpu_attention_follows_the_query_heads_beyond_the_measured_group():
    """Profiles measure CPU attention with 4 query heads per KV head; Qwen3-MoE has 8 (32 over 4) and took twice
    as long per KV byte on the H100 host. Fewer than measured (OLMoE: 1) still reads every KV byte."""
    from hf_scatter.offload import ModelSpec

    prof = synthetic(cpu_attention=[dict(batch=b, context=c, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2,
                                         seconds=2.5e-4 + b * c * 4096 / 50e9) for b in (1, 32) for c in (64, 512)])
    hrm = HierarchicalRoofline(prof)
    mixtral, qwen3, olmoe = (ModelSpec.from_config(n) for n in ("mixtral-8x7b", "qwen3-30b-a3b", "olmoe-1b-7b"))
    assert (qwen3.heads // qwen3.kv_heads, olmoe.heads // olmoe.kv_heads) == (8, 1)
    assert hrm.cpu_attention_bytes_per_token(mixtral) == mixtral.kv_bytes_per_token
    assert hrm.cpu_attention_bytes_per_token(qwen3) == 2 * qwen3.kv_bytes_per_token
    assert hrm.cpu_attention_bytes_per_token(olmoe) == olmoe.kv_bytes_per_token
    # Qwen3's 2 KiB of K/V per token cost what Mixtral's 4 KiB do: the same query heads attend
    from hf_scatter.offload.plan.cost_model import decode_terms

    policy = Policy(64, 32)
    cpu = [decode_terms(hrm, m, policy, 120.0).evaluate(0, 0).terms["cpu"] for m in (mixtral, qwen3)]
    assert cpu[1] == pytest.approx(cpu[0], rel=1e-9)


# ----- routed expert streaming -----
def test_routed_streaming_prices_only_the_experts_a_batch_chooses_by_hand():
    """8 experts, top-2: one row chooses 2 of them (a quarter of the expert bytes), four rows 8 (1 - 0.75^4) on
    average. The link carries the dense rest plus that share, and the GPU waits for the chosen experts."""
    model, prof = small_moe(), synthetic()
    L, X = model.layer_weight_bytes, model.ffn_weight_bytes
    for n, share in ((1, 0.25), (4, 1 - 0.75**4)):
        every = decode_layer_time(Policy(n, n), model, prof, 100)
        routed = decode_layer_time(Policy(n, n, routed_experts=True), model, prof, 100)
        assert routed.link_weight_bytes == pytest.approx(L - X + share * X)  # nothing resident: dense rest streams
        assert routed.terms["h2d"] == pytest.approx((L - X + share * X) / 10e9, rel=1e-3)  # + activations
        assert every.link_weight_bytes == pytest.approx(L)
        # the GPU waits for the chosen share of the streamed bytes (exactly share * X once the dense part is
        # resident; with nothing resident the dense share is counted in, an upper bound)
        assert routed.terms["gpu_compute"] - every.terms["gpu_compute"] == pytest.approx(share * L / 10e9)
        # 90% resident (more than the dense share): the chosen experts' share of the streamed 10%
        mostly = decode_layer_time(Policy(n, n, weights_gpu_fraction=0.9, routed_experts=True), model, prof, 100)
        assert mostly.link_weight_bytes == pytest.approx(share * 0.1 * L)
    with pytest.raises(ValueError, match="experts_on_gpu"):
        Policy(8, 8, experts_on_gpu=False, routed_experts=True)


def test_the_search_streams_only_routed_experts_where_that_pays_and_says_so(capsys):
    """Qwen3-30B-A3B (128 experts, top-8) in 16 GiB: a handful of requests choose few experts, so the plan
    fetches only those; a thousand requests choose them all, so it pages every expert ahead."""
    qwen = ModelSpec.from_config("qwen3-30b-a3b")
    few = search_policy(qwen, ANCHORS, Workload(77, 128, num_requests=4), "16GiB", placements=[(False, True)])
    many = search_policy(qwen, ANCHORS, Workload(77, 128, num_requests=1024), "16GiB", placements=[(False, True)])
    assert few.routed_experts and not many.routed_experts
    assert few.prediction.routed_experts == pytest.approx(qwen.active_experts(few.batch_size))
    forced = predict(dataclasses.replace(few, routed_experts=False, prediction=None), qwen, ANCHORS,
                     Workload(77, 128, num_requests=4), 16 * GiB)
    assert few.tokens_per_s > 2 * forced.tokens_per_s  # the few requests stream a fraction of the bytes
    experts = f"about {qwen.active_experts(few.batch_size):.1f} of 128 experts per layer and step"
    assert experts in few.to_markdown() and "every expert, ahead of the stage" in many.to_markdown()
    assert "Only the experts the batch's rows choose stream" in few.explain()
    assert few.to_dict()["routed_experts"] is True
    assert main(["plan", "--model", "qwen3-30b-a3b", "--gpu-memory", "16GiB", "--profile", "h100-host-anchors",
                 "--num-requests", "4", "--prompt-len", "77", "--gen-len", "128", "--placement", "cgopipe"]) == 0
    assert "routed only: about" in capsys.readouterr().out


# ----- several GPUs of one host: tensor parallelism -----
def two_gpu_host(**overrides) -> HardwareProfile:
    """The synthetic host with 2 GPUs measured: independent links (twice one GPU's pinned H2D at once), a
    100 GB/s all-reduce of 10 us."""
    return synthetic(**{"gpus": 2, "h2d_pinned_concurrent": [[2, 20e9]], "allreduce_bus_bandwidth": 100e9,
                        "allreduce_latency_s": 10e-6, **overrides})


def test_two_gpus_by_hand_halve_each_gpu_s_work_and_add_two_all_reduces_per_layer():
    """Each GPU computes half of every op at its own roofs, the hidden states of the micro-batch (64 rows of
    1024 bf16) are all-reduced twice (ring: 2 (N-1)/N of them over the bus), and the streamed weights come in
    over both links at once."""
    model, prof = small_moe(), two_gpu_host()
    resident = Policy(64, 64, attention_on_gpu=True, experts_on_gpu=True, weights_gpu_fraction=1.0,
                      kv_gpu_fraction=1.0, gpus=2)
    t = decode_layer_time(resident, model, prof, context_len=100)
    compute = sum(max(op.flops / 200e12, op.bytes / 2e12) for op in model.decode_ops(64, 100).values())
    allreduce = 2 * (10e-6 + 64 * 1024 * 2 / 100e9)
    assert t.ops["all-reduce"].seconds == pytest.approx(allreduce)
    assert t.terms["gpu_compute"] == pytest.approx(compute + allreduce) and t.bottleneck == "gpu_compute"
    streamed = dataclasses.replace(resident, weights_gpu_fraction=0.0)
    t = decode_layer_time(streamed, model, prof, context_len=100)
    assert t.bottleneck == "h2d" and t.seconds == pytest.approx(model.layer_weight_bytes / 20e9)
    one = decode_layer_time(dataclasses.replace(streamed, gpus=1), model, prof, context_len=100)
    assert "all-reduce" not in one.ops and one.seconds == pytest.approx(model.layer_weight_bytes / 10e9)


def test_olmoe_over_two_gpus_pays_a_third_small_all_reduce_for_its_qk_norms():
    """OLMoE's q/k norms span every head, so split by heads each rank all-reduces the two norms' float32 sums of
    squares ([rows, 2]) besides the hidden states: one more latency-bound all-reduce per layer, in decode and
    prefill alike; a family with per-head norms pays two."""
    prof = two_gpu_host()
    olmoe = dataclasses.replace(small_moe(), family="olmoe")
    resident = Policy(64, 64, attention_on_gpu=True, experts_on_gpu=True, weights_gpu_fraction=1.0,
                      kv_gpu_fraction=1.0, gpus=2)
    hidden_states = 2 * (10e-6 + 64 * 1024 * 2 / 100e9)
    t = decode_layer_time(resident, olmoe, prof, context_len=100)
    assert t.ops["all-reduce"].seconds == pytest.approx(hidden_states + 10e-6 + 64 * 2 * 4 / 100e9)
    plain = decode_layer_time(resident, small_moe(), prof, context_len=100)
    assert plain.ops["all-reduce"].seconds == pytest.approx(hidden_states)
    from hf_scatter.offload import CostOptions
    from hf_scatter.offload.plan.cost_model import prefill_terms

    hrm = HierarchicalRoofline(prof, gpus=2)
    prefill = {m.family: prefill_terms(hrm, m, resident, Workload(100, 8), CostOptions()).ops["all-reduce"][-1].c
               for m in (olmoe, small_moe())}
    assert prefill["olmoe"] > prefill[small_moe().family] > 0


def test_mla_over_two_gpus_caches_and_reads_the_whole_latent_on_each_rank():
    """DeepSeek's latent is every query head's, so split by heads each rank caches the whole latent and its CPU
    attention reads all of it: two GPUs hold twice the one-GPU KV cache on the host, write twice its bytes back
    in prefill and read twice them from host memory in decode. The attention's time stays the whole model's at the
    rate the profile measured for its shape (each rank computes half the heads; the group's CPU attention priced
    as one process's here: attention_scale 1). A model with KV heads to split holds the same cache either way."""
    from hf_scatter.offload import CostOptions
    from hf_scatter.offload.plan.cost_model import decode_terms, memory_use, prefill_terms
    from hf_scatter.offload.plan.tensor_parallel import group_model

    lite = ModelSpec.from_config("deepseek-v2-lite")
    latent = [dict(batch=b, context=c, q_heads=16, kv_heads=1, head_dim=576, dtype_bytes=2, values_are_keys=True,
                   seconds=1e-4 + b * c * 2304 / 80e9) for b in (1, 32) for c in (64, 512)]
    prof = two_gpu_host(cpu_attention=latent)
    work = Workload(100, 8)

    def priced(model, gpus):
        policy = Policy(64, 32, gpus=gpus)
        hrm = HierarchicalRoofline(prof, gpus=gpus)
        decode = decode_terms(hrm, model, policy, 300.0).evaluate(0, 0)
        return (memory_use(model, policy, work, CostOptions())[1]["KV cache"].c, decode.ops["attention"].bytes,
                decode.terms["cpu"], prefill_terms(hrm, model, policy, work, CostOptions()).evaluate(0, 0))

    (kv1, read1, cpu1, pre1), (kv2, read2, cpu2, pre2) = priced(lite, 1), priced(lite, 2)
    assert kv2 == pytest.approx(2 * kv1) and read2 == pytest.approx(2 * read1)
    per_call = 1e-4 + 32 * 300 * 2304 / 80e9  # the measured shape's rate: two micro-batches of 32
    assert cpu1 == pytest.approx(2 * per_call, rel=1e-6)
    assert cpu2 == pytest.approx(cpu1, rel=1e-6)
    assert pre2.terms["d2h"] > pre1.terms["d2h"] / 2  # the split weights' share halves; the latent's does not
    assert priced(MIXTRAL, 2)[0] == pytest.approx(priced(MIXTRAL, 1)[0])
    two = group_model(lite, 2)
    assert two.kv_bytes_per_token == 2 * lite.kv_bytes_per_token and group_model(two, 2) == two
    assert group_model(lite, 1) == lite and group_model(MIXTRAL, 2) == MIXTRAL


def test_memory_per_gpu_holds_its_share_of_weights_and_kv_and_all_activations():
    from hf_scatter.offload import CostOptions
    from hf_scatter.offload.plan.cost_model import memory_use

    model, workload = small_moe(), Workload(512, 64)
    one = Policy(64, 16, attention_on_gpu=True, weights_gpu_fraction=0.5, kv_gpu_fraction=0.5)
    gpu1, cpu1 = memory_use(model, one, workload, CostOptions())
    gpu2, cpu2 = memory_use(model, dataclasses.replace(one, gpus=2), workload, CostOptions())
    for purpose in ("weight double buffer", "KV cache", "KV staging"):
        assert gpu2[purpose].at(0.5, 0.5) == pytest.approx(gpu1[purpose].at(0.5, 0.5) / 2)
    # the layers split; the embedding and LM head stay whole on every GPU, as the runtime keeps them
    other = model.other_weight_bytes
    assert other > 0 and gpu2["resident weights"].at(0.5, 0.5) == pytest.approx(
        other + (gpu1["resident weights"].at(0.5, 0.5) - other) / 2)
    assert gpu2["activations"].at(0.5, 0.5) == gpu1["activations"].at(0.5, 0.5) > 0  # replicated on each GPU
    assert {k: v.at(0.5, 0.5) for k, v in cpu2.items()} == {k: v.at(0.5, 0.5) for k, v in cpu1.items()}


def test_host_memory_delivers_at_least_the_measured_copies_to_every_gpu_at_once():
    """One GPU's copy beside a CPU copy measured 65 GB/s of host memory, but copies to two GPUs at once ran at
    105 GB/s: the group's host-memory roof is the 105 seen, not the 65 (unmeasured links leave it alone)."""
    from hf_scatter.offload.plan.hrm import HierarchicalRoofline

    host = two_gpu_host(h2d_pinned=54e9, host_dram_bandwidth=65e9, h2d_pinned_concurrent=[[2, 105e9]])
    assert HierarchicalRoofline(host, 2).host_dram_bandwidth == pytest.approx(105e9)
    assert HierarchicalRoofline(host, 1).host_dram_bandwidth == pytest.approx(65e9)
    unmeasured = dataclasses.replace(host, h2d_pinned_concurrent=[])
    assert HierarchicalRoofline(unmeasured, 2).host_dram_bandwidth == pytest.approx(65e9)


def test_a_groups_ranks_attend_on_few_threads_and_unmeasured_plan_at_one_processs_rate():
    """One process keeps every core but its GPU driver's and pager's; a group's rank keeps its share less four, in a
    team of at most 12 (larger teams spinning beside the other ranks' stalled). Without a measurement of the group,
    the planner takes its CPU attention as fast as one process's (memory-bound: fewer threads per rank did not
    slow it), and says that it assumed so."""
    from hf_scatter.offload.plan.hrm import HierarchicalRoofline
    from hf_scatter.offload.plan.tensor_parallel import TensorParallel, attention_threads

    assert [attention_threads(64, n) for n in (1, 2, 4, 8)] == [62, 12, 12, 4] and attention_threads(2, 4) == 1
    host = two_gpu_host(gpus=4, cpu_cores=64, cpu_attention=[
        {"batch": 64, "context": c, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
         "seconds": c * 1e-5} for c in (256, 1024)])
    one, four = (HierarchicalRoofline(host, n).cpu_attention_rate(512)[0] for n in (1, 4))
    assert one == pytest.approx(four)
    assert any("cpu_attention_group" in u for u in TensorParallel.from_profile(host, 4)[1])


def test_a_measured_group_attention_replaces_the_assumed_rate():
    """Where the profile measured the ranks' CPU attention at once (the slowest rank over one process), the group
    plans with it, interpolated between the counts measured, and no longer lists the term as assumed; it survives
    the profile's JSON."""
    from hf_scatter.offload.plan.hrm import HierarchicalRoofline
    from hf_scatter.offload.plan.profile import HardwareProfile
    from hf_scatter.offload.plan.tensor_parallel import TensorParallel

    host = two_gpu_host(gpus=4, cpu_cores=64, cpu_attention_group=[[2, 0.7], [4, 0.8]], cpu_attention=[
        {"batch": 64, "context": c, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype_bytes": 2,
         "seconds": c * 1e-5} for c in (256, 1024)])
    assert HardwareProfile.from_dict(host.to_dict()) == host
    one = HierarchicalRoofline(host, 1).cpu_attention_rate(512)[0]
    for n, scale in ((2, 0.7), (3, 0.75), (4, 0.8)):
        assert one / HierarchicalRoofline(host, n).cpu_attention_rate(512)[0] == pytest.approx(scale)
        assert not any("cpu_attention_group" in u for u in TensorParallel.from_profile(host, n)[1])


def test_group_attention_is_measured_with_the_ranks_at_once():
    """One process and two processes of this host attend in lockstep (gloo barriers; no GPU here, so no copies
    meanwhile), taking turns round after round: each size gets one step time per round, the slowest rank's (a
    small micro-batch: the plumbing is under test, not this host's speed); a size that is no rank count is refused
    before any process starts."""
    from hf_scatter.offload.measure import group_attention_seconds

    steps = group_attention_seconds([1, 2], calls=3, rounds=2, rows=32, context=64)
    assert sorted(steps) == [1, 2]
    assert all(len(per_round) == 2 and all(0 < s < 10 for s in per_round) for per_round in steps.values())
    with pytest.raises(ValueError, match="rank counts"):
        group_attention_seconds([0, 2])


def test_one_slow_round_does_not_move_the_group_attention_ratio(monkeypatch):
    """The profile keeps, per rank count, the median of the rounds' group-over-one ratios (each round's group
    against the same round's one process), and its notes give the range: a round in which the host was slow for
    the group alone does not decide the plan."""
    from hf_scatter.offload import measure
    from hf_scatter.offload.plan.profile import HardwareProfile

    rounds = {1: [1.0, 1.0, 2.0, 1.0, 1.0], 2: [0.9, 5.0, 1.8, 1.0, 0.8]}  # ratios 0.9, 5, 0.9, 1.0, 0.8
    monkeypatch.setattr(measure.torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(measure, "group_attention_seconds", lambda sizes, **kw: {n: rounds[n] for n in sizes})
    p = HardwareProfile(name="host")
    measure._group_attention(p, quick=False)
    assert p.cpu_attention_group == [[2, pytest.approx(0.9)]]
    assert "0.80-5.00x" in p.notes["cpu_attention_group"]


@pytest.mark.kernel_bodies("reference")  # its subject is the timing's plumbing, not the kernels' arithmetic
def test_the_launch_cost_is_timed_on_the_runtime_s_own_decode_stages():
    """The per-kernel launch cost comes from the offloaded runtime issuing a tiny model's decode stages (the driver's
    traced "issue pre" + "issue post"), divided by the kernels the planner counts for that stage; the family timed
    is the first given model's."""
    from hf_scatter.offload.families.spec import KERNELS
    from hf_scatter.offload.measure import stage_issue_seconds

    seconds, kernels = stage_issue_seconds("gpt_oss", "cpu", new_tokens=3)
    assert kernels == sum(KERNELS[op] for op in ("qkv", "o_proj", "router", "ffn")) and 0 < seconds < 5


def test_a_rank_that_dies_ends_the_group_measurement_at_once_with_its_name():
    """A rank that fails (its traceback printed by its own process) is named within a second, not after the
    timeout, and the others are stopped."""
    import queue
    import time

    from hf_scatter.offload.measure import _first_result

    class Rank:
        def __init__(self, exitcode):
            self.exitcode, self.killed = exitcode, False

        def kill(self):
            self.killed = True

    ranks = [Rank(None), Rank(1)]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[\(1, 1\)\] exited with an error"):
        _first_result(queue.Queue(), ranks)
    assert time.monotonic() - start < 5 and all(r.killed for r in ranks)


def test_a_shared_host_switch_is_read_from_the_concurrent_copy_measurement():
    from hf_scatter.offload.plan.tensor_parallel import TensorParallel

    shared = two_gpu_host(gpus=4, h2d_pinned_concurrent=[[2, 14e9], [4, 16e9]])  # one switch: 1.4x, then 1.6x
    assert TensorParallel.from_profile(shared, 2)[0].link_scale == pytest.approx(1.4)
    assert TensorParallel.from_profile(shared, 3)[0].link_scale == pytest.approx(1.5)  # between the measured
    tp, assumed = TensorParallel.from_profile(synthetic(), 4)  # nothing measured: independent, and said so
    assert tp.link_scale == 4 and len(assumed) == 4 and "independent" in assumed[0] and "one process" in assumed[3]
    assert tp.allreduce_seconds(0) == pytest.approx(20e-6) and TensorParallel.from_profile(synthetic(), 1)[0] \
        .allreduce_seconds(1e9) == 0


def test_plan_over_gpus_says_where_the_bottleneck_moves():
    """Mixtral-8x7B in 16 GiB per GPU on the H100 host anchors, as the CGOPipe runtime places it: one GPU is
    bound by the link; two and four stream each share over their own link and keep more weights resident in
    their aggregate memory, so the link leaves the critical path and the shared CPU's attention binds: two GPUs
    are faster than one, four hardly faster than two, and the plan says why. Each plan fits each GPU's budget and
    names the multi-GPU terms it assumed."""
    plans = {n: search_policy(MIXTRAL, ANCHORS, Workload(512, 64), "16GiB", gpus=n, placements=[(False, True)])
             for n in (1, 2, 4)}
    rate = {n: p.prediction.tokens_per_s for n, p in plans.items()}
    assert rate[1] < rate[2] <= rate[4] < 1.1 * rate[2]
    assert plans[1].bottleneck == "h2d" and plans[2].bottleneck == plans[4].bottleneck == "cpu"
    assert plans[4].prediction.decode_layer.terms["h2d"] < plans[1].prediction.decode_layer.terms["h2d"] / 4
    for n, p in plans.items():
        assert p.gpus == n and p.prediction.gpus == n and p.prediction.fits
        assert p.prediction.gpu_memory_total <= p.prediction.gpu_usable <= 16 * GiB
        assert (n > 1) == any("allreduce_bus_bandwidth" in u for u in p.prediction.uncalibrated)
    assert "over 4 GPUs (tensor parallel" in plans[4].explain() and "| GPUs (tensor parallel) | 4 |" in \
        plans[4].to_markdown()


def test_plans_over_gpus_refuse_what_cannot_split_or_is_not_there():
    with pytest.raises(PlanError, match="tensor parallelism over 3 GPUs .* 32 query heads, 8 KV heads"):
        search_policy(MIXTRAL, ANCHORS, Workload(512, 64), "16GiB", gpus=3)
    with pytest.raises(PlanError, match="8 GPUs asked but profile 'synthetic' was measured on a host of 2"):
        search_policy(MIXTRAL, two_gpu_host(), Workload(512, 64), "16GiB", gpus=8)
    with pytest.raises(ValueError, match="gpus must be a positive integer"):
        Policy(8, 8, gpus=0)
    two = search_policy(small_moe(), HierarchicalRoofline(two_gpu_host(), 2), Workload(64, 8), "16GiB")
    assert two.gpus == 2  # a roofline of two GPUs plans for two
    from hf_scatter.offload import offload

    # one process without a group is one GPU; before the model is read
    with pytest.raises(PlanError, match=r"planned for 2 GPU\(s\), but this group has 1: plan with gpus=1"):
        offload(None, policy=Policy(8, 8, gpus=2))
    from hf_scatter.offload.plan.cost_model import decode_terms

    with pytest.raises(ValueError, match=r"runs on 2 GPU\(s\) but the roofline models 1"):
        decode_terms(HierarchicalRoofline(synthetic()), small_moe(), Policy(8, 8, gpus=2), 100)


def test_plan_command_compares_gpu_counts(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--gpu-memory", "16GiB",
                 "--placement", "cgopipe", "--gpus", "1", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| GPUs | tokens/s | vs 1 GPU | bottleneck |" in printed and "## 2 GPUs" in printed
    report = json.loads(out.read_text())
    assert sorted(report["by_gpus"]) == ["1", "2"] and report["by_gpus"]["2"]["policy"]["gpus"] == 2
    assert main(["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--gpus", "1", "2",
                 "--plot", str(tmp_path / "r.png")]) == 2
    assert "--plot draws one plan" in capsys.readouterr().err and not (tmp_path / "r.png").exists()


@pytest.mark.gpu
def test_the_launch_cost_is_the_runtime_s_and_prices_its_stages():
    """On the GPU, the profile's launch cost prices a stage at what the driver measured issuing the runtime's
    own decode stages (CUDA graph replays: about 12 us per counted kernel on an H200 host; issued op by op they took
    10-14 times a small module call's 17-18 us)."""
    from hf_scatter.offload.measure import _gpu_launch, stage_issue_seconds

    p = HardwareProfile(name="here")
    _gpu_launch(p, quick=True, family="gpt_oss")
    seconds, kernels = stage_issue_seconds("gpt_oss", "cuda", new_tokens=8)
    assert 1e-6 < p.gpu_launch_s < 2e-3 and "decode stage of a tiny gpt_oss" in p.notes["gpu_launch_s"]
    assert p.gpu_launch_s * kernels == pytest.approx(seconds, rel=0.5)  # two runs of one host-bound measurement


@pytest.mark.gpu
def test_profile_measures_the_expert_kernels_on_the_models_own_experts():
    """On the GPU, each given MoE model whose experts differ from Mixtral's gets curves of its own, in the formats
    its shape can be stored in, that the planner then prices its expert FFN by; Mixtral's shape adds none."""
    from hf_scatter.offload.measure import _gpu_bandwidth, _gpu_flops, _moe_efficiency

    p = HardwareProfile(name="here")
    _gpu_flops(p, quick=True)
    _gpu_bandwidth(p, quick=True)
    odd = ModelSpec(name="odd", family="mixtral", hidden=1056, layers=1, heads=8, kv_heads=2, head_dim=64,
                    intermediate=704, experts=24, top_k=3, vocab=1000)  # multiples of 32, not of 128
    gpt_oss = ModelSpec.from_config("gpt-oss-20b")
    _moe_efficiency(p, quick=True, models=(MIXTRAL, odd, gpt_oss))
    found = {(c["hidden"], c["intermediate"], c["format"]): c["points"] for c in p.moe_efficiency_by_shape}
    assert set(found) == {(1056, 704, "bf16"), (1056, 704, "mxfp4"), (2880, 2880, "bf16"), (2880, 2880, "mxfp4")}
    for points in found.values():
        assert [m for m, _ in points] == pytest.approx([2, 32, 512], rel=0.1)
        assert all(0 < e <= 1 for _, e in points)
    ffn = gpt_oss.prefill_ops(2048, 76)["ffn"]
    measured = synthetic(gpu_flops=p.gpu_flops, gpu_bandwidth=p.gpu_bandwidth, moe_efficiency=p.moe_efficiency,
                         mxfp4_moe_efficiency=p.mxfp4_moe_efficiency)
    own = HierarchicalRoofline(dataclasses.replace(measured, moe_efficiency_by_shape=p.moe_efficiency_by_shape))
    general = HierarchicalRoofline(measured)
    expected = own.gemm_efficiency(ffn.rows, True, "mxfp4", (2880, 2880))
    assert own.gpu_seconds(ffn) == pytest.approx(general.gpu_seconds(ffn) * general.gemm_efficiency(
        ffn.rows, True, "mxfp4") / expected)


@pytest.mark.gpu
def test_profile_measures_the_hosts_gpus_together():
    """On a host of several GPUs: concurrent copies to 2..N of them, and NCCL's all-reduce over all; the plan
    for N GPUs then assumes none of them. On one GPU only the count."""
    import torch

    from hf_scatter.offload.measure import _multi_gpu

    p = HardwareProfile(name="here", h2d_pinned=50e9)
    _multi_gpu(p, quick=True)
    count = torch.cuda.device_count()
    assert p.gpus == count
    if count < 2:
        assert p.h2d_pinned_concurrent == [] and p.allreduce_bus_bandwidth is None
        return
    assert [k for k, _ in p.h2d_pinned_concurrent] == list(range(2, count + 1))
    assert all(rate > 0 for _, rate in p.h2d_pinned_concurrent)
    assert p.allreduce_bus_bandwidth > 1e9 and 0 < p.allreduce_latency_s < 1e-2
    from hf_scatter.offload.plan.tensor_parallel import TensorParallel

    assert TensorParallel.from_profile(p, count)[1] == []
