"""Block-scaled FP8 weights as DeepSeek-V3 and the Qwen3 FP8 releases ship them, and their dequantization.

Each weight matrix [N, K] (output rows, input columns) is stored as ``float8_e4m3fn`` (1 sign, 4 exponent bits
with bias 7, 3 mantissa bits; no infinities, 0x7F / 0xFF are NaN, the largest value 448) beside
``weight_scale_inv`` [N / bn, K / bk] float32: one multiplier per bn x bk block (128 x 128 in every release).
As transformers reads them (``integrations/finegrained_fp8.py``):

    weight     [..., N, K]            float8_e4m3fn
    scale_inv  [..., N / bn, K / bk]  float32       bn = N // scale rows, bk = K // scale columns
    value      [..., N, K]            = float32(weight) * scale_inv[block], rounded once to the model's dtype

transformers derives the block from the two shapes, not from the config: a fused ``gate_up_proj`` of two
matrices narrower than a block holds one scale row per half. We do the same. One byte per weight plus a
float32 per block: 1.0002 bytes, 2x fewer than bf16. Every e4m3 value is exact in float32, so the only
rounding is the product's (float32) and its cast, the same as transformers'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import List, Optional

import torch

from .backend import cdiv, compute_capability, kernels_enabled, triton_interpreted, triton_runs
from .checks import check_out, fail
from .custom_ops import mutating_op, run_op

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max
BLOCK = (128, 128)  # every block-scaled release's weight_block_size
BYTES_PER_WEIGHT = 1 + 4 / (BLOCK[0] * BLOCK[1])
FLOAT_OUT = (torch.float32, torch.bfloat16, torch.float16)
# weight_scale_inv of random blocks that look trained: |values| up to 448 * 2**-13 ~ 0.05, as in std-0.02
# weights (benchmarks and profiles time the format, not the values)
RANDOM_SCALE = 2.0**-13
ACTIVATION_EPS = 1e-10  # the least max |x| a group of activations is scaled by (an all-zero group stays zero)

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def e4m3_bits(byte):
        """The float32 value of an e4m3fn byte (int32 0..255), built from its bits: exact, no table. Exponent 0
        holds the subnormals m * 2**-9; 0x7F and 0xFF are NaN."""
        exponent = (byte >> 3) & 0xF
        mantissa = byte & 7
        normal = ((exponent + 120) << 23) | (mantissa << 20)
        magnitude = tl.where(exponent == 0, 0, normal).to(tl.float32, bitcast=True)
        magnitude = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.001953125, magnitude)  # m * 2**-9
        magnitude = tl.where((byte & 0x7F) == 0x7F, float("nan"), magnitude)
        return (magnitude.to(tl.int32, bitcast=True) | ((byte & 0x80) << 24)).to(tl.float32, bitcast=True)  # -0 too

    @triton.jit
    def e4m3_code(v):
        """The e4m3fn byte (int32) nearest a float32 ``v`` with |v| <= 448, ties to even, as the GPU's
        ``cvt.rn.satfinite`` rounds (the interpreter's own cast truncates). Normal values round their float32
        mantissa to 3 bits (a carry moves the exponent, as it should); below 2**-6 the subnormals m * 2**-9
        come from rounding |v| * 512 with the float32 add-and-subtract of 2**23."""
        magnitude = tl.abs(v)
        bits = magnitude.to(tl.int32, bitcast=True)
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)  # exponent bias 127 -> 7
        subnormal = ((magnitude * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)  # 0..8 (8: the least normal)
        code = tl.where(magnitude < 0.015625, subnormal, normal)
        return code | ((v.to(tl.int32, bitcast=True) >> 24) & 0x80)

    @triton.jit
    def e4m3_bytes(w_ptr, expert, k0, K, cols, col_mask, stride_we, stride_wn, BLOCK_K: tl.constexpr):
        """The bytes [BLOCK_K, BLOCK_N] at K step ``k0`` of one expert's weight [K, N] stored as [N, K]."""
        ks = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        return tl.load(w_ptr + expert * stride_we + cols[None, :] * stride_wn + ks[:, None],
                       mask=(ks < K)[:, None] & col_mask[None, :], other=0)

    @triton.jit
    def e4m3_tile(w_ptr, expert, k0, K, cols, col_mask, stride_we, stride_wn, BLOCK_K: tl.constexpr,
                  CONVERT: tl.constexpr):
        """The e4m3 values [BLOCK_K, BLOCK_N] (float32, unscaled) at K step ``k0`` of one expert's weight [K, N]
        stored as bytes [N, K] (rows contiguous). CONVERT: the GPU's own conversion (sm89+); else from the
        bits (the interpreter has no 8-bit floats)."""
        byte = e4m3_bytes(w_ptr, expert, k0, K, cols, col_mask, stride_we, stride_wn, BLOCK_K)
        if CONVERT:
            return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        return e4m3_bits(byte.to(tl.int32))

    @triton.jit
    def fp8_column_scales(s_ptr, expert, k0, cols, col_mask, stride_se, stride_sn, BLOCK_K: tl.constexpr,
                          W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr):
        """The scales [BLOCK_N] of K step ``k0``'s columns, where the step lies within one block along K
        (W_BLOCK_K a multiple of BLOCK_K): one load per column, not per weight."""
        return tl.load(s_ptr + expert * stride_se + (cols // W_BLOCK_N) * stride_sn + (k0 * BLOCK_K) // W_BLOCK_K,
                       mask=col_mask, other=0.0)

    @triton.jit
    def fp8_block_tile(w_ptr, s_ptr, expert, k0, K, cols, col_mask, stride_we, stride_wn, stride_se, stride_sn,
                       BLOCK_K: tl.constexpr, W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr,
                       CONVERT: tl.constexpr):
        """The float32 values [BLOCK_K, BLOCK_N] at K step ``k0`` of one expert's weight [K, N] stored as e4m3
        bytes [N, K] with float32 scales [N / W_BLOCK_N, K / W_BLOCK_K] (rows of stride_sn), each value times
        its own block's scale (steps that cross blocks along K)."""
        ks = k0 * BLOCK_K + tl.arange(0, BLOCK_K)
        scale = tl.load(s_ptr + expert * stride_se + (cols // W_BLOCK_N)[None, :] * stride_sn +
                        (ks // W_BLOCK_K)[:, None], mask=(ks < K)[:, None] & col_mask[None, :], other=0.0)
        return e4m3_tile(w_ptr, expert, k0, K, cols, col_mask, stride_we, stride_wn, BLOCK_K, CONVERT) * scale

    @triton.jit
    def _dequantize_fp8_blocks_kernel(w_ptr, s_ptr, out_ptr, R, N, K, SN, SK, block_n, block_k,
                                      BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # w [R, K] bytes (R = matrices x N rows), scales [R // N, SN, SK], out [R, K]; all contiguous
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (rows < R)[:, None] & (cols < K)[None, :]
        r64 = rows.to(tl.int64)
        byte = tl.load(w_ptr + r64[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.int32)
        scale_row = (r64 // N) * SN + (r64 % N) // block_n
        scale = tl.load(s_ptr + scale_row[:, None] * SK + (cols // block_k)[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + r64[:, None] * K + cols[None, :], (e4m3_bits(byte) * scale).to(out_ptr.dtype.element_ty),
                 mask=mask)


    @triton.jit
    def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, R, K, stride_xr, SK, CONVERT: tl.constexpr,
                              BLOCK_R: tl.constexpr, GROUP: tl.constexpr):
        # x [R, K] (rows of stride_xr), q [R, K] e4m3 bytes, s [R, SK] float32: one group of GROUP columns
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        mask = (rows < R)[:, None] & (cols < K)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        # correctly rounded divisions, as torch divides (the GPU's default float32 division is approximate)
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), 1e-10), 448.0)  # [BLOCK_R]; 1e-10: ACTIVATION_EPS
        y = tl.clamp(tl.math.div_rn(x, scale[:, None]), -448.0, 448.0)
        if CONVERT:
            code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            code = e4m3_code(y).to(tl.uint8)
        tl.store(q_ptr + r64 * K + cols[None, :], code, mask=mask)
        tl.store(s_ptr + rows.to(tl.int64) * SK + tl.program_id(1), scale, mask=rows < R)


@functools.cache
def converts_e4m3(device_index: int) -> bool:
    """Whether the GPU converts e4m3 in hardware (compute capability 8.9 and later); older ones decode the bits."""
    return compute_capability(device_index) >= (8, 9)


def block_of(op: str, weight_shape, scale_shape, block: tuple[int, int] | None = None) -> tuple[int, int]:
    """(bn, bk), the block each scale covers: ``block`` as a layer's config gives it, whose last blocks may be
    partial (DeepSeek-V3's [576, 7168] projection has [5, 56] scales); else as transformers derives it, rows //
    scale rows and columns // scale columns, each dividing exactly (right for fused matrices too)."""
    (N, K), (SN, SK) = tuple(weight_shape[-2:]), tuple(scale_shape[-2:])
    if block is not None:
        if (cdiv(N, block[0]), cdiv(K, block[1])) != (SN, SK):
            fail(op, f"a weight [{N}, {K}] in blocks of {tuple(block)} needs [{cdiv(N, block[0])}, "
                     f"{cdiv(K, block[1])}] scales, got [{SN}, {SK}]; pass the checkpoint's weight_scale_inv for "
                     "this weight and its config's weight_block_size")
        return tuple(block)
    if SN == 0 or SK == 0 or N % SN or K % SK:
        fail(op, f"a weight [{N}, {K}] needs a scale grid that divides it into equal blocks, got [{SN}, {SK}]; "
                 "pass the checkpoint's weight_scale_inv for this weight as it is")
    return N // SN, K // SK


def _check_stored(op: str, weight, scale_inv, block=None) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dtype != FP8_DTYPE:
        fail(op, f"weight must be a float8_e4m3fn tensor (the checkpoint's weight), got "
                 f"{getattr(weight, 'dtype', type(weight).__name__)}")
    if not isinstance(scale_inv, torch.Tensor) or scale_inv.dtype != torch.float32:
        fail(op, f"scale_inv must be a float32 tensor (the checkpoint's weight_scale_inv), got "
                 f"{getattr(scale_inv, 'dtype', type(scale_inv).__name__)}; power-of-two (ue8m0) scales: pass "
                 "them as float32")
    if weight.dim() < 2 or scale_inv.shape[:-2] != weight.shape[:-2] or scale_inv.dim() != weight.dim():
        fail(op, f"scale_inv must be [..., N / bn, K / bk] with weight's leading dimensions "
                 f"{tuple(weight.shape[:-2])}, got {tuple(scale_inv.shape)} for weight {tuple(weight.shape)}")
    if scale_inv.device != weight.device:
        fail(op, f"weight is on {weight.device} but scale_inv on {scale_inv.device}")
    if weight.numel():
        block_of(op, weight.shape, scale_inv.shape, block)


@dataclass(frozen=True)
class Fp8BlockWeight:
    """Experts' weights in the kernels' layout [E, d_in, d_out] held as block-scaled FP8, as checkpoints ship
    them: ``weight`` [E, d_out, d_in] float8_e4m3fn and ``scale_inv`` [E, d_out / bn, d_in / bk] float32. The
    expert GEMMs read it in place; :meth:`dequantize` gives the values. ``block``: the config's
    weight_block_size for a matrix whose last blocks are partial (None: derived from the shapes)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block_size: tuple[int, int] | None = None

    def __post_init__(self):
        op = "Fp8BlockWeight"
        _check_stored(op, self.weight, self.scale_inv, self.block_size)
        if self.weight.dim() != 3:
            fail(op, f"weight must be [E, d_out, d_in] (one matrix per expert), got {tuple(self.weight.shape)}")
        if self.weight.stride(-1) != 1 or self.scale_inv.stride(-1) != 1:
            fail(op, "each row of weight and scale_inv must be contiguous (as a checkpoint stores them): pass "
                     "weight.contiguous() and scale_inv.contiguous()")

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, K = self.weight.shape
        return (E, K, N)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def block(self) -> tuple[int, int]:
        """(bn, bk): output rows and input columns per scale."""
        if not self.weight.numel():
            return self.block_size or BLOCK
        return block_of("Fp8BlockWeight", self.weight.shape, self.scale_inv.shape, self.block_size)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The values, [E, d_in, d_out] (a transposed view of the dequantized [E, d_out, d_in])."""
        return dequantize_fp8_blocks(self.weight, self.scale_inv, dtype, block=self.block_size).transpose(1, 2)


def dequantize_fp8_blocks_reference(weight: torch.Tensor, scale_inv: torch.Tensor,
                                    dtype: torch.dtype = torch.bfloat16, block=None) -> torch.Tensor:
    """Pure-torch definition of :func:`dequantize_fp8_blocks` (tests and devices without Triton): the float32
    product with each block's scale, cast once, as transformers dequantizes."""
    if not weight.numel():
        return torch.empty(weight.shape, dtype=dtype, device=weight.device)
    N, K = weight.shape[-2:]
    bn, bk = block_of("dequantize_fp8_blocks", weight.shape, scale_inv.shape, block)
    scale = scale_inv.repeat_interleave(bn, dim=-2)[..., :N, :].repeat_interleave(bk, dim=-1)[..., :K]
    return (weight.to(torch.float32) * scale).to(dtype)


def dequantize_fp8_blocks_triton(weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor,
                                 block=None) -> torch.Tensor:
    """Launch the kernel into ``out`` ([..., N, K], contiguous); inputs are assumed validated."""
    N, K = weight.shape[-2:]
    SN, SK = scale_inv.shape[-2:]
    R = out.numel() // K if K else 0
    if R == 0:
        return out
    bn, bk = block_of("dequantize_fp8_blocks", weight.shape, scale_inv.shape, block)
    # the interpreter casts float32 to bf16 / fp16 by truncation; the GPU rounds to nearest, as torch does
    exact = out.dtype == torch.float32 or not triton_interpreted()
    target = out if exact else torch.empty_like(out, dtype=torch.float32)
    BLOCK_R, BLOCK_C = 16, 128
    _dequantize_fp8_blocks_kernel[(cdiv(R, BLOCK_R), cdiv(K, BLOCK_C))](
        weight.view(torch.uint8), scale_inv, target, R, N, K, SN, SK, bn, bk, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
    if target is not out:
        out.copy_(target)
    return out


def _dequantize_impl(weight: torch.Tensor, scale_inv: torch.Tensor, out: torch.Tensor,
                     block: Optional[List[int]] = None) -> None:
    if triton_runs(out, "dequantize_fp8_blocks"):
        dequantize_fp8_blocks_triton(weight, scale_inv, out, block)
    else:
        out.copy_(dequantize_fp8_blocks_reference(weight, scale_inv, out.dtype, block))


_dequantize_op = mutating_op("dequantize_fp8_blocks", "out")(_dequantize_impl)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                          out: torch.Tensor | None = None, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``weight [..., N, K]`` (float8_e4m3fn) and ``scale_inv [..., N / bn, K / bk]`` (float32), a checkpoint's
    ``weight`` and ``weight_scale_inv``, as ``[..., N, K]`` values in ``dtype``, equal to transformers'.
    ``block``: the config's weight_block_size where the last blocks are partial (see :func:`block_of`)."""
    op = "dequantize_fp8_blocks"
    _check_stored(op, weight, scale_inv, block)
    if dtype not in FLOAT_OUT:
        fail(op, f"dtype must be float32, bfloat16 or float16, got {dtype}")
    if out is None:
        out = torch.empty(weight.shape, dtype=dtype, device=weight.device)
    else:
        check_out(op, out, tuple(weight.shape), weight.new_empty(0, dtype=dtype))
        if not out.is_contiguous():
            fail(op, "out must be contiguous")
    if out.numel():
        run_op(_dequantize_op, _dequantize_impl, weight.contiguous(), scale_inv.contiguous(), out,
               None if block is None else list(block))
    return out


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` as ``(float8_e4m3fn weight, float32 scale_inv)`` with transformers' arithmetic:
    each block's multiplier is 448 / max |w| (1 for an all-zero block), the values are multiplied, clamped to
    +-448 and cast; ``scale_inv`` is its float32 reciprocal. N and K must be multiples of the block, as
    transformers requires to quantize. For making small checkpoints in tests and tools."""
    op = "quantize_fp8_blocks"
    bn, bk = block
    if not weight.is_floating_point() or weight.dim() < 2 or weight.shape[-2] % bn or weight.shape[-1] % bk:
        fail(op, f"weight must be a float tensor [..., N, K] with N and K multiples of the block {block}, got "
                 f"{weight.dtype} {tuple(weight.shape)}")
    N, K = weight.shape[-2:]
    blocks = weight.to(torch.float32).reshape(*weight.shape[:-2], N // bn, bn, K // bk, bk)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., N / bn, K / bk]
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax)),
                        torch.ones_like(amax))
    scaled = blocks * scale[..., :, None, :, None]
    quantized = scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(weight.shape)
    return quantized, (1.0 / scale).to(torch.float32)


def random_experts(experts: int, d_in: int, d_out: int, device=None, block: tuple[int, int] = BLOCK) -> Fp8BlockWeight:
    """Random block-scaled FP8 experts' weights [E, d_in, d_out] (uniform bytes but the NaN codes, scale
    :data:`RANDOM_SCALE`), laid out as checkpoints ship them, made without a float copy."""
    if d_out % block[0] or d_in % block[1]:
        fail("random_experts", f"d_in {d_in} and d_out {d_out} must be multiples of the block {block}")
    bytes_ = torch.randint(0, 255, (experts, d_out, d_in), device=device, dtype=torch.uint8)
    bytes_ = torch.where((bytes_ & 0x7F) == 0x7F, bytes_ - 1, bytes_)  # 0x7F / 0xFF are NaN
    scales = torch.full((experts, d_out // block[0], d_in // block[1]), RANDOM_SCALE, device=device)
    return Fp8BlockWeight(bytes_.view(FP8_DTYPE), scales)


def quantize_experts(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> Fp8BlockWeight:
    """Experts' float weights in the kernels' layout [E, d_in, d_out] as an :class:`Fp8BlockWeight` laid out as
    checkpoints ship it (each expert's [d_out, d_in] quantized in blocks), one expert at a time."""
    parts = [quantize_fp8_blocks(w.detach().transpose(0, 1), block) for w in weight]
    return Fp8BlockWeight(torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts]))


def quantize_fp8_rows_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch definition of :func:`quantize_fp8_rows`."""
    R, K = x.shape
    groups = cdiv(K, group)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - K)).view(R, groups, group)
    scale = padded.abs().amax(-1).clamp_min(ACTIVATION_EPS) / FP8_MAX  # [R, K / group]
    values = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return values.view(R, groups * group)[:, :K].contiguous(), scale


def dequantize_fp8_rows(values: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """:func:`quantize_fp8_rows`'s output as the float32 values it stands for, [R, K]."""
    return values.to(torch.float32) * scales.repeat_interleave(group, dim=1)[:, :values.shape[1]]


def quantize_fp8_rows_triton(x: torch.Tensor, group: int, values: torch.Tensor, scales: torch.Tensor) -> None:
    """Launch the kernel into ``values`` and ``scales``; inputs are assumed validated (rows contiguous)."""
    R, K = x.shape
    if R and K:
        convert = not triton_interpreted() and converts_e4m3(x.device.index or 0)
        rows = 16 if triton_interpreted() else max(1, 8192 // group)  # 64 rows of a 128-column group
        _quantize_rows_kernel[(cdiv(R, rows), cdiv(K, group))](x, values.view(torch.uint8), scales, R, K,
                                                               x.stride(0), scales.shape[1], CONVERT=convert,
                                                               BLOCK_R=rows, GROUP=group)


def _quantize_rows_impl(x: torch.Tensor, group: int, values: torch.Tensor, scales: torch.Tensor) -> None:
    if triton_runs(x, "quantize_fp8_rows"):
        quantize_fp8_rows_triton(x, group, values, scales)
    else:
        want_values, want_scales = quantize_fp8_rows_reference(x, group)
        values.copy_(want_values)
        scales.copy_(want_scales)


_quantize_rows_op = mutating_op("quantize_fp8_rows", "values", "scales")(_quantize_rows_impl)


def quantize_fp8_rows(x: torch.Tensor, group: int = BLOCK[1]) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations ``x [R, K]`` as e4m3 values ``[R, K]`` and float32 scales ``[R, ceil(K / group)]``: each
    row's group of ``group`` columns divided by ``max |x| / 448`` and rounded to nearest (ties to even), as
    DeepSeek-V3's and vLLM's block-scaled FP8 inference quantize the activations before an FP8 product.
    ``group`` is a power of two (the weights' block along K)."""
    op = "quantize_fp8_rows"
    if x.dim() != 2 or x.dtype not in FLOAT_OUT:
        fail(op, f"x must be a float32, bfloat16 or float16 matrix [R, K], got {x.dtype} {tuple(x.shape)}")
    if group < 1 or group & (group - 1):
        fail(op, f"group must be a power of two, got {group}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    values = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty((x.shape[0], cdiv(x.shape[1], group)), dtype=torch.float32, device=x.device)
    if x.numel():
        run_op(_quantize_rows_op, _quantize_rows_impl, x, group, values, scales)
    return values, scales
