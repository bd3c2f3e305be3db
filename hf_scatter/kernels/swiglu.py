"""Fused SwiGLU over expert-grouped activations: ``act(gate) * up`` and its backward.

Gate and up are separate operands (row and column strides of their own), so one kernel pair serves every
layout: Mixtral's concatenated [gate; up] rows (two views of one buffer), GPT-OSS's interleaved
[g0, u0, g1, u1, ...] columns (two strided views) and DBRX's separate w1 / v1 outputs. The backward can write
d(gate), d(up) into the forward inputs' memory (dead by then), so the largest activation of the SMoE MLP is
never allocated twice.

The gate's form is a :class:`GateForm`: SiLU (``silu(g) * u``) by default, or GPT-OSS's clamped gate
``(clamp(u, -l, l) + 1) * g_c * sigmoid(1.702 g_c)`` with ``g_c = min(g, l)``. Its numbers are runtime
arguments of one kernel, so both forms share one compiled kernel.

:func:`swiglu` and :func:`swiglu_pair` are the differentiable public calls (autograd functions over the
``hf_scatter::swiglu_fwd`` / ``swiglu_bwd`` ops); ``swiglu_fwd_unchecked`` / ``swiglu_bwd_unchecked`` call the
ops without checks, for any :class:`GateForm`. The tile helpers (``load_gate_up``, ``swiglu_tile``,
``swiglu_grad_tile``, ``store_gate_up``) are the one copy of the math: the SwiGLU experts run it fused, in
their first projection's epilogue (``scatter2scatter_swiglu``) and in their backward pass
(``swiglu_grad_gemm``).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_float, check_like, fail
from .custom_ops import mutating_op, profiled, run_op

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def load_gate_up(g_ptr, u_ptr, r64, row_mask, col_tile, I, stride_gm, stride_gn, stride_um, stride_un,
                     BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr):
        """Column tile ``col_tile`` of gate and up at rows ``r64`` ([BLOCK_M, 1] int64) in fp32, with its column
        offsets and mask. Interleaved rows ([g0, u0, g1, u1, ...] at ``g_ptr``) are read as one contiguous
        [BLOCK_M, 2 BLOCK_N] tile and split in registers: two stride-2 reads would touch every sector twice."""
        cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = row_mask[:, None] & (cols < I)[None, :]
        if INTERLEAVED:
            cols2 = col_tile * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            mask2 = row_mask[:, None] & (cols2 < 2 * I)[None, :]
            gu = tl.load(g_ptr + r64 * stride_gm + cols2[None, :], mask=mask2, other=0.0).to(tl.float32)
            g, u = tl.split(tl.reshape(gu, (r64.shape[0], BLOCK_N, 2)))
        else:
            g = tl.load(g_ptr + r64 * stride_gm + cols[None, :] * stride_gn, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(u_ptr + r64 * stride_um + cols[None, :] * stride_un, mask=mask, other=0.0).to(tl.float32)
        return g, u, cols, mask

    @triton.jit
    def store_gate_up(dg_ptr, du_ptr, dg, du, r64, row_mask, col_tile, I, stride_dgm, stride_dgn, stride_dum,
                      stride_dun, BLOCK_N: tl.constexpr, INTERLEAVED: tl.constexpr):
        """Write a gate and an up tile where :func:`load_gate_up` read them (interleaved: one contiguous tile)."""
        if INTERLEAVED:
            cols2 = col_tile * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
            mask2 = row_mask[:, None] & (cols2 < 2 * I)[None, :]
            tl.store(dg_ptr + r64 * stride_dgm + cols2[None, :], tl.interleave(dg, du).to(dg_ptr.dtype.element_ty),
                     mask=mask2)
        else:
            cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = row_mask[:, None] & (cols < I)[None, :]
            tl.store(dg_ptr + r64 * stride_dgm + cols[None, :] * stride_dgn, dg.to(dg_ptr.dtype.element_ty),
                     mask=mask)
            tl.store(du_ptr + r64 * stride_dum + cols[None, :] * stride_dun, du.to(du_ptr.dtype.element_ty),
                     mask=mask)

    @triton.jit
    def swiglu_tile(g, u, alpha, limit, up_shift):
        """``act(g_c) * (u_c + up_shift)`` of fp32 tiles (see :class:`GateForm`)."""
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        return gc * tl.sigmoid(alpha * gc) * (uc + up_shift)

    @triton.jit
    def swiglu_grad_tile(g, u, d, alpha, limit, up_shift):
        """d(gate), d(up) of :func:`swiglu_tile` for the output gradient ``d`` (fp32 tiles)."""
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        s = tl.sigmoid(alpha * gc)
        # clamp passes the gradient where its input is within the bounds (bounds included), as torch's does
        dg = tl.where(g <= limit, d * (uc + up_shift) * s * (1.0 + alpha * gc * (1.0 - s)), 0.0)
        du = tl.where((u >= -limit) & (u <= limit), d * gc * s, 0.0)
        return dg, du

    @triton.jit
    def _swiglu_fwd_kernel(g_ptr, u_ptr, out_ptr, M, I, stride_gm, stride_gn, stride_um, stride_un, stride_om,
                           alpha, limit, up_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           INTERLEAVED: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r64 = rows[:, None].to(tl.int64)
        g, u, cols, mask = load_gate_up(g_ptr, u_ptr, r64, rows < M, tl.program_id(1), I, stride_gm, stride_gn,
                                        stride_um, stride_un, BLOCK_N, INTERLEAVED)
        out = swiglu_tile(g, u, alpha, limit, up_shift)
        tl.store(out_ptr + r64 * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(g_ptr, u_ptr, dout_ptr, dg_ptr, du_ptr, M, I, stride_gm, stride_gn, stride_um,
                           stride_un, stride_dom, stride_dgm, stride_dgn, stride_dum, stride_dun,
                           alpha, limit, up_shift, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           INTERLEAVED: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        r64 = rows[:, None].to(tl.int64)
        g, u, cols, mask = load_gate_up(g_ptr, u_ptr, r64, rows < M, tl.program_id(1), I, stride_gm, stride_gn,
                                        stride_um, stride_un, BLOCK_N, INTERLEAVED)
        d = tl.load(dout_ptr + r64 * stride_dom + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dg, du = swiglu_grad_tile(g, u, d, alpha, limit, up_shift)
        store_gate_up(dg_ptr, du_ptr, dg, du, r64, rows < M, tl.program_id(1), I, stride_dgm, stride_dgn,
                      stride_dum, stride_dun, BLOCK_N, INTERLEAVED)


class GateForm(NamedTuple):
    """How an expert's [gate, up] columns combine: ``act(g_c) * (u_c + up_shift)`` with
    ``act(x) = x * sigmoid(alpha x)``, ``g_c = min(g, limit)``, ``u_c = clamp(u, -limit, limit)``; the columns
    concatenated ([gate; up]) or ``interleaved`` ([g0, u0, g1, u1, ...]). A named tuple, so torch.compile
    traces code that holds one."""

    alpha: float = 1.0
    limit: float = math.inf
    up_shift: float = 0.0
    interleaved: bool = False

    def halves(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up views of ``h`` [M, 2I]."""
        if self.interleaved:
            return h[:, 0::2], h[:, 1::2]
        half = h.shape[1] // 2
        return h[:, :half], h[:, half:]

    @property
    def numbers(self) -> tuple[float, float, float]:
        return float(self.alpha), float(self.limit), float(self.up_shift)


SILU = GateForm()  # Mixtral, Qwen3-MoE, DeepSeek, OLMoE, DBRX: silu(gate) * up


def gpt_oss_gate(alpha: float, limit: float) -> GateForm:
    """GPT-OSS's gate: interleaved columns, ``(clamp(u, -l, l) + 1) * g_c * sigmoid(alpha g_c)``."""
    return GateForm(alpha=alpha, limit=limit, up_shift=1.0, interleaved=True)


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor, alpha: float = 1.0, limit: float = math.inf,
                     up_shift: float = 0.0) -> torch.Tensor:
    if (alpha, limit, up_shift) == (1.0, math.inf, 0.0):
        return F.silu(gate) * up
    gc = gate.clamp(max=limit)
    return gc * torch.sigmoid(alpha * gc) * (up.clamp(-limit, limit) + up_shift)


def swiglu_backward_reference(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, alpha: float = 1.0,
                              limit: float = math.inf, up_shift: float = 0.0
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    g, u, d = gate.float(), up.float(), dout.float()
    gc, uc = g.clamp(max=limit), u.clamp(-limit, limit)
    s = torch.sigmoid(alpha * gc)
    dg = torch.where(g <= limit, d * (uc + up_shift) * s * (1 + alpha * gc * (1 - s)), 0.0)
    du = torch.where((u >= -limit) & (u <= limit), d * gc * s, 0.0)
    return dg.to(gate.dtype), du.to(up.dtype)


def _blocks(I: int, backward: bool = False) -> tuple[int, int]:
    """Rows and columns per program. The backward holds three times the live values of the forward (gate,
    up, their clamps, the sigmoid, two gradients), so its tile is a quarter as wide: a 1024-wide one spilled
    registers."""
    if triton_interpreted():
        return 16, min(256, max(16, next_power_of_2(I)))
    return 8, min(256 if backward else 1024, max(16, next_power_of_2(I)))


def _interleaved(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Gate and up are the even and odd columns of one buffer ([g0, u0, g1, u1, ...] rows)."""
    return gate.stride(1) == 2 and up.stride(1) == 2 and gate.stride(0) == up.stride(0) \
        and up.data_ptr() - gate.data_ptr() == gate.element_size()


def swiglu_fwd_triton(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, alpha: float = 1.0,
                      limit: float = math.inf, up_shift: float = 0.0) -> torch.Tensor:
    M, I = out.shape
    if M and I:
        bm, bn = _blocks(I)
        _swiglu_fwd_kernel[(cdiv(M, bm), cdiv(I, bn))](
            gate, up, out, M, I, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), out.stride(0),
            alpha, limit, up_shift, BLOCK_M=bm, BLOCK_N=bn, INTERLEAVED=_interleaved(gate, up), num_warps=4)
    return out


def swiglu_bwd_triton(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, dgate: torch.Tensor,
                      dup: torch.Tensor, alpha: float = 1.0, limit: float = math.inf, up_shift: float = 0.0) -> None:
    M, I = dout.shape
    if M and I:
        interleaved = _interleaved(gate, up) and _interleaved(dgate, dup)
        bm, bn = _blocks(I, backward=True)
        _swiglu_bwd_kernel[(cdiv(M, bm), cdiv(I, bn))](
            gate, up, dout, dgate, dup, M, I, gate.stride(0), gate.stride(1), up.stride(0), up.stride(1),
            dout.stride(0), dgate.stride(0), dgate.stride(1), dup.stride(0), dup.stride(1),
            alpha, limit, up_shift, BLOCK_M=bm, BLOCK_N=bn, INTERLEAVED=interleaved, num_warps=4)


# --------------------------------------------------------------------------------------------- ops
def _swiglu_fwd_impl(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor, alpha: float, limit: float,
                     up_shift: float) -> None:
    if triton_runs(gate, "swiglu"):
        swiglu_fwd_triton(gate, up, out, alpha, limit, up_shift)
    else:
        out.copy_(swiglu_reference(gate, up, alpha, limit, up_shift))


_swiglu_fwd_op = mutating_op("swiglu_fwd", "out")(_swiglu_fwd_impl)


def _swiglu_bwd_impl(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, dgate: torch.Tensor,
                     dup: torch.Tensor, alpha: float, limit: float, up_shift: float) -> None:
    if triton_runs(gate, "swiglu"):
        swiglu_bwd_triton(gate, up, dout, dgate, dup, alpha, limit, up_shift)
    else:
        dg, du = swiglu_backward_reference(gate, up, dout, alpha, limit, up_shift)
        dgate.copy_(dg)
        dup.copy_(du)


_swiglu_bwd_op = mutating_op("swiglu_bwd", "dgate", "dup")(_swiglu_bwd_impl)


# -------------------------------------------------------------------------------------- autograd
def _mark_overwritten(*saved: torch.Tensor) -> None:
    """Saved tensors a backward wrote its gradients into: a kernel's write is invisible to autograd, so their
    version counters move by hand, and a second backward through them raises instead of reading gradients as
    activations (compiled code declares the mutation through the registered op)."""
    if not torch.compiler.is_compiling():
        for t in saved:
            torch.autograd.graph.increment_version(t)


class _SwiGLU(torch.autograd.Function):
    """``h = [gate; up]`` in one buffer; the gradient is one buffer too (no autograd cat of two halves)."""

    @staticmethod
    @profiled("hf_scatter::swiglu.forward")
    def forward(ctx, h, reuse_input_buffer):
        out = h.new_empty((h.shape[0], h.shape[1] // 2))
        run_op(_swiglu_fwd_op, _swiglu_fwd_impl, *SILU.halves(h), out, *SILU.numbers)
        ctx.reuse_input_buffer = reuse_input_buffer
        ctx.save_for_backward(h)
        return out

    @staticmethod
    @profiled("hf_scatter::swiglu.backward")
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        # With reuse, h's buffer receives d[gate; up] (a second backward through it then fails loudly).
        dh = h if ctx.reuse_input_buffer else torch.empty_like(h)
        run_op(_swiglu_bwd_op, _swiglu_bwd_impl, *SILU.halves(h), dout.contiguous(), *SILU.halves(dh),
               *SILU.numbers)
        if ctx.reuse_input_buffer:
            _mark_overwritten(h)
        return dh, None


class _SwiGLUPair(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::swiglu_pair.forward")
    def forward(ctx, gate, up, reuse_input_buffers):
        out = gate.new_empty(gate.shape)
        run_op(_swiglu_fwd_op, _swiglu_fwd_impl, gate, up, out, *SILU.numbers)
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
        run_op(_swiglu_bwd_op, _swiglu_bwd_impl, gate, up, dout.contiguous(), dgate, dup, *SILU.numbers)
        if ctx.reuse_input_buffers:
            _mark_overwritten(gate, up)
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


def swiglu_fwd_unchecked(h: torch.Tensor, out: torch.Tensor, form: GateForm = SILU) -> torch.Tensor:
    """The forward op over ``h`` [M, 2I] into ``out`` [M, I], without checks (see ``custom_ops``: for callers
    that validated already)."""
    run_op(_swiglu_fwd_op, _swiglu_fwd_impl, *form.halves(h), out, *form.numbers)
    return out


def swiglu_bwd_unchecked(h: torch.Tensor, dout: torch.Tensor, dh: torch.Tensor, form: GateForm = SILU) -> None:
    """The backward op: d(h) into ``dh`` (which may be ``h`` itself), without checks (see ``custom_ops``)."""
    run_op(_swiglu_bwd_op, _swiglu_bwd_impl, *form.halves(h), dout, *form.halves(dh), *form.numbers)
