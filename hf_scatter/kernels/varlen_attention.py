"""Variable-length (packed) bidirectional attention forward, with its pure-torch reference.

Packed BERT batches hold sequences back to back ([T, heads, head_dim], boundaries in ``cu_seqlens``), so
no padding is ever computed. One program owns ``BLOCK_M`` query rows of one sequence and one head, walks
that sequence's keys in ``BLOCK_N`` tiles with an online softmax (fp32 statistics, exp2 with the scale
folded in) and writes its rows once: no score matrix ever reaches memory.

Which rows a program owns comes from a *block table* built on the host from the sequence lengths (the
packer knows them anyway): a header row ``(number of blocks, 0, 0)`` then one int32 row ``(first query
row, sequence start, sequence end)`` per block. Programs stride over the blocks the header counts, so a
fixed grid (sized for the bucket's tokens, not its worst case of one-token sequences) serves every batch
of a length bucket: what a captured CUDA graph needs, without launching thousands of idle programs.

An optional key mask ([T], 0 for a padding key) runs a padded batch row for row: each row of [B, S] is one
sequence of S, every position (padding too) attends over its row's real keys, as in the padded model. Small
padded batches take that form because it needs no look at the mask on the host (no device-to-host wait).

The public call :func:`varlen_attention` checks its arguments and runs the ``hf_scatter::varlen_attention``
custom op: the Triton kernel where ``backend.use_triton`` says so and the per-sequence SDPA reference
otherwise (float64 always takes the reference). Inference only: the packed BERT path runs without
autograd (training keeps transformers' padded attention).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch

from ..common.dtypes import FLOAT_DTYPES
from .backend import kernels_enabled, launch, next_power_of_2, triton_interpreted, triton_runs
from .checks import fail
from .custom_ops import mutating_op, run_op
from .dependent_launch import dependent_launch

if kernels_enabled():
    import triton
    import triton.language as tl

    from .dependent_launch import wait_for_predecessor

    @triton.jit
    def _varlen_attention_fwd_kernel(q_ptr, k_ptr, v_ptr, o_ptr, blocks_ptr, keys_ptr, scale_log2e,
                                     stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                                     stride_ot, stride_oh, HEAD_DIM, SIZE_CLASS,
                                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                     UPCAST: tl.constexpr, IEEE: tl.constexpr, KEY_MASK: tl.constexpr,
                                     USE_PDL: tl.constexpr = False):
        wait_for_predecessor(USE_PDL)  # a dependent launch waits for the kernel before
        head = tl.program_id(1).to(tl.int64)
        num_blocks = tl.load(blocks_ptr)
        for blk in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
            q_start = tl.load(blocks_ptr + 3 + blk * 3)
            seq_start = tl.load(blocks_ptr + 3 + blk * 3 + 1)
            seq_end = tl.load(blocks_ptr + 3 + blk * 3 + 2)
            rows = q_start + tl.arange(0, BLOCK_M)
            row_mask = rows < seq_end
            rows64 = rows.to(tl.int64)
            d = tl.arange(0, BLOCK_D)
            d_mask = d < HEAD_DIM
            q = tl.load(q_ptr + rows64[:, None] * stride_qt + head * stride_qh + d[None, :],
                        mask=row_mask[:, None] & d_mask[None, :], other=0.0)
            if UPCAST:  # the interpreter's bf16 arithmetic is wrong
                q = q.to(tl.float32)
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            for n0 in range(seq_start, seq_end, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                col_mask = cols < seq_end
                if KEY_MASK:  # padding keys of a padded row
                    col_mask &= tl.load(keys_ptr + cols, mask=col_mask, other=0) != 0
                cols64 = cols.to(tl.int64)
                kt = tl.load(k_ptr + cols64[None, :] * stride_kt + head * stride_kh + d[:, None],
                             mask=d_mask[:, None] & col_mask[None, :], other=0.0)
                v = tl.load(v_ptr + cols64[:, None] * stride_vt + head * stride_vh + d[None, :],
                            mask=col_mask[:, None] & d_mask[None, :], other=0.0)
                if UPCAST:
                    kt = kt.to(tl.float32)
                    v = v.to(tl.float32)
                if IEEE:
                    s = tl.dot(q, kt, input_precision="ieee")
                else:
                    s = tl.dot(q, kt)
                s = tl.where(col_mask[None, :], s * scale_log2e, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_ref = m_new
                if KEY_MASK:  # a row with no real key yet keeps its sums at zero, not NaN
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.exp2(s - m_ref[:, None])
                alpha = tl.exp2(m_i - m_ref)
                l_i = l_i * alpha + tl.sum(p, 1)
                if IEEE:
                    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
                else:
                    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                m_i = m_new
            if KEY_MASK:
                l_i = tl.where(l_i == 0.0, 1.0, l_i)  # no real key at all: zeros
            out = acc / l_i[:, None]
            tl.store(o_ptr + rows64[:, None] * stride_ot + head * stride_oh + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])

    # Key tiles per query block, warps and pipeline depth, measured per head size and problem size class
    # (query rows per program stay fixed: the block table is built for them).
    _ATTN_CONFIGS = [triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                     for bn, w, st in [(64, 4, 3), (128, 4, 3), (64, 8, 3), (128, 8, 3), (32, 4, 4), (64, 4, 4),
                                       (128, 8, 2)]]
    _varlen_attention_tuned = triton.autotune(configs=_ATTN_CONFIGS, key=["HEAD_DIM", "SIZE_CLASS", "KEY_MASK"])(
        _varlen_attention_fwd_kernel)


def block_m_for(head_dim: int) -> int:
    """Query rows per program. 64 keeps the rounding waste of short sequences small (BERT requests are a few
    hundred tokens) while the tile still feeds the tensor cores; the interpreter pays per program, so it
    gets larger tiles."""
    if triton_interpreted():
        return 32
    return 64 if head_dim <= 128 else 32


def block_table(lengths, block_m: int, capacity: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
    """``[1 + blocks, 3]`` int32: the header ``(blocks, 0, 0)``, then (first query row, sequence start, sequence
    end) per block of ``block_m`` query rows of the packed sequences of ``lengths`` (zero-length sequences
    own none). ``capacity`` pads to that many block rows (a fixed-size table for a CUDA graph); it must be
    at least :func:`max_blocks` of the batch's bucket. ``out``: an int32 [1 + capacity, 3] array to write the
    table into (a graph's pinned staging), returned; a batch's table is host time on the call's critical path,
    so it is built in a few whole-array steps."""
    lengths = np.asarray(lengths, dtype=np.int64)
    counts = -(-lengths // block_m)
    ends = np.cumsum(lengths)
    block_ends = np.cumsum(counts)
    blocks = int(block_ends[-1]) if len(block_ends) else 0
    rows = blocks if capacity is None else capacity
    if blocks > rows:
        raise ValueError(f"block_table: {blocks} blocks do not fit a capacity of {capacity}")
    if len(ends) and ends[-1] >= 2 ** 31:
        raise ValueError("block_table: more than 2**31 packed tokens; split the batch")
    table = np.empty((1 + rows, 3), dtype=np.int32) if out is None else out
    table[0] = (blocks, 0, 0)
    seq = np.repeat(np.arange(len(lengths)), counts)  # the sequence of each block
    body = table[1:1 + blocks]
    body[:, 2] = ends[seq]
    body[:, 1] = body[:, 2] - lengths[seq]
    body[:, 0] = (np.arange(blocks) - (block_ends - counts)[seq]) * block_m + body[:, 1]
    table[1 + blocks:] = 0
    return table


def grid_programs(num_tokens: int, block_rows: int, block_m: int) -> int:
    """Programs per head: about one per block of a batch of ``num_tokens`` tokens (they stride over the
    rest), never more than the table holds."""
    return max(1, min(block_rows, -(-num_tokens // block_m) + 32))


def max_blocks(total_tokens: int, num_sequences: int, block_m: int) -> int:
    """Most blocks any batch of at most ``num_sequences`` sequences and ``total_tokens`` tokens can need."""
    return -(-total_tokens // block_m) + num_sequences


def varlen_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float,
                               out: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch definition: each sequence's own softmax attention, one SDPA call per sequence; with
    ``key_mask`` only its nonzero keys count, and a query with none gets zeros."""
    start = 0
    for length in lengths:
        end = start + int(length)
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [heads, L, d]
            keep = None if key_mask is None else key_mask[start:end] != 0  # [L] real keys
            if keep is not None and not keep.any():
                out[start:end] = 0
            else:
                out[start:end] = torch.nn.functional.scaled_dot_product_attention(
                    qs, ks, vs, attn_mask=keep, scale=scale).transpose(0, 1)
        start = end
    return out


def varlen_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: torch.Tensor, scale: float,
                            out: torch.Tensor, block_m: int, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Launch into ``out`` ([T, heads, d], last dim contiguous); ``blocks`` from :func:`block_table` with
    ``block_m``, on the device; ``key_mask`` [T] integers, contiguous (0: a padding key). Inputs are assumed
    validated."""
    heads, head_dim = q.shape[1], q.shape[2]
    programs = grid_programs(q.shape[0], blocks.shape[0] - 1, block_m)
    if blocks.shape[0] <= 1 or heads == 0:
        return out
    interpreted = triton_interpreted()
    ieee = q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest"
    keys = blocks if key_mask is None else key_mask  # (an unread pointer without a mask)
    args = (q, k, v, out, blocks, keys, scale * math.log2(math.e), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), head_dim,
            next_power_of_2(programs))
    meta = dict(BLOCK_M=block_m, BLOCK_D=max(16, next_power_of_2(head_dim)),
                UPCAST=interpreted or q.dtype == torch.float32, IEEE=ieee or interpreted, KEY_MASK=key_mask is not None,
                **dependent_launch(q))
    launch(_varlen_attention_fwd_kernel, _varlen_attention_tuned, _ATTN_CONFIGS, {}, lambda cfg: (programs, heads),
           args, meta, {"BLOCK_N": 32})
    return out


# ---------------------------------------------------------------------------------------------- op
def _varlen_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Optional[torch.Tensor],
                           key_mask: Optional[torch.Tensor], lengths: list[int], scale: float, block_m: int,
                           out: torch.Tensor) -> None:
    if blocks is not None and triton_runs(q, "varlen_attention"):
        varlen_attention_triton(q, k, v, blocks, scale, out, block_m, key_mask)
    else:
        varlen_attention_reference(q, k, v, lengths, scale, out, key_mask)


_varlen_attention_op = mutating_op("varlen_attention", "out")(_varlen_attention_impl)


def _check(q, k, v, lengths, out, key_mask=None) -> int:
    op = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            fail(op, f"{name} must be a [tokens, heads, head_dim] tensor, got "
                     f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            fail(op, f"q, k and v must share shape, dtype and device; {name} is {tuple(t.shape)} {t.dtype} on "
                     f"{t.device}, q is {tuple(q.shape)} {q.dtype} on {q.device}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            fail(op, f"{name}'s head_dim must be contiguous (stride {t.stride(2)}); pass {name}.contiguous()")
    if q.dtype not in FLOAT_DTYPES:
        fail(op, f"q must be float32, float16, bfloat16 or float64, got {q.dtype}")
    if any(int(n) < 0 for n in lengths):
        fail(op, f"lengths must be >= 0, got {list(lengths)}")
    total = sum(int(n) for n in lengths)
    if total > q.shape[0]:
        fail(op, f"lengths add up to {total} tokens but q has only {q.shape[0]} rows")
    if key_mask is not None and (not isinstance(key_mask, torch.Tensor) or key_mask.shape != q.shape[:1]
                                 or key_mask.is_floating_point() or key_mask.device != q.device
                                 or key_mask.stride(0) != 1):
        got = f"{key_mask.dtype} {tuple(key_mask.shape)}" if isinstance(key_mask, torch.Tensor) else type(key_mask)
        fail(op, f"key_mask must be a contiguous [{q.shape[0]}] integer or bool tensor on {q.device} "
                 f"(1: a real key), got {got}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or (out.shape[2] > 1 and out.stride(2) != 1)):
        fail(op, f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous head_dim, got "
                 f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return total


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int],
                     scale: float | None = None, *, out: torch.Tensor | None = None,
                     blocks: torch.Tensor | None = None, key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional softmax attention within each of the packed sequences of ``lengths`` (host ints).

    ``q``/``k``/``v``: [T, heads, head_dim] (any row and head strides: slices of one QKV buffer work),
    sequences back to back from row 0; rows past ``sum(lengths)`` are left untouched. ``scale`` defaults
    to ``head_dim ** -0.5``. ``out``: where to write (a planned buffer); ``blocks``: a prebuilt device
    block table (:func:`~hf_scatter.kernels.varlen_attention.block_table` with
    :func:`~hf_scatter.kernels.varlen_attention.block_m_for`), which the fixed-grid CUDA-graph path passes.
    ``key_mask``: [T] integers or bools, 0 where a key is padding (a padded batch run row for row); a query
    whose sequence has no real key gets zeros.
    """
    _check(q, k, v, lengths, out, key_mask)
    lengths = [int(n) for n in lengths]
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        fail("varlen_attention", f"scale must be finite, got {scale}")
    out = torch.empty_like(q) if out is None else out
    block_m = block_m_for(q.shape[2])
    if blocks is None and triton_runs(q, "varlen_attention"):
        blocks = torch.from_numpy(block_table(lengths, block_m)).to(q.device)
    run_op(_varlen_attention_op, _varlen_attention_impl, q, k, v, blocks, key_mask, lengths, scale, block_m, out)
    return out
