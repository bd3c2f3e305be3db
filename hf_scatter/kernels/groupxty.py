"""``groupXTY``: per-expert ``X_e^T dY_e`` (the expert weight gradient) and ``sum dY_e`` (the bias gradient).

Expert ``e`` owns the sorted rows ``[offsets[e-1], offsets[e])``; each program reduces over those rows for
one [BLOCK_K, BLOCK_N] tile. Either operand may be grouped (row ``i``) or read from its scattered position
(row ``idx[i] // fan_out``), so the backward can do without a grouped copy where that copy would cost more
memory than it saves time (see ``moe/parallel_linear.py``). Experts without rows get exact zeros.
"""

from __future__ import annotations

import torch

from .backend import cdiv, fitting_configs, kernels_enabled, launch, next_power_of_2, triton_interpreted

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
        bias_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
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
                bias_acc += tl.sum(dy.to(tl.float32), axis=0)
        dw_tile = dw_ptr + expert.to(tl.int64) * stride_dwe + ks[:, None] * stride_dwk + ns[None, :] * stride_dwn
        tl.store(dw_tile, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & n_mask[None, :])
        if HAS_BIAS:
            if pid_k == 0:
                tl.store(db_ptr + expert * stride_dbe + ns * stride_dbn, bias_acc.to(db_ptr.dtype.element_ty),
                         mask=n_mask)


if kernels_enabled():
    def _gxty_configs():
        return [triton.Config({"BLOCK_M": bm, "BLOCK_K": bk, "BLOCK_N": bn, "GROUP_K": 8}, num_warps=w,
                              num_stages=st)
                for bm, bk, bn, w, st in [(64, 128, 128, 8, 3), (32, 128, 128, 4, 4), (64, 64, 128, 4, 4),
                                          (128, 128, 128, 8, 3), (32, 64, 64, 4, 4), (64, 128, 256, 8, 3)]]

    def _prune_gxty(configs, named_args, **kwargs):
        return fitting_configs(configs, {"BLOCK_K": named_args["K"], "BLOCK_N": named_args["N"]})

    _GXTY_CONFIGS = _gxty_configs()
    _groupxty_tuned = triton.autotune(configs=_GXTY_CONFIGS,
                                      key=["K", "N", "ROWS_BUCKET", "HAS_BIAS", "X_FAN", "DY_FAN"],
                                      prune_configs_by={"early_config_prune": _prune_gxty})(_groupxty_kernel)


def _sorted_rows(t, sorted_scattered_idxs, fan_out):
    """Operand rows in expert order: ``t`` itself (fan_out 0) or ``t[idx // fan_out]``."""
    return t if not fan_out else t.index_select(0, sorted_scattered_idxs // fan_out)


def groupxty_reference(x, dy, expert_offsets, dw_out, db_out=None, sorted_scattered_idxs=None, x_fan_out=0,
                       dy_fan_out=0):
    """Pure-torch definition of :func:`groupXTY` into ``dw_out`` [E, K, N] (and ``db_out`` [E, N])."""
    x_grouped = _sorted_rows(x, sorted_scattered_idxs, x_fan_out)
    dy_grouped = _sorted_rows(dy, sorted_scattered_idxs, dy_fan_out)
    start = 0
    for e, end in enumerate(expert_offsets.tolist()):
        xs, dys = x_grouped[start:end], dy_grouped[start:end]
        dw_out[e] = (xs.float().t() @ dys.float()).to(dw_out.dtype)
        if db_out is not None:
            db_out[e] = dys.float().sum(0).to(db_out.dtype)
        start = end
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
    launch(_groupxty_kernel, _groupxty_tuned, _GXTY_CONFIGS, {"BLOCK_K": K, "BLOCK_N": N}, grid, args, meta,
           interpreter_blocks, tune_key)
    return dw_out, db_out


def _rows_bucket(rows: int, experts: int) -> int:
    """Autotuning key for the reduction length: rows per expert, rounded to a power of two."""
    return 1 << max(0, (rows // max(1, experts)).bit_length() - 1)
