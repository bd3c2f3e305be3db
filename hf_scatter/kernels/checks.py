"""Input checks shared by the kernels' public calls. Each raises ``ValueError("<op>: <what is wrong>")``."""

from __future__ import annotations

import math

import torch

from ..common.dtypes import FLOAT_DTYPES, INDEX_DTYPES


def fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


# ------------------------------------------------------------------- fixed-rank operands (MoE ops, SwiGLU)
def check_float(op: str, name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dim:
        fail(op, f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_index(op: str, name: str, t: torch.Tensor, numel: int | None, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in INDEX_DTYPES:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        fail(op, f"{name} must be a 1-D int32/int64 tensor, got {got}")
    if numel is not None and t.numel() != numel:
        fail(op, f"{name} must have {numel} elements, got {t.numel()}")
    if t.device != device:
        fail(op, f"{name} is on {t.device} but the inputs are on {device}; put all tensors on one device")
    if not t.is_contiguous():
        fail(op, f"{name} must be contiguous (call .contiguous())")


def check_like(op: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        fail(op, f"{name} is on {t.device} but the input is on {ref.device}; put all tensors on one device")
    if t.dtype != ref.dtype:
        fail(op, f"{name} has dtype {t.dtype} but the input is {ref.dtype}; cast them to one dtype")


def check_out(op: str, out: torch.Tensor, shape: tuple, like: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        fail(op, f"out must be {tuple(shape)} {like.dtype} on {like.device}, got {tuple(out.shape)} {out.dtype} "
                 f"on {out.device}")


# ------------------------------------------------------ row-wise operands (norms, softmax, router)
def check_tensor(op: str, name: str, t, min_dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        fail(op, f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        fail(op, f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def check_rows(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        fail(op, f"{name} must be contiguous along its last dimension (stride {t.stride(-1)}); "
                 f"pass {name}.contiguous()")


def check_router_logits(op: str, logits, top_k) -> int:
    """Router logits [tokens, experts] with unit last stride and ``1 <= top_k <= experts``; returns experts."""
    check_tensor(op, "logits", logits, min_dim=2)
    if logits.dim() != 2:
        fail(op, f"logits must be [tokens, experts], got shape {tuple(logits.shape)}; reshape(-1, experts)")
    check_rows(op, "logits", logits)
    E = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        fail(op, f"top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    return E


def check_same_place(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.device != x.device:
        fail(op, f"{name} is on {t.device} but x is on {x.device}; move them to one device")


def check_vector(op: str, name: str, t, x: torch.Tensor, dtypes: tuple) -> None:
    if t is None:
        return
    check_tensor(op, name, t)
    check_same_place(op, name, t, x)
    N = x.shape[-1]
    if tuple(t.shape) != (N,):
        fail(op, f"{name} must have shape ({N},) to match x's last dimension, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dict.fromkeys(dtypes))
        fail(op, f"{name} has dtype {t.dtype}; use {allowed} (x is {x.dtype})")
    if N > 1 and t.stride(0) != 1:
        fail(op, f"{name} must be contiguous; pass {name}.contiguous()")


def check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        fail(op, f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)
