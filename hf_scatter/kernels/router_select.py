"""Routers that choose on something other than the softmax probabilities, in one kernel each way.

``router.py`` covers softmax -> top-k -> renormalise (Mixtral, DBRX, Qwen, OLMoE). The families here choose
differently, and a :class:`Selection` says how:

* GPT-OSS, Granite-MoE: top-k of the logits, then a softmax over the k kept (``score="logits"``,
  ``weights="softmax"``).
* DeepSeek-V3: sigmoid scores; the choice adds ``e_score_correction_bias``, keeps the ``topk_group`` best of
  ``n_group`` expert groups (a group scores the sum of its two best), then the top-k in those groups (the
  rest at -inf); weights are the chosen *uncorrected* scores, renormalised (``+1e-20``) when
  ``norm_topk_prob``, times ``routed_scaling_factor``.
* DeepSeek-V2: softmax scores; ``group_limited_greedy`` keeps the groups with the best single score (the
  rest at 0), weights are the scores times the scaling factor.

Selection is exact, ties included: every candidate gets a distinct 64-bit key
``(ordered score bits << 32) | (2^31 - 1 - index)``, where the ordered bits flip the magnitude of negative
floats so that signed integer order is float order (-0 counts as +0, NaN above everything, as torch.topk
has it); k max reductions then give a stable descending sort's first k: among equal scores the lower
expert (or group) wins, which is the set CUDA's topk returns (see router.py for CPU's). Groups are chosen
the same way. The torch reference (:func:`router_select_reference`) spells every step out with the HF
modules' ops and a stable sort.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from ..common.dtypes import FLOAT_DTYPES
from .backend import cdiv, kernels_enabled, next_power_of_2, triton_runs
from .checks import check_router_logits, check_tensor, fail
from .custom_ops import mutating_op, profiled, run_op
from .router import MAX_TRITON_EXPERTS, router_blocks


class Selection(NamedTuple):
    """How a router scores, chooses and weighs its experts (see the module docstring for each family)."""

    score: str = "logits"  # "logits", "sigmoid" or "softmax" (float32) of the router logits
    weights: str = "softmax"  # "softmax" over the kept scores, the kept "scores", or "renorm": / (sum + 1e-20)
    n_group: int = 1  # expert groups (consecutive experts); 1 = no group limit
    topk_group: int = 1  # groups kept
    group_score: str = "top2"  # a group's rank: "top2" (sum of its two best choice scores) or "max"
    masked: float = float("-inf")  # the choice score of experts outside the kept groups
    scale: float = 1.0  # routed_scaling_factor


SCORES = ("logits", "sigmoid", "softmax")
WEIGHTS = ("softmax", "scores", "renorm")
GROUP_SCORES = ("top2", "max")


def gpt_oss_selection() -> Selection:
    """GPT-OSS and Granite-MoE: top-k of the logits, softmax over the kept."""
    return Selection()


def deepseek_v3_selection(n_group: int, topk_group: int, norm_topk_prob: bool, scale: float) -> Selection:
    return Selection(score="sigmoid", weights="renorm" if norm_topk_prob else "scores", n_group=n_group,
                     topk_group=topk_group, group_score="top2", masked=float("-inf"), scale=float(scale))


def deepseek_v2_selection(n_group: int, topk_group: int, group_limited: bool, scale: float) -> Selection:
    return Selection(score="softmax", weights="scores", n_group=n_group if group_limited else 1,
                     topk_group=topk_group if group_limited else 1, group_score="max", masked=0.0,
                     scale=float(scale))


def deepseek_v2_group_limited(topk_method: str) -> bool:
    """Whether DeepSeek-V2's ``topk_method`` keeps the choice to the best expert groups (``deepseek_v2_selection``'s
    ``group_limited``); a ValueError for a method transformers does not define."""
    if topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 router: topk_method {topk_method!r} is not one transformers defines "
                         "('greedy' or 'group_limited_greedy')")
    return topk_method == "group_limited_greedy"


if kernels_enabled():
    import triton
    import triton.language as tl

    EMPTY = tl.constexpr(-9223372036854775807)  # below every candidate's key (the lowest is -inf's)

    @triton.jit
    def _ordered_key(v, index):
        """Distinct int64 keys ordering like (v descending, index ascending) under a max reduction."""
        v = tl.where(v == 0.0, 0.0, v)  # -0 ties with +0, as in torch
        bits = v.to(tl.int32, bitcast=True)
        bits = tl.where(v != v, 0x7FC00000, bits)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return (bits.to(tl.int64) << 32) | (2147483647 - index).to(tl.int64)

    @triton.jit
    def _key_value(key):
        bits = (key >> 32).to(tl.int32)
        bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
        return bits.to(tl.float32, bitcast=True)

    @triton.jit
    def _row_scores(z_ptr, T, E, stride_t, SCORE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        """This program's block of rows: (scores [BLOCK_T, BLOCK_E] in float32, int64 rows [BLOCK_T, 1], columns
        [1, BLOCK_E], row mask [BLOCK_T], column mask). SCORE 0 the logits, 1 their sigmoid, 2 their softmax over
        the E experts."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.arange(0, BLOCK_E)[None, :]
        row_mask = rows < T
        col_ok = cols < E
        r64 = rows.to(tl.int64)[:, None]
        z = tl.load(z_ptr + r64 * stride_t + cols, mask=row_mask[:, None] & col_ok, other=0.0).to(tl.float32)
        if SCORE == 1:
            s = 1.0 / (1.0 + tl.exp(-z))
        elif SCORE == 2:
            zm = tl.where(col_ok, z, float("-inf"))
            e = tl.exp(zm - tl.max(zm, axis=1)[:, None])
            s = e / tl.sum(e, axis=1)[:, None]
        else:
            s = z
        return s, r64, cols, row_mask, col_ok

    @triton.jit
    def _router_select_kernel(z_ptr, bias_ptr, w_ptr, idx_ptr, T, E, K, group_size, stride_t, masked, scale,
                              SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, WEIGHTS: tl.constexpr,
                              N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_TOP2: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                              BLOCK_G: tl.constexpr):
        # SCORE 0 logits, 1 sigmoid, 2 softmax; WEIGHTS 0 softmax over kept, 1 scores, 2 renormalised scores
        s, r64, cols, row_mask, col_ok = _row_scores(z_ptr, T, E, stride_t, SCORE, BLOCK_T, BLOCK_E)
        c = s
        if HAS_BIAS:
            c = s + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        key = tl.where(col_ok, _ordered_key(c, cols), EMPTY)
        if N_GROUP > 1:
            group = cols // group_size
            gslots = tl.arange(0, BLOCK_G)[None, :]
            gkey = tl.full([BLOCK_T, BLOCK_G], EMPTY, tl.int64)
            for g in tl.static_range(N_GROUP):
                kg = tl.where(group == g, key, EMPTY)
                best = tl.max(kg, axis=1)
                gscore = _key_value(best)
                if GROUP_TOP2:
                    gscore += _key_value(tl.max(tl.where(kg == best[:, None], EMPTY, kg), axis=1))
                gkey = tl.where(gslots == g, _ordered_key(gscore[:, None], gslots), gkey)
            kept_group = tl.zeros([BLOCK_T, BLOCK_G], tl.int32)
            for j in tl.static_range(TOPK_GROUP):
                best = tl.max(gkey, axis=1)[:, None]
                kept_group = tl.where(gkey == best, 1, kept_group)
                gkey = tl.where(gkey == best, EMPTY, gkey)
            allowed = tl.zeros([BLOCK_T, BLOCK_E], tl.int32)
            for g in tl.static_range(N_GROUP):
                on = tl.max(tl.where(gslots == g, kept_group, 0), axis=1)[:, None]
                allowed = tl.where(group == g, on, allowed)
            key = tl.where(col_ok, _ordered_key(tl.where(allowed > 0, c, masked), cols), EMPTY)
        slots = tl.arange(0, BLOCK_K)[None, :]
        kept = slots < K
        chosen = tl.full([BLOCK_T, BLOCK_K], EMPTY, tl.int64)
        w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for j in range(K):
            best = tl.max(key, axis=1)[:, None]
            key = tl.where(key == best, EMPTY, key)
            chosen = tl.where(slots == j, best, chosen)
            if WEIGHTS != 0:  # the chosen expert's score (the choice may have added a bias)
                col = 2147483647 - (best & 2147483647)
                w = tl.where(slots == j, tl.sum(tl.where(cols == col, s, 0.0), axis=1)[:, None], w)
        expert = 2147483647 - (chosen & 2147483647)
        if WEIGHTS == 0:
            top = tl.where(kept, _key_value(chosen), float("-inf"))
            e = tl.where(kept, tl.exp(top - tl.max(top, axis=1)[:, None]), 0.0)
            w = e / tl.sum(e, axis=1)[:, None]
        elif WEIGHTS == 2:
            w = w / (tl.sum(tl.where(kept, w, 0.0), axis=1)[:, None] + 1e-20)
        if WEIGHTS != 0:
            w = w * scale
        out_mask = row_mask[:, None] & kept
        tl.store(w_ptr + r64 * K + slots, w.to(w_ptr.dtype.element_ty), mask=out_mask)
        tl.store(idx_ptr + r64 * K + slots, expert, mask=out_mask)

    @triton.jit
    def _router_select_bwd_kernel(z_ptr, idx_ptr, dw_ptr, dz_ptr, T, E, K, stride_t, scale,
                                  SCORE: tl.constexpr, WEIGHTS: tl.constexpr, BLOCK_T: tl.constexpr,
                                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
        """d(logits) [T, E] through the kept weights, recomputed from the logits (see router_select_backward)."""
        s, r64, cols, row_mask, col_ok = _row_scores(z_ptr, T, E, stride_t, SCORE, BLOCK_T, BLOCK_E)
        slots = tl.arange(0, BLOCK_K)[None, :]
        kept = slots < K
        mask_k = row_mask[:, None] & kept
        idx = tl.load(idx_ptr + r64 * K + slots, mask=mask_k, other=-1)  # [BLOCK_T, BLOCK_K]
        dw = tl.load(dw_ptr + r64 * K + slots, mask=mask_k, other=0.0).to(tl.float32)
        kept_s = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
        for j in range(K):  # the kept experts' scores, slot by slot
            col = tl.sum(tl.where(slots == j, idx, 0), axis=1)[:, None]
            kept_s = tl.where(slots == j, tl.sum(tl.where(cols == col, s, 0.0), axis=1)[:, None], kept_s)
        if WEIGHTS == 0:  # softmax over the kept logits
            top = tl.where(kept, kept_s, float("-inf"))
            e = tl.where(kept, tl.exp(top - tl.max(top, axis=1)[:, None]), 0.0)
            w = e / tl.sum(e, axis=1)[:, None]
            dkept = w * (dw - tl.sum(dw * w, axis=1)[:, None])
        elif WEIGHTS == 2:  # renormalised kept scores
            d = tl.sum(tl.where(kept, kept_s, 0.0), axis=1)[:, None] + 1e-20
            dkept = scale * (dw * d - tl.sum(dw * kept_s, axis=1)[:, None]) / (d * d)
        else:
            dkept = scale * dw
        ds = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for j in range(K):  # a row's k indices are distinct: each slot writes its own column
            col = tl.sum(tl.where(slots == j, idx, 0), axis=1)[:, None]
            ds = tl.where(cols == col, tl.sum(tl.where(slots == j, dkept, 0.0), axis=1)[:, None], ds)
        if SCORE == 1:
            dz = ds * s * (1.0 - s)
        elif SCORE == 2:
            dz = s * (ds - tl.sum(ds * s, axis=1)[:, None])
        else:
            dz = ds
        tl.store(dz_ptr + r64 * E + cols, dz.to(dz_ptr.dtype.element_ty), mask=row_mask[:, None] & col_ok)


# ------------------------------------------------------------------------------------------- launcher
def router_select_triton(logits: torch.Tensor, top_k: int, sel: Selection, bias: torch.Tensor | None,
                         weights: torch.Tensor, indices: torch.Tensor) -> None:
    """[T, E] logits (unit last stride) -> weights [T, k] and int64 indices [T, k], contiguous."""
    T, E = logits.shape
    if T == 0:
        return
    block_t, block_e, warps = router_blocks(E)
    _router_select_kernel[(cdiv(T, block_t),)](
        logits, logits if bias is None else bias, weights, indices, T, E, top_k, E // sel.n_group,
        logits.stride(0), float(sel.masked), float(sel.scale), SCORE=SCORES.index(sel.score),
        HAS_BIAS=bias is not None, WEIGHTS=WEIGHTS.index(sel.weights), N_GROUP=sel.n_group,
        TOPK_GROUP=sel.topk_group, GROUP_TOP2=sel.group_score == "top2", BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(top_k), BLOCK_G=next_power_of_2(sel.n_group), num_warps=warps)


def router_select_backward_triton(logits: torch.Tensor, indices: torch.Tensor, dweights: torch.Tensor,
                                   sel: Selection, dlogits: torch.Tensor) -> None:
    """d(logits) into contiguous ``dlogits`` [T, E] from contiguous ``indices`` and ``dweights`` [T, k]."""
    T, E = logits.shape
    if T == 0:
        return
    block_t, block_e, warps = router_blocks(E)
    k = indices.shape[1]
    _router_select_bwd_kernel[(cdiv(T, block_t),)](
        logits, indices, dweights, dlogits, T, E, k, logits.stride(0), float(sel.scale),
        SCORE=SCORES.index(sel.score), WEIGHTS=WEIGHTS.index(sel.weights), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=next_power_of_2(k), num_warps=warps)


# ------------------------------------------------------------------------------------------ references
def _scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    z = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.sigmoid(z) if score == "sigmoid" else torch.softmax(z, dim=-1) if score == "softmax" else z


def _stable_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """The first k of a stable descending sort (lower index first among equals; -0 equals +0)."""
    return torch.sort(values + 0.0, dim=-1, descending=True, stable=True).indices[..., :k]


def _kept_weights(s: torch.Tensor, indices: torch.Tensor, sel: Selection) -> torch.Tensor:
    w = s.gather(1, indices)
    if sel.weights == "softmax":
        return torch.softmax(w, dim=-1)
    if sel.weights == "renorm":
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * sel.scale


def router_select_reference(logits: torch.Tensor, top_k: int, sel: Selection, bias: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in float32 or wider, indices [T, k]) with the HF routers' torch ops, stable ties."""
    s = _scores(logits, sel.score)
    c = s if bias is None else s + bias.to(s.dtype)
    if sel.n_group > 1:
        T, E = c.shape
        grouped = c.view(T, sel.n_group, E // sel.n_group)
        picks = 2 if sel.group_score == "top2" else 1
        group_scores = grouped.gather(2, _stable_top(grouped, picks)).sum(dim=-1)
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, _stable_top(group_scores, sel.topk_group),
                                                                         True)
        c = c.masked_fill(~kept.repeat_interleave(E // sel.n_group, dim=1), sel.masked)
    indices = _stable_top(c, top_k)
    return _kept_weights(s, indices, sel), indices


def router_select_backward(logits: torch.Tensor, indices: torch.Tensor, dweights: torch.Tensor,
                           sel: Selection) -> torch.Tensor:
    """d(logits) through the kept weights (the choice itself has no gradient), recomputed from the logits.

    Softmax over the kept logits w: dz = w * (dw - <dw, w>) on the kept. Otherwise the kept scores s_j
    give w_j = scale * s_j (/ D, D = sum s + 1e-20 when renormalised): ds_i = scale * (dw_i D - <dw, s>) / D^2,
    then through the score: sigmoid s(1 - s), softmax s * (ds - <ds, s>)."""
    acc = torch.promote_types(logits.dtype, torch.float32)
    z, dw = logits.to(acc), dweights.to(acc)
    if sel.weights == "softmax":
        w = torch.softmax(z.gather(1, indices), dim=-1)
        return torch.zeros_like(z).scatter_(1, indices, w * (dw - (dw * w).sum(-1, keepdim=True)))
    s = _scores(z, sel.score)
    kept = s.gather(1, indices)
    if sel.weights == "renorm":
        d = kept.sum(-1, keepdim=True) + 1e-20
        dkept = sel.scale * (dw * d - (dw * kept).sum(-1, keepdim=True)) / (d * d)
    else:
        dkept = sel.scale * dw
    ds = torch.zeros_like(s).scatter_(1, indices, dkept)  # the k indices of a row are distinct
    if sel.score == "sigmoid":
        return ds * s * (1 - s)
    if sel.score == "softmax":
        return s * (ds - (ds * s).sum(-1, keepdim=True))
    return ds


# --------------------------------------------------------------------------------------- router op
def _router_select_impl(logits: torch.Tensor, top_k: int, score: str, weights_kind: str, n_group: int,
                        topk_group: int, group_score: str, masked: float, scale: float,
                        bias: Optional[torch.Tensor], weights: torch.Tensor, indices: torch.Tensor) -> None:
    sel = Selection(score, weights_kind, n_group, topk_group, group_score, masked, scale)
    if (logits.shape[1] <= MAX_TRITON_EXPERTS and weights.dtype != torch.float64
            and triton_runs(logits, "router_select")):
        router_select_triton(logits, top_k, sel, bias, weights, indices)
        return
    w_ref, idx_ref = router_select_reference(logits, top_k, sel, bias)
    weights.copy_(w_ref)
    indices.copy_(idx_ref)


_router_select_op = mutating_op("router_select", "weights", "indices")(_router_select_impl)


def _router_select_bwd_impl(logits: torch.Tensor, indices: torch.Tensor, dweights: torch.Tensor, score: str,
                            weights_kind: str, scale: float, dlogits: torch.Tensor) -> None:
    sel = Selection(score, weights_kind, scale=scale)
    if (logits.shape[1] <= MAX_TRITON_EXPERTS and logits.dtype != torch.float64 and dweights.dtype != torch.float64
            and triton_runs(logits, "router_select")):
        router_select_backward_triton(logits, indices, dweights, sel, dlogits)
        return
    dlogits.copy_(router_select_backward(logits, indices, dweights, sel))


_router_select_bwd_op = mutating_op("router_select_bwd", "dlogits")(_router_select_bwd_impl)


class _RouterSelect(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::router_select.forward")
    def forward(ctx, logits, bias, top_k, sel, out_dtype):
        T = logits.shape[0]
        weights = logits.new_empty((T, top_k), dtype=out_dtype)
        indices = logits.new_empty((T, top_k), dtype=torch.int64)
        run_op(_router_select_op, _router_select_impl, logits, top_k, *sel, bias, weights, indices)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(logits, indices)
        ctx.sel = sel
        ctx.set_materialize_grads(False)
        return weights, indices

    @staticmethod
    @profiled("hf_scatter::router_select.backward")
    @once_differentiable
    def backward(ctx, dweights, dindices):
        logits, indices = ctx.saved_tensors
        if dweights is None:
            return None, None, None, None, None
        sel = ctx.sel
        dlogits = logits.new_empty(logits.shape)
        run_op(_router_select_bwd_op, _router_select_bwd_impl, logits, indices, dweights.contiguous(), sel.score,
               sel.weights, float(sel.scale), dlogits)
        return dlogits, None, None, None, None


# ------------------------------------------------------------------------------------ public call
def _check_selection(op: str, sel: Selection, E: int, top_k: int) -> None:
    if not isinstance(sel, Selection):
        fail(op, f"selection must be a Selection, got {type(sel).__name__}")
    for name, value, allowed in (("score", sel.score, SCORES), ("weights", sel.weights, WEIGHTS),
                                 ("group_score", sel.group_score, GROUP_SCORES)):
        if value not in allowed:
            fail(op, f"selection.{name} must be one of {', '.join(allowed)}, got {value!r}")
    if sel.weights == "softmax" and sel.score != "logits":
        fail(op, "weights='softmax' (over the kept) is for score='logits' (GPT-OSS, Granite-MoE)")
    g = sel.n_group
    if isinstance(g, bool) or not isinstance(g, int) or g < 1 or E % g:
        fail(op, f"n_group must be a positive int dividing the {E} experts, got {g!r}")
    if not 1 <= sel.topk_group <= g:
        fail(op, f"topk_group must be in [1, n_group={g}], got {sel.topk_group!r}")
    if g > 1 and sel.group_score == "top2" and E // g < 2:
        fail(op, f"group_score='top2' needs at least 2 experts per group; {E} experts in {g} groups have {E // g}")


def router_select(logits: torch.Tensor, top_k: int, selection: Selection, bias: torch.Tensor | None = None,
                  out_dtype: torch.dtype | None = None):
    """Route tokens as ``selection`` says, in one kernel; differentiable in the weights w.r.t. the logits.

    ``logits`` [T, E]; ``bias`` [E] is added to the scores for the choice only (DeepSeek-V3's
    ``e_score_correction_bias``). Returns ``(weights [T, k] in out_dtype (default: the logits' dtype),
    indices [T, k] int64)``.
    """
    op = "router_select"
    E = check_router_logits(op, logits, top_k)
    _check_selection(op, selection, E, top_k)
    if bias is not None:
        check_tensor(op, "bias", bias)
        if bias.shape != (E,) or bias.device != logits.device:
            fail(op, f"bias must be [{E}] on {logits.device}, got {tuple(bias.shape)} on {bias.device}")
        bias = bias.contiguous()
    out_dtype = out_dtype or logits.dtype
    if out_dtype not in FLOAT_DTYPES:
        fail(op, f"out_dtype must be one of {', '.join(map(str, FLOAT_DTYPES))}, got {out_dtype!r}")
    sel = selection._replace(n_group=int(selection.n_group), topk_group=int(selection.topk_group),
                             masked=float(selection.masked), scale=float(selection.scale))
    return _RouterSelect.apply(logits, bias, top_k, sel, out_dtype)
