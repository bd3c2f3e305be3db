"""Block-scaled FP8 as DeepSeek-V3 and the Qwen3 FP8 releases ship it: our dequantization and quantization equal
transformers' own bit for bit, the kernel equals the reference for every byte, and the expert GEMMs read FP8
weights in place with the result of their values in float64; with FP8 products (W8A8) the activations are
quantized as torch rounds and the products equal the float64 product of both quantized operands."""

from types import SimpleNamespace

import pytest
import torch
from moe_reference import relative_error, routing_case, scatter2scatter_error

from hf_scatter.kernels.fp8_blocks import (FP8_DTYPE, FP8_MAX, Fp8BlockWeight, dequantize_fp8_blocks,
                                           dequantize_fp8_blocks_reference, dequantize_fp8_rows, quantize_fp8_blocks,
                                           quantize_fp8_rows, quantize_fp8_rows_reference)


@pytest.fixture(autouse=True)
def weights_decoded_in_registers(monkeypatch):
    """Every test here names the products it checks: the weights decoded in registers (W8A16) unless it turns FP8
    products on (or, for the default policy, the setting off); on a GPU the default depends on rows per expert."""
    monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", "0")


# (experts, rows, columns, scale rows, scale columns): odd blocks, a fused gate_up of two half-block matrices
# (two scale rows of 24 rows each), a single block, and several 128 x 128 blocks
SHAPES = [(3, 48, 96, 2, 3), (1, 37, 40, 1, 1), (2, 256, 384, 2, 3)]


def _random_checkpoint(experts, rows, cols, srows, scols, device, seed):
    """Every byte but the NaN codes, scales of trained weights' size and beyond."""
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (experts, rows, cols), generator=g, dtype=torch.uint8)
    data = torch.where((data & 0x7F) == 0x7F, data ^ 1, data)
    scale = torch.exp2(torch.randint(-20, 4, (experts, srows, scols), generator=g).float())
    scale = scale * (1 + torch.rand(experts, srows, scols, generator=g))  # not powers of two: the product rounds
    return data.view(FP8_DTYPE).to(device), scale.to(device)


def _transformers_dequantize(weight, scale_inv, dtype):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(weight, scale_inv, output_dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_transformers_dequantization_bit_for_bit(shape, dtype):
    weight, scale = _random_checkpoint(*shape, "cpu", seed=sum(shape))
    want = _transformers_dequantize(weight, scale, dtype)
    got = dequantize_fp8_blocks_reference(weight, scale, dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_the_reference_and_writes_every_value(shape, dtype, device):
    weight, scale = _random_checkpoint(*shape, device, seed=7 * sum(shape))
    if dtype == torch.float16:
        scale = scale.clamp(max=1.0)  # 448 * scale stays in float16's range
    out = torch.full(tuple(weight.shape), float("nan"), dtype=dtype, device=device)
    got = dequantize_fp8_blocks(weight, scale, dtype, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = dequantize_fp8_blocks_reference(weight.cpu(), scale.cpu(), dtype)
    assert torch.equal(got.cpu(), want)


def test_every_byte_decodes_as_torch_reads_it(device):
    """All 256 codes with a unit scale: the subnormals, both zeros, the largest magnitude and the NaN codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).reshape(1, 2, 128).to(device)
    got = dequantize_fp8_blocks(codes, torch.ones(1, 1, 1, device=device), torch.float32).cpu().flatten()
    want = codes.cpu().to(torch.float32).flatten()
    nan = want.isnan()
    assert nan.sum() == 2 and got[nan].isnan().all()
    assert torch.equal(got[~nan], want[~nan]) and torch.equal(got[~nan].signbit(), want[~nan].signbit())
    assert got[~nan].abs().max() == FP8_MAX


def test_quantizer_equals_transformers_bit_for_bit_and_round_trips():
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 256, 384, generator=g) * torch.logspace(-4, 1, 256)[None, :, None]
    weight[0, :128, :128] = 0.0  # an all-zero block
    got_q, got_s = quantize_fp8_blocks(weight)
    config = SimpleNamespace(weight_block_size=(128, 128), scale_fmt="float")
    want = Fp8Quantize(SimpleNamespace(quantization_config=config))._quantize_one("w.weight", weight)
    assert got_q.dtype == FP8_DTYPE and got_s.shape == (2, 2, 3)
    assert torch.equal(got_q.view(torch.uint8), want["w.weight"].view(torch.uint8))
    assert torch.equal(got_s, want["w.weight_scale_inv"])
    # every block's largest magnitude lands on 448 before rounding: the format's range is used
    values = dequantize_fp8_blocks_reference(got_q, got_s, torch.float32)
    assert (values - weight).abs().max() <= weight.abs().max() / 16  # e4m3: 3 mantissa bits
    assert got_q.view(torch.uint8)[0, :128, :128].eq(0).all() and got_s[0, 0, 0] == 1.0


def test_no_experts_or_rows_give_empty_weights(device):
    for shape in [(0, 5, 32, 1, 1), (3, 0, 32, 1, 1)]:
        weight, scale = _random_checkpoint(*shape, device, seed=1)
        assert dequantize_fp8_blocks(weight, scale).shape == shape[:3]


def test_bad_input_names_the_tensor_and_the_layout():
    weight, scale = _random_checkpoint(2, 48, 96, 2, 3, "cpu", seed=0)
    with pytest.raises(ValueError, match="weight must be a float8_e4m3fn tensor"):
        dequantize_fp8_blocks(weight.float(), scale)
    with pytest.raises(ValueError, match="scale_inv must be a float32 tensor"):
        dequantize_fp8_blocks(weight, scale.bfloat16())
    with pytest.raises(ValueError, match=r"a weight \[48, 96\] needs a scale grid that divides it .* got \[5, 3\]"):
        dequantize_fp8_blocks(weight, torch.ones(2, 5, 3))
    with pytest.raises(ValueError, match=r"weight's leading dimensions \(2,\)"):
        dequantize_fp8_blocks(weight, scale[0])
    with pytest.raises(ValueError, match=r"out must be \(2, 48, 96\) torch.bfloat16"):
        dequantize_fp8_blocks(weight, scale, torch.bfloat16, out=torch.empty(2, 48, 96))
    with pytest.raises(ValueError, match=r"multiples of the block \(128, 128\)"):
        quantize_fp8_blocks(torch.randn(3, 40))
    with pytest.raises(ValueError, match=r"one matrix per expert"):
        Fp8BlockWeight(weight[0], scale[0])
    with pytest.raises(ValueError, match=r"contiguous"):
        Fp8BlockWeight(weight.transpose(1, 2), scale.transpose(1, 2))


# ------------------------------------------------------------------------ expert GEMMs on FP8 weights
def _weight(E, N, K, SN, SK, device, seed) -> Fp8BlockWeight:
    weight, _ = _random_checkpoint(E, N, K, SN, SK, device, seed)
    g = torch.Generator().manual_seed(seed)
    scale = (2.0**-10 * (1 + torch.rand(E, SN, SK, generator=g))).to(device)  # values up to ~0.9
    return Fp8BlockWeight(weight, scale)


# fp32: fp32 accumulation over K; bf16: the values rounded to bf16 (as the kernel computes with them) and the
# output's rounding, each 2**-9 relative
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_grouped,y_grouped,with_bias,empty_expert", [
    (False, False, False, False), (False, True, True, True), (True, False, True, False), (True, True, False, True)])
@pytest.mark.parametrize("K,SK", [(96, 3), (256, 2)])
def test_scatter2scatter_reads_fp8_weights_in_place(device, dtype, x_grouped, y_grouped, with_bias, empty_expert, K,
                                                   SK):
    """Odd d_out of one scale row, d_in of three blocks (a K step crosses blocks: a scale per weight) or of two
    128-wide blocks (a step lies within one: a scale per column), an expert no token chose, output poisoned:
    every slot equals the float64 product with the weight's values."""
    E, N = 5, 37
    weight = _weight(E, N, K, 1, SK, device, seed=5)
    values = dequantize_fp8_blocks_reference(weight.weight.cpu(), weight.scale_inv.cpu(), torch.float32)
    values = values.to(dtype).double().transpose(1, 2)  # [E, K, N], rounded as the kernel computes with them
    error = scatter2scatter_error(weight, values, device, dtype, x_grouped, y_grouped, with_bias, empty_expert)
    assert error < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_experts_on_fp8_equal_their_values_forward_and_input_gradient(device, dtype):
    """The SiLU experts of Qwen3-MoE and DeepSeek ([gate; up] concatenated, two scale rows per half) on FP8
    weights against the same layer on their dequantized values: the same output, and through the frozen
    quantized experts the same input and gate gradients (a LoRA adapter's path)."""
    from hf_scatter.moe.swiglu_experts import swiglu_experts

    T, k, E, d, inter = 23, 2, 4, 64, 96
    _, routing = routing_case(T, k, E, device, empty_expert=True)
    w_in, w_out = _weight(E, 2 * inter, d, 4, 2, device, seed=1), _weight(E, d, inter, 2, 3, device, seed=2)
    x = torch.randn(T, d, device=device, dtype=dtype).requires_grad_()
    gates = torch.rand(T, k, device=device, dtype=dtype).requires_grad_()
    dy = torch.randn(T, d, device=device, dtype=dtype)

    def run(w1, w2):
        y = swiglu_experts(x, w1, w2, gates, routing)
        return (y, *torch.autograd.grad(y, (x, gates), dy))

    got = run(w_in, w_out)
    want = run(w_in.dequantize(dtype), w_out.dequantize(dtype))  # frozen (no requires_grad), like the FP8 ones
    for g, w in zip(got, want):
        assert relative_error(g.cpu(), w.double().cpu()) < TOL[dtype]
    with torch.no_grad():  # generation: no autograd node
        assert relative_error(swiglu_experts(x, w_in, w_out, gates, routing).cpu(), want[0].double().cpu()) < TOL[dtype]


def test_fp8_weight_reports_its_layout():
    weight = _weight(2, 48, 96, 2, 3, "cpu", seed=0)
    assert weight.shape == (2, 96, 48) and weight.block == (24, 32)
    assert weight.dequantize(torch.float32).shape == (2, 96, 48)
    from hf_scatter.kernels.scatter2scatter import scatter2scatter
    from hf_scatter.moe import flatten_sort_count

    se, ss, off = flatten_sort_count(torch.tensor([[0], [1]]), 2)
    with pytest.raises(ValueError, match=r"x has 32 features but weight expects d_in=96"):
        scatter2scatter(torch.randn(2, 32), weight, se, ss, off)


def test_partial_last_blocks_of_a_configured_block_size(device):
    """DeepSeek-V3's ``kv_a_proj_with_mqa`` is [576, 7168] with [5, 56] scales in 128 x 128 blocks: the last row
    block holds 64 rows. Scaled down: [24, 40] in 16 x 16 blocks. Dequantized, and read by the linear layer's
    GEMM (one expert, grouped in and out), each value takes its own block's scale."""
    from hf_scatter.models.fp8_experts import Fp8BlockLinear

    weight, _ = _random_checkpoint(1, 24, 40, 2, 3, "cpu", seed=11)
    scale = torch.tensor([[[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]]) * 2.0**-8
    want = weight[0].float() * scale[0].repeat_interleave(16, 0)[:24].repeat_interleave(16, 1)[:, :40]
    got = dequantize_fp8_blocks(weight.to(device), scale.to(device), torch.float32, block=(16, 16))
    assert torch.equal(got[0].cpu(), want)
    with pytest.raises(ValueError, match=r"in blocks of \(16, 16\) needs \[2, 3\] scales, got \[2, 2\]"):
        dequantize_fp8_blocks(weight, scale[..., :2], block=(16, 16))
    layer = Fp8BlockLinear(40, 24, (16, 16), bias=True).to(device)
    layer.weight.data, layer.weight_scale_inv.data = weight[0].to(device), scale[0].to(device)
    torch.nn.init.normal_(layer.bias)
    x = torch.randn(3, 5, 40, device=device)
    out = torch.full((3, 5, 24), float("nan"), device=device)
    with torch.no_grad():
        out.copy_(layer(x))
    ref = x.double().cpu() @ want.double().T + layer.bias.double().cpu()
    assert relative_error(out.cpu().reshape(15, 24), ref.reshape(15, 24)) < TOL[torch.float32]
    x.requires_grad_()  # a gradient to the input: the weight decoded for that call
    layer(x).sum().backward()
    assert relative_error(x.grad.cpu().reshape(15, 40), want.double().sum(0).expand(15, 40)) < TOL[torch.float32]


def test_experts_the_kernels_cannot_read_are_refused_and_other_gates_decode_their_weights():
    """A dimension of several 128-blocks that ends in a partial one ([H, 192] in 128 x 128 blocks: derived
    blocks of 96 would misplace 32 columns' scales) is refused with the load that works; a fused [gate; up] of
    halves narrower than a block (transformers' two scale rows) reads right. A gate the fused kernel does not
    know runs the ParallelLinear chain on the weights' values."""
    from hf_scatter.models.experts import fp8_expert_weight
    from hf_scatter.moe.mlp import expert_mlp

    experts = torch.nn.Module()
    experts.block_size = [128, 128]
    experts.down_proj = _weight(2, 64, 192, 1, 2, "cpu", seed=3).weight
    experts.down_proj_scale_inv = torch.ones(2, 1, 2)
    with pytest.raises(NotImplementedError, match=r"down_proj is \[64, 192\] in \(128, 128\) blocks.*dequantize=True"):
        fp8_expert_weight(experts, "down_proj")
    experts.gate_up_proj = _weight(2, 192, 64, 2, 1, "cpu", seed=4).weight  # I = 96: one block per half
    experts.gate_up_proj_scale_inv = torch.ones(2, 2, 1)
    assert fp8_expert_weight(experts, "gate_up_proj").block == (96, 64)
    w_in, w_out = _weight(2, 64, 32, 2, 1, "cpu", seed=5), _weight(2, 32, 32, 1, 1, "cpu", seed=6)
    x, idx, gates = torch.randn(7, 32), routing_case(7, 2, 2, "cpu", empty_expert=False)[0], torch.rand(7, 2)

    def gelu_gate(h):
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.gelu(gate) * up

    got = expert_mlp(x, (w_in,), w_out, idx, gates, gelu_gate)
    want = expert_mlp(x, (w_in.dequantize(x.dtype),), w_out.dequantize(x.dtype), idx, gates, gelu_gate)
    assert relative_error(got, want.double()) < TOL[torch.float32]


# ------------------------------------------------------------------------ FP8 products (W8A8)
def test_activations_round_to_the_nearest_e4m3_ties_to_even_as_torch_casts(device):
    """Each row [448, c] has the unit scale, so ``c`` itself is rounded: every finite e4m3 value, every midpoint
    between neighbours (a tie, to the even code), a float32 step to either side of each midpoint, both signs.
    The GPU uses its own conversion, the interpreter the kernel's bit arithmetic: both give torch's byte."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
    values = codes[codes.isfinite() & (codes >= 0)].unique()  # 0 .. 448, the subnormals included
    mids = (values[:-1] + values[1:]) / 2
    c = torch.cat([values, mids, torch.nextafter(mids, mids + 1), torch.nextafter(mids, mids - 1)])
    c = torch.cat([c, -c])
    rows = torch.stack([torch.full_like(c, FP8_MAX), c], 1).to(device)  # [R, 2]
    got, scales = quantize_fp8_rows(rows, group=2)
    assert torch.equal(scales.cpu(), torch.ones(len(c), 1))
    want = c.to(FP8_DTYPE)
    assert torch.equal(got[:, 1].cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("R,K,group", [(5, 300, 128), (17, 64, 32), (3, 40, 64), (0, 128, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantizer_equals_its_reference_and_writes_every_value(device, R, K, group, dtype):
    """Rows of values from 1e-8 to 1e3, an all-zero row, a last group that is partial; outputs poisoned (NaN
    codes and scales): values and scales equal the reference's bit for bit, and each value times its scale is
    within e4m3's rounding of the input (half a unit in the last of 3 bits, or of the subnormal step)."""
    from hf_scatter.kernels.fp8_blocks import _quantize_rows_impl

    g = torch.Generator().manual_seed(R * K + group)
    x = (torch.randn(R, K, generator=g) * torch.logspace(-8, 3, K)).to(dtype)
    if R > 2:
        x[2] = 0
    values = torch.full((R, K), 0x7F, dtype=torch.uint8).view(FP8_DTYPE).to(device)
    scales = torch.full((R, -(-K // group)), float("nan")).to(device)
    _quantize_rows_impl(x.to(device), group, values, scales)
    want_values, want_scales = quantize_fp8_rows_reference(x, group)
    assert torch.equal(values.cpu().view(torch.uint8), want_values.view(torch.uint8))
    assert torch.equal(scales.cpu(), want_scales)
    step = scales.cpu().repeat_interleave(group, 1)[:, :K]
    error = (dequantize_fp8_rows(values.cpu(), scales.cpu(), group) - x.float()).abs()
    assert (error <= 2.0**-4 * x.float().abs() + 2.0**-10 * step).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("x_grouped,y_grouped,with_bias,empty_expert", [
    (False, False, False, True), (True, True, True, False)])
def test_fp8_products_equal_the_float64_product_of_both_quantized_operands(monkeypatch, device, dtype, x_grouped,
                                                                          y_grouped, with_bias, empty_expert):
    """HF_SCATTER_FP8_PRODUCTS=1: the input rows quantized per 128 columns, d_in of two 128-wide blocks, odd
    d_out, an expert no token chose, output poisoned: every slot equals the float64 product of the quantized
    rows with the weight's values (exact products, float32 sums, one rounding of the output). It is not the
    W8A16 result: the rows really were quantized."""
    from hf_scatter.kernels.scatter2scatter import scatter2scatter

    monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", "1")
    (E, N, K), T, k = (5, 37, 256), 29, 3
    weight = _weight(E, N, K, 1, 2, device, seed=5)
    values = dequantize_fp8_blocks_reference(weight.weight.cpu(), weight.scale_inv.cpu(), torch.float32)
    values = values.double().transpose(1, 2)  # [E, K, N]
    _, (se, ss, off) = routing_case(T, k, E, device, empty_expert)
    bias = torch.randn(E, N, device=device, dtype=dtype) if with_bias else None
    x_tok = torch.randn(T, K, device=device, dtype=dtype)
    out = torch.full((T * k, N), float("nan"), device=device, dtype=dtype)
    scatter2scatter(x_tok[ss // k] if x_grouped else x_tok, weight, se, ss, off, fan_out=1 if x_grouped else k,
                    x_grouped=x_grouped, y_grouped=y_grouped, bias=bias, out=out)
    quantized = dequantize_fp8_rows(*quantize_fp8_rows_reference(x_tok.cpu(), 128), 128).double()

    def product(rows):
        want = torch.einsum("sk,skn->sn", rows[ss.cpu() // k], values[se.cpu()])
        if bias is not None:
            want += bias.double().cpu()[se.cpu()]
        return want if y_grouped else torch.empty_like(want).index_copy_(0, ss.cpu(), want)

    # the H100's tensor cores add FP8 products in fewer bits than float32 (DeepSeek-V3's report: about 14), within
    # the K step of 128 between two float32 scalings: 2.4e-4 measured on an H200
    tol = TOL[dtype] if device.type == "cpu" else max(TOL[dtype], 1e-3)
    assert relative_error(out.cpu(), product(quantized)) < tol
    assert relative_error(out.cpu(), product(x_tok.cpu().double())) > 1e-3


def test_fp8_products_run_for_prefill_on_gpus_that_convert_e4m3_unless_turned_off(monkeypatch):
    """The default: FP8 products past a few routed rows per expert (64 rows for a one-expert GEMM), 16- or 8-bit
    activations, a GPU of compute capability 8.9+; W8A16 elsewhere. The setting forces either, but never where
    the weight's block along K is not a power of two of at least 32."""
    from hf_scatter.kernels import scatter2scatter as s2s

    weight = _weight(4, 128, 256, 1, 2, "cpu", seed=0)
    x = torch.empty(1, 256, dtype=torch.bfloat16)
    monkeypatch.delenv("HF_SCATTER_FP8_PRODUCTS", raising=False)
    assert not s2s.fp8_products_apply(x, weight, 4096)  # a CPU tensor
    assert not s2s.fp8_products_apply(x, weight.dequantize(), 4096)  # not FP8
    on_gpu = SimpleNamespace(dtype=torch.bfloat16, is_cuda=True, device=torch.device("cuda", 0))  # what is read
    monkeypatch.setattr(s2s, "converts_e4m3", lambda index: True)
    rows = s2s.FP8_PRODUCTS_ROWS
    assert s2s.fp8_products_apply(on_gpu, weight, 4 * (rows + 1))
    assert not s2s.fp8_products_apply(on_gpu, weight, 4 * rows)
    dense = _weight(1, 128, 256, 1, 2, "cpu", seed=0)
    assert s2s.fp8_products_apply(on_gpu, dense, 65) and not s2s.fp8_products_apply(on_gpu, dense, 64)
    assert not s2s.fp8_products_apply(SimpleNamespace(**{**vars(on_gpu), "dtype": torch.float32}), weight, 4096)
    x = on_gpu
    monkeypatch.setattr(s2s, "converts_e4m3", lambda index: False)
    assert not s2s.fp8_products_apply(x, weight, 4096)
    monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", "1")
    assert s2s.fp8_products_apply(x, weight, 1)
    assert s2s.fp8_products_apply(x, _weight(4, 128, 96, 1, 3, "cpu", seed=0), 1)  # 32-column blocks
    for columns in (2, 6):  # blocks of 48 and of 16 columns
        assert not s2s.fp8_products_apply(x, _weight(4, 128, 96, 1, columns, "cpu", seed=0), 1)
    monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", "0")
    assert not s2s.fp8_products_apply(x, weight, 4096)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_experts_with_fp8_products_equal_their_reference(monkeypatch, device, dtype):
    """The SiLU experts' forward with FP8 products in both projections (the first one's SwiGLU epilogue, the
    second quantizing h): the kernels equal the torch reference of the same arithmetic, within the roundings of
    h and of the output in the activations' dtype, and differ from the W8A16 layer by the quantization. (Each
    GEMM is held to float64 above.)"""
    from hf_scatter.moe.swiglu_experts import swiglu_experts

    monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", "1")
    T, k, E, d, inter = 23, 2, 4, 128, 192
    _, routing = routing_case(T, k, E, device, empty_expert=True)
    w_in, w_out = _weight(E, 2 * inter, d, 3, 1, device, seed=1), _weight(E, d, inter, 1, 3, device, seed=2)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, d, generator=g).to(device, dtype)
    gates = torch.rand(T, k, generator=g).to(device, dtype)
    with torch.no_grad():
        got = swiglu_experts(x, w_in, w_out, gates, routing)
        monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")
        want = swiglu_experts(x, w_in, w_out, gates, routing)
        monkeypatch.setenv("HF_SCATTER_FP8_PRODUCTS", "0")
        w8a16 = swiglu_experts(x, w_in, w_out, gates, routing)
    # bf16: h is rounded to bf16 before it is quantized, by another summation order on each side, and a code
    # that moves moves by a whole e4m3 step (2**-4 relative)
    tol = {torch.float32: 1e-5, torch.bfloat16: 4e-2}[dtype]
    assert relative_error(got.cpu(), want.double().cpu()) < tol
    assert relative_error(got.cpu(), w8a16.double().cpu()) > 1e-3
