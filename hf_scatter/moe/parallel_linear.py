"""ParallelLinear: the differentiable expert-parallel linear layer of ScatterMoE (paper Algorithms 1-2).

Forward is one ``scatter2scatter``; with ``gates`` the k expert outputs of a token are mixed by a batched
matmul. Backward groups dY (gate-scaled, into the buffer of the forward output) and, unless already
grouped, X; then ``groupXTY`` gives dW/db and one more ``scatter2scatter`` with W^T gives dX, written into
the grouped-X buffer. No grouped copy of X is kept between forward and backward.
"""

from __future__ import annotations

import torch

from ..kernels.ops import group, groupXTY, scatter2scatter


class _ParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gates, k, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets,
                grouped_in, grouped_out):
        fan_out = 1 if grouped_in else k
        y_hat = scatter2scatter(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                x_grouped=grouped_in, y_grouped=grouped_out, bias=bias)
        if gates is None:
            y = y_hat
        else:
            T = gates.shape[0]
            y = torch.bmm(gates.to(y_hat.dtype).unsqueeze(1), y_hat.view(T, k, -1)).squeeze(1)
        ctx.k, ctx.grouped_in, ctx.grouped_out = k, grouped_in, grouped_out
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, gates, y_hat if gates is not None else None,
                              sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, gates, y_hat, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets = ctx.saved_tensors
        k, grouped_in, grouped_out = ctx.k, ctx.grouped_in, ctx.grouped_out
        need_x, need_w, need_b, need_g = ctx.needs_input_grad[:4]
        dy = dy.contiguous()
        d_gates = None
        if gates is not None:
            T = gates.shape[0]
            if need_g:
                d_gates = torch.bmm(y_hat.view(T, k, -1), dy.unsqueeze(2)).squeeze(2).to(gates.dtype)
            coeff = gates.reshape(-1).index_select(0, sorted_scattered_idxs).to(torch.float32)
            # y_hat is dead once d_gates is taken: the gate-scaled, grouped dY goes into its buffer.
            dy_grouped = group(dy, sorted_scattered_idxs, fan_out=k, coeff=coeff, out=y_hat)
        elif grouped_out:
            dy_grouped = dy
        else:
            dy_grouped = group(dy, sorted_scattered_idxs, fan_out=1)

        x_grouped = x if grouped_in else group(x, sorted_scattered_idxs, fan_out=k)
        d_weight = d_bias = None
        if need_w or need_b:
            # empty_like keeps a dense weight's strides: the gradient of a transposed view needs no copy.
            d_weight, d_bias = groupXTY(x_grouped, dy_grouped, expert_offsets, dw=torch.empty_like(weight),
                                        db=bool(need_b))
        d_x = None
        if need_x:
            # dX rows come out grouped (grouped_in) or in slot order, reusing grouped X's buffer if it is ours.
            out = None if grouped_in else x_grouped
            d_slots = scatter2scatter(dy_grouped, weight.transpose(1, 2), sorted_expert_idxs, sorted_scattered_idxs,
                                      expert_offsets, 1, x_grouped=True, y_grouped=grouped_in, out=out)
            if grouped_in or k == 1:
                d_x = d_slots
            else:
                d_x = d_slots.view(-1, k, d_slots.shape[1]).sum(1)
        return d_x, (d_weight if need_w else None), d_bias, d_gates, None, None, None, None, None, None


def _autocast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """Inside ``torch.autocast`` the layer computes in the autocast dtype, as ``F.linear`` would (custom ops
    are not autocast by torch itself); gradients flow back to the full-precision tensors."""
    device_type = x.device.type
    if not torch.is_autocast_enabled(device_type):
        return x, weight, bias
    dtype = torch.get_autocast_dtype(device_type)
    return x.to(dtype), weight.to(dtype), (bias.to(dtype) if bias is not None else None)


def parallel_linear(x: torch.Tensor, weight: torch.Tensor, k: int, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor,
                    bias: torch.Tensor | None = None, gates: torch.Tensor | None = None,
                    grouped_in: bool = False, grouped_out: bool = False) -> torch.Tensor:
    """Expert-parallel linear layer over the T*k routed slots.

    - ``weight`` [E, d_in, d_out] (any strides: ``hf_weight.transpose(1, 2)`` needs no copy), ``bias`` [E, d_out].
    - Input: ``grouped_in`` means ``x`` is [T*k, d_in] in expert order; otherwise slot ``s`` reads row ``s // k``.
    - Output: with ``gates`` [T, k], [T, d_out] = sum_j gates[t, j] * y[t*k + j]; otherwise [T*k, d_out] in slot
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
            raise ValueError("parallel_linear: gates mix the k outputs of each token, which needs scattered "
                             "output; pass grouped_out=False")
        if not isinstance(gates, torch.Tensor) or tuple(gates.shape) != (M // k, k):
            got = tuple(gates.shape) if isinstance(gates, torch.Tensor) else type(gates).__name__
            raise ValueError(f"parallel_linear: gates must be [T, k] = {(M // k, k)}, got {got}")
        if gates.device != x.device:
            raise ValueError(f"parallel_linear: gates are on {gates.device} but x is on {x.device}")
    x, weight, bias = _autocast(x, weight, bias)
    return _ParallelLinear.apply(x, weight, bias, gates, k, sorted_expert_idxs, sorted_scattered_idxs,
                                 expert_offsets, grouped_in, grouped_out)
