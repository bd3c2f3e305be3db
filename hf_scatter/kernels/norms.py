"""Residual add fused into LayerNorm / RMSNorm, forward and backward, each with its pure-torch reference.

A transformer block adds the residual, reduces the row to statistics and normalises it: unfused, that is
three reads of the row. Here one program reads its rows once, keeps them in registers and writes the
output (and the pre-norm sum, which pre-norm models carry on as the next residual). Short rows are
reduced several to a program (TurboTransformers' batch reduction: one program's synchronisations serve
``BLOCK_M`` rows); rows longer than one block are walked in column chunks and read a second time for the
output (from L2: one row is at most a few tens of kB).

Statistics are fp32 and taken in one read of the row. A plain ``E[x^2] - E[x]^2`` loses every digit of
the variance when the mean is large against the spread (a row at 1e4 with unit spread), and even an exact
variance does not help if the row is centred with an fp32 mean: at 1e4 that mean is only known to 5e-4.
So LayerNorm first subtracts the row's first element (exact for values of one magnitude: Sterbenz), and
takes the statistics of the shifted row ``d``: each column lane runs Welford's update over the row's
chunks and the lanes are merged at the end with Chan's formula. With a single chunk that merge is the
centred form ``mean(d)``, ``mean((d - mean(d))^2)`` over values already in registers: stability costs a
second register reduction, not a second read. The saved "mean" is ``mean(d)``, the mean less the row's
first element, which the backward reads again from the saved sum.

Rounding follows the unfused HF code so patched outputs match vanilla ones: every add is rounded to the
input dtype (``x + bias``, then ``+ residual``); LayerNorm computes in fp32 and rounds once. RMSNorm has two
castings, as transformers' families do: ``"llama"`` is MixtralRMSNorm's (Llama's, Qwen3's)
``weight * (x * rstd).to(dtype)``, rounding twice, the output dtype promoted with the weight's;
``"gpt_oss"`` is GptOssRMSNorm's ``(weight * (x * rstd)).to(dtype)``, the weight multiplying in fp32 and one
rounding, to x's dtype. In bf16 they differ in the last bit of about a quarter of the outputs, so a model gets
its own family's (the backward's d(weight) then reads the unrounded row).

Backward: the forward saves fp32 ``mean``/``rstd`` per row and the sum (or ``x`` when nothing was added),
so the backward reads each row of sum and dy once (twice for rows longer than a block). d(sum) also is d(x)
and d(residual); d(weight), d(bias) and d(add_bias) are column sums, accumulated per program in fp32 into a
``[programs, N]`` buffer and summed by torch afterwards: no atomics, so results are deterministic for a given
shape and device.

Public calls :func:`fused_add_layer_norm` and :func:`fused_add_rms_norm` check their arguments, then run a
``torch.autograd.Function`` whose forward and backward call the ``hf_scatter::add_norm_fwd`` /
``add_norm_bwd`` custom ops (see ``custom_ops``); without autograd the forward op runs alone.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .backend import cdiv, kernels_enabled, multiprocessors, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_eps, check_rows, check_same_place, check_tensor, check_vector, fail
from .custom_ops import mutating_op, profiled, run_op
from .dependent_launch import dependent_launch

if kernels_enabled():
    import triton
    import triton.language as tl

    from .dependent_launch import wait_for_predecessor

    @triton.jit
    def _load_sum(x_ptr, res_ptr, abias_ptr, r64, cols, col_mask, mask, stride_x, stride_r,
                  HAS_RES: tl.constexpr, HAS_ABIAS: tl.constexpr):
        """x (+ add_bias) (+ residual) in fp32, each add rounded to x's dtype like the unfused torch code."""
        s = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_ABIAS:
            ab = tl.load(abias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
            s = (s + ab[None, :]).to(x_ptr.dtype.element_ty).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_ptr + r64 * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            s = (s + r).to(x_ptr.dtype.element_ty).to(tl.float32)
        return s

    @triton.jit
    def _row_shift(x_ptr, res_ptr, abias_ptr, r64, row_mask, stride_x, stride_r, HAS_RES: tl.constexpr,
                   HAS_ABIAS: tl.constexpr, RMS: tl.constexpr, BLOCK_M: tl.constexpr):
        """[BLOCK_M, 1]: the first element of each row's sum for LayerNorm (RMSNorm has no mean to remove)."""
        if RMS:
            shift = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
        else:
            first = tl.zeros([1], dtype=tl.int32)
            shift = _load_sum(x_ptr, res_ptr, abias_ptr, r64, first, first == 0, row_mask[:, None], stride_x,
                              stride_r, HAS_RES, HAS_ABIAS)
        return shift

    @triton.jit
    def _sum_tile(x_ptr, res_ptr, abias_ptr, sum_ptr, r64, row_mask, cols, N, stride_x, stride_r, stride_s,
                  HAS_RES: tl.constexpr, HAS_ABIAS: tl.constexpr, STORE_SUM: tl.constexpr):
        """One tile of the pre-norm sum (stored when asked), with its column and tile masks."""
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        s = _load_sum(x_ptr, res_ptr, abias_ptr, r64, cols, col_mask, mask, stride_x, stride_r, HAS_RES, HAS_ABIAS)
        if STORE_SUM:
            tl.store(sum_ptr + r64 * stride_s + cols[None, :], s.to(sum_ptr.dtype.element_ty), mask=mask)
        return s, col_mask, mask

    @triton.jit
    def _normalize_store(d, mean, rstd, x_ptr, w_ptr, b_ptr, y_ptr, r64, cols, col_mask, mask, stride_y,
                         ROUND_NORMED: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
        xhat = (d - mean[:, None]) * rstd[:, None]
        if ROUND_NORMED:  # MixtralRMSNorm rounds the normalised row to the input dtype before the weight
            xhat = xhat.to(x_ptr.dtype.element_ty).to(tl.float32)
        y = xhat
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_norm_fwd_kernel(x_ptr, res_ptr, abias_ptr, w_ptr, b_ptr, y_ptr, sum_ptr, mean_ptr, rstd_ptr,
                             M, N, stride_x, stride_r, stride_y, stride_s, eps,
                             RMS: tl.constexpr, ROUND_NORMED: tl.constexpr, HAS_RES: tl.constexpr,
                             HAS_ABIAS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, STORE_SUM: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
        wait_for_predecessor(USE_PDL)  # a dependent launch waits for the kernel before
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        r64 = rows[:, None].to(tl.int64)
        lanes = tl.arange(0, BLOCK_N)
        shift = _row_shift(x_ptr, res_ptr, abias_ptr, r64, row_mask, stride_x, stride_r, HAS_RES, HAS_ABIAS, RMS,
                           BLOCK_M)
        if NUM_CHUNKS == 1:  # the whole row stays in registers from load to store
            s, col_mask, mask = _sum_tile(x_ptr, res_ptr, abias_ptr, sum_ptr, r64, row_mask, lanes, N, stride_x,
                                          stride_r, stride_s, HAS_RES, HAS_ABIAS, STORE_SUM)
            d = tl.where(mask, s - shift, 0.0)
            if RMS:
                mean = tl.zeros([BLOCK_M], dtype=tl.float32)
                var = tl.sum(d * d, axis=1) / N
            else:
                mean = tl.sum(d, axis=1) / N
                centred = tl.where(mask, d - mean[:, None], 0.0)
                var = tl.sum(centred * centred, axis=1) / N
        else:
            lane_mean = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            lane_m2 = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for c in range(NUM_CHUNKS):
                s, col_mask, mask = _sum_tile(x_ptr, res_ptr, abias_ptr, sum_ptr, r64, row_mask, c * BLOCK_N + lanes,
                                              N, stride_x, stride_r, stride_s, HAS_RES, HAS_ABIAS, STORE_SUM)
                d = tl.where(mask, s - shift, 0.0)
                if RMS:
                    lane_m2 += d * d
                else:  # Welford step: a lane valid in chunk c has seen c + 1 values
                    delta = d - lane_mean
                    lane_mean += tl.where(mask, delta / (c + 1), 0.0)
                    lane_m2 += tl.where(mask, delta * (d - lane_mean), 0.0)
            if RMS:
                mean = tl.zeros([BLOCK_M], dtype=tl.float32)
                var = tl.sum(lane_m2, axis=1) / N
            else:  # Chan's merge of the lanes: lane j saw ceil((N - j) / BLOCK_N) values
                lane_n = ((N - lanes + BLOCK_N - 1) // BLOCK_N).to(tl.float32)[None, :]
                mean = tl.sum(lane_mean * lane_n, axis=1) / N
                spread = lane_mean - mean[:, None]
                var = (tl.sum(lane_m2, axis=1) + tl.sum(lane_n * spread * spread, axis=1)) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        if not RMS:
            tl.store(mean_ptr + rows, mean, mask=row_mask)
        tl.store(rstd_ptr + rows, rstd, mask=row_mask)
        if NUM_CHUNKS == 1:
            _normalize_store(d, mean, rstd, x_ptr, w_ptr, b_ptr, y_ptr, r64, lanes, col_mask, mask, stride_y,
                             ROUND_NORMED, HAS_W, HAS_B)
        else:
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_N + lanes
                s, col_mask, mask = _sum_tile(x_ptr, res_ptr, abias_ptr, sum_ptr, r64, row_mask, cols, N, stride_x,
                                              stride_r, stride_s, HAS_RES, HAS_ABIAS, False)
                _normalize_store(s - shift, mean, rstd, x_ptr, w_ptr, b_ptr, y_ptr, r64, cols, col_mask, mask,
                                 stride_y, ROUND_NORMED, HAS_W, HAS_B)

    @triton.jit
    def _saved_stats(s_ptr, mean_ptr, rstd_ptr, rows, row_mask, r64, stride_s, RMS: tl.constexpr,
                     BLOCK_M: tl.constexpr):
        """(shift [BLOCK_M, 1], mean of the shifted row, rstd) as the forward had them."""
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)
        if RMS:
            shift = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        else:
            shift = tl.load(s_ptr + r64 * stride_s, mask=row_mask[:, None], other=0.0).to(tl.float32)
            mean = tl.load(mean_ptr + rows, mask=row_mask, other=0.0)
        return shift, mean, rstd

    @triton.jit
    def _bwd_tile(dy_ptr, s_ptr, w_ptr, shift, mean, rstd, r64, cols, col_mask, mask, stride_dy, stride_s,
                  RMS: tl.constexpr, HAS_W: tl.constexpr):
        """dy, the normalised row and g = dy * weight for one tile, all fp32."""
        dy = tl.load(dy_ptr + r64 * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr + r64 * stride_s + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        xhat = (s - shift - mean[:, None]) * rstd[:, None]
        g = dy
        if HAS_W:
            g = dy * tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        return dy, xhat, g

    @triton.jit
    def _dx_store(xhat, g, c1, c2, rstd, dsum_ptr, dx_ptr, r64, cols, mask, stride_dsum, stride_dx,
                  RMS: tl.constexpr, HAS_DSUM: tl.constexpr):
        """d(sum) = rstd * (g - mean(g) - xhat * mean(g * xhat)) (RMSNorm: no mean(g) term), plus the gradient
        that reached the returned sum directly."""
        if RMS:
            ds = rstd[:, None] * (g - xhat * c2[:, None])
        else:
            ds = rstd[:, None] * (g - c1[:, None] - xhat * c2[:, None])
        if HAS_DSUM:
            ds += tl.load(dsum_ptr + r64 * stride_dsum + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + r64 * stride_dx + cols[None, :], ds.to(dx_ptr.dtype.element_ty), mask=mask)
        return ds

    @triton.jit
    def _add_norm_bwd_kernel(dy_ptr, s_ptr, w_ptr, mean_ptr, rstd_ptr, dsum_ptr, dx_ptr, dw_ptr, db_ptr, dab_ptr,
                             M, N, stride_dy, stride_s, stride_dsum, stride_dx,
                             RMS: tl.constexpr, ROUND_NORMED: tl.constexpr, HAS_W: tl.constexpr,
                             HAS_DSUM: tl.constexpr, DW: tl.constexpr, DB: tl.constexpr, DAB: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_CHUNKS: tl.constexpr):
        # Persistent programs: program p takes row blocks p, p + P, ... and owns row p of the partial-sum buffers.
        pid = tl.program_id(0)
        num_programs = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK_N)
        part = pid.to(tl.int64) * N
        x_dtype = s_ptr.dtype.element_ty
        if NUM_CHUNKS == 1:
            col_mask = lanes < N
            acc_dw = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_db = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_dab = tl.zeros([BLOCK_N], dtype=tl.float32)
            for blk in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
                rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
                row_mask = rows < M
                r64 = rows[:, None].to(tl.int64)
                mask = row_mask[:, None] & col_mask[None, :]
                shift, mean, rstd = _saved_stats(s_ptr, mean_ptr, rstd_ptr, rows, row_mask, r64, stride_s, RMS,
                                                 BLOCK_M)
                dy, xhat, g = _bwd_tile(dy_ptr, s_ptr, w_ptr, shift, mean, rstd, r64, lanes, col_mask, mask,
                                        stride_dy, stride_s, RMS, HAS_W)
                c1 = tl.sum(g, axis=1) / N
                c2 = tl.sum(g * xhat, axis=1) / N
                ds = _dx_store(xhat, g, c1, c2, rstd, dsum_ptr, dx_ptr, r64, lanes, mask, stride_dsum, stride_dx,
                               RMS, HAS_DSUM)
                if DW:  # a "llama" RMSNorm's weight multiplied the row rounded to the input dtype
                    acc_dw += tl.sum(dy * (xhat.to(x_dtype).to(tl.float32) if ROUND_NORMED else xhat), axis=0)
                if DB:
                    acc_db += tl.sum(dy, axis=0)
                if DAB:
                    acc_dab += tl.sum(ds, axis=0)
            if DW:
                tl.store(dw_ptr + part + lanes, acc_dw, mask=col_mask)
            if DB:
                tl.store(db_ptr + part + lanes, acc_db, mask=col_mask)
            if DAB:
                tl.store(dab_ptr + part + lanes, acc_dab, mask=col_mask)
        else:
            for blk in range(pid, tl.cdiv(M, BLOCK_M), num_programs):
                rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
                row_mask = rows < M
                r64 = rows[:, None].to(tl.int64)
                shift, mean, rstd = _saved_stats(s_ptr, mean_ptr, rstd_ptr, rows, row_mask, r64, stride_s, RMS,
                                                 BLOCK_M)
                lane_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                lane_gx = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
                for c in range(NUM_CHUNKS):
                    cols = c * BLOCK_N + lanes
                    col_mask = cols < N
                    mask = row_mask[:, None] & col_mask[None, :]
                    dy, xhat, g = _bwd_tile(dy_ptr, s_ptr, w_ptr, shift, mean, rstd, r64, cols, col_mask, mask,
                                            stride_dy, stride_s, RMS, HAS_W)
                    lane_g += g
                    lane_gx += g * xhat
                c1 = tl.sum(lane_g, axis=1) / N
                c2 = tl.sum(lane_gx, axis=1) / N
                for c in range(NUM_CHUNKS):
                    cols = c * BLOCK_N + lanes
                    col_mask = cols < N
                    mask = row_mask[:, None] & col_mask[None, :]
                    dy, xhat, g = _bwd_tile(dy_ptr, s_ptr, w_ptr, shift, mean, rstd, r64, cols, col_mask, mask,
                                            stride_dy, stride_s, RMS, HAS_W)
                    ds = _dx_store(xhat, g, c1, c2, rstd, dsum_ptr, dx_ptr, r64, cols, mask, stride_dsum, stride_dx,
                                   RMS, HAS_DSUM)
                    # The partial rows are too long for registers: accumulate in place (zeroed by the host).
                    if DW:
                        xw = xhat.to(x_dtype).to(tl.float32) if ROUND_NORMED else xhat
                        prev = tl.load(dw_ptr + part + cols, mask=col_mask, other=0.0)
                        tl.store(dw_ptr + part + cols, prev + tl.sum(dy * xw, axis=0), mask=col_mask)
                    if DB:
                        prev = tl.load(db_ptr + part + cols, mask=col_mask, other=0.0)
                        tl.store(db_ptr + part + cols, prev + tl.sum(dy, axis=0), mask=col_mask)
                    if DAB:
                        prev = tl.load(dab_ptr + part + cols, mask=col_mask, other=0.0)
                        tl.store(dab_ptr + part + cols, prev + tl.sum(ds, axis=0), mask=col_mask)
                # The next row block reads these partial sums back, possibly in other threads of the program.
                tl.debug_barrier()


# ------------------------------------------------------------------------------------------- blocks
def _max_block_n() -> int:
    """Longest row kept whole in registers. Under the interpreter it is smaller, so that the chunked path
    (real rows longer than 8192 on a GPU) runs in CPU tests at DBRX's 6144."""
    return 4096 if triton_interpreted() else 8192


def norm_blocks(N: int, backward: bool = False) -> tuple[int, int, int, int]:
    """Cached: block choice runs on every call, where host time is what small shapes cost."""
    return _norm_blocks(N, backward, triton_interpreted())


@functools.lru_cache(maxsize=None)
def _norm_blocks(N: int, backward: bool, interpreted: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, NUM_CHUNKS, num_warps). On a GPU (measured on an H200, bf16): the forward runs
    tiles of about 2048 values, several short rows to a program (2 of BERT's 768) and one long row, at about
    16 values a thread; the backward keeps at least two rows in a program and 32 to 64 values of each
    tensor a thread. Under the interpreter, whose cost is per program, tiles are larger."""
    block_n = min(next_power_of_2(N), _max_block_n())
    if interpreted:
        return max(1, 16384 // block_n), block_n, cdiv(N, block_n), 4
    block_m = max(2 if backward else 1, 2048 // block_n)
    num_warps = max(2, min(16, block_m * block_n // (2048 if backward else 512)))
    return block_m, block_n, cdiv(N, block_n), num_warps


def _bwd_programs(x: torch.Tensor, block_m: int, block_n: int) -> int:
    """Persistent programs for the backward, each adding one fp32 row to the partial-sum buffers: about as many
    as fit on the GPU at once (small tiles: 16 a multiprocessor, 16384-value tiles: 2). Few under the
    interpreter, where the count of programs is the cost."""
    row_blocks = cdiv(x.shape[0], block_m)
    if x.device.type != "cuda":
        return max(1, min(row_blocks, 4))
    per_sm = max(2, 32768 // (block_m * block_n))
    return max(1, min(row_blocks, per_sm * multiprocessors(x.device.index or 0)))


# ------------------------------------------------------------------------------------------ launchers
def add_norm_fwd_triton(x: torch.Tensor, residual: torch.Tensor | None, add_bias: torch.Tensor | None,
                        weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool,
                        y: torch.Tensor, sum_out: torch.Tensor | None, mean: torch.Tensor | None,
                        rstd: torch.Tensor, weight_first: bool = False) -> None:
    """Writes y, sum_out (if given), mean (LayerNorm) and rstd for [M, N] ``x`` with contiguous rows.
    ``weight_first``: RMSNorm's ``"gpt_oss"`` casting (the weight multiplies before the one rounding)."""
    M, N = x.shape
    if M == 0:
        return
    block_m, block_n, chunks, warps = norm_blocks(N)
    _add_norm_fwd_kernel[(cdiv(M, block_m),)](
        x, x if residual is None else residual, x if add_bias is None else add_bias, x if weight is None else weight,
        x if bias is None else bias, y, x if sum_out is None else sum_out, rstd if mean is None else mean, rstd,
        M, N, x.stride(0), 0 if residual is None else residual.stride(0), y.stride(0),
        0 if sum_out is None else sum_out.stride(0), eps,
        RMS=rms, ROUND_NORMED=rms and not weight_first, HAS_RES=residual is not None,
        HAS_ABIAS=add_bias is not None, HAS_W=weight is not None,
        HAS_B=bias is not None, STORE_SUM=sum_out is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_CHUNKS=chunks, num_warps=warps, **dependent_launch(x))


def add_norm_bwd_triton(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None, mean: torch.Tensor | None,
                        rstd: torch.Tensor, dsum: torch.Tensor | None, rms: bool, dx: torch.Tensor,
                        dweight: torch.Tensor | None, dbias: torch.Tensor | None,
                        dadd_bias: torch.Tensor | None, weight_first: bool = False) -> None:
    """Writes dx = d(sum) and, where given, the column sums d(weight), d(bias), d(add_bias)."""
    M, N = s.shape
    block_m, block_n, chunks, warps = norm_blocks(N, backward=True)
    programs = _bwd_programs(s, block_m, block_n)
    outs = (dweight, dbias, dadd_bias)
    alloc = torch.zeros if chunks > 1 else torch.empty  # one chunk: every program stores its whole row
    partials = [None if out is None else alloc((programs, N), device=s.device, dtype=torch.float32) for out in outs]
    dw_p, db_p, dab_p = (dx if part is None else part for part in partials)
    _add_norm_bwd_kernel[(programs,)](  # also for M = 0: the partial sums must be written (as zeros)
        dy, s, s if weight is None else weight, rstd if mean is None else mean, rstd, dx if dsum is None else dsum,
        dx, dw_p, db_p, dab_p, M, N, dy.stride(0), s.stride(0), 0 if dsum is None else dsum.stride(0),
        dx.stride(0), RMS=rms, ROUND_NORMED=rms and not weight_first, HAS_W=weight is not None,
        HAS_DSUM=dsum is not None, DW=dweight is not None, DB=dbias is not None, DAB=dadd_bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_CHUNKS=chunks, num_warps=warps)
    for out, part in zip(outs, partials):
        if out is not None:
            out.copy_(part.sum(0))


# ------------------------------------------------------------------------------------------ references
def _acc_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def add_norm_reference(x: torch.Tensor, residual: torch.Tensor | None, add_bias: torch.Tensor | None,
                       weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, rms: bool,
                       weight_first: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Unfused torch in HF's order of operations: (y, sum, mean, rstd) with [M] fp32+ statistics, ``mean``
    being that of the row less its first element, as the kernel saves it (None for RMSNorm). ``weight_first``:
    GptOssRMSNorm's order (MixtralRMSNorm's otherwise)."""
    s = x if add_bias is None else x + add_bias
    s = s if residual is None else s + residual
    h = s.to(_acc_dtype(s))
    if rms:
        mean = None
        rstd = torch.rsqrt(h.pow(2).mean(-1) + eps)
        y = h * rstd[:, None]
        if weight_first:
            y = (y if weight is None else weight * y).to(x.dtype)
        else:
            y = y.to(x.dtype)
            y = y if weight is None else weight * y
    else:
        d = h - h[:, :1]
        mean = d.mean(-1)
        centred = d - mean[:, None]
        rstd = torch.rsqrt(centred.pow(2).mean(-1) + eps)
        y = centred * rstd[:, None]
        y = y if weight is None else y * weight.to(h.dtype)
        y = (y if bias is None else y + bias.to(h.dtype)).to(x.dtype)
    return y, s, mean, rstd


def add_norm_backward_reference(dy: torch.Tensor, s: torch.Tensor, weight: torch.Tensor | None,
                                mean: torch.Tensor | None, rstd: torch.Tensor, dsum: torch.Tensor | None, rms: bool,
                                weight_first: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d(sum) in s's dtype, and fp32+ column sums d(weight), d(bias), d(add_bias)) from the saved stats."""
    acc = _acc_dtype(s)
    h, d = s.to(acc), dy.to(acc)
    xhat = (h if mean is None else h - h[:, :1] - mean[:, None].to(acc)) * rstd[:, None].to(acc)
    g = d if weight is None else d * weight.to(acc)
    ds = g - xhat * (g * xhat).mean(-1, keepdim=True)
    if not rms:
        ds = ds - g.mean(-1, keepdim=True)
    ds = ds * rstd[:, None].to(acc)
    if dsum is not None:
        ds = ds + dsum.to(acc)
    xw = xhat.to(s.dtype).to(acc) if rms and not weight_first else xhat  # what the weight multiplied
    return ds.to(s.dtype), (d * xw).sum(0), d.sum(0), ds.sum(0)


# ----------------------------------------------------------------------------------------- norm ops
def _add_norm_fwd_impl(x: torch.Tensor, residual: Optional[torch.Tensor], add_bias: Optional[torch.Tensor],
                       weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, rms: bool,
                       y: torch.Tensor, sum_out: Optional[torch.Tensor], mean: Optional[torch.Tensor],
                       rstd: torch.Tensor, weight_first: bool = False) -> None:
    if triton_runs(x, "fused_add_rms_norm" if rms else "fused_add_layer_norm"):
        add_norm_fwd_triton(x, residual, add_bias, weight, bias, eps, rms, y, sum_out, mean, rstd, weight_first)
        return
    y_ref, s_ref, mean_ref, rstd_ref = add_norm_reference(x, residual, add_bias, weight, bias, eps, rms,
                                                          weight_first)
    y.copy_(y_ref)
    rstd.copy_(rstd_ref)
    if sum_out is not None:
        sum_out.copy_(s_ref)
    if mean is not None:
        mean.copy_(mean_ref)


_add_norm_fwd_op = mutating_op("add_norm_fwd", "y", "sum_out", "mean", "rstd")(_add_norm_fwd_impl)


def _add_norm_bwd_impl(dy: torch.Tensor, s: torch.Tensor, weight: Optional[torch.Tensor],
                       mean: Optional[torch.Tensor], rstd: torch.Tensor, dsum: Optional[torch.Tensor], rms: bool,
                       dx: torch.Tensor, dweight: Optional[torch.Tensor], dbias: Optional[torch.Tensor],
                       dadd_bias: Optional[torch.Tensor], weight_first: bool = False) -> None:
    if triton_runs(s, "fused_add_rms_norm" if rms else "fused_add_layer_norm"):
        add_norm_bwd_triton(dy, s, weight, mean, rstd, dsum, rms, dx, dweight, dbias, dadd_bias, weight_first)
        return
    grads = add_norm_backward_reference(dy, s, weight, mean, rstd, dsum, rms, weight_first)
    for out, grad in zip((dx, dweight, dbias, dadd_bias), grads):
        if out is not None:
            out.copy_(grad)


_add_norm_bwd_op = mutating_op("add_norm_bwd", "dx", "dweight", "dbias", "dadd_bias")(_add_norm_bwd_impl)


class _AddNorm(torch.autograd.Function):
    """[M, N] rows. Returns y, plus the pre-norm sum when something was added (the sum is what the backward
    reads, so it exists either way)."""

    @staticmethod
    @profiled("hf_scatter::add_norm.forward")
    def forward(ctx, x, residual, weight, bias, add_bias, eps, rms, weight_first):
        M, N = x.shape
        out_dtype = _norm_out_dtype(x, weight, rms, weight_first)
        stat_dtype = torch.promote_types(x.dtype, torch.float32)
        has_add = residual is not None or add_bias is not None
        y = x.new_empty((M, N), dtype=out_dtype)
        sum_out = x.new_empty((M, N)) if has_add else None
        mean = None if rms else x.new_empty((M,), dtype=stat_dtype)
        rstd = x.new_empty((M,), dtype=stat_dtype)
        run_op(_add_norm_fwd_op, _add_norm_fwd_impl, x, residual, add_bias, weight, bias, eps, rms, y, sum_out, mean,
               rstd, weight_first)
        ctx.save_for_backward(sum_out if has_add else x, weight, mean, rstd)
        ctx.rms = rms
        ctx.weight_first = weight_first
        ctx.out_dtype = out_dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.add_bias_dtype = None if add_bias is None else add_bias.dtype
        ctx.set_materialize_grads(False)  # an unused sum output should cost nothing in the backward
        return (y, sum_out) if has_add else y

    @staticmethod
    @profiled("hf_scatter::add_norm.backward")
    @once_differentiable
    def backward(ctx, dy, dsum=None):
        s, weight, mean, rstd = ctx.saved_tensors
        need_x, need_res, need_w, need_b, need_ab = ctx.needs_input_grad[:5]
        dy = s.new_zeros(s.shape, dtype=ctx.out_dtype) if dy is None else dy.contiguous()
        dx = s.new_empty(s.shape)
        N = s.shape[1]
        dweight = weight.new_empty((N,)) if need_w else None
        dbias = s.new_empty((N,), dtype=ctx.bias_dtype) if need_b else None
        dadd_bias = s.new_empty((N,), dtype=ctx.add_bias_dtype) if need_ab else None
        run_op(_add_norm_bwd_op, _add_norm_bwd_impl, dy, s, weight, mean, rstd,
               None if dsum is None else dsum.contiguous(), ctx.rms, dx, dweight, dbias, dadd_bias, ctx.weight_first)
        return dx if need_x else None, dx if need_res else None, dweight, dbias, dadd_bias, None, None, None


# ------------------------------------------------------------------------------------- validation
def _norm_rows(op: str, x, residual, weight, bias, add_bias, rms: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks the norm inputs; returns x and residual as [M, N] views (copies only if leading dims must be)."""
    check_tensor(op, "x", x)
    if x.shape[-1] == 0:
        fail(op, f"x's last dimension (the normalised one) is empty: shape {tuple(x.shape)}")
    check_rows(op, "x", x)
    if residual is not None:
        check_tensor(op, "residual", residual)
        check_same_place(op, "residual", residual, x)
        if residual.shape != x.shape:
            fail(op, f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they must match "
                     "(no broadcasting)")
        if residual.dtype != x.dtype:
            fail(op, f"residual has dtype {residual.dtype} but x has {x.dtype}; cast them to one dtype")
        check_rows(op, "residual", residual)
    params = (x.dtype, torch.float32)
    check_vector(op, "weight", weight, x, params)
    if not rms:
        check_vector(op, "bias", bias, x, params)
        check_vector(op, "add_bias", add_bias, x, (x.dtype,))
    N = x.shape[-1]
    return x.reshape(-1, N), None if residual is None else residual.reshape(-1, N)


def _norm_result(x: torch.Tensor, outputs, has_add: bool, return_sum: bool):
    y, s = outputs if has_add else (outputs, x)
    y = y.view(x.shape)
    return (y, s.view(x.shape)) if return_sum else y


# ----------------------------------------------------------------------------------- public calls
def _add_norm(op: str, x, residual, weight, bias, add_bias, eps, rms: bool, return_sum: bool, validate: bool,
              out: torch.Tensor | None = None, weight_first: bool = False):
    if validate:
        x2, res2 = _norm_rows(op, x, residual, weight, bias, add_bias, rms)
        eps = check_eps(op, eps)
    else:
        N = x.shape[-1]
        x2, res2 = x.reshape(-1, N), None if residual is None else residual.reshape(-1, N)
    has_add = residual is not None or add_bias is not None
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, residual, weight, bias, add_bias))
    if out is not None:
        _check_norm_out(op, out, x, weight, rms, needs_grad)
    if needs_grad:
        outputs = _AddNorm.apply(x2, res2, weight, bias, add_bias, eps, rms, weight_first)
    else:
        outputs = _add_norm_inference(x2, res2, weight, bias, add_bias, eps, rms, return_sum and has_add,
                                      None if out is None else out.view(x2.shape), weight_first)
    return _norm_result(x, outputs, has_add, return_sum)


def _norm_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, rms: bool, weight_first: bool = False
                    ) -> torch.dtype:
    """x's dtype, but promoted with the weight's where the weight multiplies last (MixtralRMSNorm)."""
    promoted = rms and not weight_first and weight is not None
    return torch.promote_types(x.dtype, weight.dtype) if promoted else x.dtype


def _check_norm_out(op: str, out: torch.Tensor, x: torch.Tensor, weight, rms: bool, needs_grad: bool) -> None:
    if needs_grad:
        fail(op, "out= is for inference (an output buffer cannot carry autograd history); call it under "
                 "torch.no_grad() or drop out=")
    dtype = _norm_out_dtype(x, weight, rms)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != dtype or out.device != x.device \
            or not out.is_contiguous():
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        fail(op, f"out must be a contiguous {tuple(x.shape)} {dtype} tensor on {x.device}, got {got}")


def _add_norm_inference(x, residual, weight, bias, add_bias, eps, rms, keep_sum: bool, out=None,
                        weight_first: bool = False):
    """No autograd node: the pre-norm sum is written only when the caller wants it, the statistics go to
    one scratch allocation (a small call is dominated by host time, so every allocation counts)."""
    M, N = x.shape
    y = x.new_empty((M, N), dtype=_norm_out_dtype(x, weight, rms, weight_first)) if out is None else out
    sum_out = x.new_empty((M, N)) if keep_sum else None
    stats = x.new_empty((1 if rms else 2, M), dtype=torch.promote_types(x.dtype, torch.float32))
    run_op(_add_norm_fwd_op, _add_norm_fwd_impl, x, residual, add_bias, weight, bias, eps, rms, y, sum_out,
           None if rms else stats[1], stats[0], weight_first)
    return (y, sum_out) if residual is not None or add_bias is not None else y


def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, eps: float = 1e-5, add_bias: torch.Tensor | None = None,
                         return_sum: bool = False, *, validate: bool = True, out: torch.Tensor | None = None):
    """``LayerNorm(x + add_bias + residual)`` over the last dimension in one read of each row, differentiable.

    The adds round to x's dtype one at a time, like ``LayerNorm(dense_out + input)`` unfused, so vanilla
    and fused BERT layers agree. ``add_bias``: the preceding linear layer's bias, folded into the add.
    ``weight`` / ``bias`` may be x's dtype or float32 (y keeps x's dtype). ``return_sum``: also return the
    pre-norm sum (the next residual of a pre-norm block): ``(y, sum)``. ``validate=False`` skips the input
    checks (for callers that built the arguments themselves; wrong input is then undefined behaviour).
    ``out``: write y there (inference only; a planned buffer of the packed BERT runtime).
    """
    return _add_norm("fused_add_layer_norm", x, residual, weight, bias, add_bias, eps, False, return_sum, validate,
                     out)


RMS_CASTINGS = {"llama": False, "gpt_oss": True}  # casting -> whether the weight multiplies before the rounding


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, return_sum: bool = False, *, validate: bool = True, casting: str = "llama"):
    """RMSNorm of ``s = x + residual`` in one read of each row, differentiable, rounded as the HF family does.

    ``casting="llama"`` (MixtralRMSNorm, Llama, Qwen3): ``weight * (s.float() * rstd).to(s.dtype)``, so the
    output dtype is that of ``weight * x`` (float32 weights give a float32 output). ``casting="gpt_oss"``
    (GptOssRMSNorm): ``(weight * (s.float() * rstd)).to(s.dtype)``, one rounding, output in x's dtype. Here
    ``rstd = rsqrt(mean(s.float()^2) + eps)``. ``return_sum``: also return ``s`` (the next residual):
    ``(y, s)``. ``validate`` as in :func:`fused_add_layer_norm`.
    """
    weight_first = RMS_CASTINGS.get(casting)
    if weight_first is None:
        fail("fused_add_rms_norm", f"casting must be one of {', '.join(map(repr, RMS_CASTINGS))}, got {casting!r}")
    return _add_norm("fused_add_rms_norm", x, residual, weight, None, None, eps, True, return_sum, validate,
                     weight_first=weight_first)
