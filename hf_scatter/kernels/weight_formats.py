"""The expert weights' storage formats the GEMMs read in place: one table, so a kernel, its reference and the
custom ops' signatures agree on which formats exist and how each travels.

A custom op takes tensors and plain values only, so a quantized weight crosses it as its values, its scales and
FP8's block size, and is rebuilt on the other side from the values' dtype: uint8 bytes are MXFP4,
float8_e4m3fn are block-scaled FP8.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from .fp8_blocks import FP8_DTYPE, Fp8BlockWeight
from .mxfp4 import Mxfp4Weight

QUANTIZED_WEIGHTS = (Mxfp4Weight, Fp8BlockWeight)
ExpertWeight = Union[torch.Tensor, Mxfp4Weight, Fp8BlockWeight]


def is_quantized(weight) -> bool:
    """Whether ``weight`` is stored in a checkpoint's quantized format (frozen: no gradient is computed)."""
    return isinstance(weight, QUANTIZED_WEIGHTS)


def operands(weight: ExpertWeight) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[list[int]]]:
    """A weight as the ops take it: (tensor, None, None), (MXFP4 blocks, exponents, None) or (FP8 bytes,
    scale_inv, the block size it was given or None)."""
    if isinstance(weight, Mxfp4Weight):
        return weight.blocks, weight.scales, None
    if isinstance(weight, Fp8BlockWeight):
        return weight.weight, weight.scale_inv, None if weight.block_size is None else list(weight.block_size)
    return weight, None, None


def weight_of(values: torch.Tensor, scales: Optional[torch.Tensor], block: Optional[list[int]] = None
              ) -> ExpertWeight:
    """:func:`operands` undone."""
    if scales is None:
        return values
    if values.dtype == FP8_DTYPE:
        return Fp8BlockWeight(values, scales, None if block is None else tuple(block))
    return Mxfp4Weight(values, scales)
