"""Can a warp-specialised Hopper kernel close the gap to SonicMoE on the experts' gathered first product?

Triton 3.6 does not warp-specialise ``tl`` kernels on Hopper; its lower-level Gluon language does
(``gl.warp_specialize``). This probe writes the plain product of the experts' first projection in Gluon and
times it beside our ``scatter2scatter`` on the same routing: expert-sorted slot ``s`` reads token row
``idx[s] // k`` of ``x`` (gathered), multiplies by its expert's [K, N] weight (N contiguous) and writes row ``s``
in expert order. Partitions, persistent over 128-row tiles of one expert (our tile table) x 256-column tiles:

- a loader of 4 warps: per K step, waits for the stage to be free, starts the weight tile's TMA copy (its
  barrier expects the bytes) and copies the 128 gathered rows with ``cp.async``; each thread's copies arrive
  on the stage's rows barrier when they land;
- the default partition of 8 warps: waits for both barriers, issues the wgmma, keeps one in flight, frees the
  stage the previous wgmma read, and stores each finished tile while the loader already fills the next one;
- in the second form (``FORMS``), a store partition: the wgmma partition leaves each finished tile in shared
  memory and goes on to the next tile's wgmma while the store partition writes the rows out.

The same weight is then read as a [gate; up] weight for the first projection itself, SwiGLU epilogue included
(``swiglu_gather_gemm``, the same kernel with HALVES: gate and up accumulators side by side, the store partition
writing the pre-activation and silu(gate) * up), beside ``scatter2scatter_swiglu``. Every form runs on the weight
in both layouts: N contiguous and transformers' [E, N, K] read as [E, K, N] (the loader's TMA boxes are then
[BN, BK], handed to wgmma transposed). The partitions each walk the same persistent tile sequence: that loop
header repeats in every one of them by design.

Outputs are compared with the same product in float32 (per slot, bit-level agreement is not expected). Every form
on an H200: docs/results/history/gluon-gather-gemm-forms-h200.json (all correct; the SwiGLU form on the K-contiguous
layout ties with Triton, the others are 5-14% slower).
GPU time of CUDA-graph replays, forms timed alternately (``alternating_replay_ms``).

Run on a Hopper GPU: PYTHONPATH=. python3 scripts/probes/probe_gluon_gather_gemm.py [SHAPE ...]
(writes $OUT/gluon_gather_gemm.json)
"""
import functools
import os
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

SHAPES = {"qwen3-30b-a3b": (16384, 128, 8, 2048, 1536), "fine-grained": (16384, 64, 8, 4096, 2048),
          "gpt-oss-20b": (16384, 32, 4, 2880, 5760)}  # tokens, experts, top-k, d (K), 2 x d_expert (N)
BM, BN, BK, LOADER_REGS, MMA_WARPS = 128, 256, 64, 88, 8
# The two forms: stores from the wgmma partition's registers (4 stages, a 4-warp loader), or through a [BM, BN]
# shared buffer to a store partition (3 stages: the buffer takes the fourth's shared memory). Warps count in fours
# and the registers of a whole kernel are split over them: with 16 warps the wgmma partition could not hold its
# [128, 256] float32 accumulator (ptxas asks for 154 registers and has 128), so the loader and the stores take 2
# warps each.
FORMS = {"gluon_stores_in_mma_partition": dict(STAGES=4, LOADER_WARPS=4, STORE_WARPS=0, STORE_REGS=0),
         "gluon_store_partition": dict(STAGES=3, LOADER_WARPS=2, STORE_WARPS=2, STORE_REGS=88)}


@gluon.jit
def _tile(tile, num_col_tiles, tile_expert_ptr, tile_row_ptr, expert_end_ptr, E):
    """(expert, first sorted row, the expert's row end, column tile) of persistent tile ``tile``: both partitions
    walk the same tiles; an expert of E or more marks a table entry past the routing's tiles."""
    pid_m = tile // num_col_tiles
    expert = gl.load(tile_expert_ptr + pid_m)
    row0 = gl.load(tile_row_ptr + pid_m)
    row_end = gl.load(expert_end_ptr + gl.minimum(expert, E - 1))
    return expert, row0, row_end, tile % num_col_tiles


@gluon.jit
def _loader(x_ptr, scattered_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, w_desc, a_bufs, b_bufs, up_bufs,
            a_ready, b_ready, empty, num_tiles, N, K, E, stride_xm, FAN_OUT: gl.constexpr, BM: gl.constexpr,
            BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr, HALVES: gl.constexpr,
            K_MAJOR: gl.constexpr):
    """Fills the stages: the weight tile by TMA ([BK, BN] columns, or with HALVES a [gate; up] weight's gate
    columns and the up columns N / 2 further on, BN each; K_MAJOR: the weight stored [E, N, K] as transformers
    keeps it, each tile [BN, BK]) and the tile's gathered rows by cp.async."""
    # 4 rows x 64 columns a warp a pass, 16 bytes a thread
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    num_col_tiles = gl.cdiv(N // 2 if HALVES else N, BN)
    step = 0
    for tile in range(gl.program_id(0), num_tiles * num_col_tiles, gl.num_programs(0)):
        expert, row0, row_end, pid_n = _tile(tile, num_col_tiles, tile_expert_ptr, tile_row_ptr, expert_end_ptr, E)
        if expert < E:
            rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
            row_mask = rows < row_end
            src = gl.load(scattered_ptr + rows, mask=row_mask, other=0) // FAN_OUT  # [BM] token rows
            cols = gl.arange(0, BK, layout=gl.SliceLayout(0, layout))
            ptrs = x_ptr + src.to(gl.int64)[:, None] * stride_xm + cols[None, :]  # [BM, BK]
            for k in range(0, K, BK):
                s = step % STAGES
                phase = (step // STAGES) & 1
                mbarrier.wait(empty.index(s), phase ^ 1)  # barriers start with phase 1 complete
                mbarrier.expect(b_ready.index(s), w_desc.block_type.nbytes * (2 if HALVES else 1))
                if K_MAJOR:
                    tma.async_copy_global_to_shared(w_desc, [expert * N + pid_n * BN, k], b_ready.index(s),
                                                    b_bufs.index(s))
                    if HALVES:
                        tma.async_copy_global_to_shared(w_desc, [expert * N + N // 2 + pid_n * BN, k],
                                                        b_ready.index(s), up_bufs.index(s))
                else:
                    tma.async_copy_global_to_shared(w_desc, [expert * K + k, pid_n * BN], b_ready.index(s),
                                                    b_bufs.index(s))
                    if HALVES:
                        tma.async_copy_global_to_shared(w_desc, [expert * K + k, N // 2 + pid_n * BN],
                                                        b_ready.index(s), up_bufs.index(s))
                async_copy.async_copy_global_to_shared(a_bufs.index(s), ptrs + k, mask=row_mask[:, None])
                async_copy.mbarrier_arrive(a_ready.index(s), increment_count=False)  # one arrival a thread
                step += 1


@gluon.jit
def _mma(y_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, a_bufs, b_bufs, up_bufs, a_ready, b_ready, empty,
         c_smem, up_smem, c_ready, c_empty, num_tiles, N, K, E, stride_ym, BM: gl.constexpr, BN: gl.constexpr,
         BK: gl.constexpr, STAGES: gl.constexpr, STORE_WARPS: gl.constexpr, HALVES: gl.constexpr,
         K_MAJOR: gl.constexpr, num_warps: gl.constexpr):
    """The wgmma partition: one step's product in flight while the next is issued, then the tile stored here or
    handed to the store partition through shared memory. With HALVES (a [gate; up] weight, the store partition's
    SwiGLU) a tile has a gate and an up accumulator, BN columns each."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    num_col_tiles = gl.cdiv(N // 2 if HALVES else N, BN)
    step = 0
    handed = 0  # tiles handed to the store partition
    for tile in range(gl.program_id(0), num_tiles * num_col_tiles, gl.num_programs(0)):
        expert, row0, row_end, pid_n = _tile(tile, num_col_tiles, tile_expert_ptr, tile_row_ptr, expert_end_ptr, E)
        if expert < E:
            acc = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            if HALVES:
                up = gl.zeros((BM, BN), dtype=gl.float32, layout=mma_layout)
            for k in range(0, K, BK):
                s = step % STAGES
                phase = (step // STAGES) & 1
                mbarrier.wait(a_ready.index(s), phase)
                mbarrier.wait(b_ready.index(s), phase)
                fence_async_shared()  # the rows came through cp.async (generic proxy); wgmma reads the async one
                b_tile = b_bufs.index(s)
                if K_MAJOR:  # a [BN, BK] tile read as [BK, BN]: wgmma takes either major order
                    b_tile = b_tile.permute((1, 0))
                acc = warpgroup_mma(a_bufs.index(s), b_tile, acc, is_async=True)
                if HALVES:
                    up_tile = up_bufs.index(s)
                    if K_MAJOR:
                        up_tile = up_tile.permute((1, 0))
                    up = warpgroup_mma(a_bufs.index(s), up_tile, up, is_async=True)
                    acc, up = warpgroup_mma_wait(2, (acc, up))  # the previous step's two are done: free its stage
                else:
                    acc = warpgroup_mma_wait(1, (acc, ))  # the previous step's wgmma is done: free its stage
                mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=k > 0)
                step += 1
            if HALVES:
                acc, up = warpgroup_mma_wait(0, (acc, up))
            else:
                acc = warpgroup_mma_wait(0, (acc, ))
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES))
            if STORE_WARPS > 0:  # through shared memory: the next tile's wgmma start while the stores run
                mbarrier.wait(c_empty, (handed & 1) ^ 1)
                c_smem.store(acc.to(gl.bfloat16))
                if HALVES:
                    up_smem.store(up.to(gl.bfloat16))
                mbarrier.arrive(c_ready)
                handed += 1
            else:
                _store_tile(y_ptr, acc.to(gl.bfloat16), row0, row_end, pid_n * BN, N, stride_ym, mma_layout)


@gluon.jit
def _store_tile(y_ptr, values, row0, row_end, col0, col_end, stride_ym, layout: gl.constexpr):
    """Rows ``row0 + i`` and columns ``col0 + j`` of one tile's values where they belong to the tile's expert and
    lie before ``col_end``."""
    rows = row0 + gl.arange(0, values.shape[0], layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, values.shape[1], layout=gl.SliceLayout(0, layout))
    mask = (rows < row_end)[:, None] & (cols < col_end)[None, :]
    gl.store(y_ptr + rows.to(gl.int64)[:, None] * stride_ym + cols[None, :], values, mask=mask)


@gluon.jit
def _stores(y_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, c_smem, up_smem, c_ready, c_empty, num_tiles,
            N, E, stride_ym, stride_hm, BM: gl.constexpr, BN: gl.constexpr, CHUNK: gl.constexpr, WARPS: gl.constexpr,
            GLU: gl.constexpr):
    """The store partition: each finished tile from shared memory to its rows, CHUNK rows at a time. With GLU the
    tile is a gate and an up half (N / 2 apart in the pre-activation), and their SwiGLU goes to ``h``: silu(gate) *
    up of the rounded values, as our Triton epilogue computes it."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [256 // BN, BN // 8], [WARPS, 1], [1, 0])  # BN columns a row
    width = N // 2 if GLU else N
    num_col_tiles = gl.cdiv(width, BN)
    taken = 0
    for tile in range(gl.program_id(0), num_tiles * num_col_tiles, gl.num_programs(0)):
        expert, row0, row_end, pid_n = _tile(tile, num_col_tiles, tile_expert_ptr, tile_row_ptr, expert_end_ptr, E)
        if expert < E:
            mbarrier.wait(c_ready, taken & 1)
            for r in gl.static_range(0, BM, CHUNK):
                values = c_smem.slice(r, CHUNK).load(layout)
                _store_tile(y_ptr, values, row0 + r, row_end, pid_n * BN, width, stride_ym, layout)
                if GLU:
                    up = up_smem.slice(r, CHUNK).load(layout)
                    _store_tile(y_ptr + width, up, row0 + r, row_end, pid_n * BN, width, stride_ym, layout)
                    gate = values.to(gl.float32)
                    h = gate / (1.0 + gl.exp(-gate)) * up.to(gl.float32)
                    _store_tile(h_ptr, h.to(gl.bfloat16), row0 + r, row_end, pid_n * BN, width, stride_hm, layout)
            mbarrier.arrive(c_empty)
            taken += 1


@gluon.jit
def gather_gemm_kernel(x_ptr, scattered_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, w_desc, y_ptr, h_ptr,
                       num_tiles, N, K, E, stride_xm, stride_ym, stride_hm, FAN_OUT: gl.constexpr, BM: gl.constexpr,
                       BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr, LOADER_WARPS: gl.constexpr,
                       LOADER_REGS: gl.constexpr, STORE_WARPS: gl.constexpr, STORE_REGS: gl.constexpr,
                       STORE_CHUNK: gl.constexpr, HALVES: gl.constexpr, K_MAJOR: gl.constexpr,
                       num_warps: gl.constexpr):
    """Every form: stores in the wgmma partition (STORE_WARPS 0) or a store partition; with HALVES (which takes
    the store partition) a [gate; up] weight, BN gate and BN up columns a tile, and the SwiGLU into ``h``."""
    a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)
    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], a_layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    up_bufs = b_bufs  # read only with HALVES
    if HALVES:
        up_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(a_ready.index(i), count=LOADER_WARPS * 32)  # every loader thread's cp.async arrival
        mbarrier.init(b_ready.index(i), count=1)  # the expect, then the TMA bytes
        mbarrier.init(empty.index(i), count=1)  # the consumer's one arrival
    if STORE_WARPS > 0:
        c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], gl.bfloat16)
        c_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], c_layout)
        up_smem = c_smem  # read only with HALVES
        if HALVES:
            up_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, BN], c_layout)
        c_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        c_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(c_ready, count=1)
        mbarrier.init(c_empty, count=1)
        gl.warp_specialize([
            (_mma, (y_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, a_bufs, b_bufs, up_bufs, a_ready, b_ready,
                    empty, c_smem, up_smem, c_ready, c_empty, num_tiles, N, K, E, stride_ym, BM, BN, BK, STAGES,
                    STORE_WARPS, HALVES, K_MAJOR, num_warps)),
            (_loader, (x_ptr, scattered_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, w_desc, a_bufs, b_bufs,
                        up_bufs, a_ready, b_ready, empty, num_tiles, N, K, E, stride_xm, FAN_OUT, BM, BN, BK, STAGES,
                        LOADER_WARPS, HALVES, K_MAJOR)),
            (_stores, (y_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, c_smem, up_smem, c_ready, c_empty,
                       num_tiles, N, E, stride_ym, stride_hm, BM, BN, STORE_CHUNK, STORE_WARPS, HALVES)),
        ], [LOADER_WARPS, STORE_WARPS], [LOADER_REGS, STORE_REGS])
    else:
        gl.warp_specialize([
            (_mma, (y_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, a_bufs, b_bufs, None, a_ready, b_ready,
                    empty, None, None, None, None, num_tiles, N, K, E, stride_ym, BM, BN, BK, STAGES, STORE_WARPS,
                    False, K_MAJOR, num_warps)),
            (_loader, (x_ptr, scattered_ptr, tile_expert_ptr, tile_row_ptr, expert_end_ptr, w_desc, a_bufs, b_bufs,
                        None, a_ready, b_ready, empty, num_tiles, N, K, E, stride_xm, FAN_OUT, BM, BN, BK, STAGES,
                        LOADER_WARPS, False, K_MAJOR)),
        ], [LOADER_WARPS], [LOADER_REGS])


def _weight_descriptor(w, bn):
    """(TMA descriptor, K_MAJOR) over the experts' rows of w [E, K, N]: N contiguous ([E * K, N], [BK, bn]
    boxes) or K contiguous, transformers' [E, N, K] read transposed ([E * N, K], [bn, BK] boxes)."""
    E, K, N = w.shape
    assert K % BK == 0 and N % 16 == 0
    k_major = not w.is_contiguous()
    rows = w.transpose(1, 2).view(E * N, K) if k_major else w.view(E * K, N)  # a view error: neither layout
    box = [bn, BK] if k_major else [BK, bn]
    return TensorDescriptor.from_tensor(rows, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)), k_major


def swiglu_gather_gemm(x, w, sorted_scattered_idxs, expert_offsets, fan_out, tile_expert, tile_row, programs):
    """(pre-activation [M, N], SwiGLU [M, N / 2]) in expert order for a [gate; up] weight w [E, K, N] (N or K
    contiguous, gate columns first): the first projection with its epilogue, as ``scatter2scatter_swiglu``."""
    E, K, N = w.shape
    bn = BN // 2  # a tile's 256 columns: 128 gate and the 128 up columns that pair with them
    assert x.stride(1) == 1
    y = x.new_empty((sorted_scattered_idxs.numel(), N))
    h = x.new_empty((sorted_scattered_idxs.numel(), N // 2))
    w_desc, k_major = _weight_descriptor(w, bn)
    num_tiles = tile_expert.numel()
    grid = (min(programs, num_tiles * triton.cdiv(N // 2, bn)),)
    gather_gemm_kernel[grid](x, sorted_scattered_idxs, tile_expert, tile_row, expert_offsets, w_desc, y, h, num_tiles,
                             N, K, E, x.stride(0), y.stride(0), h.stride(0), FAN_OUT=fan_out, BM=BM, BN=bn, BK=BK,
                             LOADER_REGS=LOADER_REGS, STORE_CHUNK=8, HALVES=True, K_MAJOR=k_major,
                             num_warps=MMA_WARPS, **FORMS["gluon_store_partition"])  # 8-row chunks: 16 spilled
    return y, h


def gather_gemm(x, w, sorted_scattered_idxs, expert_offsets, fan_out, tile_expert, tile_row, programs, form):
    """y [M, N] in expert order: row s = x[idx[s] // fan_out] @ w[e(s)], for w [E, K, N] (N or K contiguous)."""
    E, K, N = w.shape
    assert x.stride(1) == 1
    y = x.new_empty((sorted_scattered_idxs.numel(), N))
    w_desc, k_major = _weight_descriptor(w, BN)
    num_tiles = tile_expert.numel()
    grid = (min(programs, num_tiles * triton.cdiv(N, BN)),)
    gather_gemm_kernel[grid](x, sorted_scattered_idxs, tile_expert, tile_row, expert_offsets, w_desc, y, None,
                             num_tiles, N, K, E, x.stride(0), y.stride(0), 0, FAN_OUT=fan_out, BM=BM, BN=BN, BK=BK,
                             LOADER_REGS=LOADER_REGS, STORE_CHUNK=16, HALVES=False, K_MAJOR=k_major,
                             num_warps=MMA_WARPS, **FORMS[form])
    return y


def main(names):
    from hf_scatter.common.atomic_files import write_json
    from hf_scatter.common.timing import alternating_replay_ms, run_header
    from hf_scatter.kernels.backend import multiprocessors
    from hf_scatter.kernels.scatter2scatter import _tiles_of, scatter2scatter, scatter2scatter_swiglu
    from hf_scatter.moe import flatten_sort_count

    report = {**run_header(), "what": __doc__, "config": dict(BM=BM, BN=BN, BK=BK, LOADER_REGS=LOADER_REGS,
                                                                 MMA_WARPS=MMA_WARPS),
              "forms": FORMS, "shapes": {}}
    sms = multiprocessors(0)
    for name in names:
        T, E, k, d, n = SHAPES[name]
        torch.manual_seed(0)
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, d, n, device="cuda", dtype=torch.bfloat16) * d ** -0.5  # [E, K, N], N contiguous
        se, ss, off = flatten_sort_count(torch.rand(T, E, device="cuda").topk(k, -1).indices, E)
        tile_expert, tile_row = _tiles_of(off, BM, T * k)
        row = {"flops": 2 * T * k * d * n, "max_rel_err": {}, "errors": {}}  # the same for both products
        ref = torch.cat([x[ss[int(a):int(b)] // k].float() @ w[e].float()
                         for e, (a, b) in enumerate(zip([0] + off[:-1].tolist(), off.tolist()))])  # [M, N] float32
        inter = n // 2
        h_ref = torch.nn.functional.silu(ref[:, :inter]) * ref[:, inter:]
        # the same values in both layouts: N contiguous, and transformers' [E, N, K] read as [E, K, N]
        weights = {"n_contiguous": w, "k_contiguous": w.transpose(1, 2).contiguous().transpose(1, 2)}
        plain, swiglu = {}, {}  # the plain product, and the first projection itself (the weight as [gate; up])
        for layout, wl in weights.items():
            plain[f"triton_scatter2scatter/{layout}"] = functools.partial(scatter2scatter, x, wl, se, ss, off,
                                                                          fan_out=k, y_grouped=True)
            for form in FORMS:
                plain[f"{form}/{layout}"] = functools.partial(gather_gemm, x, wl, ss, off, k, tile_expert, tile_row,
                                                              sms, form)
            swiglu[f"triton_scatter2scatter_swiglu/{layout}"] = functools.partial(scatter2scatter_swiglu, x, wl, se,
                                                                                  ss, off, k)
            swiglu[f"gluon_swiglu_store_partition/{layout}"] = functools.partial(swiglu_gather_gemm, x, wl, ss, off, k,
                                                                                 tile_expert, tile_row, sms)

        def rel(got, want):
            return float((got.float() - want).abs().max() / want.abs().max())

        forms = {}
        for label, fn in {**plain, **swiglu}.items():
            try:  # a probe: a form's failure is its result
                out = fn()
                row["max_rel_err"][label] = ({"pre": rel(out[0], ref), "h": rel(out[1], h_ref)} if label in swiglu
                                             else rel(out, ref))
                forms[label] = fn
            except Exception as error:  # noqa: BLE001
                row["errors"][label] = f"{type(error).__name__}: {str(error)[:2000]}"
        ref = h_ref = None
        row["ms"] = alternating_replay_ms(forms)
        row["tflops"] = {form: row["flops"] / ms / 1e9 for form, ms in row["ms"].items()}
        print(name, row, flush=True)
        report["shapes"][name] = row
        x = w = None  # free this shape before the next one
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "gluon_gather_gemm.json"), report)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
