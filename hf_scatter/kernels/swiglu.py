"""Fused SwiGLU over expert-grouped activations: ``silu(gate) * up`` and its backward.

Gate and up are separate operands (row strides of their own), so one kernel pair serves both layouts:
Mixtral's concatenated [gate; up] rows (two views of one buffer) and DBRX's separate w1 / v1 outputs.
The backward can write d(gate), d(up) into the forward inputs' memory (dead by then), so the largest
activation of the SMoE MLP is never allocated twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _gate_up_tile(g_ptr, u_ptr, M, I, stride_gm, stride_um, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """This program's [BLOCK_M, BLOCK_N] tile of gate and up in fp32, with its row offsets and mask."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < I)[None, :]
        r64 = rows[:, None].to(tl.int64)
        g = tl.load(g_ptr + r64 * stride_gm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r64 * stride_um + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        return g, u, r64, cols, mask

    @triton.jit
    def _swiglu_fwd_kernel(g_ptr, u_ptr, out_ptr, M, I, stride_gm, stride_um, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        g, u, r64, cols, mask = _gate_up_tile(g_ptr, u_ptr, M, I, stride_gm, stride_um, BLOCK_M, BLOCK_N)
        out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + r64 * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, u_ptr, dout_ptr, dg_ptr, du_ptr, M, I, stride_gm, stride_um, stride_dom,
                           stride_dgm, stride_dum, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        g, u, r64, cols, mask = _gate_up_tile(g_ptr, u_ptr, M, I, stride_gm, stride_um, BLOCK_M, BLOCK_N)
        d = tl.load(dout_ptr + r64 * stride_dom + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = d * u * s * (1.0 + g * (1.0 - s))
        du = d * g * s
        tl.store(dg_ptr + r64 * stride_dgm + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
        tl.store(du_ptr + r64 * stride_dum + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_backward_reference(gate: torch.Tensor, up: torch.Tensor,
                              dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.float(), up.float(), dout.float()
    s = torch.sigmoid(g)
    return (d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)


def _blocks(I: int) -> tuple[int, int]:
    if triton_interpreted():
        return 16, min(256, max(16, next_power_of_2(I)))
    return 8, min(1024, max(16, next_power_of_2(I)))


def swiglu_fwd_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    M, I = out.shape
    if M and I:
        bm, bn = _blocks(I)
        _swiglu_fwd_kernel[(cdiv(M, bm), cdiv(I, bn))](
            gate, up, out, M, I, gate.stride(0), up.stride(0), out.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


def swiglu_bwd_triton(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, dgate: torch.Tensor,
                      dup: torch.Tensor) -> None:
    M, I = dout.shape
    if M and I:
        bm, bn = _blocks(I)
        _swiglu_bwd_kernel[(cdiv(M, bm), cdiv(I, bn))](
            gate, up, dout, dgate, dup, M, I, gate.stride(0), up.stride(0), dout.stride(0), dgate.stride(0),
            dup.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
