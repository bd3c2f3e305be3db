"""MXFP4 as GPT-OSS checkpoints ship it: our dequantization equals transformers' own bit for bit, the kernel
equals the reference, the quantizer that makes small test checkpoints picks a nearest value of the format, and
the expert GEMMs read MXFP4 weights in place with the result of their values in float64."""

import pytest
import torch
from moe_reference import relative_error, routing_case, scatter2scatter_error

from hf_scatter.kernels.mxfp4 import (E2M1_VALUES, GROUP, Mxfp4Weight, dequantize_mxfp4, dequantize_mxfp4_reference,
                                      quantize_mxfp4)

# odd sizes: 3 experts, 5 output rows, 3 groups of 32 inputs; then one expert's shape of a GPT-OSS layer, scaled
SHAPES = [(3, 5, 3), (1, 1, 1), (2, 13, 4)]


def _random_checkpoint(experts, rows, groups, device, seed, scale_range=(110, 140)):
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, rows, groups, GROUP // 2), generator=g, dtype=torch.uint8)
    scales = torch.randint(*scale_range, (experts, rows, groups), generator=g, dtype=torch.uint8)
    return blocks.to(device), scales.to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_transformers_dequantization_bit_for_bit(shape, dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random_checkpoint(*shape, "cpu", seed=sum(shape))
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # GPT-OSS's [E, K, N]
    got = dequantize_mxfp4_reference(blocks, scales, dtype).transpose(1, 2)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES + [(2, 3, 5)])
def test_kernel_equals_the_reference_and_writes_every_value(shape, dtype, device):
    # float16 holds 2**-14 .. 65504: scales around 127 keep every value of the format in range
    blocks, scales = _random_checkpoint(*shape, device, seed=7 * sum(shape),
                                        scale_range=(120, 131) if dtype == torch.float16 else (1, 255))
    out = torch.full((*shape[:2], shape[2] * GROUP), float("nan"), dtype=dtype, device=device)
    got = dequantize_mxfp4(blocks, scales, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = dequantize_mxfp4_reference(blocks.cpu(), scales.cpu(), torch.float32)
    finite = want.isfinite() & (want.abs() >= torch.finfo(torch.float32).tiny)  # the format's normal range
    assert torch.equal(got.float().cpu()[finite], want[finite].to(dtype).float())
    assert not got.isnan().any()


def test_no_experts_or_rows_give_empty_weights(device):
    for shape in [(0, 5, 2), (3, 0, 2)]:
        blocks, scales = _random_checkpoint(*shape, device, seed=1)
        assert dequantize_mxfp4(blocks, scales).shape == (*shape[:2], shape[2] * GROUP)


def test_quantizer_picks_a_nearest_value_and_round_trips_the_formats_own_values():
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 7, 3 * GROUP, generator=g) * torch.logspace(-3, 2, 7)[None, :, None]
    weight[0, 0, :GROUP] = 0.0  # an all-zero group
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 7, 3, GROUP // 2) and scales.shape == (2, 7, 3)
    got = dequantize_mxfp4_reference(blocks, scales, torch.float32)
    # brute force: every value of the format at the group's scale; the chosen one is at the least distance
    step = torch.exp2(scales.float() - 127).repeat_interleave(GROUP, dim=-1)
    candidates = torch.tensor(E2M1_VALUES)[None, None, None, :] * step[..., None]
    best = (candidates - weight[..., None]).abs().amin(dim=-1)
    assert torch.equal((got - weight).abs(), best)
    # the group's largest magnitude lands in [4, 8) before rounding: no scale wastes the format's range
    amax = weight.unflatten(-1, (-1, GROUP)).abs().amax(-1)
    ratio = amax / torch.exp2(scales.float() - 127)
    assert ((ratio >= 4) & (ratio < 8) | (amax == 0)).all()
    # dequantized values are the format's own: quantized again, the same bytes
    again = quantize_mxfp4(got)
    assert torch.equal(again[0], blocks) and torch.equal(again[1], scales)


def test_bad_input_names_the_tensor_and_the_layout():
    blocks, scales = _random_checkpoint(2, 3, 2, "cpu", seed=0)
    with pytest.raises(ValueError, match="blocks must be a uint8 tensor"):
        dequantize_mxfp4(blocks.float(), scales)
    with pytest.raises(ValueError, match=r"16 bytes per group of 32 values"):
        dequantize_mxfp4(blocks[..., :8], scales)
    with pytest.raises(ValueError, match=r"scales must be blocks' shape without its last dimension"):
        dequantize_mxfp4(blocks, scales[:, :, :1])
    with pytest.raises(ValueError, match=r"out must be \(2, 3, 64\) torch.bfloat16"):
        dequantize_mxfp4(blocks, scales, torch.bfloat16, out=torch.empty(2, 3, 64))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantize_mxfp4(torch.randn(3, 40))


# ------------------------------------------------------------------------ expert GEMMs on MXFP4 weights
def _weight(E, N, K, device, seed) -> Mxfp4Weight:
    # scales around 2**-7 keep values near trained weights' size; every code of the format appears
    return Mxfp4Weight(*_random_checkpoint(E, N, K // GROUP, device, seed, scale_range=(118, 124)))


TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # fp32 accumulation over K; bf16: the output's rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_grouped,y_grouped,with_bias,empty_expert", [
    (False, False, False, False), (False, True, True, True), (True, False, True, False), (True, True, False, True)])
def test_scatter2scatter_reads_mxfp4_weights_in_place(device, dtype, x_grouped, y_grouped, with_bias, empty_expert):
    """Odd d_out, d_in of three groups, an expert no token chose, output poisoned: every slot equals the float64
    product with the weight's values."""
    E, K, N = 5, 96, 37
    weight = _weight(E, N, K, device, seed=5)
    values = dequantize_mxfp4_reference(weight.blocks.cpu(), weight.scales.cpu(), torch.float64).transpose(1, 2)
    error = scatter2scatter_error(weight, values, device, dtype, x_grouped, y_grouped, with_bias, empty_expert)
    assert error < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_experts_on_mxfp4_equal_their_values_forward_and_input_gradient(device, dtype):
    """The whole SwiGLU layer (GPT-OSS's interleaved, biased, clamped gate in the first GEMM's epilogue) on
    MXFP4 weights against the same layer on their dequantized values: the same output, and through the frozen
    quantized experts the same input and gate gradients (a LoRA adapter's path)."""
    from hf_scatter.kernels.swiglu import gpt_oss_gate
    from hf_scatter.moe.swiglu_experts import swiglu_experts

    T, k, E, d, inter = 23, 2, 4, 64, 96
    _, routing = routing_case(T, k, E, device, empty_expert=True)
    w_in, w_out = _weight(E, 2 * inter, d, device, seed=1), _weight(E, d, inter, device, seed=2)
    b_in = torch.randn(E, 2 * inter, device=device, dtype=dtype)
    b_out = torch.randn(E, d, device=device, dtype=dtype)
    form = gpt_oss_gate(1.702, 7.0)
    x = (torch.randn(T, d, device=device, dtype=dtype) * 4).requires_grad_()
    gates = torch.rand(T, k, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(T, d, device=device, dtype=dtype)

    def run(w1, w2):
        y = swiglu_experts(x, w1, w2, gates, routing, b_in, b_out, form)
        return (y, *torch.autograd.grad(y, (x, gates), dy))

    got = run(w_in, w_out)
    want = run(w_in.dequantize(dtype), w_out.dequantize(dtype))  # frozen (no requires_grad), like the MXFP4 ones
    for g, w in zip(got, want):
        assert relative_error(g.cpu(), w.double().cpu()) < TOL[dtype]
    with torch.no_grad():  # generation: no autograd node
        assert relative_error(swiglu_experts(x, w_in, w_out, gates, routing, b_in, b_out, form).cpu(),
                        want[0].double().cpu()) < TOL[dtype]


def test_mxfp4_weight_names_the_layout_it_needs():
    blocks, scales = _random_checkpoint(2, 3, 2, "cpu", seed=0)
    weight = Mxfp4Weight(blocks, scales)
    assert weight.shape == (2, 64, 3) and weight.dequantize(torch.float32).shape == (2, 64, 3)
    with pytest.raises(ValueError, match=r"one matrix per expert"):
        Mxfp4Weight(blocks[0], scales[0])
    with pytest.raises(ValueError, match=r"contiguous"):
        Mxfp4Weight(torch.cat([blocks, blocks], -1)[..., ::2], scales)
    with pytest.raises(ValueError, match=r"scales must be a uint8 tensor"):
        Mxfp4Weight(blocks, scales.float())
    from hf_scatter.kernels.scatter2scatter import scatter2scatter
    from hf_scatter.moe import flatten_sort_count

    se, ss, off = flatten_sort_count(torch.tensor([[0], [1]]), 2)
    with pytest.raises(ValueError, match=r"x has 32 features but weight expects d_in=64"):
        scatter2scatter(torch.randn(2, 32), weight, se, ss, off)
