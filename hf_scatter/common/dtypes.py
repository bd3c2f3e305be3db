"""The dtypes kernels and checks accept, and the autocast dtype our own autograd functions compute in,
written once."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def autocast_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Inside ``torch.autocast`` a layer computes in the autocast dtype, as ``F.linear`` would (custom ops
    are not autocast by torch itself); gradients flow back to the full-precision tensors."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    if isinstance(weight, torch.Tensor):  # a quantized weight is decoded into x's dtype by the kernels
        weight = weight.to(dtype)
    return x.to(dtype), weight, (bias.to(dtype) if bias is not None else None)


__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES", "autocast_operands"]
