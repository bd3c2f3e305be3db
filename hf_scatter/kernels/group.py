"""``group``: gather rows into expert order, optionally scaled per row (ScatterMoE backward).

``out[i] = x[sorted_scattered_idxs[i] // fan_out] * coeff[i]``: rows are read straight from their
scattered positions, so no intermediate copy of ``x`` exists.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import cdiv, kernels_enabled, next_power_of_2, triton_runs
from .checks import check_float, check_index, check_out, fail
from .custom_ops import mutating_op, run_op

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _group_kernel(
        src_ptr, idx_ptr, coeff_ptr, out_ptr,
        M, K,
        stride_src_m, stride_src_k, stride_out_m, stride_out_k,
        FAN_OUT: tl.constexpr, HAS_COEFF: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        src_rows = tl.load(idx_ptr + rows, mask=row_mask, other=0) // FAN_OUT
        if HAS_COEFF:
            coeff = tl.load(coeff_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            mask = row_mask[:, None] & (cols < K)[None, :]
            tile = tl.load(src_ptr + src_rows[:, None] * stride_src_m + cols[None, :] * stride_src_k, mask=mask)
            if HAS_COEFF:
                tile = (tile.to(tl.float32) * coeff[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + rows[:, None] * stride_out_m + cols[None, :] * stride_out_k, tile, mask=mask)


def group_reference(x: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int = 1,
                    coeff: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch definition of :func:`group` (tests and devices without Triton)."""
    out = x.index_select(0, sorted_scattered_idxs // fan_out)
    if coeff is not None:
        out = (out.float() * coeff.float()[:, None]).to(x.dtype)
    return out


def group_triton(x, sorted_scattered_idxs, fan_out, coeff, out):
    """Launch the Triton kernel into ``out`` ([M, K]); inputs are assumed validated."""
    M, K = out.shape
    if M == 0 or K == 0:
        return out
    BLOCK_M, BLOCK_K = 32, min(128, max(16, next_power_of_2(K)))
    _group_kernel[(cdiv(M, BLOCK_M),)](
        x, sorted_scattered_idxs, coeff if coeff is not None else x, out,
        M, K, x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        FAN_OUT=fan_out, HAS_COEFF=coeff is not None, BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
    )
    return out


# ---------------------------------------------------------------------------------------------- op
def _group_impl(x: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int, coeff: Optional[torch.Tensor],
                out: torch.Tensor) -> None:
    if triton_runs(x, "group"):
        group_triton(x, sorted_scattered_idxs, fan_out, coeff, out)
    else:
        out.copy_(group_reference(x, sorted_scattered_idxs, fan_out, coeff))


_group_op = mutating_op("group", "out")(_group_impl)


def group(x: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int = 1,
          coeff: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``x`` in expert order: ``out[i] = x[idx[i] // fan_out] * coeff[i]`` (fp32 scaling)."""
    op = "group"
    check_float(op, "x", x, 2)
    check_index(op, "sorted_scattered_idxs", sorted_scattered_idxs, None, x.device)
    if fan_out < 1:
        fail(op, f"fan_out must be >= 1, got {fan_out}")
    M = sorted_scattered_idxs.numel()
    if x.shape[0] * fan_out != M:
        fail(op, f"x has {x.shape[0]} rows; with fan_out={fan_out} that is {x.shape[0] * fan_out} slots, "
                 f"but sorted_scattered_idxs has {M}")
    if coeff is not None:
        if tuple(coeff.shape) != (M,) or coeff.device != x.device:
            fail(op, f"coeff must have shape {(M,)} on {x.device}, got {tuple(coeff.shape)} on {coeff.device}")
        if not coeff.is_contiguous():
            fail(op, "coeff must be contiguous (call .contiguous())")
    if out is not None:
        check_out(op, out, (M, x.shape[1]), x)
    return group_unchecked(x, sorted_scattered_idxs, fan_out, coeff, out)


def group_unchecked(x, sorted_scattered_idxs, fan_out=1, coeff=None, out=None) -> torch.Tensor:
    """:func:`group` without the checks (see ``custom_ops``: for callers that validated already)."""
    if out is None:
        out = x.new_empty((sorted_scattered_idxs.shape[0], x.shape[1]))
    run_op(_group_op, _group_impl, x, sorted_scattered_idxs, fan_out, coeff, out)
    return out
