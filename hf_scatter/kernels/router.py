"""MoE router in one kernel: softmax over expert logits, top-k, renormalisation; backward in torch.

Mixtral: fp32 softmax, top-k, divide by the sum of the k kept probabilities. DBRX: softmax in the logits'
dtype (probabilities rounded to it before the top-k, which is where ties come from), top-k, divide by
the p-norm of the kept ones (``moe_normalize_expert_weights``; None keeps them as they are). Each
program routes ``BLOCK_T`` tokens; the softmax is computed in fp32 and rounded to the softmax dtype, the
p-norm is rounded to it before the division: the order of operations of the HF modules.

Top-k takes k maxima of 64-bit keys ``(probability bits << 32) | (2^31 - 1 - expert)``, removing each
one found: for non-negative floats the bit pattern orders like the value, so keys order by probability
and, among equal probabilities, put the lower expert index first (NaN, from NaN logits, first as in
torch); every key is distinct, so one max reduction per step finds value and expert at once. The result
is a stable descending sort's first k, which the reference reproduces with ``torch.sort(stable=True)``.
(k reductions beat ``tl.sort``'s log^2 E stages for the usual k <= 8, and the interpreter runs
``tl.sort`` element by element.)
Ties and torch.topk (measured on torch 2.11 + CUDA 13, H200, 744 heavily tied cases, E from 4 to 5000):
the *set* of experts CUDA's topk returns is exactly this one (lowest indices win a tie at the k-th place),
but its order among equal values is not by index. Equal values carry equal weights, so the routed output
is the same up to the order of summation. CPU topk (std::partial_sort / nth_element) picks among tied
values in an implementation-defined way, so on CPU even the chosen set can differ where a tie straddles
the k-th place (e.g. [1, 3, 3, 2, 3, 0, 3], k=2: torch 2.13 CPU returns experts [1, 6], this returns [1, 2]).

The backward (weights and, optionally, probabilities -> logits) is a few [T, E] torch ops on the saved
probabilities; ``router_backward`` spells out the chain rule.

The public call :func:`router_topk` checks its arguments, then runs a ``torch.autograd.Function`` whose
forward calls the ``hf_scatter::router_topk`` custom op (see ``custom_ops``).
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..common.dtypes import FLOAT_DTYPES
from .backend import cdiv, kernels_enabled, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_router_logits, fail
from .custom_ops import mutating_op, profiled, run_op

MAX_TRITON_EXPERTS = 256  # wider routers take the torch reference

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _router_topk_kernel(logits_ptr, w_ptr, idx_ptr, probs_ptr, T, E, K, stride_t, p_norm,
                            NORM: tl.constexpr, STORE_PROBS: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        # NORM: 0 none, 1 p = 1 (Mixtral's sum), 2 p = 2, 3 any other p > 0
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)
        row_mask = rows < T
        mask = row_mask[:, None] & (cols < E)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        prob_dtype = w_ptr.dtype.element_ty
        # softmax(logits.to(prob_dtype)), computed in fp32 and rounded to prob_dtype (torch's softmax(dtype=))
        z = tl.load(logits_ptr + r64 * stride_t + cols[None, :], mask=mask, other=0.0)
        z = tl.where((cols < E)[None, :], z.to(prob_dtype).to(tl.float32), float("-inf"))
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        p = (e / tl.sum(e, axis=1)[:, None]).to(prob_dtype).to(tl.float32)
        if STORE_PROBS:
            tl.store(probs_ptr + r64 * E + cols[None, :], p.to(prob_dtype), mask=mask)
        bits = tl.where(p != p, 0x7FC00000, p.to(tl.int32, bitcast=True)).to(tl.int64)
        key = tl.where(mask, (bits << 32) | (2147483647 - cols[None, :]).to(tl.int64), -1)
        slots = tl.arange(0, BLOCK_K)[None, :]
        chosen = tl.full([BLOCK_T, BLOCK_K], -1, dtype=tl.int64)
        for j in range(K):
            best = tl.max(key, axis=1)[:, None]
            key = tl.where(key == best, -1, key)
            chosen = tl.where(slots == j, best, chosen)
        top = (chosen >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        expert = 2147483647 - (chosen & 2147483647)
        kept = slots < K
        if NORM != 0:
            if NORM == 1:
                norm = tl.sum(tl.where(kept, tl.abs(top), 0.0), axis=1)
            elif NORM == 2:
                norm = tl.sqrt(tl.sum(tl.where(kept, top * top, 0.0), axis=1))
            else:  # |v|^p as exp(p log|v|): 0 -> exp(-inf) = 0
                powered = tl.where(kept, tl.exp(p_norm * tl.log(tl.abs(top))), 0.0)
                norm = tl.exp(tl.log(tl.sum(powered, axis=1)) / p_norm)
            norm = norm.to(prob_dtype).to(tl.float32)  # torch.norm returns the probabilities' dtype
            top = top / norm[:, None]
        out_mask = row_mask[:, None] & kept
        tl.store(w_ptr + r64 * K + slots, top.to(prob_dtype), mask=out_mask)
        tl.store(idx_ptr + r64 * K + slots, expert, mask=out_mask)


def router_blocks(E: int) -> tuple[int, int, int]:
    """Cached: block choice runs on every call, where host time is what small shapes cost."""
    return _router_blocks(E, triton_interpreted())


@functools.lru_cache(maxsize=None)
def _router_blocks(E: int, interpreted: bool) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_E, num_warps): tokens to a program so that a tile holds about 2048 keys on a GPU
    (256 tokens of Mixtral's 8 experts), more under the interpreter (its cost is per program)."""
    block_e = next_power_of_2(E)
    tile = 16384 if interpreted else 2048
    block_t = max(1, tile // block_e)
    return block_t, block_e, 4 if block_t * block_e <= 2048 else 8


def _norm_kind(p: float | None) -> int:
    return 0 if p is None else 1 if p == 1 else 2 if p == 2 else 3


# ------------------------------------------------------------------------------------------- launcher
def router_topk_triton(logits: torch.Tensor, top_k: int, p: float | None, weights: torch.Tensor,
                       indices: torch.Tensor, probs: torch.Tensor | None) -> None:
    """[T, E] logits (unit last stride) -> weights [T, k] (softmax dtype), indices [T, k] int64 and, if
    given, probs [T, E], all contiguous."""
    T, E = logits.shape
    if T == 0:
        return
    block_t, block_e, warps = router_blocks(E)
    _router_topk_kernel[(cdiv(T, block_t),)](
        logits, weights, indices, weights if probs is None else probs, T, E, top_k, logits.stride(0),
        1.0 if p is None else float(p), NORM=_norm_kind(p), STORE_PROBS=probs is not None, BLOCK_T=block_t,
        BLOCK_E=block_e, BLOCK_K=next_power_of_2(top_k), num_warps=warps)


# ------------------------------------------------------------------------------------------ references
def router_topk_reference(logits: torch.Tensor, top_k: int, p: float | None, softmax_dtype: torch.dtype
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, indices, probs) with the HF modules' torch ops; the top-k as a stable descending sort."""
    probs = torch.softmax(logits.to(softmax_dtype), dim=-1)
    indices = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    top = probs.gather(1, indices)
    if p is not None:
        top = top / torch.linalg.vector_norm(top, ord=p, dim=-1, keepdim=True)
    return top, indices, probs


def router_backward(probs: torch.Tensor, indices: torch.Tensor, dweights: torch.Tensor | None,
                    dprobs: torch.Tensor | None, p: float | None) -> torch.Tensor:
    """d(logits), fp32+ (cast by the caller), from the saved probabilities ``probs`` [T, E].

    With kept probabilities v, n = ||v||_p and w = v / n:
    dv = (dw - <dw, w> * dn/dv) / n, dn/dv_j = sign(v_j) |w_j|^(p-1); dv lands on the kept experts of
    dp (plus any gradient of the returned probabilities), then the softmax: dz = p * (dp - <dp, p>).
    """
    acc = torch.promote_types(probs.dtype, torch.float32)
    prob = probs.to(acc)
    dp = torch.zeros_like(prob) if dprobs is None else dprobs.to(acc).clone()
    if dweights is not None:
        dw = dweights.to(acc)
        if p is None:
            dv = dw
        else:
            v = prob.gather(1, indices)
            n = torch.linalg.vector_norm(v, ord=p, dim=-1, keepdim=True)
            w = v / n
            dn_dv = torch.sign(v) if p == 1 else torch.sign(v) * w.abs().pow(p - 1)
            dv = (dw - (dw * w).sum(-1, keepdim=True) * dn_dv) / n
        dp.scatter_add_(1, indices, dv)
    return prob * (dp - (dp * prob).sum(-1, keepdim=True))


# --------------------------------------------------------------------------------------- router op
def _router_topk_impl(logits: torch.Tensor, top_k: int, p: Optional[float], weights: torch.Tensor,
                      indices: torch.Tensor, probs: Optional[torch.Tensor]) -> None:
    if (logits.shape[1] <= MAX_TRITON_EXPERTS and weights.dtype != torch.float64
            and triton_runs(logits, "router_topk")):
        router_topk_triton(logits, top_k, p, weights, indices, probs)
        return
    w_ref, idx_ref, probs_ref = router_topk_reference(logits, top_k, p, weights.dtype)
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
        run_op(_router_topk_op, _router_topk_impl, logits, top_k, p, weights, indices, probs)
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
        dlogits = router_backward(probs, indices, dweights, dprobs, ctx.p)
        return dlogits.to(ctx.logits_dtype), None, None, None, None, None


# ------------------------------------------------------------------------------------ public call
def _norm_order(op: str, normalize) -> float | None:
    if normalize is None:
        return None
    if normalize == "sum":
        return 1.0
    if isinstance(normalize, bool) or not isinstance(normalize, (int, float)) or not (
            math.isfinite(normalize) and normalize > 0):
        fail(op, f"normalize must be 'sum', None or a finite p-norm order > 0 (DBRX's "
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
    check_router_logits(op, logits, top_k)
    if softmax_dtype not in FLOAT_DTYPES:
        fail(op, f"softmax_dtype must be one of {', '.join(map(str, FLOAT_DTYPES))}, got {softmax_dtype!r}")
    p = _norm_order(op, normalize)
    keep_probs = bool(return_probs) or (logits.requires_grad and torch.is_grad_enabled())
    return _RouterTopK.apply(logits, top_k, p, softmax_dtype, bool(return_probs), keep_probs)
