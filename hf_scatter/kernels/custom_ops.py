"""How the kernels become ``torch.library`` custom ops (so ``torch.compile`` traces them) and how eager calls run them.

Each kernel module registers its op with :func:`mutating_op`; the op runs its Triton kernel where Triton can
(``backend.use_triton``) and its pure-torch reference otherwise (float64 always takes the reference). The
modules' Python functions validate arguments (``checks``) and allocate outputs; the ops write into
caller-provided buffers so the backward pass can reuse memory (ScatterMoE Algorithm 2). Eager calls skip the
dispatcher (:func:`run_op`). Under an active torch profiler every kernel call and autograd function carries an
``hf_scatter::`` name (:func:`run_op`, :func:`profiled`).

Each checked public call has a ``*_unchecked`` twin for callers that validated at their own boundary
(parallel_linear checks its inputs once; its backward's shapes follow from the forward's): the checks cost
tens of microseconds of host time per call, and a training step of a 16-layer MoE makes hundreds of kernel
calls.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import profiler as _profiler


@torch.compiler.assume_constant_result
def tf32_allowed() -> bool:
    """fp32 kernels use TF32 only when torch matmuls may (``torch.set_float32_matmul_precision('high')``)."""
    return torch.get_float32_matmul_precision() != "highest"


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


def run_op(op, impl, *args) -> None:
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
