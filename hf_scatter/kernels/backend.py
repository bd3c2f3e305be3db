"""Which implementation a kernel call runs: compiled Triton, interpreted Triton, or the torch reference.

Triton decides at decoration time whether ``@triton.jit`` functions are interpreted
(``TRITON_INTERPRET=1``), so that choice is fixed when the kernel modules are first imported.
Everything here is read once and cached; kernel call sites ask :func:`use_triton`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import warnings

import torch

_ENV_FORCE = "HF_SCATTER_KERNELS"  # "triton" or "torch": override the automatic choice
_warned: set[str] = set()


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_interpreted() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "yes", "on"}


def enable_interpreter_if_no_gpu() -> bool:
    """Turn on the Triton interpreter on machines without a GPU, before any kernel is defined.

    Returns True if the interpreter is (now) active. Has no effect once kernel modules were imported
    in compiled mode, which is why callers (tests, the demo) invoke it first thing.
    """
    if not torch.cuda.is_available() and triton_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return triton_interpreted()


def autotune_enabled() -> bool:
    """GPU kernels measure candidate block sizes per shape unless ``HF_SCATTER_AUTOTUNE=0`` (then: first config)."""
    return os.environ.get("HF_SCATTER_AUTOTUNE", "1").strip().lower() not in {"0", "false", "no", "off"}


def _forced() -> str | None:
    value = os.environ.get(_ENV_FORCE, "").strip().lower()
    if value in {"", "auto"}:
        return None
    if value not in {"triton", "torch"}:
        raise ValueError(f"{_ENV_FORCE}={value!r} is not understood; use 'triton', 'torch' or 'auto'")
    return value


def kernel_path(device: torch.device | str) -> str:
    """Name of the path kernels take on ``device``: 'triton', 'triton-interpreter' or 'torch'."""
    device = torch.device(device)
    forced = _forced()
    if forced == "torch" or not triton_available():
        return "torch"
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and triton_interpreted():
        return "triton-interpreter"
    return "torch"


def use_triton(tensor: torch.Tensor, op: str) -> bool:
    """Whether ``op`` should run its Triton kernel for ``tensor``; warns once per op when it cannot."""
    path = kernel_path(tensor.device)
    if path != "torch":
        return True
    if _forced() == "torch":
        return False
    if op not in _warned:
        _warned.add(op)
        reason = "Triton is not installed" if not triton_available() else (
            f"Triton does not run on {tensor.device.type} tensors (set TRITON_INTERPRET=1 before importing "
            "hf_scatter to interpret the kernels on CPU)")
        warnings.warn(f"hf_scatter: {op} uses the pure-torch reference path: {reason}.", RuntimeWarning, stacklevel=3)
    return False


def fitting_configs(configs: list, block_limits: dict[str, int]) -> list:
    """Autotune candidates whose blocks do not overshoot the problem (``{"BLOCK_N": N, ...}``); never empty."""
    def fits(cfg) -> bool:
        return all(cfg.kwargs[block] <= max(32, 1 << max(0, dim - 1).bit_length()) for block, dim in block_limits.items())

    kept = [c for c in configs if fits(c)]
    return kept or [min(configs, key=lambda c: sum(c.kwargs[b] for b in block_limits))]


def launch(kernel, tuned, configs: list, block_limits: dict[str, int], grid, args: tuple, meta: dict,
           interpreter_blocks: dict) -> None:
    """Run a kernel the way the current path wants it: fixed large blocks under the interpreter (its cost grows
    with programs x loop trips), autotuned on a GPU, or the first fitting config with ``HF_SCATTER_AUTOTUNE=0``."""
    if triton_interpreted():
        kernel[grid(interpreter_blocks)](*args, **meta, **interpreter_blocks)
    elif autotune_enabled():
        tuned[grid](*args, **meta)
    else:
        cfg = fitting_configs(configs, block_limits)[0]
        kernel[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
