"""``swiglu_grad_gemm``: the SwiGLU experts' backward through their output projection: one GEMM, one pass.

For expert-sorted slot ``s`` (token ``t = idx[s] // fan_out``, routing gate ``c[s]``, expert ``e``) the GEMM
(scatter2scatter, dY's rows gathered straight into its tiles) computes the ungated input gradient
``dA'[s] = dY[t] W_out[e]^T``; then one pass over each slot's row finishes the SwiGLU's backward:

- ``h = act(gate, up)``, recomputed from the pre-activation (the forward keeps only that);
- the gate gradient's dot ``h . dA'``;
- ``dH = c[s] dA'``, and d(gate), d(up) written over the pre-activation, in place;
- optionally ``h`` or ``c[s] h`` into ``h_out`` (the output projection's weight gradient reads it).

Unfused, the pass was three (SwiGLU recompute, gate gradients with scaling, SwiGLU backward), reading the
pre-activation twice and dA' twice. Finishing it in the GEMM's own epilogue was tried and spilled registers
(the accumulator, gate, up and their gradients live at once): on the H100 it ran slower than the GEMM and the
three passes together. Values are rounded to the activations' dtype where the unfused sequence stored them
(dA', h, dH), so ``h`` is the forward's, bit for bit.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted, triton_runs
from .custom_ops import mutating_op, run_op, tf32_allowed
from .gating import gate_grad_reference
from .scatter2scatter import scatter2scatter_reference, scatter2scatter_triton
from .swiglu import GateForm, swiglu_backward_reference, swiglu_reference

if kernels_enabled():
    import triton
    import triton.language as tl

    from .swiglu import load_gate_up, store_gate_up, swiglu_grad_tile, swiglu_tile

    @triton.jit
    def _swiglu_grad_rows_kernel(da_ptr, g_ptr, u_ptr, coeff_ptr, h_ptr, dots_ptr, M, I,
                                 stride_dam, stride_gm, stride_gn, stride_um, stride_un, stride_hm,
                                 alpha, limit, up_shift, STORE_H: tl.constexpr, SCALE_H: tl.constexpr,
                                 INTERLEAVED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """BLOCK_M slots' rows, all of I in BLOCK_N-wide steps: the dot accumulates in registers."""
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        r64 = rows[:, None].to(tl.int64)
        c = tl.load(coeff_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)  # [BLOCK_M] routing gates
        dtype = g_ptr.dtype.element_ty
        dots = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for col_tile in range(0, tl.cdiv(I, BLOCK_N)):
            g, u, cols, mask = load_gate_up(g_ptr, u_ptr, r64, row_mask, col_tile, I, stride_gm, stride_gn,
                                            stride_um, stride_un, BLOCK_N, INTERLEAVED)
            da = tl.load(da_ptr + r64 * stride_dam + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            h = swiglu_tile(g, u, alpha, limit, up_shift).to(dtype).to(tl.float32)  # [BLOCK_M, BLOCK_N]
            dots += tl.sum(h * da, 1)
            if STORE_H:
                if SCALE_H:
                    h = h * c[:, None]
                tl.store(h_ptr + r64 * stride_hm + cols[None, :], h.to(h_ptr.dtype.element_ty), mask=mask)
            dh = (da * c[:, None]).to(dtype).to(tl.float32)  # gated dH, as the unfused buffer held it
            dg, du = swiglu_grad_tile(g, u, dh, alpha, limit, up_shift)
            store_gate_up(g_ptr, u_ptr, dg, du, r64, row_mask, col_tile, I, stride_gm, stride_gn, stride_um,
                          stride_un, BLOCK_N, INTERLEAVED)
        tl.store(dots_ptr + rows, dots, mask=row_mask)


def swiglu_grad_gemm_reference(dy, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                               gate_up, coeff, form: GateForm, h_out=None, scale_h=False) -> torch.Tensor:
    """Pure-torch definition of :func:`swiglu_grad_gemm`: the unfused sequence it replaces."""
    da = scatter2scatter_reference(dy, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                   x_grouped=False, y_grouped=True)
    gate, up = form.halves(gate_up)
    h = swiglu_reference(gate, up, *form.numbers)
    dots = gate_grad_reference(da, h, 1, coeff, h_out if scale_h else None)  # da *= coeff in place
    if h_out is not None and not scale_h:
        h_out.copy_(h)
    dgate, dup = swiglu_backward_reference(gate, up, da, *form.numbers)
    gate.copy_(dgate)
    up.copy_(dup)
    return dots


def _swiglu_grad_gemm_triton(dy, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                             gate_up, coeff, form, h_out, scale_h, dots, allow_tf32) -> None:
    M, I = sorted_scattered_idxs.numel(), weight.shape[2]
    if M == 0:
        return
    da = scatter2scatter_triton(dy, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                x_grouped=False, y_grouped=True, bias=None, out=gate_up.new_empty((M, I)),
                                allow_tf32=allow_tf32)  # [M, I] ungated dA'
    gate, up = form.halves(gate_up)
    h = h_out if h_out is not None else da
    # A warp per row, 256 columns a step: 4.1 TB/s on an H200 at Qwen3-30B-A3B's and the fine-grained shape
    # (8 rows on 4 warps: 3.5), 3.7 at GPT-OSS-20B's (3.2) (scripts/probes/probe_swiglu_grad_rows.py).
    block_m = 64 if triton_interpreted() else 4  # the interpreter's cost grows with the programs
    block_n = min(128 if triton_interpreted() else 256, max(16, next_power_of_2(I)))
    _swiglu_grad_rows_kernel[(cdiv(M, block_m),)](
        da, gate, up, coeff, h, dots, M, I, da.stride(0), gate.stride(0), gate.stride(1), up.stride(0),
        up.stride(1), h.stride(0), *form.numbers, STORE_H=h_out is not None, SCALE_H=scale_h,
        INTERLEAVED=form.interleaved, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4)


# ---------------------------------------------------------------------------------------------- op
def _swiglu_grad_gemm_impl(dy: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                           sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int,
                           gate_up: torch.Tensor, coeff: torch.Tensor, alpha: float, limit: float, up_shift: float,
                           interleaved: bool, h_out: Optional[torch.Tensor], scale_h: bool, dots: torch.Tensor,
                           allow_tf32: bool) -> None:
    form = GateForm(alpha, limit, up_shift, interleaved)
    if triton_runs(dy, "swiglu_grad_gemm"):
        _swiglu_grad_gemm_triton(dy, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                 gate_up, coeff, form, h_out, scale_h, dots, allow_tf32)
    else:
        dots.copy_(swiglu_grad_gemm_reference(dy, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
                                              fan_out, gate_up, coeff, form, h_out, scale_h))


_swiglu_grad_gemm_op = mutating_op("swiglu_grad_gemm", "gate_up", "h_out", "dots")(_swiglu_grad_gemm_impl)


def swiglu_grad_gemm_unchecked(dy, weight, routing, fan_out, gate_up, coeff, form: GateForm, h_out=None,
                               scale_h=False) -> torch.Tensor:
    """The SwiGLU experts' output-projection backward, GEMM and one pass (module docstring): ``dy`` [T, d]
    ungrouped (slot ``s`` reads row ``idx[s] // fan_out``), ``weight`` [E, d, I] (the output projection's transposed
    view), ``gate_up`` [M, 2I] the grouped pre-activation (overwritten with its gradient), ``coeff`` [M] fp32
    the routing gates in sorted order, ``h_out`` [M, I] or None. Returns the ungated gate-gradient dots [M]
    (fp32, sorted order). No checks: the SwiGLU experts' autograd function calls it with its own tensors."""
    dots = torch.empty(gate_up.shape[0], device=gate_up.device, dtype=torch.promote_types(gate_up.dtype,
                                                                                          torch.float32))
    run_op(_swiglu_grad_gemm_op, _swiglu_grad_gemm_impl, dy, weight, *routing, fan_out, gate_up, coeff,
           *form.numbers, form.interleaved, h_out, scale_h, dots, tf32_allowed())
    return dots
