"""The kernels as ``torch.library`` custom ops (so ``torch.compile`` traces them), with input checks.

Each op runs its Triton kernel where Triton can (``backend.use_triton``) and its pure-torch reference
otherwise. The Python functions here validate arguments and allocate outputs; the ops write into
caller-provided buffers so the backward pass can reuse memory (ScatterMoE Algorithm 2). Under an active
torch profiler every kernel call and autograd function carries an ``hf_scatter::`` name (``_run``,
:func:`profiled`).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.autograd import profiler as _profiler

from .backend import use_triton
from .gating import gate_grad_reference, gate_grad_triton, gate_mix_reference, gate_mix_triton
from .group import group_reference, group_triton
from .groupxty import groupxty_reference, groupxty_triton
from .scatter2scatter import scatter2scatter_reference, scatter2scatter_triton
from .swiglu import swiglu_backward_reference, swiglu_bwd_triton, swiglu_fwd_triton, swiglu_reference

_INDEX_DTYPES = (torch.int32, torch.int64)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@torch.compiler.assume_constant_result
def tf32_allowed() -> bool:
    """fp32 kernels use TF32 only when torch matmuls may (``torch.set_float32_matmul_precision('high')``)."""
    return torch.get_float32_matmul_precision() != "highest"


# --------------------------------------------------------------------------------------------- ops
_dispatch_observers = 0  # > 0 while something watches the dispatcher (the memory planner's recorder)


class dispatch_ops:
    """Within this context eager calls go through the registered ops, so a ``TorchDispatchMode`` sees each
    kernel call with the buffers it reads and writes (a Triton launch is invisible to the dispatcher)."""

    def __enter__(self):
        global _dispatch_observers
        _dispatch_observers += 1

    def __exit__(self, *exc):
        global _dispatch_observers
        _dispatch_observers -= 1


def _writes_only(*args, **kwargs) -> None:
    return None


def mutating_op(name: str, *mutated: str):
    """Register an implementation as the custom op ``hf_scatter::<name>``. Every kernel writes into
    caller-provided buffers (``mutated``) and returns nothing, so what ``torch.compile`` traces in its place
    (the fake) does nothing either."""
    def register(impl):
        op = torch.library.custom_op(f"hf_scatter::{name}", mutates_args=mutated)(impl)
        op.register_fake(_writes_only)
        _profile_names[op] = f"hf_scatter::{name}"
        return op

    return register


_profile_names: dict = {}  # registered op -> the name its eager calls carry in a profiler trace


def _run(op, impl, *args) -> None:
    """Eager calls go straight to the implementation: the torch.library dispatch of a Python custom op cost
    about 0.3 ms of host time per call (measured on an H200 host), more than some kernels take. The
    registered op is what torch.compile traces (and what :class:`dispatch_ops` observers see). Under an
    active torch profiler the call is a ``record_function`` range named like the op, so traces show it
    either way; otherwise the only cost is one read of the profiler's Python flag."""
    if _dispatch_observers or torch.compiler.is_compiling():
        op(*args)
    elif _profiler._is_profiler_enabled:
        with _profiler.record_function(_profile_names[op]):
            impl(*args)
    else:
        impl(*args)


def profiled(name: str):
    """Decorator: calls of the function appear as ``name`` in a torch profiler trace (autograd functions'
    forward and backward: torch names them after the class, outside the ``hf_scatter::`` namespace). With
    no profiler active it costs one read of the profiler's Python flag (what torch's own hot paths check)
    and one extra Python frame; no ``record_function`` is made. Compiled code is left to torch.compile."""
    def wrap(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not _profiler._is_profiler_enabled or torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            with _profiler.record_function(name):
                return fn(*args, **kwargs)

        return run

    return wrap


def _scatter2scatter_impl(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                          sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int,
                          x_grouped: bool, y_grouped: bool, bias: Optional[torch.Tensor], out: torch.Tensor,
                          allow_tf32: bool) -> None:
    if use_triton(x, "scatter2scatter") and x.dtype != torch.float64:
        scatter2scatter_triton(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                               x_grouped, y_grouped, bias, out, allow_tf32)
    else:
        scatter2scatter_reference(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                  x_grouped, y_grouped, bias, out)


_scatter2scatter_op = mutating_op("scatter2scatter", "out")(_scatter2scatter_impl)


def _group_impl(x: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int, coeff: Optional[torch.Tensor],
                out: torch.Tensor) -> None:
    if use_triton(x, "group") and x.dtype != torch.float64:
        group_triton(x, sorted_scattered_idxs, fan_out, coeff, out)
    else:
        out.copy_(group_reference(x, sorted_scattered_idxs, fan_out, coeff))


_group_op = mutating_op("group", "out")(_group_impl)


def _groupxty_impl(x: torch.Tensor, dy: torch.Tensor, expert_offsets: torch.Tensor, dw: torch.Tensor,
                   db: Optional[torch.Tensor], allow_tf32: bool, sorted_scattered_idxs: Optional[torch.Tensor],
                   x_fan_out: int, dy_fan_out: int) -> None:
    if use_triton(x, "groupXTY") and x.dtype != torch.float64:
        groupxty_triton(x, dy, expert_offsets, dw, db, allow_tf32, sorted_scattered_idxs, x_fan_out, dy_fan_out)
    else:
        groupxty_reference(x, dy, expert_offsets, dw, db, sorted_scattered_idxs, x_fan_out, dy_fan_out)


_groupxty_op = mutating_op("groupxty", "dw", "db")(_groupxty_impl)


def _gate_mix_impl(y_slots: torch.Tensor, gates: torch.Tensor, out: torch.Tensor) -> None:
    if use_triton(y_slots, "gate_mix") and y_slots.dtype != torch.float64:
        gate_mix_triton(y_slots, gates, out)
    else:
        out.copy_(gate_mix_reference(y_slots, gates))


_gate_mix_op = mutating_op("gate_mix", "out")(_gate_mix_impl)


def _gate_grad_impl(dx: torch.Tensor, x: torch.Tensor, fan_out: int, coeff: Optional[torch.Tensor],
                    dots: torch.Tensor, x_scaled_out: Optional[torch.Tensor]) -> None:
    if use_triton(dx, "gate_grad") and dx.dtype != torch.float64:
        gate_grad_triton(dx, x, fan_out, coeff, dots, x_scaled_out)
    else:
        dots.copy_(gate_grad_reference(dx, x, fan_out, coeff, x_scaled_out))


_gate_grad_op = mutating_op("gate_grad", "dx", "dots", "x_scaled_out")(_gate_grad_impl)


def _swiglu_fwd_impl(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor) -> None:
    if use_triton(gate, "swiglu") and gate.dtype != torch.float64:
        swiglu_fwd_triton(gate, up, out)
    else:
        out.copy_(swiglu_reference(gate, up))


_swiglu_fwd_op = mutating_op("swiglu_fwd", "out")(_swiglu_fwd_impl)


def _swiglu_bwd_impl(gate: torch.Tensor, up: torch.Tensor, dout: torch.Tensor, dgate: torch.Tensor,
                   dup: torch.Tensor) -> None:
    if use_triton(gate, "swiglu") and gate.dtype != torch.float64:
        swiglu_bwd_triton(gate, up, dout, dgate, dup)
    else:
        dg, du = swiglu_backward_reference(gate, up, dout)
        dgate.copy_(dg)
        dup.copy_(du)


_swiglu_bwd_op = mutating_op("swiglu_bwd", "dgate", "dup")(_swiglu_bwd_impl)


def gate_up_halves(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = h.shape[1] // 2
    return h[:, :half], h[:, half:]


class _SwiGLU(torch.autograd.Function):
    """``h = [gate; up]`` in one buffer; the gradient is one buffer too (no autograd cat of two halves)."""

    @staticmethod
    @profiled("hf_scatter::swiglu.forward")
    def forward(ctx, h, reuse_input_buffer):
        out = h.new_empty((h.shape[0], h.shape[1] // 2))
        _run(_swiglu_fwd_op, _swiglu_fwd_impl, *gate_up_halves(h), out)
        ctx.reuse_input_buffer = reuse_input_buffer
        ctx.save_for_backward(h)
        return out

    @staticmethod
    @profiled("hf_scatter::swiglu.backward")
    def backward(ctx, dout):
        (h,) = ctx.saved_tensors
        # With reuse, h's buffer receives d[gate; up] (a second backward through it then fails loudly).
        dh = h if ctx.reuse_input_buffer else torch.empty_like(h)
        _run(_swiglu_bwd_op, _swiglu_bwd_impl, *gate_up_halves(h), dout.contiguous(), *gate_up_halves(dh))
        return dh, None


class _SwiGLUPair(torch.autograd.Function):
    @staticmethod
    @profiled("hf_scatter::swiglu_pair.forward")
    def forward(ctx, gate, up, reuse_input_buffers):
        out = gate.new_empty(gate.shape)
        _run(_swiglu_fwd_op, _swiglu_fwd_impl, gate, up, out)
        ctx.reuse_input_buffers = reuse_input_buffers
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @profiled("hf_scatter::swiglu_pair.backward")
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        if ctx.reuse_input_buffers:
            dgate, dup = gate, up
        else:
            dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _run(_swiglu_bwd_op, _swiglu_bwd_impl, gate, up, dout.contiguous(), dgate, dup)
        return dgate, dup, None


def swiglu(h: torch.Tensor, reuse_input_buffer: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for ``h = [gate; up]`` ([M, 2I], rows contiguous), fused, differentiable.

    ``reuse_input_buffer``: the backward writes the gradient into ``h``'s memory. Only for an ``h`` that
    nothing else reads afterwards (the SMoE MLP's own intermediate).
    """
    _check_float("swiglu", "h", h, 2)
    if h.shape[1] % 2 or h.stride(1) != 1:
        _fail("swiglu", f"h must be [M, 2I] with contiguous rows, got shape {tuple(h.shape)} strides {h.stride()}")
    return _SwiGLU.apply(h, reuse_input_buffer)


def swiglu_pair(gate: torch.Tensor, up: torch.Tensor, reuse_input_buffers: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for separate [M, I] operands (DBRX's w1 and v1 outputs), fused, differentiable.

    ``reuse_input_buffers``: the backward writes d(gate) and d(up) into ``gate`` and ``up``; only for
    intermediates nothing else reads afterwards.
    """
    _check_float("swiglu_pair", "gate", gate, 2)
    _check_like("swiglu_pair", "up", up, gate)
    if gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        _fail("swiglu_pair", f"gate and up must both be [M, I] with contiguous rows, got {tuple(gate.shape)} "
                             f"strides {gate.stride()} and {tuple(up.shape)} strides {up.stride()}")
    return _SwiGLUPair.apply(gate, up, reuse_input_buffers)


# ------------------------------------------------------------------------------------- validation
def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _check_float(op: str, name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(op, f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != dim:
        _fail(op, f"{name} must be {dim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOAT_DTYPES:
        _fail(op, f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def _check_index(op: str, name: str, t: torch.Tensor, numel: int | None, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.dtype not in _INDEX_DTYPES:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        _fail(op, f"{name} must be a 1-D int32/int64 tensor, got {got}")
    if numel is not None and t.numel() != numel:
        _fail(op, f"{name} must have {numel} elements, got {t.numel()}")
    if t.device != device:
        _fail(op, f"{name} is on {t.device} but the inputs are on {device}; put all tensors on one device")
    if not t.is_contiguous():
        _fail(op, f"{name} must be contiguous (call .contiguous())")


def _check_like(op: str, name: str, t: torch.Tensor, ref: torch.Tensor) -> None:
    if t.device != ref.device:
        _fail(op, f"{name} is on {t.device} but the input is on {ref.device}; put all tensors on one device")
    if t.dtype != ref.dtype:
        _fail(op, f"{name} has dtype {t.dtype} but the input is {ref.dtype}; cast them to one dtype")


def _check_out(op: str, out: torch.Tensor, shape: tuple, like: torch.Tensor) -> None:
    if tuple(out.shape) != tuple(shape) or out.dtype != like.dtype or out.device != like.device:
        _fail(op, f"out must be {tuple(shape)} {like.dtype} on {like.device}, got {tuple(out.shape)} {out.dtype} "
                  f"on {out.device}")


# ----------------------------------------------------------------------------------- public calls
def scatter2scatter(x: torch.Tensor, weight: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, expert_offsets: torch.Tensor, fan_out: int = 1,
                    x_grouped: bool = False, y_grouped: bool = False, bias: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """``y[i or idx[i]] = x[i or idx[i] // fan_out] @ weight[e(i)] (+ bias[e(i)])`` over expert-sorted rows ``i``.

    ``weight`` is [E, d_in, d_out] with any strides (a transposed view of an HF [E, d_out, d_in] tensor
    is read in place). Returns ``out`` of shape [M, d_out], M = number of (token, expert) slots.
    """
    op = "scatter2scatter"
    _check_float(op, "x", x, 2)
    _check_float(op, "weight", weight, 3)
    _check_like(op, "weight", weight, x)
    E, K, N = weight.shape
    if x.shape[1] != K:
        _fail(op, f"x has {x.shape[1]} features but weight expects d_in={K} (weight is [E, d_in, d_out])")
    M = sorted_scattered_idxs.numel() if isinstance(sorted_scattered_idxs, torch.Tensor) else None
    _check_index(op, "sorted_scattered_idxs", sorted_scattered_idxs, None, x.device)
    _check_index(op, "sorted_expert_idxs", sorted_expert_idxs, M, x.device)
    _check_index(op, "expert_offsets", expert_offsets, E, x.device)
    if fan_out < 1:
        _fail(op, f"fan_out must be >= 1, got {fan_out}")
    expected_rows = M if x_grouped else (M // fan_out if M % fan_out == 0 else None)
    if x.shape[0] != expected_rows:
        what = "grouped x needs one row per slot" if x_grouped else f"scattered x with fan_out={fan_out} needs M/fan_out rows"
        _fail(op, f"x has {x.shape[0]} rows for M={M} slots: {what}")
    if bias is not None:
        _check_like(op, "bias", bias, x)
        if tuple(bias.shape) != (E, N):
            _fail(op, f"bias must be [E, d_out] = {(E, N)}, got {tuple(bias.shape)}")
    if out is not None:
        _check_out(op, out, (M, N), x)
    return scatter2scatter_unchecked(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out,
                                     x_grouped, y_grouped, bias, out)


def group(x: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int = 1,
          coeff: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``x`` in expert order: ``out[i] = x[idx[i] // fan_out] * coeff[i]`` (fp32 scaling)."""
    op = "group"
    _check_float(op, "x", x, 2)
    _check_index(op, "sorted_scattered_idxs", sorted_scattered_idxs, None, x.device)
    if fan_out < 1:
        _fail(op, f"fan_out must be >= 1, got {fan_out}")
    M = sorted_scattered_idxs.numel()
    if x.shape[0] * fan_out != M:
        _fail(op, f"x has {x.shape[0]} rows; with fan_out={fan_out} that is {x.shape[0] * fan_out} slots, "
                  f"but sorted_scattered_idxs has {M}")
    if coeff is not None:
        if tuple(coeff.shape) != (M,) or coeff.device != x.device:
            _fail(op, f"coeff must have shape {(M,)} on {x.device}, got {tuple(coeff.shape)} on {coeff.device}")
        if not coeff.is_contiguous():
            _fail(op, "coeff must be contiguous (call .contiguous())")
    if out is not None:
        _check_out(op, out, (M, x.shape[1]), x)
    return group_unchecked(x, sorted_scattered_idxs, fan_out, coeff, out)


def groupXTY(x_grouped: torch.Tensor, dy_grouped: torch.Tensor, expert_offsets: torch.Tensor,
             dw: torch.Tensor | None = None, db: torch.Tensor | bool | None = None,
             sorted_scattered_idxs: torch.Tensor | None = None, x_fan_out: int = 0, dy_fan_out: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-expert ``dW[e] = X_e^T dY_e`` ([E, d_in, d_out]) and, with ``db`` (a buffer or True), ``db[e] = sum dY_e``.

    ``dw`` may be any [E, d_in, d_out] buffer, e.g. one strided like the weight it is the gradient of.
    Operands are grouped (expert-sorted rows) by default; ``x_fan_out``/``dy_fan_out`` > 0 reads that operand's
    sorted row ``i`` from row ``sorted_scattered_idxs[i] // fan_out`` instead, so no grouped copy is needed.
    """
    op = "groupXTY"
    _check_float(op, "x_grouped", x_grouped, 2)
    _check_float(op, "dy_grouped", dy_grouped, 2)
    _check_like(op, "dy_grouped", dy_grouped, x_grouped)
    _check_index(op, "expert_offsets", expert_offsets, None, x_grouped.device)
    if x_fan_out < 0 or dy_fan_out < 0:
        _fail(op, f"fan-outs must be >= 0 (0 = grouped operand), got x_fan_out={x_fan_out}, dy_fan_out={dy_fan_out}")
    if sorted_scattered_idxs is None:
        if x_fan_out or dy_fan_out:
            _fail(op, "scattered operands (x_fan_out/dy_fan_out > 0) need sorted_scattered_idxs")
        M = x_grouped.shape[0]
    else:
        _check_index(op, "sorted_scattered_idxs", sorted_scattered_idxs, None, x_grouped.device)
        M = sorted_scattered_idxs.numel()
    for name, t, fan in (("x_grouped", x_grouped, x_fan_out), ("dy_grouped", dy_grouped, dy_fan_out)):
        rows = M // fan if fan else M
        if t.shape[0] != rows or (fan and M % fan):
            how = f"scattered with fan_out={fan}, that is M/fan_out" if fan else "grouped, one row per slot"
            _fail(op, f"{name} has {t.shape[0]} rows for M={M} slots ({how})")
    E, K, N = expert_offsets.numel(), x_grouped.shape[1], dy_grouped.shape[1]
    if dw is not None:
        _check_out(op, dw, (E, K, N), x_grouped)
    if isinstance(db, torch.Tensor):
        _check_out(op, db, (E, N), x_grouped)
    return groupxty_unchecked(x_grouped, dy_grouped, expert_offsets, dw, db, sorted_scattered_idxs, x_fan_out,
                              dy_fan_out)


def gate_mix(y_slots: torch.Tensor, gates: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[t] = sum_j gates[t, j] * y_slots[t*k + j]`` (fp32 accumulation): the k expert outputs of each token,
    in slot order, mixed by its routing gates."""
    op = "gate_mix"
    _check_float(op, "y_slots", y_slots, 2)
    _check_float(op, "gates", gates, 2)
    T, k = gates.shape
    if y_slots.shape[0] != T * k or gates.device != y_slots.device or y_slots.stride(1) != 1:
        _fail(op, f"y_slots must be [T*k, N] = [{T * k}, N] with contiguous rows on {gates.device}, got "
                  f"{tuple(y_slots.shape)} strides {y_slots.stride()} on {y_slots.device}")
    if out is not None:
        _check_out(op, out, (T, y_slots.shape[1]), y_slots)
        if out.stride(1) != 1:
            _fail(op, "out must have contiguous rows")
    return gate_mix_unchecked(y_slots, gates, out)


def gate_grad(dx: torch.Tensor, x: torch.Tensor, fan_out: int = 1, coeff: torch.Tensor | None = None,
              x_scaled_out: torch.Tensor | None = None) -> torch.Tensor:
    """``dots[i] = dx[i] . x[i // fan_out]`` in fp32 ([M]); with ``coeff`` [M], ``dx[i] *= coeff[i]`` in place in
    the same pass, and ``x_scaled_out[i] = coeff[i] * x[i // fan_out]`` when that [M, N] buffer is given. With
    ``dx = dY W^T`` these dots are the routing-gate gradients."""
    op = "gate_grad"
    _check_float(op, "dx", dx, 2)
    _check_float(op, "x", x, 2)
    _check_like(op, "x", x, dx)
    M, N = dx.shape
    if fan_out < 1 or x.shape[0] * fan_out != M or x.shape[1] != N or dx.stride(1) != 1 or x.stride(1) != 1:
        _fail(op, f"dx [M, N] and x [M / fan_out, N] need contiguous rows; got dx {tuple(dx.shape)}, x "
                  f"{tuple(x.shape)}, fan_out={fan_out}")
    if coeff is not None and (tuple(coeff.shape) != (M,) or coeff.device != dx.device or not coeff.is_contiguous()):
        _fail(op, f"coeff must be a contiguous [{M}] tensor on {dx.device}, got {tuple(coeff.shape)}")
    if x_scaled_out is not None:
        if coeff is None:
            _fail(op, "x_scaled_out needs coeff (it receives coeff[i] * x[i // fan_out])")
        _check_out(op, x_scaled_out, (M, N), dx)
        if x_scaled_out.stride(1) != 1:
            _fail(op, "x_scaled_out must have contiguous rows")
    return gate_grad_unchecked(dx, x, fan_out, coeff, x_scaled_out)


# --------------------------------------------------------------------------------- unchecked calls
# For callers that validated at their own boundary (parallel_linear checks its inputs once; its backward's
# shapes follow from the forward's): the checks above cost tens of microseconds of host time per call,
# and a training step of a 16-layer MoE makes hundreds of kernel calls.
def scatter2scatter_unchecked(x, weight, sorted_expert_idxs, sorted_scattered_idxs, expert_offsets, fan_out=1,
                              x_grouped=False, y_grouped=False, bias=None, out=None) -> torch.Tensor:
    if out is None:
        out = x.new_empty((sorted_scattered_idxs.shape[0], weight.shape[2]))
    _run(_scatter2scatter_op, _scatter2scatter_impl, x, weight, sorted_expert_idxs, sorted_scattered_idxs,
         expert_offsets, fan_out, x_grouped, y_grouped, bias, out, tf32_allowed())
    return out


def group_unchecked(x, sorted_scattered_idxs, fan_out=1, coeff=None, out=None) -> torch.Tensor:
    if out is None:
        out = x.new_empty((sorted_scattered_idxs.shape[0], x.shape[1]))
    _run(_group_op, _group_impl, x, sorted_scattered_idxs, fan_out, coeff, out)
    return out


def groupxty_unchecked(x, dy, expert_offsets, dw=None, db=None, sorted_scattered_idxs=None, x_fan_out=0,
                       dy_fan_out=0) -> tuple[torch.Tensor, torch.Tensor | None]:
    E, K, N = expert_offsets.shape[0], x.shape[1], dy.shape[1]
    if dw is None:
        dw = x.new_empty((E, K, N))
    if db is True:
        db = x.new_empty((E, N))
    elif db is False:
        db = None
    _run(_groupxty_op, _groupxty_impl, x, dy, expert_offsets, dw, db, tf32_allowed(), sorted_scattered_idxs,
         x_fan_out, dy_fan_out)
    return dw, db


def gate_mix_unchecked(y_slots, gates, out=None) -> torch.Tensor:
    if out is None:
        out = y_slots.new_empty((gates.shape[0], y_slots.shape[1]))
    _run(_gate_mix_op, _gate_mix_impl, y_slots, gates, out)
    return out


def gate_grad_unchecked(dx, x, fan_out=1, coeff=None, x_scaled_out=None) -> torch.Tensor:
    dots = dx.new_empty((dx.shape[0],), dtype=torch.promote_types(dx.dtype, torch.float32))
    _run(_gate_grad_op, _gate_grad_impl, dx, x, fan_out, coeff, dots, x_scaled_out)
    return dots


def swiglu_fwd_unchecked(gate, up, out) -> torch.Tensor:
    _run(_swiglu_fwd_op, _swiglu_fwd_impl, gate, up, out)
    return out


def swiglu_bwd_unchecked(gate, up, dout, dgate, dup) -> None:
    _run(_swiglu_bwd_op, _swiglu_bwd_impl, gate, up, dout, dgate, dup)
