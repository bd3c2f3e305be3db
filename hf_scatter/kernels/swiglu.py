"""Fused SwiGLU over expert-grouped activations: ``silu(gate) * up`` and its backward.

Gate and up are separate operands (row strides of their own), so one kernel pair serves both layouts:
Mixtral's concatenated [gate; up] rows (two views of one buffer) and DBRX's separate w1 / v1 outputs.
The backward can write d(gate), d(up) into the forward inputs' memory (dead by then), so the largest
activation of the SMoE MLP is never allocated twice.

:func:`swiglu` and :func:`swiglu_pair` are the differentiable public calls (autograd functions over the
``hf_scatter::swiglu_fwd`` / ``swiglu_bwd`` ops); ``swiglu_fwd_unchecked`` / ``swiglu_bwd_unchecked`` call the
ops directly for the SwiGLU experts' own autograd function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_float, check_like, fail
from .custom_ops import mutating_op, profiled, run_op

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


# --------------------------------------------------------------------------------------------- ops
def _swiglu_fwd_impl(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    if triton_runs(gate, "swiglu"):
        swiglu_fwd_triton(gate, up, out)
    else:
        out.copy_(swiglu_reference(gate, up))


_swiglu_fwd_op = mutating_op("swiglu_fwd", "out")(_swiglu_fwd_impl)


def _swiglu_bwd_impl(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, dgate: torch.Tensor,
                   dup: torch.Tensor) -> None:
    if triton_runs(gate, "swiglu"):
        swiglu_bwd_triton(gate, up, dout, dgate, dup)
    else:
        dg, du = swiglu_backward_reference(gate, up, dout)
        dgate.copy_(dg)
        dup.copy_(du)


_swiglu_bwd_op = mutating_op("swiglu_bwd", "dgate", "dup")(_swiglu_bwd_impl)


# -------------------------------------------------------------------------------------- autograd
def gate_up_halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]


class _SwiGLU(torch.autograd.Function):
    """``h = [gate; up]`` in one buffer; the gradient is one buffer too (no autograd cat of two halves)."""

    @staticmethod
    @profiled("hf_scatter::swiglu.forward")
    def forward(ctx, h, reuse_input_buffer):
        out = h.new_empty((h.shape[0], h.shape[1] // 2))
        run_op(_swiglu_fwd_op, _swiglu_fwd_impl, *gate_up_halves(h), out)
        ctx.reuse_input_buffer = reuse_input_buffer
        ctx.save_for_backward(h)
        return out

    @staticmethod
    @profiled("hf_scatter::swiglu.backward")
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        # With reuse, h's buffer receives d[gate; up] (a second backward through it then fails loudly).
        dh = h if ctx.reuse_input_buffer else torch.empty_like(h)
        run_op(_swiglu_bwd_op, _swiglu_bwd_impl, *gate_up_halves(h), dout.contiguous(), *gate_up_halves(dh))
        return dh, None


class _SwiGLUPair(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::swiglu_pair.forward")
    def forward(ctx, gate, up, reuse_input_buffers):
        out = gate.new_empty(gate.shape)
        run_op(_swiglu_fwd_op, _swiglu_fwd_impl, gate, up, out)
        ctx.reuse_input_buffers = reuse_input_buffers
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @profiled("hf_scatter::swiglu_pair.backward")
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        if ctx.reuse_input_buffers:
            dgate, dup = gate, up
        else:
            dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        run_op(_swiglu_bwd_op, _swiglu_bwd_impl, gate, up, dout.contiguous(), dgate, dup)
        return dgate, dup, None


# ---------------------------------------------------------------------------------- public calls
def swiglu(h: torch.Tensor, reuse_input_buffer: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate; up]`` ([M, 2I], rows contiguous), fused, differentiable.

    ``reuse_input_buffer``: the backward writes the gradient into ``h``'s memory. Only for an ``h`` that
    nothing else reads afterwards (the SMoE MLP's own intermediate).
    """
    check_float("swiglu", "h", h, 2)
    if h.shape[1] % 2 or h.stride(1) != 1:
        fail("swiglu", f"h must be [M, 2I] with contiguous rows, got shape {tuple(h.shape)} strides {h.stride()}")
    return _SwiGLU.apply(h, reuse_input_buffer)


def swiglu_pair(gate: torch.Tensor, up: torch.Tensor, reuse_input_buffers: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for separate [M, I] operands (DBRX's w1 and v1 outputs), fused, differentiable.

    ``reuse_input_buffers``: the backward writes d(gate) and d(up) into ``gate`` and ``up``; only for
    intermediates nothing else reads afterwards.
    """
    check_float("swiglu_pair", "gate", gate, 2)
    check_like("swiglu_pair", "up", up, gate)
    if gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        fail("swiglu_pair", f"gate and up must both be [M, I] with contiguous rows, got {tuple(gate.shape)} "
                            f"strides {gate.stride()} and {tuple(up.shape)} strides {up.stride()}")
    return _SwiGLUPair.apply(gate, up, reuse_input_buffers)


def swiglu_fwd_unchecked(gate, up, out) -> torch.Tensor:
    """The forward op into ``out``, without checks (see ``custom_ops``: for callers that validated already)."""
    run_op(_swiglu_fwd_op, _swiglu_fwd_impl, gate, up, out)
    return out


def swiglu_bwd_unchecked(gate, up, dout, dgate, dup) -> None:
    """The backward op into ``dgate`` / ``dup``, without checks (see ``custom_ops``)."""
    run_op(_swiglu_bwd_op, _swiglu_bwd_impl, gate, up, dout, dgate, dup)
