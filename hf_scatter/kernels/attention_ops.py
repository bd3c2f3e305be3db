"""Packed variable-length attention as a checked call and a ``torch.library`` custom op.

The op runs the Triton kernel where ``backend.use_triton`` says so and the per-sequence SDPA reference
otherwise (float64 always takes the reference). Inference only: the packed BERT path runs without
autograd (training keeps transformers' padded attention).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from . import varlen_attention as va
from .backend import use_triton
from .ops import _fail, _run, mutating_op

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _varlen_attention_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Optional[torch.Tensor],
                           lengths: list[int], scale: float, block_m: int, out: torch.Tensor) -> None:
    if blocks is not None and q.dtype != torch.float64 and use_triton(q, "varlen_attention"):
        va.varlen_attention_triton(q, k, v, blocks, scale, out, block_m)
    else:
        va.varlen_attention_reference(q, k, v, lengths, scale, out)


_varlen_attention_op = mutating_op("varlen_attention", "out")(_varlen_attention_impl)


def _check(q, k, v, lengths, out) -> int:
    op = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            _fail(op, f"{name} must be a [tokens, heads, head_dim] tensor, got "
                      f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            _fail(op, f"q, k and v must share shape, dtype and device; {name} is {tuple(t.shape)} {t.dtype} on "
                      f"{t.device}, q is {tuple(q.shape)} {q.dtype} on {q.device}")
        if t.shape[2] > 1 and t.stride(2) != 1:
            _fail(op, f"{name}'s head_dim must be contiguous (stride {t.stride(2)}); pass {name}.contiguous()")
    if q.dtype not in _DTYPES:
        _fail(op, f"q must be float32, float16, bfloat16 or float64, got {q.dtype}")
    if any(int(n) < 0 for n in lengths):
        _fail(op, f"lengths must be >= 0, got {list(lengths)}")
    total = sum(int(n) for n in lengths)
    if total > q.shape[0]:
        _fail(op, f"lengths add up to {total} tokens but q has only {q.shape[0]} rows")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                            or (out.shape[2] > 1 and out.stride(2) != 1)):
        _fail(op, f"out must be {tuple(q.shape)} {q.dtype} on {q.device} with a contiguous head_dim, got "
                  f"{tuple(out.shape)} {out.dtype} on {out.device}")
    return total


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: Sequence[int],
                     scale: float | None = None, *, out: torch.Tensor | None = None,
                     blocks: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional softmax attention within each of the packed sequences of ``lengths`` (host ints).

    ``q``/``k``/``v``: [T, heads, head_dim] (any row and head strides: slices of one QKV buffer work),
    sequences back to back from row 0; rows past ``sum(lengths)`` are left untouched. ``scale`` defaults
    to ``head_dim ** -0.5``. ``out``: where to write (a planned buffer); ``blocks``: a prebuilt device
    block table (:func:`~hf_scatter.kernels.varlen_attention.block_table` with
    :func:`~hf_scatter.kernels.varlen_attention.block_m_for`), which the fixed-grid CUDA-graph path passes.
    """
    _check(q, k, v, lengths, out)
    lengths = [int(n) for n in lengths]
    scale = q.shape[2] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        _fail("varlen_attention", f"scale must be finite, got {scale}")
    out = torch.empty_like(q) if out is None else out
    block_m = va.block_m_for(q.shape[2])
    if blocks is None and q.dtype != torch.float64 and use_triton(q, "varlen_attention"):
        blocks = torch.from_numpy(va.block_table(lengths, block_m)).to(q.device)
    _run(_varlen_attention_op, _varlen_attention_impl, q, k, v, blocks, lengths, scale, block_m, out)
    return out
