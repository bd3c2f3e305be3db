"""``groupXTY``: per-expert ``X_e^T dY_e`` (the expert weight gradient) and ``sum dY_e`` (the bias gradient).

Expert ``e`` owns the sorted rows ``[offsets[e-1], offsets[e])``; each program reduces over those rows for
one [BLOCK_K, BLOCK_N] tile. Either operand may be grouped (row ``i``) or read from its scattered position
(row ``idx[i] // fan_out``), so the backward can do without a grouped copy where that copy would cost more
memory than it saves time (see ``moe/parallel_linear.py``). Experts without rows get exact zeros.

On Hopper and Blackwell, bf16 gradients of two grouped operands run as the library grouped GEMM instead
(``library_gemm.grouped_mm_weight_grad``); the bias gradient beside it is :func:`group_sum`, one pass over
the grouped dY.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from .backend import (cdiv, fit_shared_memory, fitted_block, fitting_configs, kernels_enabled, launch,
                      next_power_of_2, triton_interpreted, triton_runs)
from .checks import check_float, check_index, check_like, check_out, fail
from .custom_ops import mutating_op, run_op, tf32_allowed

if kernels_enabled():
    import triton
    import triton.language as tl

    from .tiling import dot_accumulate, grouped_tile

    @triton.jit
    def _groupxty_kernel(
        x_ptr, dy_ptr, dw_ptr, db_ptr, expert_end_ptr, idx_ptr,
        K, N,
        stride_xm, stride_xk, stride_dym, stride_dyn,
        stride_dwe, stride_dwk, stride_dwn, stride_dbe, stride_dbn,
        ROWS_BUCKET,  # autotuning key only (rows per expert, power of two)
        X_FAN: tl.constexpr, DY_FAN: tl.constexpr,  # 0: that operand is grouped
        HAS_BIAS: tl.constexpr, ALLOW_TF32: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_K: tl.constexpr,
    ):
        # The expert is the slow grid axis: concurrently running programs share one expert's rows in L2.
        # Within an expert, GROUP_K row-tiles of dW sweep the column tiles together (grouped order).
        pid = tl.program_id(0)
        expert = tl.program_id(1)
        pid_k, pid_n = grouped_tile(pid, tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N), GROUP_K)
        end = tl.load(expert_end_ptr + expert)
        start = tl.load(expert_end_ptr + expert - 1, mask=expert > 0, other=0)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        k_mask = ks < K
        n_mask = ns < N
        ms = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        # dY rows summed elementwise, reduced once after the loop: a reduction per step stalled the pipeline
        bias_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + ms
            row_mask = rows < end
            x_rows = rows
            dy_rows = rows
            if X_FAN + DY_FAN > 0:
                slots = tl.load(idx_ptr + rows, mask=row_mask, other=0)
                if X_FAN > 0:
                    x_rows = slots // X_FAN
                if DY_FAN > 0:
                    dy_rows = slots // DY_FAN
            xt = tl.load(x_ptr + x_rows[None, :].to(tl.int64) * stride_xm + ks[:, None] * stride_xk,
                         mask=k_mask[:, None] & row_mask[None, :], other=0.0)
            dy = tl.load(dy_ptr + dy_rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn,
                         mask=row_mask[:, None] & n_mask[None, :], other=0.0)
            acc = dot_accumulate(acc, xt, dy, UPCAST, ALLOW_TF32)
            if HAS_BIAS:
                bias_acc += dy.to(tl.float32)
        dw_tile = dw_ptr + expert.to(tl.int64) * stride_dwe + ks[:, None] * stride_dwk + ns[None, :] * stride_dwn
        tl.store(dw_tile, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])
        if HAS_BIAS:
            if pid_k == 0:
                db = tl.sum(bias_acc, axis=0)
                tl.store(db_ptr + expert * stride_dbe + ns * stride_dbn, db.to(db_ptr.dtype.element_ty),
                         mask=n_mask)


    @triton.jit
    def _group_sum_kernel(dy_ptr, db_ptr, expert_end_ptr, N, stride_dym, stride_dyn, stride_dbe, stride_dbn,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # one program per (column block, expert): it streams the expert's rows once, no atomics
        pid_n = tl.program_id(0)
        expert = tl.program_id(1)
        end = tl.load(expert_end_ptr + expert)
        start = tl.load(expert_end_ptr + expert - 1, mask=expert > 0, other=0)
        ns = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = ns < N
        ms = tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # reduced over rows once, after the loop
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + ms
            tile = dy_ptr + rows[:, None].to(tl.int64) * stride_dym + ns[None, :] * stride_dyn
            acc += tl.load(tile, mask=(rows < end)[:, None] & n_mask[None, :], other=0.0).to(tl.float32)
        db = tl.sum(acc, axis=0)
        tl.store(db_ptr + expert * stride_dbe + ns * stride_dbn, db.to(db_ptr.dtype.element_ty), mask=n_mask)

if kernels_enabled():
    def _gxty_configs():
        return [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_N": bn, "GROUP_K": 8}, num_warps=w,
                              num_stages=st)
                for bm, bk, bn, w, st in [(64, 128, 128, 8, 3), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4),
                                          (128, 128, 128, 8, 3), (32, 64, 64, 4, 4), (64, 128, 256, 8, 3),
                                          (64, 128, 256, 8, 4)]]

    def _prune_gxty(configs, named_args, **kwargs):
        return fitting_configs(configs, {"BLOCK_K": named_args["K"], "BLOCK_N": named_args["N"]})

    _GXTY_CONFIGS = _gxty_configs()
    _groupxty_tuned = triton.autotune(configs=_GXTY_CONFIGS,
                                      key=["K", "N", "ROWS_BUCKET", "HAS_BIAS", "X_FAN", "DY_FAN"],
                                      prune_configs_by={"early_config_prune": _prune_gxty})(_groupxty_kernel)


@functools.lru_cache(maxsize=None)
def _table_config(K: int, N: int, dy_gathered: bool, has_bias: bool, itemsize: int):
    """The launch config without a sweep (Triton's autotuner over the 18 weight-gradient launch keys of the bench
    moe shapes, H100): 64-row steps into a 128 x 256 dW tile, 8 warps, 4 stages; 128 x 128, 3 stages when dY
    rows are gathered from their scattered positions (within 1.2% of the best on average, 6.5% at worst), or
    when the bias gradient is summed alongside (its accumulator beside a 128 x 256 tile spilled registers)."""
    bn, stages = (128, 3) if dy_gathered or has_bias else (256, 4)
    bm, bk, bn = 64, fitted_block(128, K), fitted_block(bn, N)
    bm, stages = fit_shared_memory(bm, stages, (bk + bn) * itemsize)  # fp32 operands: half the rows per step
    return triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_N": bn, "GROUP_K": 8}, num_warps=8,
                         num_stages=stages)


def _sorted_rows(t, sorted_scattered_idxs, fan_out):
    """Operand rows in expert order: ``t`` itself (fan_out 0) or ``t[idx // fan_out]``."""
    return t if not fan_out else t.index_select(0, sorted_scattered_idxs // fan_out)


def groupxty_reference(x, dy, expert_offsets, dw_out, db_out=None, sorted_scattered_idxs=None, x_fan_out=0,
                       dy_fan_out=0):
    """Pure-torch definition of :func:`groupXTY` into ``dw_out`` [E, K, N] (and ``db_out`` [E, N])."""
    x_grouped = _sorted_rows(x, sorted_scattered_idxs, x_fan_out)
    dy_grouped = _sorted_rows(dy, sorted_scattered_idxs, dy_fan_out)
    start = 0
    for e, end in enumerate(expert_offsets.tolist()[:dw_out.shape[0]]):  # a skip bin past the experts: no weight
        dw_out[e] = (x_grouped[start:end].float().t() @ dy_grouped[start:end].float()).to(dw_out.dtype)
        start = end
    if db_out is not None:
        group_sum_reference(dy_grouped, expert_offsets, db_out)
    return dw_out, db_out


def groupxty_triton(x, dy, expert_offsets, dw_out, db_out=None, allow_tf32=False, sorted_scattered_idxs=None,
                    x_fan_out=0, dy_fan_out=0):
    """Launch the Triton kernel; inputs are assumed validated."""
    E, K, N = dw_out.shape
    if E == 0 or K == 0 or N == 0:
        return dw_out, db_out
    interpreted = triton_interpreted()
    db = db_out if db_out is not None else dw_out
    idx = sorted_scattered_idxs if sorted_scattered_idxs is not None else expert_offsets
    rows = idx.numel() if sorted_scattered_idxs is not None else x.shape[0]
    args = (x, dy, dw_out, db, expert_offsets, idx, K, N,
            x.stride(0), x.stride(1), dy.stride(0), dy.stride(1),
            dw_out.stride(0), dw_out.stride(1), dw_out.stride(2), db.stride(0), db.stride(-1),
            _rows_bucket(rows, E))
    meta = dict(X_FAN=x_fan_out, DY_FAN=dy_fan_out, HAS_BIAS=db_out is not None,
                ALLOW_TF32=allow_tf32, UPCAST=interpreted and x.dtype == torch.bfloat16)
    grid = lambda cfg: (cdiv(K, cfg["BLOCK_K"]) * cdiv(N, cfg["BLOCK_N"]), E)  # noqa: E731
    interpreter_blocks = dict(BLOCK_M=32, BLOCK_K=min(128, max(16, next_power_of_2(K))),
                              BLOCK_N=min(128, max(16, next_power_of_2(N))), GROUP_K=4)
    tune_key = (K, N, args[-1], x_fan_out, dy_fan_out, db_out is not None, allow_tf32, x.dtype, dy.dtype, dw_out.dtype)
    table = None if interpreted else _table_config(K, N, dy_fan_out > 0, db_out is not None, x.element_size())
    launch(_groupxty_kernel, _groupxty_tuned, _GXTY_CONFIGS, {"BLOCK_K": K, "BLOCK_N": N}, grid, args, meta,
           interpreter_blocks, tune_key, table)
    return dw_out, db_out


def _rows_bucket(rows: int, experts: int) -> int:
    """Autotuning key for the reduction length: rows per expert, rounded to a power of two."""
    return 1 << max(0, (rows // max(1, experts)).bit_length() - 1)


# ---------------------------------------------------------------------------------------------- op
def _groupxty_impl(x: torch.Tensor, dy: torch.Tensor, expert_offsets: torch.Tensor, dw: torch.Tensor,
                   db: Optional[torch.Tensor], allow_tf32: bool, sorted_scattered_idxs: Optional[torch.Tensor],
                   x_fan_out: int, dy_fan_out: int) -> None:
    if triton_runs(x, "groupXTY"):
        groupxty_triton(x, dy, expert_offsets, dw, db, allow_tf32, sorted_scattered_idxs, x_fan_out, dy_fan_out)
    else:
        groupxty_reference(x, dy, expert_offsets, dw, db, sorted_scattered_idxs, x_fan_out, dy_fan_out)


_groupxty_op = mutating_op("groupxty", "dw", "db")(_groupxty_impl)


def groupXTY(x_grouped: torch.Tensor, dy_grouped: torch.Tensor, expert_offsets: torch.Tensor,
             dw: torch.Tensor | None = None, db: torch.Tensor | bool | None = None,
             sorted_scattered_idxs: torch.Tensor | None = None, x_fan_out: int = 0, dy_fan_out: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-expert ``dW[e] = X_e^T dY_e`` ([E, d_in, d_out]) and, with ``db`` (a buffer or True), ``db[e] = sum dY_e``.

    ``dw`` may be any [E, d_in, d_out] buffer, e.g. one strided like the weight it is the gradient of.
    Operands are grouped (expert-sorted rows) by default; ``x_fan_out``/``dy_fan_out`` > 0 reads that operand's
    sorted row ``i`` from row ``sorted_scattered_idxs[i] // fan_out`` instead, so no grouped copy is needed.
    """
    op = "groupXTY"
    check_float(op, "x_grouped", x_grouped, 2)
    check_float(op, "dy_grouped", dy_grouped, 2)
    check_like(op, "dy_grouped", dy_grouped, x_grouped)
    check_index(op, "expert_offsets", expert_offsets, None, x_grouped.device)
    if x_fan_out < 0 or dy_fan_out < 0:
        fail(op, f"fan-outs must be >= 0 (0 = grouped operand), got x_fan_out={x_fan_out}, dy_fan_out={dy_fan_out}")
    if sorted_scattered_idxs is None:
        if x_fan_out or dy_fan_out:
            fail(op, "scattered operands (x_fan_out/dy_fan_out > 0) need sorted_scattered_idxs")
        M = x_grouped.shape[0]
    else:
        check_index(op, "sorted_scattered_idxs", sorted_scattered_idxs, None, x_grouped.device)
        M = sorted_scattered_idxs.numel()
    for name, t, fan in (("x_grouped", x_grouped, x_fan_out), ("dy_grouped", dy_grouped, dy_fan_out)):
        rows = M // fan if fan else M
        if t.shape[0] != rows or (fan and M % fan):
            how = f"scattered with fan_out={fan}, that is M/fan_out" if fan else "grouped, one row per slot"
            fail(op, f"{name} has {t.shape[0]} rows for M={M} slots ({how})")
    E, K, N = expert_offsets.numel(), x_grouped.shape[1], dy_grouped.shape[1]
    if dw is not None:
        check_out(op, dw, (E, K, N), x_grouped)
    if isinstance(db, torch.Tensor):
        check_out(op, db, (E, N), x_grouped)
    return groupxty_unchecked(x_grouped, dy_grouped, expert_offsets, dw, db, sorted_scattered_idxs, x_fan_out,
                              dy_fan_out)


def groupxty_unchecked(x, dy, expert_offsets, dw=None, db=None, sorted_scattered_idxs=None, x_fan_out=0,
                       dy_fan_out=0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`groupXTY` without the checks (see ``custom_ops``: for callers that validated already)."""
    # the experts are dw's when given: a routing may hold one bin more, of routes to skip
    E, K, N = (dw.shape[0] if dw is not None else expert_offsets.shape[0]), x.shape[1], dy.shape[1]
    if dw is None:
        dw = x.new_empty((E, K, N))
    if db is True:
        db = x.new_empty((E, N))
    elif db is False:
        db = None
    run_op(_groupxty_op, _groupxty_impl, x, dy, expert_offsets, dw, db, tf32_allowed(), sorted_scattered_idxs,
           x_fan_out, dy_fan_out)
    return dw, db


def group_sum_reference(dy_grouped: torch.Tensor, expert_offsets: torch.Tensor, db_out: torch.Tensor) -> torch.Tensor:
    """Pure-torch definition of :func:`group_sum` into ``db_out`` [E, N] (fp32 sums)."""
    start = 0
    for e, end in enumerate(expert_offsets.tolist()[:db_out.shape[0]]):
        db_out[e] = dy_grouped[start:end].float().sum(0).to(db_out.dtype)
        start = end
    return db_out


def group_sum_triton(dy_grouped, expert_offsets, db_out):
    """Launch the Triton kernel into ``db_out`` [E, N]; inputs are assumed validated."""
    E, N = db_out.shape
    if E == 0 or N == 0:
        return db_out
    # 64 x 64 bf16 steps (8 KB per load): E x N/64 programs, 720-1,536 of them on the library's shapes
    block_m, block_n = (32, min(64, max(16, next_power_of_2(N)))) if triton_interpreted() else (64, 64)
    _group_sum_kernel[(cdiv(N, block_n), E)](dy_grouped, db_out, expert_offsets, N, dy_grouped.stride(0),
                                              dy_grouped.stride(1), db_out.stride(0), db_out.stride(1),
                                              BLOCK_M=block_m, BLOCK_N=block_n)
    return db_out


def _group_sum_impl(dy_grouped: torch.Tensor, expert_offsets: torch.Tensor, db: torch.Tensor) -> None:
    if triton_runs(dy_grouped, "group_sum"):
        group_sum_triton(dy_grouped, expert_offsets, db)
    else:
        group_sum_reference(dy_grouped, expert_offsets, db)


_group_sum_op = mutating_op("group_sum", "db")(_group_sum_impl)


def group_sum(dy_grouped: torch.Tensor, expert_offsets: torch.Tensor, experts: int | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-expert row sums ``db[e] = sum dY_e`` ([E, N], the bias gradient) of expert-ordered rows: expert ``e``
    owns rows ``[offsets[e-1], offsets[e])``; ``experts`` (default: all of ``expert_offsets``) leaves out a
    trailing bin of skipped routes. Experts without rows get zeros; ``out`` may be any [E, N] buffer."""
    op = "group_sum"
    check_float(op, "dy_grouped", dy_grouped, 2)
    check_index(op, "expert_offsets", expert_offsets, None, dy_grouped.device)
    bins = expert_offsets.numel()
    if experts is not None and not 0 <= experts <= bins:
        fail(op, f"experts must be between 0 and the {bins} bins of expert_offsets, got {experts}")
    experts = bins if experts is None else experts
    if out is not None:
        check_out(op, out, (experts, dy_grouped.shape[1]), dy_grouped)
    return group_sum_unchecked(dy_grouped, expert_offsets, experts, out)


def group_sum_unchecked(dy_grouped, expert_offsets, experts, out=None) -> torch.Tensor:
    """:func:`group_sum` without the checks (see ``custom_ops``: for callers that validated already)."""
    if out is None:
        out = dy_grouped.new_empty((experts, dy_grouped.shape[1]))
    run_op(_group_sum_op, _group_sum_impl, dy_grouped, expert_offsets, out)
    return out
