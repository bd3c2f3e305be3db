"""Rotary position embeddings on Liger-Kernel's fused RoPE kernel, bound into a family's attention forward.

transformers applies RoPE to q and k as a chain of torch ops (``rotate_half``'s slices and ``cat``, two
multiplies and an add per tensor): about a dozen kernels and autograd nodes per layer each way, on a step
that is bound by host time. Liger-Kernel (a dependency on Linux x86-64, as for the fused loss) does q and
k in one Triton kernel each way; RoPE is not our speciality, so its kernel is used as it is.

The attention class is not rewritten. Its subclass runs the vanilla ``forward``'s own code object with one
global rebound: the module's RoPE function (``apply_rotary_pos_emb``) becomes :func:`fused_rope`'s, which
takes Liger's kernel for CUDA tensors and calls the family's function otherwise (CPU, no Liger, under
``torch.compile``, where inductor fuses the vanilla ops itself). transformers' modules keep their names,
so models left unpatched in the same process run as before.
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Callable

import torch

from ..kernels.backend import warn_missing_library

FUSED_ROPE = "fused_rope"


@functools.lru_cache(maxsize=None)
def _liger_rope() -> type | None:
    try:
        from liger_kernel.ops.rope import LigerRopeFunction
    except ImportError:
        return None
    return LigerRopeFunction


def fused_rope(vanilla: Callable, full_head: bool = False) -> Callable:
    """``vanilla(q, k, cos, sin, unsqueeze_dim=1)`` on Liger's kernel where it runs. q [B, H, S, D] and k
    [B, H_kv, S, D]; cos and sin [B or 1, S, D] (``full_head``: [.., D / 2], GPT-OSS's halves, every
    channel of the head rotated). Compiled code never calls it (:func:`rope_attention_forward`)."""

    @functools.wraps(vanilla)
    def apply(q, k, cos, sin, unsqueeze_dim=1):
        liger = _liger_rope()
        if liger is None or not q.is_cuda or unsqueeze_dim != 1 or q.dim() != 4 or cos.dim() != 3:
            if liger is None and q.is_cuda:
                warn_missing_library(FUSED_ROPE, "liger-kernel", "transformers' unfused RoPE ops")
            return vanilla(q, k, cos, sin, unsqueeze_dim)
        return liger.apply(q, k, cos, sin, None, 1, q.shape[-1] if full_head else None)

    return apply


def forward_with_global(forward: Callable, name: str, value: object) -> Callable | None:
    """``forward``'s code run with its module global ``name`` bound to ``value``, or None where that would
    not change what it calls (the name is not a global it reads). A decorated forward (transformers 5.24
    wraps every attention forward in ``deprecate_kwarg``) is rebuilt layer by layer: each wrapper keeps its
    own code and globals and closes over the rebound function in place of the one it wrapped."""
    inner = getattr(forward, "__wrapped__", None)
    if inner is None:
        if name not in forward.__code__.co_names or name not in forward.__globals__:
            return None
        scope = dict(forward.__globals__)
        scope[name] = value
        return _function_copy(forward, scope, forward.__closure__)
    rebound_inner = forward_with_global(inner, name, value)
    cells = forward.__closure__ or ()
    holding = [i for i, cell in enumerate(cells) if _cell_value(cell) is inner]
    if rebound_inner is None or len(holding) != 1:
        return None
    closure = tuple(types.CellType(rebound_inner) if i == holding[0] else cell for i, cell in enumerate(cells))
    rebound = _function_copy(forward, forward.__globals__, closure)
    rebound.__wrapped__ = rebound_inner
    return rebound


def _cell_value(cell: types.CellType) -> object:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _function_copy(function: Callable, scope: dict, closure: tuple | None) -> Callable:
    copy = types.FunctionType(function.__code__, scope, function.__name__, function.__defaults__, closure)
    copy.__kwdefaults__ = function.__kwdefaults__
    copy.__dict__.update(function.__dict__)
    copy.__qualname__, copy.__doc__, copy.__module__ = function.__qualname__, function.__doc__, function.__module__
    copy.__annotations__ = dict(function.__annotations__)
    return copy


def rope_attention_forward(attention: type, full_head: bool = False, name: str = "apply_rotary_pos_emb"
                           ) -> Callable | None:
    """The forward of ``attention`` with its RoPE on :func:`fused_rope`, or None where it has no such call.
    Under ``torch.compile`` the vanilla forward runs (dynamo finds an inlined function's globals through
    its module, which the rebound copy's are not)."""
    vanilla_forward = attention.forward
    vanilla = inspect.unwrap(vanilla_forward).__globals__.get(name)  # the modeling module's, not a decorator's
    rebound = None if vanilla is None else forward_with_global(vanilla_forward, name, fused_rope(vanilla, full_head))
    if rebound is None:
        return None

    @functools.wraps(vanilla_forward)
    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():
            return vanilla_forward(self, *args, **kwargs)
        return rebound(self, *args, **kwargs)

    return forward
