"""ParallelLinear: the differentiable expert-parallel linear layer of ScatterMoE (paper Algorithms 1-2).

Forward is one ``scatter2scatter``; with ``gates`` [S, j] (S*j = T*k slots) each group of j consecutive slot
outputs is mixed into one row by ``gate_mix``, and they are not kept: the gate gradient is ``x . (dY W^T)``,
a row dot against the input gradient that backward computes anyway. The gate width j is independent of
the input fan-out k (Algorithm 1): Mixture-of-Attention's output projection reads one row per slot (k=1)
and mixes each token's k_moa slots (j = k_moa). For dW a scattered operand is either copied into expert order
or read in place by ``groupXTY`` (:func:`dw_operand` says which; the library grouped GEMM of
:func:`expert_weight_grad` reads grouped rows only), and dX is produced before dW is allocated, so the
largest backward buffers are never live together.
"""

from __future__ import annotations

import torch

# Inputs are validated once, by the forward's checked scatter2scatter; every other call skips the checks.
from ..common.dtypes import autocast_operands
from ..kernels.custom_ops import profiled
from ..kernels.gating import gate_grad_unchecked, gate_mix_unchecked
from ..kernels.group import group_unchecked
from ..kernels.groupxty import group_sum_unchecked, groupxty_unchecked
from ..kernels.library_gemm import grouped_mm_applies, grouped_mm_weight_grad
from ..kernels.scatter2scatter import scatter2scatter, scatter2scatter_unchecked
from .routing import skips_routes, slot_experts


def weight_to_save(weight: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
    """``(tensor, view)`` to save for backward in place of an expert weight: a view of a contiguous parameter
    (the Hugging Face layout read as [E, d_in, d_out] by a transpose, DBRX's 2-D tensors read as 3-D) is saved
    as the parameter itself, with the view's shape, strides and offset to rebuild it in backward.

    An engine that frees a gathered parameter by giving it new, empty data (DeepSpeed ZeRO-3) frees nothing
    that a saved view still holds: the view would keep every layer's whole gathered weight until backward (on
    4 Mixtral-8x7B layers, 11 GiB more per GPU). The parameter sees its data freed after forward and gathered
    again (contiguous, the same shape) before backward. FSDP2 frees the storage itself, which a view shares,
    so either way works there. Under ``torch.compile`` (which traces no view bases) the tensor is saved as it
    is."""
    if torch.compiler.is_compiling():
        return weight, None
    base = weight._base
    # a whole-tensor view only: saving the base of a slice would keep (or offload) more than the weight
    if base is None or base.dtype != weight.dtype or not base.is_contiguous() or base.numel() != weight.numel():
        return weight, None
    return base, (tuple(base.shape), tuple(weight.shape), tuple(weight.stride()),
                  weight.storage_offset() - base.storage_offset())


def saved_weight(saved: torch.Tensor, view: tuple | None) -> torch.Tensor:
    """The expert weight :func:`weight_to_save` stood in for, read from the tensor's data as it is now (gathered
    again, by an engine that freed it, into a contiguous tensor of the same shape)."""
    if view is None:
        return saved
    base_shape, shape, stride, offset = view
    if tuple(saved.shape) != base_shape or not saved.is_contiguous():
        raise RuntimeError(f"hf_scatter: an expert weight saved for backward as its parameter {base_shape} came "
                           f"back as {tuple(saved.shape)} (contiguous: {saved.is_contiguous()}); the engine "
                           f"that freed it gathered it into another layout")
    return saved.as_strided(shape, stride, saved.storage_offset() + offset)


def grouped_copy_pays(width: int, other_width: int) -> bool:
    """Whether a scattered dW operand is copied into expert order rather than gathered inside groupXTY.

    Gathering rows in groupXTY's reduction loop ran 15-30% slower than a grouped copy plus the plain kernel
    (H100, bf16: 19.5 vs 14.9 + 1.4 ms on the paper unit's first projection), but the copy is [T*k, width].
    It is made when it is no wider than the other operand, whose grouped rows exist anyway, so it at most
    doubles the operands' memory; a fine-grained MoE's [T*k, d] copy of its input (d 4096 against 2I
    2048, k 8) is skipped.
    """
    return width <= other_width


def dw_operand(t: torch.Tensor, fan_out: int, other_width: int, sorted_scattered_idxs: torch.Tensor,
               library: bool = False):
    """``(tensor, fan_out)`` as the weight gradient reads it: a grouped operand (fan_out 0) as is, a scattered
    one copied into expert order or left in place for groupXTY to gather. The library grouped GEMM
    (``library``) reads grouped rows only: there the copy is always made."""
    if fan_out and (library or grouped_copy_pays(t.shape[1], other_width)):
        return group_unchecked(t, sorted_scattered_idxs, fan_out), 0
    return t, fan_out


def expert_weight_grad(x_op: torch.Tensor, x_fan: int, dy_op: torch.Tensor, dy_fan: int, weight: torch.Tensor,
                       need_b: bool, expert_offsets: torch.Tensor, sorted_scattered_idxs: torch.Tensor,
                       library: bool):
    """``(dW, db)`` of one expert projection, dW laid out like ``weight``: the library grouped GEMM when the
    caller chose it (:func:`~hf_scatter.kernels.library_gemm.grouped_mm_applies`; its operands were made grouped
    by :func:`dw_operand`) with db summed over dY's grouped rows apart, groupXTY (db in the same loop) otherwise."""
    if library:
        d_bias = group_sum_unchecked(dy_op, expert_offsets, weight.shape[0]) if need_b else None
        return grouped_mm_weight_grad(x_op, dy_op, expert_offsets, weight), d_bias
    # empty_like keeps a dense weight's strides: the gradient of a transposed view needs no copy.
    return groupxty_unchecked(x_op, dy_op, expert_offsets, torch.empty_like(weight), bool(need_b),
                              sorted_scattered_idxs, x_fan, dy_fan)


class _ParallelLinear(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::parallel_linear.forward")
    def forward(ctx, x, weight, bias, gates, k, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
                grouped_in, grouped_out):
        fan_out = 1 if grouped_in else k
        y = scatter2scatter(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                            x_grouped=grouped_in, y_grouped=grouped_out, bias=bias)
        if gates is not None:
            y = gate_mix_unchecked(y, gates)
        ctx.k, ctx.grouped_in, ctx.grouped_out = k, grouped_in, grouped_out
        kept, ctx.weight_view = weight_to_save(weight)
        ctx.save_for_backward(x, kept, bias, gates, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
        return y

    @staticmethod
    @profiled("hf_scatter::parallel_linear.backward")
    def backward(ctx, dy):
        x, kept, bias, gates, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets = ctx.saved_tensors
        weight = saved_weight(kept, ctx.weight_view)
        k, grouped_in, grouped_out = ctx.k, ctx.grouped_in, ctx.grouped_out
        need_x, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        routing = (sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
        idx = sorted_scattered_idxs
        d_in, d_out = weight.shape[1], weight.shape[2]
        w_t = weight.transpose(1, 2)
        dy = dy.contiguous()
        x_fan_out = 0 if grouped_in else k  # slot s reads x[s // k]
        j = gates.shape[1] if gates is not None else 1  # gated: slot s sees dY[s // j]
        d_x = d_gates = dw_x = coeff = None
        library = need_w and grouped_mm_applies(weight, x, dy) and \
            not skips_routes(expert_offsets, weight)  # the dW operands are then grouped
        if gates is None:
            if need_x:
                # dY is grouped already, or in slot order (then sorted row i reads dY[idx[i]]).
                d_slots = scatter2scatter_unchecked(dy, w_t, *routing, 1, x_grouped=grouped_out, y_grouped=grouped_in)
                d_x = d_slots if grouped_in or k == 1 else d_slots.view(-1, k, d_in).sum(1)
                del d_slots
        else:
            # Every slot s sees dY[s // j], scaled by its gate (coeff, in expert order).
            coeff = gates.reshape(-1).index_select(0, idx).to(torch.float32)
            # With X grouped and dY read in place, dW takes the gate on X's rows, written by gate_grad's pass
            # (db needs the gate on dY's rows: with a bias, dY is copied).
            if need_w and not need_b and grouped_in and not grouped_copy_pays(d_out, d_in) and not library:
                dw_x = x.new_empty(x.shape)
            if need_x or need_g or dw_x is not None:
                # Ungated input gradient per slot, dX'[s] = dY[s // j] W_e^T: grouped (sorted) rows or slot order.
                dxp = scatter2scatter_unchecked(dy, w_t, *routing, j, x_grouped=False, y_grouped=grouped_in)
                if grouped_in:
                    dots = gate_grad_unchecked(dxp, x, 1, coeff, x_scaled_out=dw_x)  # dX' scaled into dX in place
                    d_gates = torch.empty_like(dots).index_copy_(0, idx, dots)
                    d_x = dxp
                elif k == 1 and need_x:  # one slot per input row: dX is dX' scaled by the gates, in the same pass
                    d_gates = gate_grad_unchecked(dxp, x, 1, gates.reshape(-1).contiguous())
                    d_x = dxp
                else:
                    d_gates = gate_grad_unchecked(dxp, x, k)
                    # dX[t] sums token t's k slots, each scaled by its gate: gate_mix over the gates as [T, k].
                    d_x = gate_mix_unchecked(dxp, gates if j == k else gates.reshape(-1, k)) if need_x else None
                del dxp
                d_gates = with_bias_term(d_gates.view(gates.shape), dy, bias, routing).to(gates.dtype) \
                    if need_g else None
        d_weight = d_bias = None
        if need_w or need_b:
            # After dX, so dX's slot-order buffer is freed before dW and any grouped copy are allocated.
            if dw_x is not None:  # gate on X's rows, dY read in place
                x_op, x_fan, dy_op, dy_fan = dw_x, 0, dy, j
            else:
                x_op, x_fan = dw_operand(x, x_fan_out, d_out, idx, library)
                if gates is None:
                    dy_op, dy_fan = dw_operand(dy, 0 if grouped_out else 1, d_in, idx, library)
                else:  # the gate-scaled grouped copy of dY
                    dy_op, dy_fan = group_unchecked(dy, idx, j, coeff=coeff), 0
            d_weight, d_bias = expert_weight_grad(x_op, x_fan, dy_op, dy_fan, weight, need_b, expert_offsets, idx,
                                                  library)
        return (d_x if need_x else None), (d_weight if need_w else None), d_bias, d_gates, \
            None, None, None, None, None, None


def with_bias_term(d_gates: torch.Tensor, dy: torch.Tensor, bias: torch.Tensor | None, routing) -> torch.Tensor:
    """With a bias, slot output is ``x W_e + b_e``: its gate gradient gains ``dY[s // j] . b_e`` (d_gates [S, j])."""
    if bias is None:
        return d_gates
    expert_of_slot = slot_experts(*routing[:2])
    per_expert = dy.to(d_gates.dtype) @ bias.to(d_gates.dtype).t()  # [S, E]
    # a skipped route (id E, :func:`~hf_scatter.moe.routing.skips_routes`) has no output, so no bias term
    expert_of_slot = expert_of_slot.view(d_gates.shape).long()
    skipped = expert_of_slot >= bias.shape[0]
    term = per_expert.gather(1, expert_of_slot.clamp(max=bias.shape[0] - 1)).masked_fill(skipped, 0.0)
    return d_gates + term


def parallel_linear(x: torch.Tensor, weight: torch.Tensor, k: int, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor,
                    bias: torch.Tensor | None = None, gates: torch.Tensor | None = None,
                    grouped_in: bool = False, grouped_out: bool = False) -> torch.Tensor:
    """Expert-parallel linear layer over the M = T*k routed slots (ScatterMoE Algorithm 1).

    - ``weight`` [E, d_in, d_out] (any strides: ``hf_weight.transpose(1, 2)`` needs no copy), ``bias`` [E, d_out].
    - Input: ``grouped_in`` means ``x`` is [M, d_in] in expert order; otherwise slot ``s`` reads row ``s // k``.
    - Output: with ``gates`` [S, j], S*j = M, [S, d_out] with row s = sum_i gates[s, i] * y[s*j + i], where
      y is the [M, d_out] slot-order output; j need not be k (the SMoE MLP passes [T, k]; an input with
      one row per slot, k=1, passes [T, k_moa] to mix each token's slots). Otherwise [M, d_out] in slot
      order, or expert order with ``grouped_out``.
    Differentiable in x, weight, bias and gates.
    """
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"parallel_linear: k must be a positive int, got {k!r}")
    M = sorted_scattered_idxs.numel()
    if M % k:
        raise ValueError(f"parallel_linear: {M} routed slots is not a multiple of k={k}")
    if gates is not None:
        if grouped_out:
            raise ValueError("parallel_linear: gates mix groups of consecutive slot outputs, which needs scattered "
                             "output; pass grouped_out=False")
        if not isinstance(gates, torch.Tensor) or gates.dim() != 2 or gates.numel() != M or gates.shape[1] < 1:
            got = tuple(gates.shape) if isinstance(gates, torch.Tensor) else type(gates).__name__
            raise ValueError(f"parallel_linear: gates must be [S, j] with S*j = {M} routed slots (row s mixes slots "
                             f"s*j .. s*j+j-1), e.g. [T, k] = {(M // k, k)}; got {got}")
        if not gates.is_floating_point():
            raise ValueError(f"parallel_linear: gates must be a floating-point tensor, got {gates.dtype}")
        if gates.device != x.device:
            raise ValueError(f"parallel_linear: gates are on {gates.device} but x is on {x.device}")
    x, weight, bias = autocast_operands(x, weight, bias)
    return _ParallelLinear.apply(x, weight, bias, gates, k, sorted_expert_idxs, sorted_scattered_idxs,
                                 expert_offsets, grouped_in, grouped_out)
