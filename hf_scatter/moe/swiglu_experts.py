"""The SwiGLU SMoE MLP as one autograd function, its backward ordered for peak memory.

As a chain of autograd nodes (two ParallelLinear, one SwiGLU) the output projection's dW is allocated
while the [T*k, 2I] gradient of the first projection's output is still to come, and saved activations
live until the whole chain is done. Here one backward runs: output projection's input gradient, then one
pass for the gate gradients and the SwiGLU backward into its own input buffer (``swiglu_grad_gemm``), dX,
the first projection's dW, and only then
the output projection's dW, each buffer freed as soon as it is dead. On the fine-grained shape (d 4096,
I 1024, E 64, k 8) that lowers the layer's backward peak from 2.25 to about 2.0 GiB.

The forward runs the SwiGLU in the first projection's epilogue (``scatter2scatter_swiglu``). Only the
[T*k, 2I] pre-activation is kept between forward and backward; the [T*k, I] SwiGLU output is recomputed
from it in the pass that runs the SwiGLU backward, which reads the pre-activation anyway. A model's
activations then hold one I-wide buffer less per MoE layer, which is what every layer keeps alive until the
backward reaches it: 0.75 GiB of a 16-layer Qwen3-MoE-style step at 8k tokens.

At training-sized batches on Hopper/Blackwell the output projection and the input gradient, whose inputs are
grouped rows, run as the library grouped GEMM (``kernels/library_gemm.py``): their [T*k, d] results then come
in expert order, and the per-token mix reads them through the slot positions (``routing.slot_positions``).
"""

from __future__ import annotations

import torch

from ..kernels.custom_ops import profiled
from ..kernels.gating import gate_mix_unchecked
from ..kernels.group import group_unchecked
from ..kernels.library_gemm import grouped_mm_applies, grouped_mm_rows, grouped_mm_rows_apply
from ..kernels.scatter2scatter import scatter2scatter_swiglu, scatter2scatter_unchecked
from ..kernels.swiglu import SILU, GateForm
from ..kernels.swiglu_grad_gemm import swiglu_grad_gemm_unchecked
from ..kernels.weight_formats import is_quantized
from ..common.dtypes import autocast_operands
from .parallel_linear import (dw_operand, expert_weight_grad, grouped_copy_pays, saved_weight, weight_to_save,
                              with_bias_term)
from .routing import skips_routes, slot_experts, slot_positions


def _release(t: torch.Tensor) -> None:
    """Hand a dead intermediate's memory back to the allocator now, although autograd still holds the saved
    tensor until this backward returns (its storage shrinks to nothing; nothing reads it again)."""
    t.untyped_storage().resize_(0)


def _per_token(rows, weight, routing, k, gates=None, bias=None):
    """``sum_j gates[t, j] * (rows[s] @ W[e] + b[e])`` over token t's slots s = t*k + j (a plain sum without
    gates), for ``rows`` [T*k, K] in expert order: the output projection (forward) and the input gradient
    (backward). Where it pays, the product runs on the library and comes in expert order, mixed through the
    slot positions (the bias added after the mix, :func:`_add_routed_bias`); our kernel writes it in slot
    order, the bias in its epilogue."""
    if grouped_mm_rows_apply(weight, rows) and not skips_routes(routing[2], weight):
        grouped = grouped_mm_rows(rows, weight, routing[2])  # [T*k, N] in expert order
        mixed = gate_mix_unchecked(grouped, gates, slot_rows=slot_positions(routing[1]), k=k)  # [T, N]
        return mixed if bias is None else _add_routed_bias(mixed, bias, gates, routing, k)
    slots = scatter2scatter_unchecked(rows, weight, *routing, 1, x_grouped=True, bias=bias)  # [T*k, N]
    if gates is not None:
        return gate_mix_unchecked(slots, gates)
    return slots.view(-1, k, slots.shape[1]).sum(1) if k > 1 else slots


def _add_routed_bias(mixed, bias, gates, routing, k):
    """``mixed[t] += sum_j gates[t, j] * bias[e(t, j)]`` as one [T, E] x [E, N] product: the per-token weights of
    each expert's bias (at most k nonzeros a row), a few GFLOP against a pass over the [T*k, N] slots."""
    experts = slot_experts(*routing[:2]).view(-1, k).long()  # [T, k]
    weights = gates.to(mixed.dtype) if gates is not None else mixed.new_ones(experts.shape)  # [T, k]
    per_expert = mixed.new_zeros((mixed.shape[0], bias.shape[0])).scatter_add_(1, experts, weights)  # [T, E]
    return mixed.addmm_(per_expert, bias.to(mixed.dtype))  # [T, N]


def _forward(x, w_in, w_out, gates, b_in, b_out, form, k, routing, keep_pre_activation=True):
    """The layer's output and the [T*k, 2I] pre-activation its backward starts from (None in inference: the
    first projection's kernel then writes only the SwiGLU output)."""
    gate_up, h = scatter2scatter_swiglu(x, w_in, *routing, k, form, b_in, keep_pre_activation)  # checks
    return _per_token(h, w_out, routing, k, gates, b_out), gate_up


@profiled("hf_scatter::swiglu_experts.forward")
def _inference(x, w_in, w_out, gates, b_in, b_out, form, k, routing):
    """Nothing to differentiate (generation): no autograd node, whose host time a decode step cannot spare."""
    return _forward(x, w_in, w_out, gates, b_in, b_out, form, k, routing, keep_pre_activation=False)[0]


class _SwiGLUExperts(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::swiglu_experts.forward")
    def forward(ctx, x, w_in, w_out, gates, b_in, b_out, form, k, sorted_expert_idxs, sorted_scattered_idxs,
                expert_offsets):
        routing = (sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
        y, gate_up = _forward(x, w_in, w_out, gates, b_in, b_out, form, k, routing)
        ctx.k, ctx.form = k, form
        ctx.consumed = False
        ctx.quantized = tuple(w if is_quantized(w) else None for w in (w_in, w_out))
        (w_in_kept, ctx.w_in_view), (w_out_kept, ctx.w_out_view) = (
            (None, None) if is_quantized(w) else weight_to_save(w) for w in (w_in, w_out))
        ctx.save_for_backward(x, w_in_kept, w_out_kept, gates, b_in, b_out, gate_up, *routing)  # h: recomputed
        return y

    @staticmethod
    @profiled("hf_scatter::swiglu_experts.backward")
    def backward(ctx, dy):
        if ctx.consumed:
            raise RuntimeError("hf_scatter: backward through the SwiGLU experts ran twice; the first one consumed "
                               "their activations (run the forward again rather than retain_graph=True)")
        ctx.consumed = True
        x, w_in, w_out, gates, b_in, b_out, gate_up, sorted_expert_idxs, idx, expert_offsets = ctx.saved_tensors
        w_in, w_out = saved_weight(w_in, ctx.w_in_view), saved_weight(w_out, ctx.w_out_view)
        # frozen quantized experts (a quantized checkpoint under LoRA): their values for the input gradient, one
        # layer's worth at a time, freed when this backward returns
        w_in, w_out = (q.dequantize(x.dtype) if q is not None else w for q, w in zip(ctx.quantized, (w_in, w_out)))
        routing = (sorted_expert_idxs, idx, expert_offsets)
        k, form = ctx.k, ctx.form
        need_x, need_w_in, need_w_out, need_g, need_b_in, need_b_out = ctx.needs_input_grad[:6]
        d, inter = x.shape[1], gate_up.shape[1] // 2
        dy = dy.contiguous()
        coeff = gates.reshape(-1).index_select(0, idx).to(torch.float32)

        # Output projection, then one pass: ungated dH'[s] = dY[t] W_e^T; h recomputed from the pre-activation,
        # the gate gradients h . dH' (+ dY . b_e with a bias), dH = g dH' and d(gate_up) written over gate_up.
        # When dW_out will read dY in place, h takes the gate instead (h is ours and dead after dW_out); the
        # output bias's gradient needs the gate on dY's rows, so with it dY is copied.
        # The library grouped GEMM for a dW reads grouped operands only (both copies are then made).
        skips = skips_routes(expert_offsets, w_in)
        library_in = need_w_in and not skips and grouped_mm_applies(w_in, x, gate_up)
        library_out = need_w_out and not skips and grouped_mm_applies(w_out, gate_up, dy)
        gather_dy = not grouped_copy_pays(d, inter) and not need_b_out and not library_out
        h = gate_up.new_empty((gate_up.shape[0], inter)) if need_w_out or need_b_out else None
        dots = swiglu_grad_gemm_unchecked(dy, w_out.transpose(1, 2), routing, k, gate_up, coeff, form, h_out=h,
                                          scale_h=need_w_out and gather_dy)
        d_gates = with_bias_term(torch.empty_like(dots).index_copy_(0, idx, dots).view(gates.shape), dy, b_out,
                                 routing).to(gates.dtype) if need_g else None
        del dots
        d_gate_up = gate_up
        d_x = None
        if need_x:
            d_x = _per_token(d_gate_up, w_in.transpose(1, 2), routing, k)  # [T, d]
        d_w_in = d_b_in = None
        if need_w_in or need_b_in:
            x_op, x_fan = dw_operand(x, k, d_gate_up.shape[1], idx, library_in)
            d_w_in, d_b_in = expert_weight_grad(x_op, x_fan, d_gate_up, 0, w_in, need_b_in, expert_offsets, idx,
                                                library_in)
            del x_op
        _release(gate_up)
        del d_gate_up, gate_up
        d_w_out = d_b_out = None
        if need_w_out or need_b_out:
            if gather_dy:
                dy_op, dy_fan = dy, k  # h already carries the gates
            else:
                dy_op, dy_fan = group_unchecked(dy, idx, k, coeff=coeff), 0
            d_w_out, d_b_out = expert_weight_grad(h, 0, dy_op, dy_fan, w_out, need_b_out, expert_offsets, idx,
                                                  library_out)
        if h is not None:
            _release(h)
        return (d_x, d_w_in if need_w_in else None, d_w_out if need_w_out else None, d_gates,
                d_b_in if need_b_in else None, d_b_out if need_b_out else None, None, None, None, None, None)


def swiglu_experts(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, gates: torch.Tensor,
                   routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor], b_in: torch.Tensor | None = None,
                   b_out: torch.Tensor | None = None, form: GateForm = SILU) -> torch.Tensor:
    """``sum_j gates[t,j] * (w_out[e] act(x_t w_in[e] + b_in[e]) + b_out[e])`` over the routed slots, with
    ``act`` the gate ``form`` over the [gate, up] columns (SiLU: ``silu(g) * u``).

    ``w_in`` [E, d, 2I] and ``w_out`` [E, I, d] in kernel layout (transposed views welcome; or
    a quantized ``Mxfp4Weight`` / ``Fp8BlockWeight``, frozen: their gradients are not computed), biases [E, 2I] /
    [E, d] or None; ``routing`` from :func:`flatten_sort_count`. Same result and gradients as the
    ParallelLinear chain, at a lower backward peak.
    """
    k = gates.shape[1]
    x, w_in, b_in = autocast_operands(x, w_in, b_in)
    _, w_out, b_out = autocast_operands(x, w_out, b_out)
    if not torch.is_grad_enabled() or not any(getattr(t, "requires_grad", False)
                                              for t in (x, w_in, w_out, gates, b_in, b_out)):
        return _inference(x, w_in, w_out, gates, b_in, b_out, form, k, routing)
    return _SwiGLUExperts.apply(x, w_in, w_out, gates, b_in, b_out, form, k, *routing)
