"""Routing-gate kernels: mixing the k expert outputs of each token, and the gate gradient.

``gate_mix``: ``y[t] = sum_j g[t, j] * y_slots[t*k + j]`` in fp32 (a batched [1, k] x [k, N] matmul runs as
a cuBLAS gemv far below bandwidth); the rows may also be read through ``slot_rows`` (slot s lies in row
``slot_rows[s]``: expert-ordered outputs of the library grouped GEMM), and without gates it is the plain k-sum.
``gate_grad``: ``dots[i] = dx[i] . x[i // fan_out]`` in fp32, optionally scaling ``dx[i]`` by ``coeff[i]`` in
place and writing ``coeff[i] * x[i // fan_out]`` in the same pass. With ``dx = dY W^T`` (the ungated input
gradient) the dots are the gate gradients: ``d g = (x W) . dY = x . (dY W^T)``, so the forward's [T*k, d_out]
expert outputs need not be kept for backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_float, check_index, check_like, check_out, fail
from .custom_ops import mutating_op, run_op

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_mix_kernel(y_ptr, g_ptr, rows_ptr, out_ptr, T, N, stride_ym, stride_gt, stride_gk, stride_ot,
                         K_SLOTS: tl.constexpr, HAS_GATES: tl.constexpr, GATHER: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t_mask = tokens < T
        mask = t_mask[:, None] & (cols < N)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(K_SLOTS):  # unrolled: the k rows' loads are all in flight at once
            slot = tokens.to(tl.int64) * K_SLOTS + j
            if GATHER:
                slot = tl.load(rows_ptr + slot, mask=t_mask, other=0).to(tl.int64)
            y = tl.load(y_ptr + slot[:, None] * stride_ym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            if HAS_GATES:
                y *= tl.load(g_ptr + tokens * stride_gt + j * stride_gk, mask=t_mask, other=0.0).to(tl.float32)[:, None]
            acc += y
        tl.store(out_ptr + tokens[:, None].to(tl.int64) * stride_ot + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _gate_grad_kernel(dx_ptr, x_ptr, coeff_ptr, dots_ptr, xs_ptr, M, N, stride_dxm, stride_xm, stride_xsm,
                          FAN_OUT: tl.constexpr, SCALE: tl.constexpr, SCALED_X: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r_mask = rows < M
        dx_rows = rows.to(tl.int64)
        x_rows = (rows // FAN_OUT).to(tl.int64)
        if SCALE:
            c = tl.load(coeff_ptr + rows, mask=r_mask, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            mask = r_mask[:, None] & (cols < N)[None, :]
            dx = tl.load(dx_ptr + dx_rows[:, None] * stride_dxm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + x_rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += tl.sum(dx * x, axis=1)
            if SCALE:
                tl.store(dx_ptr + dx_rows[:, None] * stride_dxm + cols[None, :],
                         (dx * c[:, None]).to(dx_ptr.dtype.element_ty), mask=mask)
            if SCALED_X:
                tl.store(xs_ptr + dx_rows[:, None] * stride_xsm + cols[None, :],
                         (x * c[:, None]).to(xs_ptr.dtype.element_ty), mask=mask)
        tl.store(dots_ptr + rows, acc, mask=r_mask)


def gate_mix_reference(y_slots: torch.Tensor, gates: torch.Tensor | None, slot_rows: torch.Tensor | None,
                       k: int) -> torch.Tensor:
    """Pure-torch definition of :func:`gate_mix` (and of the plain k-sum without ``gates``)."""
    acc = torch.promote_types(y_slots.dtype, torch.float32)
    rows = y_slots if slot_rows is None else y_slots.index_select(0, slot_rows)
    rows = rows.view(-1, k, y_slots.shape[1]).to(acc)
    if gates is not None:
        rows = rows * gates.to(acc).unsqueeze(-1)
    return rows.sum(1).to(y_slots.dtype)


def gate_grad_reference(dx: torch.Tensor, x: torch.Tensor, fan_out: int, coeff: torch.Tensor | None,
                        x_scaled_out: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch definition of :func:`gate_grad` (scales ``dx`` in place when ``coeff`` is given)."""
    acc = torch.promote_types(dx.dtype, torch.float32)
    rows = x.repeat_interleave(fan_out, 0) if fan_out > 1 else x
    dots = (dx.to(acc) * rows.to(acc)).sum(1)
    if coeff is not None:
        dx.copy_(dx.to(acc) * coeff.to(acc)[:, None])
        if x_scaled_out is not None:
            x_scaled_out.copy_(rows.to(acc) * coeff.to(acc)[:, None])
    return dots


# One token's row of up to 512 columns per program: as many programs as the rows allow, each loading its k slot
# rows at once. 16 x 256 tiles with a rolled loop over k left a 64-token decode call (Qwen3-30B-A3B, k 8) on 32
# programs, 7.1 us against 1.6 us now, and the training shape (16384 tokens) at 202 against 139 us, 90% of the
# H200's memory bandwidth (scripts/probes/probe_gate_mix_blocks.py).
MIX_BLOCK_T, MIX_BLOCK_N = 1, 512


def gate_mix_triton(y_slots, gates, out, slot_rows, k):
    T, N = out.shape
    if T == 0 or N == 0:
        return out
    BLOCK_T = 16 if triton_interpreted() else MIX_BLOCK_T  # the interpreter pays per program
    BLOCK_N = min(MIX_BLOCK_N, max(16, next_power_of_2(N)))
    g = gates if gates is not None else out
    _gate_mix_kernel[(cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))](
        y_slots, g, slot_rows if slot_rows is not None else out, out, T, N, y_slots.stride(0), g.stride(0),
        g.stride(1), out.stride(0), K_SLOTS=k, HAS_GATES=gates is not None, GATHER=slot_rows is not None,
        BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, num_warps=4)
    return out


def gate_grad_triton(dx, x, fan_out, coeff, dots, x_scaled_out=None):
    M, N = dx.shape
    if M == 0:
        return dots
    BLOCK_M, BLOCK_N = 16, min(256, max(16, next_power_of_2(N)))
    xs = x_scaled_out if x_scaled_out is not None else dx
    _gate_grad_kernel[(cdiv(M, BLOCK_M),)](
        dx, x, coeff if coeff is not None else dots, dots, xs, M, N, dx.stride(0), x.stride(0), xs.stride(0),
        FAN_OUT=fan_out, SCALE=coeff is not None, SCALED_X=x_scaled_out is not None, BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N, num_warps=4)
    return dots


# --------------------------------------------------------------------------------------------- ops
def _gate_mix_impl(y_slots: torch.Tensor, gates: Optional[torch.Tensor], out: torch.Tensor,
                   slot_rows: Optional[torch.Tensor], k: int) -> None:
    if triton_runs(y_slots, "gate_mix"):
        gate_mix_triton(y_slots, gates, out, slot_rows, k)
    else:
        out.copy_(gate_mix_reference(y_slots, gates, slot_rows, k))


_gate_mix_op = mutating_op("gate_mix", "out")(_gate_mix_impl)


def _gate_grad_impl(dx: torch.Tensor, x: torch.Tensor, fan_out: int, coeff: Optional[torch.Tensor],
                    dots: torch.Tensor, x_scaled_out: Optional[torch.Tensor]) -> None:
    if triton_runs(dx, "gate_grad"):
        gate_grad_triton(dx, x, fan_out, coeff, dots, x_scaled_out)
    else:
        dots.copy_(gate_grad_reference(dx, x, fan_out, coeff, x_scaled_out))


_gate_grad_op = mutating_op("gate_grad", "dx", "dots", "x_scaled_out")(_gate_grad_impl)


def gate_mix(y_slots: torch.Tensor, gates: torch.Tensor, out: torch.Tensor | None = None,
             slot_rows: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j gates[t, j] * y_slots[r(t*k + j)]`` (fp32 accumulation): the k expert outputs of each
    token mixed by its routing gates, read in slot order (``r(s) = s``) or through ``slot_rows`` [T*k]
    (``r(s) = slot_rows[s]``, e.g. the row where an expert-ordered output keeps slot s)."""
    op = "gate_mix"
    check_float(op, "y_slots", y_slots, 2)
    check_float(op, "gates", gates, 2)
    T, k = gates.shape
    if y_slots.shape[0] != T * k or gates.device != y_slots.device or y_slots.stride(1) != 1:
        fail(op, f"y_slots must be [T*k, N] = [{T * k}, N] with contiguous rows on {gates.device}, got "
                 f"{tuple(y_slots.shape)} strides {y_slots.stride()} on {y_slots.device}")
    if slot_rows is not None:
        check_index(op, "slot_rows", slot_rows, T * k, y_slots.device)
    if out is not None:
        check_out(op, out, (T, y_slots.shape[1]), y_slots)
        if out.stride(1) != 1:
            fail(op, "out must have contiguous rows")
    return gate_mix_unchecked(y_slots, gates, out, slot_rows)


def gate_grad(dx: torch.Tensor, x: torch.Tensor, fan_out: int = 1, coeff: torch.Tensor | None = None,
              x_scaled_out: torch.Tensor | None = None) -> torch.Tensor:
    """``dots[i] = dx[i] . x[i // fan_out]`` in fp32 ([M]); with ``coeff`` [M], ``dx[i] *= coeff[i]`` in place in
    the same pass, and ``x_scaled_out[i] = coeff[i] * x[i // fan_out]`` when that [M, N] buffer is given. With
    ``dx = dY W^T`` these dots are the routing-gate gradients."""
    op = "gate_grad"
    check_float(op, "dx", dx, 2)
    check_float(op, "x", x, 2)
    check_like(op, "x", x, dx)
    M, N = dx.shape
    if fan_out < 1 or x.shape[0] * fan_out != M or x.shape[1] != N or dx.stride(1) != 1 or x.stride(1) != 1:
        fail(op, f"dx [M, N] and x [M / fan_out, N] need contiguous rows; got dx {tuple(dx.shape)}, x "
                 f"{tuple(x.shape)}, fan_out={fan_out}")
    if coeff is not None and (tuple(coeff.shape) != (M,) or coeff.device != dx.device or not coeff.is_contiguous()):
        fail(op, f"coeff must be a contiguous [{M}] tensor on {dx.device}, got {tuple(coeff.shape)}")
    if x_scaled_out is not None:
        if coeff is None:
            fail(op, "x_scaled_out needs coeff (it receives coeff[i] * x[i // fan_out])")
        check_out(op, x_scaled_out, (M, N), dx)
        if x_scaled_out.stride(1) != 1:
            fail(op, "x_scaled_out must have contiguous rows")
    return gate_grad_unchecked(dx, x, fan_out, coeff, x_scaled_out)


def gate_mix_unchecked(y_slots, gates, out=None, slot_rows=None, k=None) -> torch.Tensor:
    """:func:`gate_mix` without the checks (see ``custom_ops``: for callers that validated already); ``gates``
    None with a fan-in ``k`` sums each token's k rows unweighted."""
    k = gates.shape[1] if gates is not None else k
    if out is None:
        out = y_slots.new_empty((y_slots.shape[0] // k, y_slots.shape[1]))
    run_op(_gate_mix_op, _gate_mix_impl, y_slots, gates, out, slot_rows, k)
    return out


def gate_grad_unchecked(dx, x, fan_out=1, coeff=None, x_scaled_out=None) -> torch.Tensor:
    """:func:`gate_grad` without the checks (see ``custom_ops``: for callers that validated already)."""
    dots = dx.new_empty((dx.shape[0],), dtype=torch.promote_types(dx.dtype, torch.float32))
    run_op(_gate_grad_op, _gate_grad_impl, dx, x, fan_out, coeff, dots, x_scaled_out)
    return dots
