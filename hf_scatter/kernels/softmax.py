"""Fused masked softmax over attention scores: ``softmax(scale * x + mask)`` with dropout, and its backward.

Unfused, BERT's eager attention scales the scores, adds the mask, takes the softmax and applies dropout:
four passes over the largest activation of the layer. Here each program reads ``BLOCK_M`` rows once
(several short rows per program, TurboTransformers' batch reduction) and writes the result once.

Masks broadcast without being materialised: the kernel reads the mask through its expanded strides
(0 on broadcast dims), so BERT's ``[B, 1, 1, S]`` and ``[B, 1, S, S]`` additive masks cost one small read.
An entry whose mask is ``-inf`` or at most ``finfo(mask.dtype).min`` (what HF writes for padding) is
masked out exactly; a row with every entry masked gives zeros, not NaN (unfused torch gives NaN for
``-inf`` and a uniform row for ``finfo.min``).

Dropout draws from Philox4x32-10 keyed by a 62-bit seed that the caller takes from torch's default CPU
generator, counter = the element's row-major index in the scores. So outputs are deterministic given
``torch.manual_seed``, the backward regenerates the keep mask instead of storing it, and the torch
reference (``philox_uniform``) reproduces Triton's ``tl.rand`` bit for bit: both paths drop the same
elements. The stream differs from ``torch.nn.functional.dropout``'s.

The public call :func:`fused_masked_softmax` checks its arguments, then runs a ``torch.autograd.Function``
whose forward and backward call the ``hf_scatter::masked_softmax_fwd`` / ``masked_softmax_bwd`` custom ops
(see ``custom_ops``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_rows, check_same_place, check_tensor, fail
from .custom_ops import mutating_op, profiled, run_op

MAX_TRITON_ROW = 16384  # longer rows take the torch reference: one block per row would spill registers

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _row_offsets(rows, D1, D2, stride0, stride1, stride2):
        """Element offset of each flattened row of a [D0, D1, D2, S] view with the given strides."""
        r64 = rows.to(tl.int64)
        outer = r64 // D2
        return (outer // D1) * stride0 + (outer % D1) * stride1 + (r64 % D2) * stride2

    @triton.jit
    def _keep_scale(seed, rows, cols, S, p_drop, inv_keep):
        """1 / (1 - p) where the element is kept, 0 where dropped: the same draw in forward and backward."""
        counter = rows.to(tl.int64)[:, None] * S + cols[None, :]
        return tl.where(tl.rand(seed, counter) >= p_drop, inv_keep, 0.0)

    # A fresh seed every call: specialising on it (divisible by 16 or not) would compile a second variant.
    @triton.jit(do_not_specialize=["seed"])
    def _masked_softmax_fwd_kernel(x_ptr, mask_ptr, y_ptr, out_ptr, R, S, D1, D2,
                                   stride_x0, stride_x1, stride_x2, stride_m0, stride_m1, stride_m2, stride_ms,
                                   scale, mask_min, p_drop, inv_keep, seed,
                                   HAS_MASK: tl.constexpr, DROPOUT: tl.constexpr, STORE_Y: tl.constexpr,
                                   BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_S)
        mask = (rows < R)[:, None] & (cols < S)[None, :]
        x_off = _row_offsets(rows, D1, D2, stride_x0, stride_x1, stride_x2)
        z = tl.load(x_ptr + x_off[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32) * scale
        if HAS_MASK:
            m_off = _row_offsets(rows, D1, D2, stride_m0, stride_m1, stride_m2)
            am = tl.load(mask_ptr + m_off[:, None] + cols[None, :] * stride_ms, mask=mask, other=0.0).to(tl.float32)
            z = tl.where(am <= mask_min, float("-inf"), z + am)
        z = tl.where(mask, z, float("-inf"))
        top = tl.max(z, axis=1)
        top = tl.where(top == float("-inf"), 0.0, top)  # fully masked row: every exp is 0, not NaN
        e = tl.exp(z - top[:, None])
        total = tl.sum(e, axis=1)
        y = e / tl.where(total == 0.0, 1.0, total)[:, None]
        out_off = rows.to(tl.int64)[:, None] * S + cols[None, :]
        if STORE_Y:
            tl.store(y_ptr + out_off, y.to(y_ptr.dtype.element_ty), mask=mask)
        if DROPOUT:
            y = y * _keep_scale(seed, rows, cols, S, p_drop, inv_keep)
        tl.store(out_ptr + out_off, y.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["seed"])
    def _masked_softmax_bwd_kernel(y_ptr, dout_ptr, dx_ptr, R, S, scale, p_drop, inv_keep, seed,
                                   DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.arange(0, BLOCK_S)
        mask = (rows < R)[:, None] & (cols < S)[None, :]
        off = rows.to(tl.int64)[:, None] * S + cols[None, :]
        y = tl.load(y_ptr + off, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(dout_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if DROPOUT:
            g = g * _keep_scale(seed, rows, cols, S, p_drop, inv_keep)
        dx = scale * y * (g - tl.sum(g * y, axis=1)[:, None])
        tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def softmax_blocks(S: int) -> tuple[int, int, int]:
    """Cached: block choice runs on every call, where host time is what small shapes cost."""
    return _softmax_blocks(S, triton_interpreted())


@functools.lru_cache(maxsize=None)
def _softmax_blocks(S: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_S, num_warps): whole rows, as many as make a tile of 1024 values, about 32 a thread
    (fastest on an H200: BERT's 128-token rows 8 to a program, 512-token rows 2 on one warp); larger tiles
    under the interpreter, whose cost is per program."""
    block_s = next_power_of_2(S)
    if interpreted:
        return max(1, 16384 // block_s), block_s, 4
    block_m = max(1, 1024 // block_s)
    return block_m, block_s, max(1, min(16, block_m * block_s // 1024))


def _inv_keep(p: float) -> float:
    return 0.0 if p >= 1.0 else 1.0 / (1.0 - p)


# ------------------------------------------------------------------------------------------ launchers
def masked_softmax_fwd_triton(x4: torch.Tensor, mask4: torch.Tensor | None, scale: float, mask_min: float,
                              dropout_p: float, seed: int, y: torch.Tensor | None, out: torch.Tensor) -> None:
    """``x4``: [D0, D1, D2, S] scores with unit last stride; ``mask4``: the mask expanded to it (any strides);
    ``y`` (pre-dropout, kept for the backward) and ``out`` contiguous. Rows must fit MAX_TRITON_ROW."""
    D0, D1, D2, S = x4.shape
    R = D0 * D1 * D2
    if R == 0 or S == 0:
        return
    block_m, block_s, warps = softmax_blocks(S)
    m = x4 if mask4 is None else mask4
    _masked_softmax_fwd_kernel[(cdiv(R, block_m),)](
        x4, m, out if y is None else y, out, R, S, D1, D2, *x4.stride()[:3], *m.stride(),
        scale, mask_min, dropout_p, _inv_keep(dropout_p), seed,
        HAS_MASK=mask4 is not None, DROPOUT=dropout_p > 0, STORE_Y=y is not None, BLOCK_M=block_m,
        BLOCK_S=block_s, num_warps=warps)


def masked_softmax_bwd_triton(y: torch.Tensor, dout: torch.Tensor, scale: float, dropout_p: float, seed: int,
                              dx: torch.Tensor) -> None:
    """All three contiguous, of one shape; the last dim is the softmax's."""
    S = y.shape[-1]
    R = y.numel() // S if S else 0
    if R == 0:
        return
    block_m, block_s, warps = softmax_blocks(S)
    _masked_softmax_bwd_kernel[(cdiv(R, block_m),)](
        y, dout, dx, R, S, scale, dropout_p, _inv_keep(dropout_p), seed, DROPOUT=dropout_p > 0,
        BLOCK_M=block_m, BLOCK_S=block_s, num_warps=warps)


# ------------------------------------------------------------------------------------------ references
_MASK32 = 0xFFFFFFFF


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of ``a * b`` for 32-bit ``a`` and int64 ``b`` < 2^32, without overflowing int64."""
    lo_part = a * (b & 0xFFFF)  # < 2^48
    hi_part = a * (b >> 16)  # < 2^48; the product is lo_part + hi_part * 2^16
    hi = ((lo_part >> 16) + hi_part) >> 16
    lo = (lo_part + ((hi_part & 0xFFFF) << 16)) & _MASK32
    return hi, lo


def philox_uniform(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [0, 1) equal to Triton's ``tl.rand(seed, counter)`` for int64 ``counter``:
    Philox4x32-10 with key (seed low, seed high) and counter (low, high, 0, 0), first output word."""
    c0, c1 = counter & _MASK32, (counter >> 32) & _MASK32
    c2 = c3 = torch.zeros_like(counter)
    k0, k1 = seed & _MASK32, (seed >> 32) & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(0xCD9E8D57, c2)
        hi_a, lo_a = _mul_hi_lo(0xD2511F53, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & _MASK32, (k1 + 0xBB67AE85) & _MASK32
    signed = torch.where(c0 >= 2 ** 31, c0 - 2 ** 32, c0)  # the word as int32
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.float32) * torch.tensor(4.6566127342e-10, dtype=torch.float32)


def dropout_keep_scale(seed: int, dropout_p: float, shape: torch.Size, device: torch.device,
                       dtype: torch.dtype) -> torch.Tensor:
    """The kernels' dropout factor (1 / (1 - p) kept, 0 dropped) for scores of ``shape``."""
    S = shape[-1]
    rows = torch.arange(torch.Size(shape[:-1]).numel(), device=device, dtype=torch.int64)
    counter = rows[:, None] * S + torch.arange(S, device=device, dtype=torch.int64)
    keep = philox_uniform(seed, counter) >= dropout_p
    return torch.where(keep, torch.tensor(_inv_keep(dropout_p), dtype=torch.float32, device=device),
                       torch.tensor(0.0, device=device)).to(dtype).reshape(shape)


def masked_softmax_reference(x: torch.Tensor, mask: torch.Tensor | None, scale: float, mask_min: float,
                             dropout_p: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax before dropout, output) in x's dtype, computed in fp32 (float64 for float64 scores)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    z = x.to(acc) * scale
    if mask is not None:
        m = mask.to(acc)
        z = torch.where(m <= mask_min, float("-inf"), z + m)
    top = z.amax(-1, keepdim=True)
    e = torch.exp(z - torch.where(top == float("-inf"), 0.0, top))
    total = e.sum(-1, keepdim=True)
    y = e / torch.where(total == 0, 1.0, total)
    out = y
    if dropout_p > 0:
        out = y * dropout_keep_scale(seed, dropout_p, x.shape, x.device, acc)
    return y.to(x.dtype), out.to(x.dtype)


def masked_softmax_backward_reference(y: torch.Tensor, dout: torch.Tensor, scale: float, dropout_p: float,
                                      seed: int) -> torch.Tensor:
    """``scale * y * (g - sum(g * y))`` with ``g`` = dout through the same dropout mask."""
    acc = torch.promote_types(y.dtype, torch.float32)
    yy, g = y.to(acc), dout.to(acc)
    if dropout_p > 0:
        g = g * dropout_keep_scale(seed, dropout_p, y.shape, y.device, acc)
    return (scale * yy * (g - (g * yy).sum(-1, keepdim=True))).to(y.dtype)


# -------------------------------------------------------------------------------------- softmax ops
def _masked_softmax_fwd_impl(x4: torch.Tensor, mask4: Optional[torch.Tensor], scale: float, mask_min: float,
                             dropout_p: float, seed: Optional[torch.Tensor], y: Optional[torch.Tensor],
                             out: torch.Tensor) -> None:
    seed_value = 0 if seed is None else int(seed.item())
    if x4.shape[-1] <= MAX_TRITON_ROW and triton_runs(x4, "fused_masked_softmax"):
        masked_softmax_fwd_triton(x4, mask4, scale, mask_min, dropout_p, seed_value, y, out)
        return
    y_ref, out_ref = masked_softmax_reference(x4, mask4, scale, mask_min, dropout_p, seed_value)
    out.copy_(out_ref)
    if y is not None:
        y.copy_(y_ref)


_masked_softmax_fwd_op = mutating_op("masked_softmax_fwd", "y", "out")(_masked_softmax_fwd_impl)


def _masked_softmax_bwd_impl(y: torch.Tensor, dout: torch.Tensor, scale: float, dropout_p: float,
                             seed: Optional[torch.Tensor], dx: torch.Tensor) -> None:
    seed_value = 0 if seed is None else int(seed.item())
    if y.shape[-1] <= MAX_TRITON_ROW and triton_runs(y, "fused_masked_softmax"):
        masked_softmax_bwd_triton(y, dout, scale, dropout_p, seed_value, dx)
    else:
        dx.copy_(masked_softmax_backward_reference(y, dout, scale, dropout_p, seed_value))


_masked_softmax_bwd_op = mutating_op("masked_softmax_bwd", "dx")(_masked_softmax_bwd_impl)


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::masked_softmax.forward")
    def forward(ctx, x, mask, scale, mask_min, dropout_p, seed):
        lead = (None,) * (4 - x.dim())  # a [D0, D1, D2, S] view of the scores and of the expanded mask
        x4 = x[lead]
        mask4 = None if mask is None else mask.expand(x.shape)[lead]
        out = x.new_empty(x4.shape)
        y = x.new_empty(x4.shape) if dropout_p > 0 else None  # the softmax before dropout, for the backward
        run_op(_masked_softmax_fwd_op, _masked_softmax_fwd_impl, x4, mask4, scale, mask_min, dropout_p, seed, y, out)
        ctx.save_for_backward(out if y is None else y, seed)
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.mask_shape = None if mask is None else mask.shape
        return out.view(x.shape)

    @staticmethod
    @profiled("hf_scatter::masked_softmax.backward")
    @once_differentiable
    def backward(ctx, dout):
        y, seed = ctx.saved_tensors
        need_x, need_mask = ctx.needs_input_grad[:2]
        dz = torch.empty_like(y)
        # A learned additive bias (the mask) gets d(scale * x + mask) = dz: then the kernel runs unscaled.
        scale = 1.0 if need_mask else ctx.scale
        run_op(_masked_softmax_bwd_op, _masked_softmax_bwd_impl, y, dout.contiguous().view(y.shape), scale,
               ctx.dropout_p, seed, dz)
        dz = dz.view(dout.shape)
        dx = (dz * ctx.scale if need_mask else dz) if need_x else None
        dmask = dz.sum_to_size(ctx.mask_shape) if need_mask else None
        return dx, dmask, None, None, None, None


# ------------------------------------------------------------------------------------ public call
def fused_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                         dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """``dropout(softmax(scale * x + mask))`` over the last dimension of 1-D to 4-D scores, differentiable.

    ``mask``: an additive float mask broadcastable to x (BERT's [B, 1, 1, S] or [B, 1, S, S]), read in place.
    Entries that are -inf or at most ``finfo(mask.dtype).min`` are masked; fully masked rows give zeros.
    Dropout (only with ``training``) draws its seed from torch's CPU generator: deterministic given
    ``torch.manual_seed``, and replayed by ``torch.utils.checkpoint``, which restores that generator.
    """
    op = "fused_masked_softmax"
    check_tensor(op, "x", x)
    if x.dim() > 4:
        fail(op, f"x must have 1 to 4 dimensions, got shape {tuple(x.shape)}; merge leading dimensions with "
                 "reshape")
    check_rows(op, "x", x)
    if mask is not None:
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            fail(op, "mask must be an additive float mask, got a bool tensor; convert it with "
                     "torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float('-inf'))")
        check_tensor(op, "mask", mask, min_dim=0)
        check_same_place(op, "mask", mask, x)
        trailing = x.shape[x.dim() - mask.dim():]
        if mask.dim() > x.dim() or any(m not in (1, n) for m, n in zip(mask.shape, trailing)):
            fail(op, f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        fail(op, f"scale must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        fail(op, f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    p = float(dropout_p) if training else 0.0
    seed = torch.randint(2 ** 62, (1,), dtype=torch.int64) if p > 0 else None
    mask_min = float(torch.finfo(mask.dtype).min) if mask is not None else 0.0
    return _MaskedSoftmax.apply(x, mask, float(scale), mask_min, p, seed)
