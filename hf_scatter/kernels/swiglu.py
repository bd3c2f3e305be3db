"""Fused SwiGLU over the expert-grouped [gate; up] activations: ``silu(gate) * up`` and its backward.

The backward writes d[gate; up] into the buffer of the forward input (dead by then), so the largest
activation of the SMoE MLP is never allocated twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import triton_available, triton_interpreted

if triton_available():
    import triton
    import triton.language as tl

    @triton.jit
    def _swiglu_fwd_kernel(h_ptr, out_ptr, M, I, stride_hm, stride_om,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < I)[None, :]
        base = h_ptr + rows[:, None].to(tl.int64) * stride_hm + cols[None, :]
        g = tl.load(base, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(base + I, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(h_ptr, dout_ptr, dh_ptr, M, I, stride_hm, stride_dom, stride_dhm,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rows < M)[:, None] & (cols < I)[None, :]
        r64 = rows[:, None].to(tl.int64)
        g = tl.load(h_ptr + r64 * stride_hm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(h_ptr + r64 * stride_hm + I + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        d = tl.load(dout_ptr + r64 * stride_dom + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        dg = d * u * s * (1.0 + g * (1.0 - s))
        du = d * g * s
        dst = dh_ptr + r64 * stride_dhm + cols[None, :]
        tl.store(dst, dg.to(dh_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + I, du.to(dh_ptr.dtype.element_ty), mask=mask)


def swiglu_reference(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_backward_reference(h: torch.Tensor, dout: torch.Tensor) -> torch.Tensor:
    gate, up = h.float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    d = dout.float()
    return torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], dim=-1).to(h.dtype)


def _blocks(I: int) -> tuple[int, int]:
    if triton_interpreted():
        return 16, min(256, max(16, triton.next_power_of_2(I)))
    return 8, min(1024, max(16, triton.next_power_of_2(I)))


def swiglu_fwd_triton(h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    M, I = out.shape
    if M and I:
        bm, bn = _blocks(I)
        _swiglu_fwd_kernel[(triton.cdiv(M, bm), triton.cdiv(I, bn))](h, out, M, I, h.stride(0), out.stride(0),
                                                                    BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


def swiglu_bwd_triton(h: torch.Tensor, dout: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    M, I = dout.shape
    if M and I:
        bm, bn = _blocks(I)
        _swiglu_bwd_kernel[(triton.cdiv(M, bm), triton.cdiv(I, bn))](h, dout, dh, M, I, h.stride(0), dout.stride(0),
                                                                    dh.stride(0), BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return dh
