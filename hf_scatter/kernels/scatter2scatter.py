"""``scatter2scatter``: one expert-parallel GEMM for every grouped/scattered input/output combination.

Row ``i`` of the expert-sorted order multiplies input row ``x[i]`` (grouped) or ``x[idx[i] // fan_out]``
(scattered) by ``W[expert(i)]`` and writes ``y[i]`` (grouped) or ``y[idx[i]]`` (scattered). Rows are
gathered straight into tiles: no padded or grouped copy of ``x`` is made.

Unlike the original ScatterMoE, a tile never straddles two experts: tiles are laid out per expert
(``expert_tiles``), so each program runs its K loop exactly once with one weight matrix.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch

from .backend import (cdiv, compute_capability, env_switch, fit_shared_memory, fitted_block, fitting_configs,
                      kernels_enabled, launch, multiprocessors, next_power_of_2, planned_config,
                      shared_memory_per_multiprocessor, triton_interpreted, triton_runs, use_triton)
from .checks import check_float, check_index, check_like, check_out, fail
from .custom_ops import mutating_op, run_op, tf32_allowed
from .fp8_blocks import (FP8_DTYPE, Fp8BlockWeight, converts_e4m3, dequantize_fp8_rows, quantize_fp8_rows_reference,
                         quantize_fp8_rows_triton)
from .mxfp4 import Mxfp4Weight, scaled_dot_enabled
from .swiglu import SILU, GateForm, swiglu_reference
from .weight_formats import is_quantized, operands, weight_of

if kernels_enabled():
    import triton
    import triton.language as tl

    try:  # Triton 3.3 on; before it, the weight tiles keep the plain loads
        from triton.tools.tensor_descriptor import TensorDescriptor
    except ImportError:
        TensorDescriptor = None

    from .fp8_blocks import e4m3_bits, e4m3_tile, fp8_block_tile, fp8_column_scales
    from .mxfp4 import mxfp4_operands, mxfp4_tile
    from .swiglu import swiglu_tile
    from .tiling import dot_accumulate, grouped_tile

    # EVEN_K: every K step is whole, so the plain product's loads need no mask along K. The copies stay 16 bytes
    # wide either way, but masked, the loop computes a byte count for each of its async copies at every step
    # (sm90 PTX of the probe's kernel: 111 selects against 6): Qwen3-30B-A3B's first projection took 1.64
    # instead of 1.58 ms with them (H200, scripts/probes/probe_first_projection_loads.py).
    # W_HALVES: a [gate; up] weight with N contiguous (plain weights only: the quantized ones keep K contiguous).
    # A tile's gate/up pairs are then two contiguous runs of columns: each half loads whole rows into a product
    # of its own, and the two accumulators are joined into pairs after the loop. Loaded column by column, the
    # pairs cost 2-byte reads (12x the time; joined before each product, 1.7x: Qwen3-30B-A3B's shape, H200,
    # scripts/probes/probe_first_projection_layout.py).
    # W_TMA: the weight's tiles come through a TMA descriptor (Hopper's bulk tensor copies, no per-thread address
    # work): 1 over its [E * N, K] rows (K contiguous), 2 over its [E * K, N] rows (N contiguous, whole K steps);
    # a tile past an expert's last column reads the next expert's (or zeros past the end), never stored. A
    # [gate; up] weight through TMA is two products, as with W_HALVES.
    @triton.heuristics({"EVEN_K": lambda args: args["K"] % args["BLOCK_K"] == 0,
                        "W_HALVES": lambda args: bool(args["GLU_CONCAT"] and (args["stride_wn"] == 1 or args["W_TMA"])
                                                      and not args["W_MXFP4"] and not args["W_FP8"])})
    @triton.jit
    def _scatter2scatter_kernel(
        x_ptr, w_ptr, w_desc, b_ptr, y_ptr, h_ptr,
        tile_expert_ptr, tile_row_ptr, expert_end_ptr, scattered_ptr,
        NUM_TILES, K, N, E,
        stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_be, stride_bn, stride_ym, stride_yn,
        stride_hm, alpha, limit, up_shift, scales_ptr, stride_se, stride_sn, x_scales_ptr, stride_xsm,
        FAN_OUT: tl.constexpr, X_GROUPED: tl.constexpr, Y_GROUPED: tl.constexpr, HAS_BIAS: tl.constexpr,
        ALLOW_TF32: tl.constexpr, UPCAST: tl.constexpr, GLU: tl.constexpr, GLU_CONCAT: tl.constexpr,
        STORE_Y: tl.constexpr, SKIP_BIN: tl.constexpr, W_MXFP4: tl.constexpr, SCALED_DOT: tl.constexpr,
        W_FP8: tl.constexpr, W_BLOCK_N: tl.constexpr, W_BLOCK_K: tl.constexpr, CONVERT: tl.constexpr,
        A_FP8: tl.constexpr, W_TMA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, W_HALVES: tl.constexpr,
    ):
        # W_MXFP4: w_ptr holds the weight as MXFP4 bytes [E, N, K / 2] (two values of row n per byte, low nibble
        # first) and scales_ptr its exponents [E, N, K / 32]; each [BLOCK_K, BLOCK_N] tile is decoded in
        # registers (exact in the activations' dtype) right before its product, so HBM holds and serves 4.25
        # bits per weight.
        # W_FP8: w_ptr holds the weight as e4m3 bytes [E, N, K] and scales_ptr its float32 scales
        # [E, N / W_BLOCK_N, K / W_BLOCK_K]; each tile is converted and scaled in registers (the float32 product
        # rounded once, as transformers dequantizes), so HBM serves 1 byte per weight. A K step within one block
        # along K loads one scale per column; a step across blocks one per weight.
        # A_FP8 (with W_FP8, a K step within one block): x_ptr holds the activations as e4m3 bytes and
        # x_scales_ptr one float32 scale per row and W_BLOCK_K columns; each step is an FP8 tensor-core product
        # (exact products, float32 sums) times the row's and the column's scales. The interpreter has no 8-bit
        # floats: it multiplies the decoded values in float32, the same products.
        # GLU: the N = 2I columns are [gate, up] pairs and the epilogue also writes h = act(gate) * up [M, I]
        # (``y``, the pre-activation, only with STORE_Y). A tile holds BLOCK_N / 2 pairs side by side, so one
        # split in registers separates them: interleaved weights ([g0, u0, g1, u1, ...]) are read as they lie;
        # concatenated ones ([gate; up]) are read with each up column beside its gate column.
        # Grouped program order: GROUP_M row tiles sweep all column tiles together, so their input rows
        # stay in L2 while the column tiles of one expert's weight are reused across them.
        # SKIP_BIN (0 or 1): the routing sorted into one bin more than the weight has experts, and that last
        # bin's rows (routes to another rank's experts) are written as zeros without a product.
        # Persistent programs (grid below the tile count): each program steps through tiles pid, pid + P, ...
        num_col_tiles = tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), NUM_TILES * num_col_tiles, tl.num_programs(0)):
            pid_m, pid_n = grouped_tile(tile, NUM_TILES, num_col_tiles, GROUP_M)
            expert = tl.load(tile_expert_ptr + pid_m)
            if expert < E + SKIP_BIN:
                computed = expert < E
                row0 = tl.load(tile_row_ptr + pid_m)
                row_end = tl.load(expert_end_ptr + expert)
                rows = row0 + tl.arange(0, BLOCK_M)
                row_mask = rows < row_end
                if X_GROUPED:  # a row past the expert's end reads its last row (in bounds; never stored)
                    x_rows = tl.minimum(rows, row_end - 1)
                else:
                    x_rows = tl.load(scattered_ptr + rows, mask=row_mask, other=0) // FAN_OUT
                cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                if GLU_CONCAT:
                    pairs = cols // 2  # [BLOCK_N]: the pair each column belongs to, gate first
                    cols = pairs + (cols % 2) * (N // 2)
                    col_mask = pairs < N // 2
                ks = tl.arange(0, BLOCK_K)
                x_tile_ptr = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + ks[None, :] * stride_xk
                w_expert_ptr = w_ptr + tl.minimum(expert, E - 1).to(tl.int64) * stride_we
                w_row = tl.minimum(expert, E - 1) * (N if W_TMA == 1 else K)  # the expert's first descriptor row
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                if W_HALVES:  # the tile's gate columns, contiguous; its up columns lie N / 2 further on
                    half_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                    half_mask = half_cols < N // 2
                    w_tile_ptr = w_expert_ptr + ks[:, None] * stride_wk + half_cols[None, :]
                    acc_gate = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
                    acc_up = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
                else:
                    w_tile_ptr = w_expert_ptr + ks[:, None] * stride_wk + cols[None, :] * stride_wn
                for k0 in range(0, tl.cdiv(K, BLOCK_K) * computed.to(tl.int32)):
                    k_mask = ks < K - k0 * BLOCK_K
                    if W_MXFP4 and SCALED_DOT:  # bf16 activations: Triton's microscaled product reads the bytes
                        x = tl.load(x_tile_ptr, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                        packed, exponents = mxfp4_operands(w_ptr, scales_ptr, tl.minimum(expert, E - 1).to(tl.int64), k0,
                                                           K, cols, col_mask, stride_we, stride_wn, stride_se, stride_sn,
                                                           BLOCK_K, BLOCK_N)
                        acc = tl.dot_scaled(x, None, "bf16", packed, exponents, "e2m1", acc=acc)
                    elif W_MXFP4:  # the even and the odd input columns times the weight's matching rows
                        w_even, w_odd = mxfp4_tile(w_ptr, scales_ptr, tl.minimum(expert, E - 1).to(tl.int64), k0, K,
                                                   cols, col_mask, stride_we, stride_wn, stride_se, stride_sn, BLOCK_K,
                                                   BLOCK_N)
                        k_even = k0 * BLOCK_K + 2 * tl.arange(0, BLOCK_K // 2)
                        x_even_ptr = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + k_even[None, :] * stride_xk
                        x_mask = row_mask[:, None] & (k_even < K)[None, :]
                        x_even = tl.load(x_even_ptr, mask=x_mask, other=0.0)
                        x_odd = tl.load(x_even_ptr + stride_xk, mask=x_mask, other=0.0)
                        acc = dot_accumulate(acc, x_even, w_even.to(x_even.dtype), UPCAST, ALLOW_TF32)
                        acc = dot_accumulate(acc, x_odd, w_odd.to(x_odd.dtype), UPCAST, ALLOW_TF32)
                    elif A_FP8:
                        e64 = tl.minimum(expert, E - 1).to(tl.int64)
                        x_tile = tl.load(x_tile_ptr, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                        w_tile = tl.load(w_tile_ptr, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                        if CONVERT:  # e4m3 pointers: the tiles go to the tensor cores as loaded
                            part = tl.dot(x_tile, w_tile)
                        else:  # bytes: their values in float32
                            part = tl.dot(e4m3_bits(x_tile.to(tl.int32)), e4m3_bits(w_tile.to(tl.int32)),
                                          input_precision="ieee")
                        x_scale = tl.load(x_scales_ptr + x_rows.to(tl.int64) * stride_xsm + (k0 * BLOCK_K) // W_BLOCK_K,
                                          mask=row_mask, other=0.0)
                        w_scale = fp8_column_scales(scales_ptr, e64, k0, cols, col_mask, stride_se, stride_sn, BLOCK_K,
                                                    W_BLOCK_N, W_BLOCK_K)
                        acc += part * x_scale[:, None] * w_scale[None, :]
                    elif W_FP8:
                        x = tl.load(x_tile_ptr, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                        e64 = tl.minimum(expert, E - 1).to(tl.int64)
                        if W_BLOCK_K % BLOCK_K == 0:  # the step within one block along K: a scale per column
                            w = e4m3_tile(w_ptr, e64, k0, K, cols, col_mask, stride_we, stride_wn, BLOCK_K, CONVERT)
                            w = w * fp8_column_scales(scales_ptr, e64, k0, cols, col_mask, stride_se, stride_sn,
                                                      BLOCK_K, W_BLOCK_N, W_BLOCK_K)[None, :]
                        else:
                            w = fp8_block_tile(w_ptr, scales_ptr, e64, k0, K, cols, col_mask, stride_we, stride_wn,
                                               stride_se, stride_sn, BLOCK_K, W_BLOCK_N, W_BLOCK_K, CONVERT)
                        if not UPCAST:  # the interpreter truncates a cast to bf16: it keeps the float32 values
                            w = w.to(x.dtype)  # the value transformers dequantizes to: float32 product, rounded once
                        acc = dot_accumulate(acc, x, w, UPCAST, ALLOW_TF32)
                    elif W_HALVES:
                        if EVEN_K:
                            x = tl.load(x_tile_ptr)
                            w_mask = half_mask[None, :]
                        else:
                            x = tl.load(x_tile_ptr, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                            w_mask = k_mask[:, None] & half_mask[None, :]
                        if W_TMA == 1:
                            gate_w = w_desc.load([w_row + pid_n * (BLOCK_N // 2), k0 * BLOCK_K]).T
                            up_w = w_desc.load([w_row + N // 2 + pid_n * (BLOCK_N // 2), k0 * BLOCK_K]).T
                        elif W_TMA == 2:
                            gate_w = w_desc.load([w_row + k0 * BLOCK_K, pid_n * (BLOCK_N // 2)])
                            up_w = w_desc.load([w_row + k0 * BLOCK_K, N // 2 + pid_n * (BLOCK_N // 2)])
                        else:
                            gate_w = tl.load(w_tile_ptr, mask=w_mask, other=0.0)
                            up_w = tl.load(w_tile_ptr + N // 2, mask=w_mask, other=0.0)
                        acc_gate = dot_accumulate(acc_gate, x, gate_w, UPCAST, ALLOW_TF32)
                        acc_up = dot_accumulate(acc_up, x, up_w, UPCAST, ALLOW_TF32)
                    else:
                        if EVEN_K:  # every row index is in bounds (a masked one reads row 0): x needs no mask
                            x = tl.load(x_tile_ptr)
                        else:
                            x = tl.load(x_tile_ptr, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
                        if W_TMA == 1:
                            w = w_desc.load([w_row + pid_n * BLOCK_N, k0 * BLOCK_K]).T
                        elif W_TMA == 2:
                            w = w_desc.load([w_row + k0 * BLOCK_K, pid_n * BLOCK_N])
                        elif EVEN_K:
                            w = tl.load(w_tile_ptr, mask=col_mask[None, :], other=0.0)
                        else:
                            w = tl.load(w_tile_ptr, mask=k_mask[:, None] & col_mask[None, :], other=0.0)
                        acc = dot_accumulate(acc, x, w, UPCAST, ALLOW_TF32)
                    x_tile_ptr += BLOCK_K * stride_xk
                    w_tile_ptr += BLOCK_K * stride_wk
                if W_HALVES:  # into the kernel's column order: [g0, u0, g1, u1, ...]
                    acc = tl.reshape(tl.join(acc_gate, acc_up), (BLOCK_M, BLOCK_N))
                if HAS_BIAS:
                    bias = tl.load(b_ptr + tl.minimum(expert, E - 1) * stride_be + cols * stride_bn, mask=col_mask,
                                   other=0.0)
                    acc += bias.to(tl.float32)[None, :] * computed.to(tl.float32)  # a skipped row stays zero
                if Y_GROUPED:
                    y_rows = rows
                else:
                    y_rows = tl.load(scattered_ptr + rows, mask=row_mask, other=0)
                y_r64 = y_rows[:, None].to(tl.int64)
                if GLU:  # h from the rounded pre-activation, so it equals the SwiGLU kernel's over the stored one
                    pre = acc.to(y_ptr.dtype.element_ty)
                    gate, up = tl.split(tl.reshape(pre, (BLOCK_M, BLOCK_N // 2, 2)))
                    h_cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
                    h_mask = row_mask[:, None] & (h_cols < N // 2)[None, :]
                    if STORE_Y:
                        if GLU_CONCAT:  # two contiguous stores; the tile's own column order would scatter them
                            tl.store(y_ptr + y_r64 * stride_ym + h_cols[None, :] * stride_yn, gate, mask=h_mask)
                            tl.store(y_ptr + y_r64 * stride_ym + (N // 2 + h_cols[None, :]) * stride_yn, up, mask=h_mask)
                        else:
                            tl.store(y_ptr + y_r64 * stride_ym + cols[None, :] * stride_yn, pre,
                                     mask=row_mask[:, None] & col_mask[None, :])
                    h = swiglu_tile(gate.to(tl.float32), up.to(tl.float32), alpha, limit, up_shift)
                    tl.store(h_ptr + y_r64 * stride_hm + h_cols[None, :], h.to(h_ptr.dtype.element_ty), mask=h_mask)
                elif STORE_Y:
                    tl.store(y_ptr + y_r64 * stride_ym + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
                             mask=row_mask[:, None] & col_mask[None, :])


    # Weight-streaming configs (long K steps, narrow N, deep pipelines) only matter where the tile has few
    # rows and the GEMM is bound by reading the experts' weights: decode-sized batches.
    _STREAMING = [(64, 256, 4, 3), (64, 128, 4, 5), (128, 128, 4, 4), (32, 256, 4, 4)]

    def _s2s_configs():
        configs = []
        for bn, bk, warps, stages in [(128, 64, 4, 4), (128, 64, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4),
                                      (256, 32, 8, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3)] + _STREAMING:
            configs.append(triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps,
                                         num_stages=stages))
        return configs

    def _prune_s2s(configs, named_args, **kwargs):
        if kwargs.get("A_FP8"):  # a K step within one block of the scales
            configs = [c for c in configs if kwargs["W_BLOCK_K"] % c.kwargs["BLOCK_K"] == 0] or configs
        if kwargs.get("BLOCK_M", 128) > 64:
            streaming = {(bn, bk, w, st) for bn, bk, w, st in _STREAMING}
            configs = [c for c in configs if (c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_warps,
                                              c.num_stages) not in streaming]
        return fitting_configs(configs, {"BLOCK_N": named_args["N"], "BLOCK_K": named_args["K"]})

    # With HF_SCATTER_AUTOTUNE=1: block sizes chosen per shape by measurement (BLOCK_M is set by the caller,
    # it shapes the tiles); otherwise :func:`_table_config`.
    _S2S_CONFIGS = _s2s_configs()
    _scatter2scatter_tuned = triton.autotune(
        configs=_S2S_CONFIGS, key=["K", "N", "BLOCK_M", "X_GROUPED", "Y_GROUPED", "FAN_OUT"],
        prune_configs_by={"early_config_prune": _prune_s2s},
    )(_scatter2scatter_kernel)


    @triton.jit
    def store_expert_tiles(starts, counts, e, E, pids, NUM_PROGRAMS, tile_expert_ptr, tile_row_ptr,
                           BLOCK_M: tl.constexpr):
        """Write (expert, first sorted row) of programs ``pids`` from the experts' row starts and counts [BLOCK_E]."""
        e_mask = e < E
        tiles = tl.where(e_mask, (counts + BLOCK_M - 1) // BLOCK_M, 0)
        tile_end = tl.cumsum(tiles, 0)
        tile_start = tile_end - tiles
        # The expert of program p: how many experts' tiles end at or before p (searchsorted, right side).
        expert = tl.sum(((tile_end[None, :] <= pids[:, None]) & e_mask[None, :]).to(tl.int32), 1)
        pick = e[None, :] == tl.minimum(expert, E - 1)[:, None]
        row = tl.sum(tl.where(pick, starts[None, :], 0), 1) + \
            (pids - tl.sum(tl.where(pick, tile_start[None, :], 0), 1)) * BLOCK_M
        p_mask = pids < NUM_PROGRAMS
        tl.store(tile_expert_ptr + pids, expert.to(tl.int32), mask=p_mask)
        tl.store(tile_row_ptr + pids, row.to(tl.int32), mask=p_mask)

    @triton.jit
    def _expert_tiles_kernel(ends_ptr, tile_expert_ptr, tile_row_ptr, E, NUM_PROGRAMS,
                             BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
        e = tl.arange(0, BLOCK_E)
        e_mask = e < E
        ends = tl.load(ends_ptr + e, mask=e_mask, other=0).to(tl.int64)
        starts = tl.load(ends_ptr + e - 1, mask=e_mask & (e > 0), other=0).to(tl.int64)
        pids = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
        store_expert_tiles(starts, ends - starts, e, E, pids, NUM_PROGRAMS, tile_expert_ptr, tile_row_ptr, BLOCK_M)


@functools.lru_cache(maxsize=None)
def _table_config(K: int, N: int, block_m: int, itemsize: int, fp8_step: int = 0):
    """The launch config without a sweep, from Triton's autotuner over 49 launch keys (every projection, forward
    and backward, of the bench moe shapes from Mixtral-8x7B to Qwen3-30B-A3B, H100): 128-row tiles run
    256-wide, 64-deep, 8 warps, 4 stages (the best config, or within 1.9% of it on average and 7.4% at worst);
    decode-sized tiles stream weights 128 x 128 with 4 warps (within 0.7% of the best)."""
    if fp8_step:  # FP8 products: K steps within the weight's blocks of fp8_step columns
        bn, bk, warps, stages = FP8_PRODUCTS_CONFIG
        bk = min(bk, fp8_step)
    elif block_m >= 128:
        bn, bk, warps, stages = 256, 64, 8, 4
    else:
        bn, bk, warps, stages = 128, 128, 4, 4
    bn, bk = fitted_block(bn, N), fitted_block(bk, K)
    bk, stages = fit_shared_memory(bk, stages, (block_m + bn) * itemsize)  # fp32 operands: half as deep
    return triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=warps, num_stages=stages)


# FP8 tensor-core products (BLOCK_N, BLOCK_K, warps, stages) on tiles of FP8_PRODUCTS_TILE_ROWS rows, measured on
# an H200 over 16 configs and 2 tile heights on Qwen3-30B-A3B's experts at 2048 and 8192 tokens: 64 x 128 tiles a
# whole scale block deep (both GEMMs 1.27 ms at 8192 tokens, bf16's 1.28; 128-row tiles 1.53 at best). Every K
# step ends in a float32 rescale that waits for the step's product; 128 x 256 tiles spilled registers.
FP8_PRODUCTS_CONFIG = (128, 128, 4, 3)
FP8_PRODUCTS_TILE_ROWS = 64
# Mean routed rows per expert above which FP8 products run. Qwen3-30B-A3B's expert layer on an H200, GPU time by
# tokens (docs/results/history/moe-fp8-rows-sweep-h200.json): from 8 rows per expert (128 tokens) up, FP8 products
# beat the weights' conversion in registers by 1.2x to 2x (0.29 against 0.35 ms at 128 tokens, 0.38 against 0.74
# at 1,024). One-expert GEMMs (FP8 linear layers) keep the earlier bound, which no measurement has moved yet.
FP8_PRODUCTS_ROWS = 4
FP8_PRODUCTS_DENSE_ROWS = 64


def fp8_products_apply(x: torch.Tensor, weight, num_rows: int) -> bool:
    """Whether a GEMM with block-scaled FP8 ``weight`` quantizes its input rows to FP8 and runs FP8 tensor-core
    products (W8A8, as DeepSeek-V3's inference and transformers' own FP8 kernels do) instead of converting the
    weight to the activations' dtype in registers (W8A16). ``HF_SCATTER_FP8_PRODUCTS``: 1 always (where the
    weight's block along K is a power of two of at least 32), 0 never; unset: on GPUs that convert e4m3
    (compute capability 8.9+) past a few rows per expert (:data:`FP8_PRODUCTS_ROWS`); the smallest GEMMs are
    bound by reading the weights, and quantizing the input would only add a pass."""
    if not isinstance(weight, Fp8BlockWeight):
        return False
    bk = weight.block[1]
    if bk < 32 or bk & (bk - 1):
        return False
    setting = env_switch("HF_SCATTER_FP8_PRODUCTS")
    if setting is not None:
        return setting
    experts = weight.shape[0]
    bound = FP8_PRODUCTS_ROWS if experts > 1 else FP8_PRODUCTS_DENSE_ROWS
    return (x.is_cuda and x.dtype != torch.float32 and converts_e4m3(x.device.index or 0)
            and num_rows / max(1, experts) > bound)


def num_tile_programs(num_rows: int, num_experts: int, block_m: int) -> int:
    return max(1, min(cdiv(num_rows, block_m) + num_experts, num_rows))


def expert_tiles_reference(expert_offsets: torch.Tensor, block_m: int, num_rows: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch definition of :func:`expert_tiles`."""
    num_experts = expert_offsets.numel()
    ends = expert_offsets.to(torch.int64)
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    tiles = (ends - starts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    pid = torch.arange(num_tile_programs(num_rows, num_experts, block_m), device=expert_offsets.device)
    tile_expert = torch.searchsorted(tile_end, pid, right=True)
    e = tile_expert.clamp(max=num_experts - 1)
    tile_row = starts[e] + (pid - (tile_end - tiles)[e]) * block_m
    return tile_expert.to(torch.int32), tile_row.to(torch.int32)


def expert_tiles(expert_offsets: torch.Tensor, block_m: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-program (expert, first sorted row) for expert-aligned tiles of ``block_m`` rows.

    Computed on the device without a host sync: the table has a host-known upper bound of
    ``min(ceil(M / block_m) + E, M)`` entries; programs past the real tile count get expert ``E`` and exit.
    One small kernel (the torch form is ten launches and two advanced-indexing ops: about 0.35 ms of host
    time per MoE layer on the H100 machine's host); the torch form under ``torch.compile``.
    """
    num_experts = expert_offsets.numel()
    if torch.compiler.is_compiling() or not use_triton(expert_offsets, "expert_tiles"):
        return expert_tiles_reference(expert_offsets, block_m, num_rows)
    programs = num_tile_programs(num_rows, num_experts, block_m)
    tile_expert = torch.empty(programs, dtype=torch.int32, device=expert_offsets.device)
    tile_row = torch.empty_like(tile_expert)
    # 16 programs' entries per program: each compares its programs against every expert, so wider blocks
    # serialise that work on a few SMs (Qwen3-30B-A3B's 1,152 entries over 128 experts: 33 us at 128, 6 at 16)
    block_p = 16
    _expert_tiles_kernel[(cdiv(programs, block_p),)](
        expert_offsets, tile_expert, tile_row, num_experts, programs, BLOCK_M=block_m,
        BLOCK_E=max(16, next_power_of_2(num_experts)), BLOCK_P=block_p, num_warps=4)
    return tile_expert, tile_row


def _tiles_of(expert_offsets: torch.Tensor, block_m: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expert_tiles`, computed once per routing: every projection of an MoE layer, forward and backward,
    shares one ``expert_offsets`` tensor, and the dozen small ops cost more host time than some kernels."""
    if torch.compiler.is_compiling():
        return expert_tiles(expert_offsets, block_m, num_rows)
    key = (block_m, num_rows, expert_offsets._version)
    cache = expert_offsets.__dict__.setdefault("_hf_scatter_tiles", {})
    if key not in cache:
        cache[key] = expert_tiles(expert_offsets, block_m, num_rows)
    return cache[key]


def remember_expert_tiles(expert_offsets: torch.Tensor, block_m: int, num_rows: int,
                          tiles: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Hand :func:`_tiles_of` a tile table made together with ``expert_offsets`` (the routing sort's kernel)."""
    expert_offsets.__dict__.setdefault("_hf_scatter_tiles", {})[(block_m, num_rows, expert_offsets._version)] = tiles


def tile_rows(num_rows: int, num_experts: int) -> int:
    """Rows per tile, from the mean rows per expert: 128 for prefill and training; at decode sizes a tile that
    holds an expert's rows even when routing is uneven (twice the mean or more), because every extra tile
    of an expert streams its whole weight again and decode is bound by exactly that traffic."""
    rows_per_expert = num_rows / max(1, num_experts)
    for mean, block in ((4, 16), (12, 32), (64, 64)):
        if rows_per_expert <= mean:
            return block
    return 128


def scatter2scatter_reference(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                              x_grouped, y_grouped, bias=None, out=None):
    """Pure-torch definition of :func:`scatter2scatter` (tests, and devices without Triton)."""
    if is_quantized(weight):
        weight = weight.dequantize(x.dtype)  # the values the kernel computes with
    M = sorted_scattered_idxs.numel()
    rows = x if x_grouped else x.index_select(0, sorted_scattered_idxs // fan_out)
    y_sorted = rows.new_zeros((M, weight.shape[2]))  # a skip bin's rows (one bin more than experts) stay zero
    start = 0
    for e, end in enumerate(expert_offsets.tolist()[:weight.shape[0]]):
        if end > start:
            y_e = rows[start:end] @ weight[e]
            y_sorted[start:end] = y_e if bias is None else y_e + bias[e]
        start = end
    if out is None:
        out = rows.new_empty((M, weight.shape[2]))
    if y_grouped:
        out.copy_(y_sorted)
    else:
        out.index_copy_(0, sorted_scattered_idxs, y_sorted)
    return out


def scatter2scatter_triton(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                           x_grouped, y_grouped, bias, out, allow_tf32=False, glu: GateForm | None = None,
                           h_out=None, fp8_products=False):
    """Launch the Triton kernel into ``out`` ([M, N]); inputs are assumed validated. With a gate form ``glu``,
    also ``h_out`` [M, N/2] = act(gate) * up of the [gate, up] columns (``out`` None: h alone). ``weight``: a
    tensor, or an :class:`Mxfp4Weight` or :class:`Fp8BlockWeight` read as it is stored. ``fp8_products`` (FP8
    weights, see :func:`fp8_products_apply`): ``x`` is quantized to e4m3 rows first and every product is FP8."""
    M, K, N, E = sorted_scattered_idxs.numel(), weight.shape[1], weight.shape[2], weight.shape[0]
    if M == 0 or N == 0:
        return out
    interpreted = triton_interpreted()
    convert = not interpreted and converts_e4m3(x.device.index or 0)
    x_scales = None
    if fp8_products:  # [R, K] e4m3 values (bytes for the interpreter) and [R, K / bk] float32 scales
        x_scales = x.new_empty((x.shape[0], cdiv(K, weight.block[1])), dtype=torch.float32)
        values = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
        quantize_fp8_rows_triton(x if x.stride(1) == 1 else x.contiguous(), weight.block[1], values, x_scales)
        x = values.view(FP8_DTYPE) if convert else values
    # per routing bin (a skip bin included), as the routing sort's own tile table is made: one table per routing
    block_m = tile_rows(M, expert_offsets.numel())
    if fp8_products:
        block_m = min(block_m, FP8_PRODUCTS_TILE_ROWS)
    tile_expert, tile_row = _tiles_of(expert_offsets, block_m, M)
    num_tiles = tile_expert.numel()
    y = out if out is not None else h_out
    b = bias if bias is not None else y
    h = h_out if h_out is not None else y
    mxfp4, fp8 = isinstance(weight, Mxfp4Weight), isinstance(weight, Fp8BlockWeight)
    w_block = (1, 1)
    if mxfp4:  # bytes [E, N, K / 2] and exponents [E, N, K / 32]
        w, scales = weight.blocks, weight.scales
        w_strides, s_strides = (w.stride(0), 1, w.stride(1)), (scales.stride(0), scales.stride(1))
    elif fp8:  # bytes [E, N, K] and float32 scales [E, N / bn, K / bk]
        # 8-bit float pointers where the products are FP8 (the tensor cores read the tiles as loaded)
        w = weight.weight if fp8_products and convert else weight.weight.view(torch.uint8)
        scales, w_block = weight.scale_inv, weight.block
        w_strides, s_strides = (w.stride(0), 1, w.stride(1)), (scales.stride(0), scales.stride(1))
    else:
        w, scales = weight, weight
        w_strides, s_strides = (weight.stride(0), weight.stride(1), weight.stride(2)), (0, 0)
    # FP8 products: a K step never leaves a block of the weight (nor of the activations' scales)
    deepest = min(128, w_block[1]) if fp8_products else 128
    interpreter_blocks = dict(BLOCK_N=min(128, max(16, next_power_of_2(N))),
                              BLOCK_K=min(deepest, max(16, next_power_of_2(K))), GROUP_M=4)
    table = None if interpreted else _table_config(K, N, block_m, x.element_size(), deepest if fp8_products else 0)
    # Training- and prefill-sized tiles of a plain weight take it through TMA, in persistent programs, where the
    # launch's blocks are known before it. Decode-sized ones keep the plain loads: their GPU time was the same either
    # way, and a descriptor costs host time per launch.
    w_desc, w_tma, programs = None, 0, None
    if not (mxfp4 or fp8) and block_m >= 128 and env_switch(_ENV_TMA) is not False:
        planned = None if interpreted else planned_config(table)
        blocks = interpreter_blocks if interpreted else None if planned is None else planned.kwargs
        if blocks is not None:
            w_desc, w_tma = _weight_descriptor(w, blocks, glu is not None and not glu.interleaved)
            programs = _persistent_programs(x, planned)
    args = (x, w, w_desc, b, y, h, tile_expert, tile_row, expert_offsets, sorted_scattered_idxs, num_tiles, K, N, E,
            x.stride(0), x.stride(1), *w_strides,
            b.stride(0), b.stride(-1), y.stride(0), y.stride(1), h.stride(0), *(glu or SILU).numbers, scales, *s_strides,
            x_scales if fp8_products else scales, x_scales.stride(0) if fp8_products else 0)
    meta = dict(FAN_OUT=fan_out, X_GROUPED=x_grouped, Y_GROUPED=y_grouped, HAS_BIAS=bias is not None,
                ALLOW_TF32=allow_tf32, UPCAST=interpreted and x.dtype == torch.bfloat16, GLU=glu is not None,
                GLU_CONCAT=glu is not None and not glu.interleaved, STORE_Y=out is not None,
                SKIP_BIN=int(expert_offsets.numel() > E), W_MXFP4=mxfp4,
                SCALED_DOT=mxfp4 and x.dtype == torch.bfloat16 and scaled_dot_enabled(), W_FP8=fp8,
                W_BLOCK_N=w_block[0], W_BLOCK_K=w_block[1],
                CONVERT=fp8 and convert, A_FP8=fp8_products, W_TMA=w_tma,
                BLOCK_M=block_m)

    def grid(cfg):
        tiles = num_tiles * cdiv(N, cfg["BLOCK_N"])
        return (min(tiles, programs) if programs else tiles,)

    tune_key = (K, N, block_m, x_grouped, y_grouped, fan_out, bias is not None, allow_tf32, x.dtype, w.dtype,
                y.dtype, meta["GLU"], meta["GLU_CONCAT"], meta["STORE_Y"], meta["SKIP_BIN"], meta["W_MXFP4"], fp8,
                w_block, fp8_products, w_tma)
    launch(_scatter2scatter_kernel, _scatter2scatter_tuned, _S2S_CONFIGS, {"BLOCK_N": N, "BLOCK_K": min(K, deepest)},
           grid, args, meta, interpreter_blocks, tune_key, table)
    return out


_ENV_TMA = "HF_SCATTER_TMA"  # 0/false/no/off: plain weight loads and one program per tile (an A/B in one process)


def _weight_descriptor(weight: torch.Tensor, blocks: dict, halves: bool):
    """(TMA descriptor, W_TMA) for a plain 16-bit weight [E, K, N] whose rows one 2-D descriptor spans: [E * N, K]
    (K contiguous: transformers' layout read transposed) or [E * K, N] (N contiguous, whole K steps, every tile
    starting on a 16-byte boundary) in tiles of the launch's ``blocks``, on a GPU with TMA (Hopper on) or the
    interpreter; (None, 0) otherwise. A [gate; up] weight (``halves``) is read half a tile wide at a time. With :func:`_persistent_programs`, every training shape's fwd+bwd came 0.3-1.9% faster, the forward up
    to 3.6% (H200; docs/moe-kernel-tiles.md)."""
    E, K, N = weight.shape
    if TensorDescriptor is None or weight.dtype not in (torch.bfloat16, torch.float16) or not _has_tma(weight.device):
        return None, 0
    bn, bk = blocks["BLOCK_N"] // (2 if halves else 1), blocks["BLOCK_K"]
    sk, sn = weight.stride(1), weight.stride(2)
    if weight.data_ptr() % 16 or max(bn, bk) > 256 or min(bn, bk) * weight.element_size() < 16:
        return None, 0
    if sk == 1 and weight.stride(0) == N * sn and sn % 8 == 0:
        return TensorDescriptor(weight, [E * N, K], [sn, 1], [bn, bk]), 1
    # a box's first column 16-byte aligned: the up half's start too
    if sn == 1 and weight.stride(0) == K * sk and sk % 8 == 0 and K % bk == 0 and not (halves and (N // 2) % 8):
        return TensorDescriptor(weight, [E * K, N], [sk, 1], [bk, bn]), 2
    return None, 0


def _has_tma(device: torch.device) -> bool:
    return device.type != "cuda" or compute_capability(device.index or 0) >= (9, 0)


# Programs of the interpreter's persistent launches: fewer than the tiles, so its tests run the tile loop.
INTERPRETER_PROGRAMS = 3


def _persistent_programs(x: torch.Tensor, config) -> int | None:
    """How many programs a launch of the plain product in ``config`` (its planned table config; None under the
    interpreter) may run, each stepping through the tiles: one per multiprocessor where the config holds one
    program per multiprocessor anyway (a pipeline over half its shared memory), so the programs' start-up is paid
    once per multiprocessor rather than once per tile (measured together with :func:`_weight_descriptor`); None
    (one program per tile) otherwise."""
    if x.device.type != "cuda":
        return INTERPRETER_PROGRAMS
    step_bytes = (128 + config.kwargs["BLOCK_N"]) * config.kwargs["BLOCK_K"] * x.element_size()
    index = x.device.index or 0
    shared = shared_memory_per_multiprocessor(index)
    return multiprocessors(index) if shared and step_bytes * config.num_stages * 2 > shared else None


# ---------------------------------------------------------------------------------------------- op
def _scatter2scatter_impl(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                          sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int,
                          x_grouped: bool, y_grouped: bool, bias: Optional[torch.Tensor], out: torch.Tensor,
                          allow_tf32: bool, weight_scales: Optional[torch.Tensor] = None,
                          weight_block: Optional[List[int]] = None, fp8_products: bool = False) -> None:
    weight = weight_of(weight, weight_scales, weight_block)
    if triton_runs(x, "scatter2scatter"):
        scatter2scatter_triton(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                               x_grouped, y_grouped, bias, out, allow_tf32, fp8_products=fp8_products)
    elif fp8_products:
        out.copy_(scatter2scatter_reference(_fp8_rows_values(x, weight), weight, sorted_expert_idxs,
                                            sorted_scattered_idxs, expert_offsets, fan_out, x_grouped, y_grouped,
                                            bias))
    else:
        scatter2scatter_reference(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                  x_grouped, y_grouped, bias, out)


def _fp8_rows_values(x: torch.Tensor, weight: Fp8BlockWeight) -> torch.Tensor:
    """The float32 values the FP8 products multiply: ``x`` quantized to e4m3 rows, times their scales (the
    weight's, by :func:`scatter2scatter_reference`, also in float32)."""
    return dequantize_fp8_rows(*quantize_fp8_rows_reference(x, weight.block[1]), weight.block[1])


_scatter2scatter_op = mutating_op("scatter2scatter", "out")(_scatter2scatter_impl)


def _scatter2scatter_swiglu_impl(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                                 sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int,
                                 bias: Optional[torch.Tensor], alpha: float, limit: float, up_shift: float,
                                 interleaved: bool, out: Optional[torch.Tensor], h_out: torch.Tensor,
                                 allow_tf32: bool, weight_scales: Optional[torch.Tensor] = None,
                                 weight_block: Optional[List[int]] = None, fp8_products: bool = False) -> None:
    weight = weight_of(weight, weight_scales, weight_block)
    form = GateForm(alpha, limit, up_shift, interleaved)
    if triton_runs(x, "scatter2scatter"):
        scatter2scatter_triton(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                               False, True, bias, out, allow_tf32, glu=form, h_out=h_out, fp8_products=fp8_products)
    else:
        rows = _fp8_rows_values(x, weight) if fp8_products else x
        pre = scatter2scatter_reference(rows, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
                                        fan_out, False, True, bias).to(h_out.dtype)  # rounded as the kernel's
        if out is not None:
            out.copy_(pre)
        h_out.copy_(swiglu_reference(*form.halves(pre), *form.numbers))


_scatter2scatter_swiglu_op = mutating_op("scatter2scatter_swiglu", "out", "h_out")(_scatter2scatter_swiglu_impl)


def scatter2scatter(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int = 1,
                    x_grouped: bool = False, y_grouped: bool = False, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[i or idx[i]] = x[i or idx[i] // fan_out] @ weight[e(i)] (+ bias[e(i)])`` over expert-sorted rows ``i``.

    ``weight`` is [E, d_in, d_out] with any strides (a transposed view of an HF [E, d_out, d_in] tensor
    is read in place), or an :class:`Mxfp4Weight` or :class:`Fp8BlockWeight` of that shape (decoded in the
    kernel). Returns ``out`` of
    shape [M, d_out], M = number of (token, expert) slots.
    """
    scatter2scatter_checks(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out, x_grouped,
                           bias, out)
    return scatter2scatter_unchecked(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                     x_grouped, y_grouped, bias, out)


def scatter2scatter_checks(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out, x_grouped,
                           bias, out) -> None:
    """:func:`scatter2scatter`'s argument checks: a ValueError naming the argument and the fix."""
    op = "scatter2scatter"
    check_float(op, "x", x, 2)
    if is_quantized(weight):  # validated when made
        if weight.device != x.device:
            fail(op, f"weight is on {weight.device} but the input is on {x.device}; put all tensors on one device")
    else:
        check_float(op, "weight", weight, 3)
        check_like(op, "weight", weight, x)
    E, K, N = weight.shape
    if x.shape[1] != K:
        fail(op, f"x has {x.shape[1]} features but weight expects d_in={K} (weight is [E, d_in, d_out])")
    M = sorted_scattered_idxs.numel() if isinstance(sorted_scattered_idxs, torch.Tensor) else None
    check_index(op, "sorted_scattered_idxs", sorted_scattered_idxs, None, x.device)
    check_index(op, "sorted_expert_idxs", sorted_expert_idxs, M, x.device)
    check_index(op, "expert_offsets", expert_offsets, None, x.device)
    if expert_offsets.numel() not in (E, E + 1):
        fail(op, f"expert_offsets must have one end per expert (E={E}), or one more for a bin of routes to skip; "
                 f"got {expert_offsets.numel()}")
    if fan_out < 1:
        fail(op, f"fan_out must be >= 1, got {fan_out}")
    expected_rows = M if x_grouped else (M // fan_out if M % fan_out == 0 else None)
    if x.shape[0] != expected_rows:
        what = "grouped x needs one row per slot" if x_grouped else f"scattered x with fan_out={fan_out} needs M/fan_out rows"
        fail(op, f"x has {x.shape[0]} rows for M={M} slots: {what}")
    if bias is not None:
        check_like(op, "bias", bias, x)
        if tuple(bias.shape) != (E, N):
            fail(op, f"bias must be [E, d_out] = {(E, N)}, got {tuple(bias.shape)}")
    if out is not None:
        check_out(op, out, (M, N), x)


def scatter2scatter_swiglu(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                           sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int,
                           form: GateForm = SILU, bias: torch.Tensor | None = None, keep_pre_activation: bool = True
                           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The experts' first projection with the gate in its epilogue: ``pre = x[idx // fan_out] @ weight[e] (+ bias)``
    in expert order ([M, 2I], the [gate, up] columns of ``form``) and ``h = act(gate) * up`` ([M, I]), in one
    kernel; ``pre`` is None unless ``keep_pre_activation`` (a backward recomputes h from it). Same checks as
    :func:`scatter2scatter`; h equals the SwiGLU kernel's over the stored ``pre``, bit for bit."""
    if len(getattr(weight, "shape", ())) == 3 and weight.shape[2] % 2:
        fail("scatter2scatter_swiglu",
             f"weight needs an even d_out = 2I of [gate, up] columns, got {weight.shape[2]}")
    scatter2scatter_checks(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out, False,
                           bias, None)
    M, N = sorted_scattered_idxs.shape[0], weight.shape[2]
    pre = x.new_empty((M, N)) if keep_pre_activation else None
    h = x.new_empty((M, N // 2))
    fp8 = fp8_products_apply(x, weight, M)
    weight, scales, block = operands(weight)
    run_op(_scatter2scatter_swiglu_op, _scatter2scatter_swiglu_impl, x, weight, sorted_expert_idxs,
           sorted_scattered_idxs, expert_offsets, fan_out, bias, *form.numbers, form.interleaved, pre, h,
           tf32_allowed(), scales, block, fp8)
    return pre, h


def scatter2scatter_unchecked(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out=1,
                              x_grouped=False, y_grouped=False, bias=None, out=None) -> torch.Tensor:
    """:func:`scatter2scatter` without the checks (see ``custom_ops``: for callers that validated already)."""
    if out is None:
        out = x.new_empty((sorted_scattered_idxs.shape[0], weight.shape[2]))
    fp8 = fp8_products_apply(x, weight, sorted_scattered_idxs.shape[0])
    weight, scales, block = operands(weight)
    run_op(_scatter2scatter_op, _scatter2scatter_impl, x, weight, sorted_expert_idxs, sorted_scattered_idxs,
           expert_offsets, fan_out, x_grouped, y_grouped, bias, out, tf32_allowed(), scales, block, fp8)
    return out
