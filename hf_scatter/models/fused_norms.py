"""Residual add + norm on the fused kernels, with the dtype rules the vanilla modules follow.

The vanilla code adds first (``x + residual`` promotes to the wider dtype) and normalises after; under
autocast ``nn.LayerNorm`` runs in float32. These helpers reproduce both before calling the one-pass kernel,
so a patched model keeps the dtypes, and the rounding, of the one it replaces.
"""

from __future__ import annotations

import torch
from torch import nn

from ..kernels.norms import fused_add_layer_norm, fused_add_rms_norm

FUSED_ADD_NORM = "fused_add_norm"


def _promote(x: torch.Tensor, residual: torch.Tensor | None):
    if residual is None or residual.dtype == x.dtype:
        return x, residual
    dtype = torch.promote_types(x.dtype, residual.dtype)
    return x.to(dtype), residual.to(dtype)


def _module_call(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module):
    """``(norm(x + residual), x + residual)`` through the module itself, or None where the kernel applies.

    accelerate (``device_map``, offloading) brings a module's weights only when the module is called; and
    the kernel takes weights in the activations' dtype or float32 only (validation is skipped here to keep
    small calls cheap, so this is where unusual inputs are caught)."""
    weight = norm.weight
    if not hasattr(norm, "_hf_hook") and (weight is None or weight.dtype in (x.dtype, torch.float32)) and \
            x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1):
        return None
    summed = x if residual is None else x + residual
    return norm(summed), summed


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
             casting: str = "llama"):
    """``(RMSNorm(x + residual), x + residual)`` as MixtralRMSNorm computes it (``casting="gpt_oss"``: as
    GptOssRMSNorm, the weight multiplied before the rounding; ``kernels.norms.fused_add_rms_norm``)."""
    x, residual = _promote(x, residual)
    return fused_add_rms_norm(x, residual, weight, eps=eps, return_sum=True, casting=casting)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module, casting: str = "llama"):
    """:func:`rms_norm` with the weight and eps of the MixtralRMSNorm-like module ``norm``."""
    x, residual = _promote(x, residual)
    return _module_call(x, residual, norm) or fused_add_rms_norm(
        x, residual, norm.weight, eps=norm.variance_epsilon, return_sum=True, validate=False, casting=casting)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None, norm: nn.LayerNorm, return_sum: bool = True):
    """``(norm(x + residual), x + residual)`` for an ``nn.LayerNorm`` over the last dimension (the sum is
    None without ``return_sum``, and then never written in inference)."""
    if torch.is_autocast_enabled(x.device.type):  # autocast runs layer_norm in float32 on the sum
        summed = x if residual is None else x + residual
        called = _module_call(summed.float(), None, norm)
        y = called[0] if called else fused_add_layer_norm(summed.float(), None, norm.weight, norm.bias,
                                                          eps=norm.eps, validate=False)
        return y, summed
    x, residual = _promote(x, residual)
    called = _module_call(x, residual, norm)
    if called:
        return called
    out = fused_add_layer_norm(x, residual, norm.weight, norm.bias, eps=norm.eps, return_sum=return_sum,
                               validate=False)
    return out if return_sum else (out, None)
