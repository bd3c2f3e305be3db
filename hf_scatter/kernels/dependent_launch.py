"""Programmatic dependent launch (Hopper and newer): a kernel of a chain may start while the one before it ends.

Within :func:`dependent_launches`, kernels that take ``USE_PDL`` are launched with Triton's ``launch_pdl`` and call
:func:`wait_for_predecessor` first thing: each waits for its predecessor's results before it reads or writes
anything, then lets the next kernel launch, so only the launches and the waits overlap. For chains of microsecond
kernels in a CUDA graph (a short request through an encoder), where every boundary costs about as much as a kernel.
``HF_SCATTER_PDL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from .backend import compute_capability, env_switch, kernels_enabled, triton_interpreted

_dependent_launches = threading.local()


@contextlib.contextmanager
def dependent_launches():
    """Kernels that support it, launched inside this block on the calling thread, are dependent launches."""
    depth = getattr(_dependent_launches, "depth", 0)
    _dependent_launches.depth = depth + 1
    try:
        yield
    finally:
        _dependent_launches.depth = depth


def dependent_launch(tensor: torch.Tensor) -> dict:
    """Launch options of a kernel that takes ``USE_PDL`` for a call on ``tensor``: ``{"USE_PDL": True,
    "launch_pdl": True}`` inside :func:`dependent_launches` where the GPU and Triton support it, else
    ``{"USE_PDL": False}``."""
    if getattr(_dependent_launches, "depth", 0) and tensor.is_cuda:
        index = tensor.device.index
        if _pdl_supported(torch.cuda.current_device() if index is None else index):
            return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}


@functools.lru_cache(maxsize=None)
def _pdl_supported(device_index: int) -> bool:
    if triton_interpreted() or env_switch("HF_SCATTER_PDL") is False:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and compute_capability(device_index) >= (9, 0))


if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def wait_for_predecessor(USE_PDL: tl.constexpr):
        """A dependent launch's first step: wait until the kernel before is done and its writes are visible, then
        let the next kernel launch."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
