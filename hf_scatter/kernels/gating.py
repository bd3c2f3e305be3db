"""Routing-gate kernels: mixing the k expert outputs of each token, and the gate gradient.

``gate_mix``: ``y[t] = sum_j g[t, j] * y_slots[t*k + j]`` in fp32 (a batched [1, k] x [k, N] matmul runs as
a cuBLAS gemv far below bandwidth). ``gate_grad``: ``dots[i] = dx[i] . x[i // fan_out]`` in fp32, optionally
scaling ``dx[i]`` by ``coeff[i]`` in place and writing ``coeff[i] * x[i // fan_out]`` in the same pass. With ``dx = dY W^T`` (the ungated input
gradient) the dots are the gate gradients: ``d g = (x W) . dY = x . (dY W^T)``, so the forward's [T*k, d_out]
expert outputs need not be kept for backward.
"""

from __future__ import annotations

import torch

from .backend import cdiv, kernels_enabled, next_power_of_2

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_mix_kernel(y_ptr, g_ptr, out_ptr, T, N, stride_ym, stride_gt, stride_gk, stride_ot,
                         K_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t_mask = tokens < T
        mask = t_mask[:, None] & (cols < N)[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for j in range(K_SLOTS):
            g = tl.load(g_ptr + tokens * stride_gt + j * stride_gk, mask=t_mask, other=0.0).to(tl.float32)
            slot = tokens.to(tl.int64) * K_SLOTS + j
            y = tl.load(y_ptr + slot[:, None] * stride_ym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += g[:, None] * y
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


def gate_mix_reference(y_slots: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """Pure-torch definition of :func:`gate_mix`."""
    T, k = gates.shape
    acc = torch.promote_types(y_slots.dtype, torch.float32)
    return (y_slots.view(T, k, -1).to(acc) * gates.to(acc).unsqueeze(-1)).sum(1).to(y_slots.dtype)


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


def gate_mix_triton(y_slots, gates, out):
    T, k = gates.shape
    N = out.shape[1]
    if T == 0 or N == 0:
        return out
    BLOCK_T, BLOCK_N = 16, min(256, max(16, next_power_of_2(N)))
    _gate_mix_kernel[(cdiv(T, BLOCK_T), cdiv(N, BLOCK_N))](
        y_slots, gates, out, T, N, y_slots.stride(0), gates.stride(0), gates.stride(1), out.stride(0),
        K_SLOTS=k, BLOCK_T=BLOCK_T, BLOCK_N=BLOCK_N, num_warps=4)
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
