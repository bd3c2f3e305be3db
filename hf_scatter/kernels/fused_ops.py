"""Fused reductions as differentiable calls: residual add + LayerNorm / RMSNorm, masked softmax, router top-k.

Each public function checks its arguments, then runs a ``torch.autograd.Function`` whose forward and
backward call ``torch.library`` custom ops (traced by ``torch.compile``; eager calls skip the dispatcher,
see ``ops._run``). An op runs its Triton kernel where ``backend.use_triton`` says so and the torch reference
of the kernel's module otherwise; float64 always takes the reference. Ops write into buffers allocated
here, as in ``ops.py``; forward and backward carry ``hf_scatter::`` names in profiler traces (``ops.profiled``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from . import norms, router, softmax
from .backend import use_triton
from .ops import _fail, _run, mutating_op, profiled

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _triton(t: torch.Tensor, op: str) -> bool:
    return t.dtype != torch.float64 and use_triton(t, op)


# ----------------------------------------------------------------------------------------- norm ops
def _add_norm_fwd_impl(x: torch.Tensor, residual: Optional[torch.Tensor], add_bias: Optional[torch.Tensor],
                       weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], eps: float, rms: bool,
                       y: torch.Tensor, sum_out: Optional[torch.Tensor], mean: Optional[torch.Tensor],
                       rstd: torch.Tensor) -> None:
    if _triton(x, "fused_add_rms_norm" if rms else "fused_add_layer_norm"):
        norms.add_norm_fwd_triton(x, residual, add_bias, weight, bias, eps, rms, y, sum_out, mean, rstd)
        return
    y_ref, s_ref, mean_ref, rstd_ref = norms.add_norm_reference(x, residual, add_bias, weight, bias, eps, rms)
    y.copy_(y_ref)
    rstd.copy_(rstd_ref)
    if sum_out is not None:
        sum_out.copy_(s_ref)
    if mean is not None:
        mean.copy_(mean_ref)


_add_norm_fwd_op = mutating_op("add_norm_fwd", "y", "sum_out", "mean", "rstd")(_add_norm_fwd_impl)


def _add_norm_bwd_impl(dy: torch.Tensor, s: torch.Tensor, weight: Optional[torch.Tensor],
                       mean: Optional[torch.Tensor], rstd: torch.Tensor, dsum: Optional[torch.Tensor], rms: bool,
                       dx: torch.Tensor, dweight: Optional[torch.Tensor], dbias: Optional[torch.Tensor],
                       dadd_bias: Optional[torch.Tensor]) -> None:
    if _triton(s, "fused_add_rms_norm" if rms else "fused_add_layer_norm"):
        norms.add_norm_bwd_triton(dy, s, weight, mean, rstd, dsum, rms, dx, dweight, dbias, dadd_bias)
        return
    grads = norms.add_norm_backward_reference(dy, s, weight, mean, rstd, dsum, rms)
    for out, grad in zip((dx, dweight, dbias, dadd_bias), grads):
        if out is not None:
            out.copy_(grad)


_add_norm_bwd_op = mutating_op("add_norm_bwd", "dx", "dweight", "dbias", "dadd_bias")(_add_norm_bwd_impl)


class _AddNorm(torch.autograd.Function):
    """[M, N] rows. Returns y, plus the pre-norm sum when something was added (the sum is what the backward
    reads, so it exists either way)."""

    @staticmethod
    @profiled("hf_scatter::add_norm.forward")
    def forward(ctx, x, residual, weight, bias, add_bias, eps, rms):
        M, N = x.shape
        out_dtype = _norm_out_dtype(x, weight, rms)
        stat_dtype = torch.promote_types(x.dtype, torch.float32)
        has_add = residual is not None or add_bias is not None
        y = x.new_empty((M, N), dtype=out_dtype)
        sum_out = x.new_empty((M, N)) if has_add else None
        mean = None if rms else x.new_empty((M,), dtype=stat_dtype)
        rstd = x.new_empty((M,), dtype=stat_dtype)
        _run(_add_norm_fwd_op, _add_norm_fwd_impl, x, residual, add_bias, weight, bias, eps, rms, y, sum_out, mean,
             rstd)
        ctx.save_for_backward(sum_out if has_add else x, weight, mean, rstd)
        ctx.rms = rms
        ctx.out_dtype = out_dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.add_bias_dtype = None if add_bias is None else add_bias.dtype
        ctx.set_materialize_grads(False)  # an unused sum output should cost nothing in the backward
        return (y, sum_out) if has_add else y

    @staticmethod
    @profiled("hf_scatter::add_norm.backward")
    @once_differentiable
    def backward(ctx, dy, dsum=None):
        s, weight, mean, rstd = ctx.saved_tensors
        need_x, need_res, need_w, need_b, need_ab = ctx.needs_input_grad[:5]
        dy = s.new_zeros(s.shape, dtype=ctx.out_dtype) if dy is None else dy.contiguous()
        dx = s.new_empty(s.shape)
        N = s.shape[1]
        dweight = weight.new_empty((N,)) if need_w else None
        dbias = s.new_empty((N,), dtype=ctx.bias_dtype) if need_b else None
        dadd_bias = s.new_empty((N,), dtype=ctx.add_bias_dtype) if need_ab else None
        _run(_add_norm_bwd_op, _add_norm_bwd_impl, dy, s, weight, mean, rstd,
             None if dsum is None else dsum.contiguous(), ctx.rms, dx, dweight, dbias, dadd_bias)
        return dx if need_x else None, dx if need_res else None, dweight, dbias, dadd_bias, None, None


# -------------------------------------------------------------------------------------- softmax ops
def _masked_softmax_fwd_impl(x4: torch.Tensor, mask4: Optional[torch.Tensor], scale: float, mask_min: float,
                             dropout_p: float, seed: Optional[torch.Tensor], y: Optional[torch.Tensor],
                             out: torch.Tensor) -> None:
    seed_value = 0 if seed is None else int(seed.item())
    if x4.shape[-1] <= softmax.MAX_TRITON_ROW and _triton(x4, "fused_masked_softmax"):
        softmax.masked_softmax_fwd_triton(x4, mask4, scale, mask_min, dropout_p, seed_value, y, out)
        return
    y_ref, out_ref = softmax.masked_softmax_reference(x4, mask4, scale, mask_min, dropout_p, seed_value)
    out.copy_(out_ref)
    if y is not None:
        y.copy_(y_ref)


_masked_softmax_fwd_op = mutating_op("masked_softmax_fwd", "y", "out")(_masked_softmax_fwd_impl)


def _masked_softmax_bwd_impl(y: torch.Tensor, dout: torch.Tensor, scale: float, dropout_p: float,
                             seed: Optional[torch.Tensor], dx: torch.Tensor) -> None:
    seed_value = 0 if seed is None else int(seed.item())
    if y.shape[-1] <= softmax.MAX_TRITON_ROW and _triton(y, "fused_masked_softmax"):
        softmax.masked_softmax_bwd_triton(y, dout, scale, dropout_p, seed_value, dx)
    else:
        dx.copy_(softmax.masked_softmax_backward_reference(y, dout, scale, dropout_p, seed_value))


_masked_softmax_bwd_op = mutating_op("masked_softmax_bwd", "dx")(_masked_softmax_bwd_impl)


class _MaskedSoftmax(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::masked_softmax.forward")
    def forward(ctx, x, mask, scale, mask_min, dropout_p, seed):
        lead = (None,) * (4 - x.dim())  # a [D0, D1, D2, S] view of the scores and of the expanded mask
        x4 = x[lead]
        mask4 = None if mask is None else mask.expand(x.shape)[lead]
        out = x.new_empty(x4.shape)
        y = x.new_empty(x4.shape) if dropout_p > 0 else None  # the softmax before dropout, for the backward
        _run(_masked_softmax_fwd_op, _masked_softmax_fwd_impl, x4, mask4, scale, mask_min, dropout_p, seed, y, out)
        ctx.save_for_backward(out if y is None else y, seed)
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.mask_shape = None if mask is None else mask.shape
        return out.view(x.shape)

    @staticmethod
    @profiled("hf_scatter::masked_softmax.backward")
    @once_differentiable
    def backward(ctx, dout):
        y, seed = ctx.saved_tensors
        need_x, need_mask = ctx.needs_input_grad[:2]
        dz = torch.empty_like(y)
        # A learned additive bias (the mask) gets d(scale * x + mask) = dz: then the kernel runs unscaled.
        scale = 1.0 if need_mask else ctx.scale
        _run(_masked_softmax_bwd_op, _masked_softmax_bwd_impl, y, dout.contiguous().view(y.shape), scale,
             ctx.dropout_p, seed, dz)
        dz = dz.view(dout.shape)
        dx = (dz * ctx.scale if need_mask else dz) if need_x else None
        dmask = dz.sum_to_size(ctx.mask_shape) if need_mask else None
        return dx, dmask, None, None, None, None


# --------------------------------------------------------------------------------------- router ops
def _router_topk_impl(logits: torch.Tensor, top_k: int, p: Optional[float], weights: torch.Tensor,
                      indices: torch.Tensor, probs: Optional[torch.Tensor]) -> None:
    if (logits.shape[1] <= router.MAX_TRITON_EXPERTS and weights.dtype != torch.float64
            and _triton(logits, "router_topk")):
        router.router_topk_triton(logits, top_k, p, weights, indices, probs)
        return
    w_ref, idx_ref, probs_ref = router.router_topk_reference(logits, top_k, p, weights.dtype)
    weights.copy_(w_ref)
    indices.copy_(idx_ref)
    if probs is not None:
        probs.copy_(probs_ref)


_router_topk_op = mutating_op("router_topk", "weights", "indices", "probs")(_router_topk_impl)


class _RouterTopK(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::router_topk.forward")
    def forward(ctx, logits, top_k, p, softmax_dtype, return_probs, keep_probs):
        T, E = logits.shape
        weights = logits.new_empty((T, top_k), dtype=softmax_dtype)
        indices = logits.new_empty((T, top_k), dtype=torch.int64)
        probs = logits.new_empty((T, E), dtype=softmax_dtype) if keep_probs else None
        _run(_router_topk_op, _router_topk_impl, logits, top_k, p, weights, indices, probs)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(probs, indices)
        ctx.p, ctx.logits_dtype = p, logits.dtype
        ctx.set_materialize_grads(False)
        return (weights, indices, probs) if return_probs else (weights, indices)

    @staticmethod
    @profiled("hf_scatter::router_topk.backward")
    @once_differentiable
    def backward(ctx, dweights, dindices, dprobs=None):
        probs, indices = ctx.saved_tensors
        dlogits = router.router_backward(probs, indices, dweights, dprobs, ctx.p)
        return dlogits.to(ctx.logits_dtype), None, None, None, None, None


# ------------------------------------------------------------------------------------- validation
def _check_tensor(op: str, name: str, t, min_dim: int = 1) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() < min_dim:
        _fail(op, f"{name} must have at least {min_dim} dimension(s), got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        _fail(op, f"{name} must be float32, float16, bfloat16 or float64, got {t.dtype}")


def _check_rows(op: str, name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        _fail(op, f"{name} must be contiguous along its last dimension (stride {t.stride(-1)}); "
                  f"pass {name}.contiguous()")


def _check_same_place(op: str, name: str, t: torch.Tensor, x: torch.Tensor) -> None:
    if t.device != x.device:
        _fail(op, f"{name} is on {t.device} but x is on {x.device}; move them to one device")


def _check_vector(op: str, name: str, t, x: torch.Tensor, dtypes: tuple) -> None:
    if t is None:
        return
    _check_tensor(op, name, t)
    _check_same_place(op, name, t, x)
    N = x.shape[-1]
    if tuple(t.shape) != (N,):
        _fail(op, f"{name} must have shape ({N},) to match x's last dimension, got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = " or ".join(str(d) for d in dict.fromkeys(dtypes))
        _fail(op, f"{name} has dtype {t.dtype}; use {allowed} (x is {x.dtype})")
    if N > 1 and t.stride(0) != 1:
        _fail(op, f"{name} must be contiguous; pass {name}.contiguous()")


def _check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        _fail(op, f"eps must be a finite number >= 0, got {eps!r}")
    return float(eps)


def _norm_rows(op: str, x, residual, weight, bias, add_bias, rms: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Checks the norm inputs; returns x and residual as [M, N] views (copies only if leading dims must be)."""
    _check_tensor(op, "x", x)
    if x.shape[-1] == 0:
        _fail(op, f"x's last dimension (the normalised one) is empty: shape {tuple(x.shape)}")
    _check_rows(op, "x", x)
    if residual is not None:
        _check_tensor(op, "residual", residual)
        _check_same_place(op, "residual", residual, x)
        if residual.shape != x.shape:
            _fail(op, f"residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}; they must match "
                      "(no broadcasting)")
        if residual.dtype != x.dtype:
            _fail(op, f"residual has dtype {residual.dtype} but x has {x.dtype}; cast them to one dtype")
        _check_rows(op, "residual", residual)
    params = (x.dtype, torch.float32)
    _check_vector(op, "weight", weight, x, params)
    if not rms:
        _check_vector(op, "bias", bias, x, params)
        _check_vector(op, "add_bias", add_bias, x, (x.dtype,))
    N = x.shape[-1]
    return x.reshape(-1, N), None if residual is None else residual.reshape(-1, N)


def _norm_result(x: torch.Tensor, outputs, has_add: bool, return_sum: bool):
    y, s = outputs if has_add else (outputs, x)
    y = y.view(x.shape)
    return (y, s.view(x.shape)) if return_sum else y


# ----------------------------------------------------------------------------------- public calls
def _add_norm(op: str, x, residual, weight, bias, add_bias, eps, rms: bool, return_sum: bool, validate: bool,
              out: torch.Tensor | None = None):
    if validate:
        x2, res2 = _norm_rows(op, x, residual, weight, bias, add_bias, rms)
        eps = _check_eps(op, eps)
    else:
        N = x.shape[-1]
        x2, res2 = x.reshape(-1, N), None if residual is None else residual.reshape(-1, N)
    has_add = residual is not None or add_bias is not None
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                                 for t in (x, residual, weight, bias, add_bias))
    if out is not None:
        _check_norm_out(op, out, x, weight, rms, needs_grad)
    if needs_grad:
        outputs = _AddNorm.apply(x2, res2, weight, bias, add_bias, eps, rms)
    else:
        outputs = _add_norm_inference(x2, res2, weight, bias, add_bias, eps, rms, return_sum and has_add,
                                      None if out is None else out.view(x2.shape))
    return _norm_result(x, outputs, has_add, return_sum)


def _norm_out_dtype(x: torch.Tensor, weight: torch.Tensor | None, rms: bool) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype) if rms and weight is not None else x.dtype


def _check_norm_out(op: str, out: torch.Tensor, x: torch.Tensor, weight, rms: bool, needs_grad: bool) -> None:
    if needs_grad:
        _fail(op, "out= is for inference (an output buffer cannot carry autograd history); call it under "
                  "torch.no_grad() or drop out=")
    dtype = _norm_out_dtype(x, weight, rms)
    if not isinstance(out, torch.Tensor) or out.shape != x.shape or out.dtype != dtype or out.device != x.device \
            or not out.is_contiguous():
        got = f"{tuple(out.shape)} {out.dtype} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        _fail(op, f"out must be a contiguous {tuple(x.shape)} {dtype} tensor on {x.device}, got {got}")


def _add_norm_inference(x, residual, weight, bias, add_bias, eps, rms, keep_sum: bool, out=None):
    """No autograd node: the pre-norm sum is written only when the caller wants it, the statistics go to
    one scratch allocation (a small call is dominated by host time, so every allocation counts)."""
    M, N = x.shape
    y = x.new_empty((M, N), dtype=_norm_out_dtype(x, weight, rms)) if out is None else out
    sum_out = x.new_empty((M, N)) if keep_sum else None
    stats = x.new_empty((1 if rms else 2, M), dtype=torch.promote_types(x.dtype, torch.float32))
    _run(_add_norm_fwd_op, _add_norm_fwd_impl, x, residual, add_bias, weight, bias, eps, rms, y, sum_out,
         None if rms else stats[1], stats[0])
    return (y, sum_out) if residual is not None or add_bias is not None else y


def fused_add_layer_norm(x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                         bias: torch.Tensor | None = None, eps: float = 1e-5, add_bias: torch.Tensor | None = None,
                         return_sum: bool = False, *, validate: bool = True, out: torch.Tensor | None = None):
    """``LayerNorm(x + add_bias + residual)`` over the last dimension in one read of each row, differentiable.

    The adds round to x's dtype one at a time, like ``LayerNorm(dense_out + input)`` unfused, so vanilla
    and fused BERT layers agree. ``add_bias``: the preceding linear layer's bias, folded into the add.
    ``weight`` / ``bias`` may be x's dtype or float32 (y keeps x's dtype). ``return_sum``: also return the
    pre-norm sum (the next residual of a pre-norm block): ``(y, sum)``. ``validate=False`` skips the input
    checks (for callers that built the arguments themselves; wrong input is then undefined behaviour).
    ``out``: write y there (inference only; a planned buffer of the packed BERT runtime).
    """
    return _add_norm("fused_add_layer_norm", x, residual, weight, bias, add_bias, eps, False, return_sum, validate,
                     out)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                       eps: float = 1e-6, return_sum: bool = False, *, validate: bool = True):
    """MixtralRMSNorm of ``x + residual`` in one read of each row, differentiable.

    Same rounding as HF: ``weight * (s.float() * rsqrt(mean(s.float()^2) + eps)).to(s.dtype)``, so the output
    dtype is that of ``weight * x`` (float32 weights give a float32 output). ``return_sum``: also return
    ``s = x + residual`` (the next residual): ``(y, s)``. ``validate`` as in :func:`fused_add_layer_norm`.
    """
    return _add_norm("fused_add_rms_norm", x, residual, weight, None, None, eps, True, return_sum, validate)


def fused_masked_softmax(x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 1.0,
                         dropout_p: float = 0.0, training: bool = False) -> torch.Tensor:
    """``dropout(softmax(scale * x + mask))`` over the last dimension of 1-D to 4-D scores, differentiable.

    ``mask``: an additive float mask broadcastable to x (BERT's [B, 1, 1, S] or [B, 1, S, S]), read in place.
    Entries that are -inf or at most ``finfo(mask.dtype).min`` are masked; fully masked rows give zeros.
    Dropout (only with ``training``) draws its seed from torch's CPU generator: deterministic given
    ``torch.manual_seed``, and replayed by ``torch.utils.checkpoint``, which restores that generator.
    """
    op = "fused_masked_softmax"
    _check_tensor(op, "x", x)
    if x.dim() > 4:
        _fail(op, f"x must have 1 to 4 dimensions, got shape {tuple(x.shape)}; merge leading dimensions with "
                  "reshape")
    _check_rows(op, "x", x)
    if mask is not None:
        if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:
            _fail(op, "mask must be an additive float mask, got a bool tensor; convert it with "
                      "torch.zeros(mask.shape, dtype=x.dtype).masked_fill(~mask, float('-inf'))")
        _check_tensor(op, "mask", mask, min_dim=0)
        _check_same_place(op, "mask", mask, x)
        trailing = x.shape[x.dim() - mask.dim():]
        if mask.dim() > x.dim() or any(m not in (1, n) for m, n in zip(mask.shape, trailing)):
            _fail(op, f"mask of shape {tuple(mask.shape)} does not broadcast to x's shape {tuple(x.shape)}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        _fail(op, f"scale must be a finite number, got {scale!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p <= 1.0:
        _fail(op, f"dropout_p must be a number in [0, 1], got {dropout_p!r}")
    p = float(dropout_p) if training else 0.0
    seed = torch.randint(2 ** 62, (1,), dtype=torch.int64) if p > 0 else None
    mask_min = float(torch.finfo(mask.dtype).min) if mask is not None else 0.0
    return _MaskedSoftmax.apply(x, mask, float(scale), mask_min, p, seed)


def _norm_order(op: str, normalize) -> float | None:
    if normalize is None:
        return None
    if normalize == "sum":
        return 1.0
    if isinstance(normalize, bool) or not isinstance(normalize, (int, float)) or not (
            math.isfinite(normalize) and normalize > 0):
        _fail(op, f"normalize must be 'sum', None or a finite p-norm order > 0 (DBRX's "
                  f"moe_normalize_expert_weights), got {normalize!r}")
    return float(normalize)


def router_topk(logits: torch.Tensor, top_k: int, normalize: str | float | None = "sum",
                softmax_dtype: torch.dtype = torch.float32, return_probs: bool = False):
    """Route tokens: ``softmax(logits.to(softmax_dtype))``, top-k, renormalise, in one kernel; differentiable
    in the weights (and probabilities) w.r.t. the logits.

    Mixtral: ``normalize='sum'`` with float32. DBRX: ``normalize=moe_normalize_expert_weights`` (a p-norm
    order, or None) with ``softmax_dtype=logits.dtype``. Returns ``(weights [T, k] in softmax_dtype,
    indices [T, k] int64)``, plus the probabilities [T, E] with ``return_probs`` (for the aux loss).
    Among equal probabilities the lower expert index wins (see router.py for how that compares with
    torch.topk).
    """
    op = "router_topk"
    _check_tensor(op, "logits", logits, min_dim=2)
    if logits.dim() != 2:
        _fail(op, f"logits must be [tokens, experts], got shape {tuple(logits.shape)}; reshape(-1, experts)")
    _check_rows(op, "logits", logits)
    E = logits.shape[1]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= E:
        _fail(op, f"top_k must be an int in [1, {E}] (the number of experts), got {top_k!r}")
    if softmax_dtype not in _FLOAT_DTYPES:
        _fail(op, f"softmax_dtype must be one of {', '.join(map(str, _FLOAT_DTYPES))}, got {softmax_dtype!r}")
    p = _norm_order(op, normalize)
    keep_probs = bool(return_probs) or (logits.requires_grad and torch.is_grad_enabled())
    return _RouterTopK.apply(logits, top_k, p, softmax_dtype, bool(return_probs), keep_probs)
