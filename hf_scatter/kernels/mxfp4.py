"""MXFP4 weights as GPT-OSS checkpoints ship them, and their dequantization.

The OCP microscaling format: each byte holds two e2m1 values (1 sign, 2 exponent, 1 mantissa bit; low nibble
first), and every 32 consecutive values along the input dimension share one e8m0 scale (a power of two stored
as its exponent plus 127). A checkpoint's tensors, as transformers' ``integrations/mxfp4.py`` reads them:

    blocks  [..., N, K // 32, 16]  uint8   (N output rows, 32 values = 16 bytes per group)
    scales  [..., N, K // 32]      uint8
    weight  [..., N, K]            = e2m1(blocks) * 2 ** (scales - 127)

GPT-OSS's experts keep ``gate_up_proj`` as ``[E, hidden, 2 * intermediate]``: that is ``weight`` transposed on
its last two dimensions. The format is 4.25 bits per weight, 3.76x fewer bytes than bf16.

Every value of the format is exact in bf16 and float32, so dequantization is exact (up to float32 overflow of
6 * 2**127 and subnormal results of the smallest scales, which no trained checkpoint holds).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .backend import cdiv, kernels_enabled, triton_runs
from .checks import check_out, fail
from .custom_ops import mutating_op, run_op

GROUP = 32  # values per shared scale
SCALE_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E2M1_MAX_EXPONENT = 2  # 6 = 1.5 * 2**2: a group's scale puts its largest magnitude in [4, 8)
BYTES_PER_WEIGHT = (4 + 8 / GROUP) / 8  # 0.53125
# e8m0 exponents of random groups that look trained: scales of 2**-8 .. 2**-6 put a group's largest values near
# 0.05, as in std-0.02 weights (for benchmarks and profiles, which time the format, not the values)
RANDOM_EXPONENTS = (119, 122)

if kernels_enabled():
    import triton
    import triton.language as tl

    GROUP_SIZE = tl.constexpr(GROUP)  # a global a @jit function may read

    @triton.jit
    def _dequantize_mxfp4_kernel(blocks_ptr, scales_ptr, out_ptr, R, B, BIAS: tl.constexpr,
                                 BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
        # blocks [R, B] bytes (B = K / 2), scales [R, B / 16], out [R, 2 * B]; all contiguous
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_B + tl.arange(0, BLOCK_B)
        mask = (rows < R)[:, None] & (cols < B)[None, :]
        packed = tl.load(blocks_ptr + rows[:, None] * B + cols[None, :], mask=mask, other=0).to(tl.int32)
        exponent = tl.load(scales_ptr + rows[:, None] * (B // 16) + cols[None, :] // 16, mask=mask, other=BIAS)
        scale = _scale(exponent.to(tl.int32))
        lo = _e2m1_bits(packed & 0xF) * scale  # [BLOCK_R, BLOCK_B] fp32
        hi = _e2m1_bits(packed >> 4) * scale
        values = tl.interleave(lo, hi)  # [BLOCK_R, 2 * BLOCK_B]: value 2b from byte b's low nibble
        out_cols = tl.program_id(1) * (2 * BLOCK_B) + tl.arange(0, 2 * BLOCK_B)
        out_mask = (rows < R)[:, None] & (out_cols < 2 * B)[None, :]
        tl.store(out_ptr + rows[:, None] * (2 * B) + out_cols[None, :], values.to(out_ptr.dtype.element_ty),
                 mask=out_mask)

    @triton.jit
    def mxfp4_operands(blocks_ptr, scales_ptr, expert, k0, K, cols, col_mask, stride_be, stride_bn, stride_se,
                       stride_sn, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """``tl.dot_scaled``'s e2m1 operands at K step ``k0`` of one expert's weight [K, N]: the bytes
        [BLOCK_K / 2, BLOCK_N] (packed along K, the first value in the low nibble, as checkpoints pack them)
        and the exponents [BLOCK_N, BLOCK_K / 32]."""
        b = k0 * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(blocks_ptr + expert * stride_be + cols[None, :] * stride_bn + b[:, None],
                         mask=(b < K // 2)[:, None] & col_mask[None, :], other=0)
        g = k0 * (BLOCK_K // GROUP_SIZE) + tl.arange(0, BLOCK_K // GROUP_SIZE)
        exponents = tl.load(scales_ptr + expert * stride_se + cols[:, None] * stride_sn + g[None, :],
                            mask=col_mask[:, None] & (g < K // GROUP_SIZE)[None, :], other=127)
        return packed, exponents

    @triton.jit
    def mxfp4_tile(blocks_ptr, scales_ptr, expert, k0, K, cols, col_mask, stride_be, stride_bn, stride_se, stride_sn,
                   BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
        """The float32 values at K step ``k0`` of one expert's weight [K, N] held as MXFP4 bytes [N, K / 2] (row
        n's values 2b and 2b + 1 in byte b's low and high nibble) and exponents [N, K / 32], K a multiple of 32:
        rows 2b ([BLOCK_K / 2, BLOCK_N]) and rows 2b + 1, apart. A caller multiplies them with the matching
        even and odd input columns, which sums the same products as one [BLOCK_K, BLOCK_N] tile without
        interleaving the halves in registers. Bits are built directly: no table, no exp2."""
        b = k0 * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)  # the tile's bytes along K
        mask = (b < K // 2)[:, None] & col_mask[None, :]
        packed = tl.load(blocks_ptr + expert * stride_be + cols[None, :] * stride_bn + b[:, None], mask=mask,
                         other=0).to(tl.int32)  # [BLOCK_K / 2, BLOCK_N]
        exponent = tl.load(scales_ptr + expert * stride_se + cols[None, :] * stride_sn + (b // 16)[:, None],
                           mask=mask, other=127).to(tl.int32)
        scale = _scale(exponent)
        return _e2m1_bits(packed & 0xF) * scale, _e2m1_bits(packed >> 4) * scale

    @triton.jit
    def _e2m1_bits(nibble):
        """The e2m1 value of 4 bits as float32, from its bits: sign, then exponent 0 (0 or 0.5) or (1 + m/2) * 2**(e-1)."""
        exponent = (nibble >> 1) & 3
        mantissa = nibble & 1
        normal = ((exponent + 126) << 23) | (mantissa << 22)
        magnitude = tl.where(exponent == 0, mantissa * (126 << 23), normal)
        return (magnitude | ((nibble & 8) << 28)).to(tl.float32, bitcast=True)

    @triton.jit
    def _scale(exponent):
        """An e8m0 scale, 2 ** (exponent - 127), as float32 from its bits (exact; exponent 0 is the subnormal
        2 ** -127)."""
        return tl.where(exponent == 0, 0x00400000, exponent << 23).to(tl.float32, bitcast=True)


def scaled_dot_enabled() -> bool:
    """Whether bf16 products with MXFP4 weights run as Triton's ``tl.dot_scaled`` (``HF_SCATTER_MXFP4_DOT``:
    ``scaled``, the default, or ``decode``, which decodes each tile into registers first; both are exact
    decodings, so they differ only in speed)."""
    return os.environ.get("HF_SCATTER_MXFP4_DOT", "scaled") != "decode"


@dataclass(frozen=True)
class Mxfp4Weight:
    """Experts' weights in the kernels' layout [E, d_in, d_out] held as MXFP4, as a checkpoint ships them:
    ``blocks`` [E, d_out, d_in / 32, 16] and ``scales`` [E, d_out, d_in / 32] (uint8; each expert's [d_out, d_in]
    matrix quantized along d_in). The expert GEMMs read it in place; :meth:`dequantize` gives the values."""

    blocks: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self):
        op = "Mxfp4Weight"
        _check_packed(op, self.blocks, self.scales)
        if self.blocks.dim() != 4:
            fail(op, f"blocks must be [E, d_out, d_in/{GROUP}, {GROUP // 2}] (one matrix per expert), got "
                     f"{tuple(self.blocks.shape)}")
        if self.blocks.stride(-1) != 1 or self.blocks.stride(-2) != GROUP // 2 or self.scales.stride(-1) != 1:
            fail(op, "each row of blocks and scales must be contiguous (as a checkpoint stores them): pass "
                     "blocks.contiguous() and scales.contiguous()")

    @property
    def shape(self) -> tuple[int, int, int]:
        E, N, G, _ = self.blocks.shape
        return (E, G * GROUP, N)

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """The values, [E, d_in, d_out] (a transposed view of the dequantized [E, d_out, d_in])."""
        return dequantize_mxfp4(self.blocks, self.scales, dtype).transpose(1, 2)


def _check_packed(op: str, blocks, scales) -> None:
    for name, t in (("blocks", blocks), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            fail(op, f"{name} must be a uint8 tensor (the checkpoint's *_{name}), got "
                     f"{getattr(t, 'dtype', type(t).__name__)}")
    if blocks.dim() < 3 or blocks.shape[-1] != GROUP // 2:
        fail(op, f"blocks must be [..., N, K/{GROUP}, {GROUP // 2}] (16 bytes per group of {GROUP} values), "
                 f"got {tuple(blocks.shape)}")
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        fail(op, f"scales must be blocks' shape without its last dimension, {tuple(blocks.shape[:-1])}, "
                 f"got {tuple(scales.shape)}")
    if scales.device != blocks.device:
        fail(op, f"blocks are on {blocks.device} but scales on {scales.device}")


def dequantize_mxfp4_reference(blocks: torch.Tensor, scales: torch.Tensor,
                               dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Pure-torch definition of :func:`dequantize_mxfp4` (tests and devices without Triton): a table lookup of
    each nibble, then the group's power of two (``ldexp``, as transformers dequantizes)."""
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    packed = blocks.to(torch.int64)
    values = torch.stack((table[packed & 0xF], table[packed >> 4]), dim=-1).flatten(-2)  # [..., N, G, 32]
    values = torch.ldexp(values, (scales.to(torch.int32) - SCALE_BIAS)[..., None].to(dtype))
    return values.flatten(-2)


def dequantize_mxfp4_triton(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Launch the kernel into ``out`` ([..., N, K], contiguous); inputs are assumed validated."""
    B = blocks.shape[-2] * blocks.shape[-1]
    R = out.numel() // (2 * B) if B else 0
    if R == 0:
        return out
    BLOCK_R, BLOCK_B = 16, 64
    _dequantize_mxfp4_kernel[(cdiv(R, BLOCK_R), cdiv(B, BLOCK_B))](
        blocks, scales, out, R, B, BIAS=SCALE_BIAS, BLOCK_R=BLOCK_R, BLOCK_B=BLOCK_B)
    return out


def _dequantize_impl(blocks: torch.Tensor, scales: torch.Tensor, out: torch.Tensor) -> None:
    if triton_runs(out, "dequantize_mxfp4"):
        dequantize_mxfp4_triton(blocks, scales, out)
    else:
        out.copy_(dequantize_mxfp4_reference(blocks, scales, out.dtype))


_dequantize_op = mutating_op("dequantize_mxfp4", "out")(_dequantize_impl)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``blocks [..., N, K/32, 16]`` and ``scales [..., N, K/32]`` (uint8, a checkpoint's ``*_blocks`` and
    ``*_scales``) as ``[..., N, K]`` values in ``dtype`` (exact)."""
    op = "dequantize_mxfp4"
    _check_packed(op, blocks, scales)
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        fail(op, f"dtype must be float32, bfloat16 or float16, got {dtype}")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * GROUP)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    else:
        check_out(op, out, shape, blocks.new_empty(0, dtype=dtype))  # dtype asked for, on blocks' device
        if not out.is_contiguous():
            fail(op, "out must be contiguous")
    run_op(_dequantize_op, _dequantize_impl, blocks.contiguous(), scales.contiguous(), out)
    return out


def random_experts(experts: int, d_in: int, d_out: int, device=None) -> Mxfp4Weight:
    """Random MXFP4 experts' weights [E, d_in, d_out] (uniform bytes, exponents in :data:`RANDOM_EXPONENTS`), laid
    out as checkpoints ship them, made without a float copy."""
    blocks = torch.randint(0, 256, (experts, d_out, d_in // GROUP, GROUP // 2), device=device, dtype=torch.uint8)
    scales = torch.randint(*RANDOM_EXPONENTS, (experts, d_out, d_in // GROUP), device=device, dtype=torch.uint8)
    return Mxfp4Weight(blocks, scales)


def quantize_experts(weight: torch.Tensor) -> Mxfp4Weight:
    """Experts' float weights in the kernels' layout [E, d_in, d_out] as an :class:`Mxfp4Weight` laid out as
    checkpoints ship it (each expert's [d_out, d_in] quantized along d_in), one expert at a time so the
    temporaries stay one expert's."""
    parts = [quantize_mxfp4(w.detach().transpose(0, 1)) for w in weight]
    return Mxfp4Weight(torch.stack([b for b, _ in parts]), torch.stack([s for _, s in parts]))


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., N, K]`` (K a multiple of 32) as MXFP4 ``(blocks, scales)``, the OCP way: each group's
    scale is ``2 ** (floor(log2(max |w|)) - 2)``, and each value rounds to the nearest e2m1 value (ties to the
    even code; beyond 6 it saturates). For making small checkpoints in tests and tools; checkpoints ship
    quantized already."""
    op = "quantize_mxfp4"
    if not weight.is_floating_point() or weight.dim() < 2 or weight.shape[-1] % GROUP:
        fail(op, f"weight must be a float tensor [..., N, K] with K a multiple of {GROUP}, got "
                 f"{weight.dtype} {tuple(weight.shape)}")
    groups = weight.float().unflatten(-1, (-1, GROUP))  # [..., N, G, 32]
    amax = groups.abs().amax(dim=-1)
    _, e = torch.frexp(amax)  # amax = m * 2**e, m in [0.5, 1): floor(log2(amax)) = e - 1, exactly
    exponent = torch.where(amax > 0, (e - 1 - E2M1_MAX_EXPONENT).float(), torch.full_like(amax, -SCALE_BIAS))
    exponent = exponent.clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = groups / torch.exp2(exponent)[..., None]
    # the nearest of the 8 magnitudes; on a tie the even code (mantissa bit 0) wins
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    distance = (scaled.abs()[..., None] - magnitudes).abs()
    tie_break = (torch.arange(8, device=weight.device) & 1) * 1e-6  # prefers the even code among equals
    code = (distance + tie_break).argmin(dim=-1)
    code = code | ((scaled < 0) & (code > 0)).to(code.dtype) << 3  # -0.0 stored as +0.0
    pairs = code.to(torch.uint8).unflatten(-1, (-1, 2))
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return blocks.contiguous(), (exponent + SCALE_BIAS).to(torch.uint8)
