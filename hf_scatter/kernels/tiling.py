"""Tile-level helpers shared by the GEMM-like kernels: program order and the fp32-accumulating dot."""

from __future__ import annotations

from .backend import kernels_enabled

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_tile(pid, num_row_tiles, num_col_tiles, GROUP: tl.constexpr):
        """Map a linear program id to (row tile, column tile) so that GROUP row tiles sweep all column tiles
        together: their shared operand stays in L2 while the other operand's tiles are reused across them."""
        group_size = GROUP * num_col_tiles
        first_row = (pid // group_size) * GROUP
        rows_in_group = tl.minimum(num_row_tiles - first_row, GROUP)
        row = first_row + (pid % group_size) % rows_in_group
        col = (pid % group_size) // rows_in_group
        return row, col

    @triton.jit
    def dot_accumulate(acc, a, b, UPCAST: tl.constexpr, ALLOW_TF32: tl.constexpr):
        """``acc + a @ b`` in fp32: operands upcast first under the interpreter (its bf16 arithmetic is wrong);
        fp32 operands use IEEE products unless TF32 is allowed."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if ALLOW_TF32:
            acc += tl.dot(a, b, input_precision="tf32")
        else:
            acc += tl.dot(a, b, input_precision="ieee")
        return acc
