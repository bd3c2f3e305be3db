"""Block-scaled FP8 checkpoints (DeepSeek-V3, the Qwen3 FP8 releases) converted as they ship.

Each FP8 weight ``key`` has float32 scales ``key + "_scale_inv"``, one per block of rows x columns of each
matrix (the last two dimensions). Converting moves whole rows of weights, never columns, so a scale moves with
the block of rows it scales: every run of rows that a link copies must start and end on its block boundaries
(on both sides), and the bytes and scales are copied as they are, never dequantized.

As transformers reads the blocks: a matrix of R rows with S scale rows has R // S rows a block, so a fused
``gate_up_proj`` of two halves narrower than a block keeps one scale row per half.
"""

from __future__ import annotations

import math

from .layout import Correspondence, Link
from .safetensors_io import ConversionError, TensorInfo

SCALE_SUFFIX = "_scale_inv"
QUANT_METHOD = "fp8"  # transformers' name for block-scaled FP8 in quantization_config
BLOCK = (128, 128)  # its weight_block_size where the config names none


def scale_key(key: str) -> str:
    """``...gate_proj.weight`` -> ``...gate_proj.weight_scale_inv``; ``...experts.gate_up_proj`` -> ``..._scale_inv``."""
    return key + SCALE_SUFFIX


def _rows_per_scale(rows: int, scale_rows: int, block: tuple[int, int]) -> int:
    return rows // scale_rows if rows % scale_rows == 0 else block[0]  # a last partial block: the config's size


def with_scales(corr: Correspondence, from_hf: bool, tensors: dict[str, TensorInfo],
                block: tuple[int, int]) -> Correspondence:
    """``corr`` plus the links of every FP8 weight's scales; ``tensors`` are the source side's (HF when
    ``from_hf``). Raises :class:`ConversionError` where a weight's rows would split a block."""
    side = (lambda link: (link.hf_key, link.hf_offset, link.scatter_key, link.scatter_offset)) if from_hf else \
        (lambda link: (link.scatter_key, link.scatter_offset, link.hf_key, link.hf_offset))
    src_shapes, dst_shapes = (corr.hf_shapes, corr.scatter_shapes) if from_hf else (corr.scatter_shapes, corr.hf_shapes)
    by_dst: dict[str, list[Link]] = {}
    for link in corr.links:
        by_dst.setdefault(side(link)[2], []).append(link)
    out = Correspondence(dict(corr.hf_shapes), dict(corr.scatter_shapes), list(corr.links), set(corr.optional))
    src_scales, dst_scales = (out.hf_shapes, out.scatter_shapes) if from_hf else (out.scatter_shapes, out.hf_shapes)
    for dst_key, links in by_dst.items():
        quantized = [scale_key(side(link)[0]) in tensors for link in links]
        if not any(quantized):
            continue
        if not all(quantized):
            plain = next(side(link)[0] for link, q in zip(links, quantized) if not q)
            raise ConversionError(f"{dst_key!r} would join FP8 weights and {plain!r}, which has no "
                                  f"{SCALE_SUFFIX} tensor: the checkpoint is not consistently quantized")
        for src_key in {side(link)[0] for link in links}:
            src_scales[scale_key(src_key)] = tensors[scale_key(src_key)].shape
        dst_shape = dst_shapes[dst_key]
        if len(links) == 1 and src_shapes[side(links[0])[0]] == dst_shape and links[0].count == math.prod(dst_shape):
            src_key = side(links[0])[0]  # the same tensor under another name (or the same): its scales likewise
            shape = tensors[scale_key(src_key)].shape
            dst_scales[scale_key(dst_key)] = shape
            out.links.append(_oriented(from_hf, scale_key(src_key), 0, scale_key(dst_key), 0, math.prod(shape)))
            continue
        _scale_links(out, from_hf, dst_key, dst_shape, [side(link) + (link.count,) for link in links], src_shapes,
                     tensors, block, dst_scales)
    return out


def _oriented(from_hf: bool, src_key: str, src_offset: int, dst_key: str, dst_offset: int, count: int) -> Link:
    return (Link(src_key, src_offset, dst_key, dst_offset, count) if from_hf else
            Link(dst_key, dst_offset, src_key, src_offset, count))


def _scale_links(out: Correspondence, from_hf: bool, dst_key: str, dst_shape, runs, src_shapes, tensors, block,
                 dst_scales) -> None:
    """Runs of rows (src_key, src_offset, dst_key, dst_offset, count) within one matrix on each side."""
    width, dst_rows = dst_shape[-1], dst_shape[-2]
    per_matrix: dict[int, list[tuple]] = {}
    for src_key, src_off, _, dst_off, count in runs:
        first, rows = dst_off // width, count // width
        if first % dst_rows + rows > dst_rows:
            raise ConversionError(f"{src_key!r} would span two matrices of {dst_key!r}: the converter cannot "
                                  f"keep the FP8 layout")
        per_matrix.setdefault(first // dst_rows, []).append((first % dst_rows, rows, src_key, src_off // width))
    scale_rows = None
    for matrix, pieces in sorted(per_matrix.items()):
        pieces.sort()
        offsets, total = [], 0
        for dst_row, rows, src_key, src_first in pieces:
            src_shape, scale = src_shapes[src_key], tensors[scale_key(src_key)]
            src_rows, (src_scale_rows, scale_cols) = src_shape[-2], scale.shape[-2:]
            per = _rows_per_scale(src_rows, src_scale_rows, block)
            row = src_first % src_rows
            if row % per or (rows % per and row + rows != src_rows) or row + rows > src_rows:
                raise ConversionError(f"{src_key!r}: rows {row}..{row + rows} go to {dst_key!r}, but its scales "
                                      f"cover blocks of {per} rows: the converter would split a block")
            taken = -(-rows // per)
            src_scale_at = ((src_first // src_rows) * src_scale_rows + row // per) * scale_cols
            offsets.append((dst_row, rows, total, taken, scale_key(src_key), src_scale_at, scale_cols))
            total += taken
        if scale_rows not in (None, total):
            raise ConversionError(f"{dst_key!r}: its matrices would get {scale_rows} and {total} scale rows")
        scale_rows = total
        per_dst = _rows_per_scale(dst_rows, total, block)
        for dst_row, rows, at, taken, src_scale, src_scale_at, cols in offsets:
            if dst_row != at * per_dst or (rows != taken * per_dst and dst_row + rows != dst_rows):
                raise ConversionError(f"{dst_key!r}: rows {dst_row}..{dst_row + rows} would not fall on its "
                                      f"{per_dst}-row scale blocks: the converter cannot keep the FP8 layout")
            out.links.append(_oriented(from_hf, src_scale, src_scale_at, scale_key(dst_key),
                                       (matrix * total + at) * cols, taken * cols))
    dst_scales[scale_key(dst_key)] = (*dst_shape[:-2], scale_rows, offsets[0][-1])
