"""Which implementation a kernel call runs: compiled Triton, interpreted Triton, or the torch reference.

Triton decides whether ``@triton.jit`` functions (its own standard library included) are interpreted
when they are defined, so ``TRITON_INTERPRET`` must be set before Triton is first imported. On a machine
without a GPU, CPU tensors take the torch reference (fast, and the designed path there) unless the user asks
for the kernels: ``TRITON_INTERPRET=1`` set before the import (the tests), or ``HF_SCATTER_KERNELS=triton``,
for which ``import hf_scatter`` sets ``TRITON_INTERPRET`` (:func:`interpret_if_asked`; nothing else at import
touches the environment). ``hf-scatter demo`` runs its checks in a fresh process with both set.
Kernel call sites ask :func:`use_triton`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
import warnings

import torch

_ENV_FORCE = "HF_SCATTER_KERNELS"  # "triton" or "torch": override the automatic choice
_warned: set[str] = set()
_interpreter_auto = False  # True when hf_scatter set TRITON_INTERPRET itself (for HF_SCATTER_KERNELS=triton)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=None)
def kernels_enabled() -> bool:
    """Whether this process defines the Triton kernels: Triton is installed and can run here (a CUDA GPU,
    or the interpreter). Decided once, when the first kernel module is imported; otherwise every op takes
    its torch reference (importing hf_scatter never fails on a machine without a GPU)."""
    return triton_available() and (torch.cuda.is_available() or triton_interpreted())


@functools.lru_cache(maxsize=None)
def triton_interpreted() -> bool:
    """True when Triton kernels run under the CPU interpreter (``TRITON_INTERPRET=1``). Cached: Triton reads the
    variable once, when it defines its functions, so a later change has no effect anyway (and each kernel
    launch asks)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in {"1", "true", "yes", "on"}


def interpret_if_asked() -> bool:
    """Where the user set ``HF_SCATTER_KERNELS=triton`` on a machine without a GPU, turn the Triton interpreter
    on (``TRITON_INTERPRET=1``) before Triton is imported: the one way that request can be met. Otherwise the
    environment is left as it is. Returns True if the interpreter is (now) active; only effective before the
    first ``import triton`` (``import hf_scatter`` calls it first thing)."""
    global _interpreter_auto
    if _forced() == "triton" and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available() \
            and triton_available():
        os.environ["TRITON_INTERPRET"] = "1"
        _interpreter_auto = True
        triton_interpreted.cache_clear()
    return triton_interpreted()


def cpu_reference_is_designed(device: torch.device) -> bool:
    """CPU tensors on a machine without a GPU, the kernels not asked for: the torch reference is the designed
    path there (faster than interpreting the kernels), so nothing warns about it."""
    return device.type == "cpu" and not torch.cuda.is_available() and _forced() != "triton"


_autotune_override = threading.local()  # per thread: a stack of overrides


def autotune_setting() -> bool | None:
    """``HF_SCATTER_AUTOTUNE`` (or :func:`autotune_override`): True sweeps every kernel's candidate configs
    per shape, False sweeps none, None (unset) leaves it to each kernel: the MoE GEMMs launch the config of
    their measured table (:func:`launch`'s ``table_config``), kernels without a table sweep."""
    stack = getattr(_autotune_override, "stack", None)
    if stack:
        return stack[-1]
    return env_switch("HF_SCATTER_AUTOTUNE")


def env_switch(name: str) -> bool | None:
    """An on/off environment variable of ours: None when unset or empty, False for 0/false/no/off (any case),
    True for anything else."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    return value not in {"0", "false", "no", "off"}


def autotune_enabled() -> bool:
    """Whether kernels without a measured table sweep their candidates (all of them unless turned off)."""
    return autotune_setting() is not False


@contextlib.contextmanager
def autotune_override(enabled: bool):
    """Autotuning on or off for the kernels launched inside, whatever the environment says (the offloaded
    runtime turns it off: Triton's tuner allocates a 256 MB scratch buffer, beyond a strict GPU budget).
    Applies to the calling thread."""
    stack = _autotune_override.__dict__.setdefault("stack", [])
    stack.append(bool(enabled))
    try:
        yield
    finally:
        stack.pop()


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
    if forced == "torch" or not kernels_enabled():
        return "torch"
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and triton_interpreted() and (forced == "triton" or not _interpreter_auto):
        return "triton-interpreter"
    return "torch"


# The GPU's fixed facts, asked of the driver once per device: launch decisions read them on every call.
@functools.lru_cache(maxsize=None)
def compute_capability(device_index: int) -> tuple[int, int]:
    """(major, minor): which instructions the kernels may use (TMA and dependent launches from 9.0, e4m3
    conversion from 8.9) and whether torch's grouped GEMM is a CUTLASS kernel there."""
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=None)
def multiprocessors(device_index: int) -> int:
    """The GPU's streaming multiprocessors: how many programs a persistent launch runs at once."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.lru_cache(maxsize=None)
def shared_memory_per_multiprocessor(device_index: int) -> int:
    """Bytes of shared memory a multiprocessor holds: how many programs of a pipeline fit on one at a time (0 where
    torch does not report it)."""
    return getattr(torch.cuda.get_device_properties(device_index), "shared_memory_per_multiprocessor", 0)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for host-side grid sizes (``triton.cdiv`` is a constexpr function costing microseconds
    per call on the host in recent Triton releases; a training step makes hundreds of these calls)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def use_triton(tensor: torch.Tensor, op: str) -> bool:
    """Whether ``op`` should run its Triton kernel for ``tensor``; warns once per op when it cannot."""
    if tensor.is_cuda and os.environ.get(_ENV_FORCE, "").strip().lower() in {"", "auto", "triton"} \
            and kernels_enabled():
        return True  # the hot path: one environment lookup per kernel call
    path = kernel_path(tensor.device)
    if path != "torch":
        return True
    if _forced() == "torch" or cpu_reference_is_designed(tensor.device):
        return False  # asked for, or the designed CPU path: no warning
    if op not in _warned:
        _warned.add(op)
        if not triton_available():
            reason = "Triton is not installed"
        elif not kernels_enabled():
            reason = ("there is no CUDA GPU and the Triton interpreter was off when the kernels were imported "
                      "(set TRITON_INTERPRET=1 before importing hf_scatter to interpret them on CPU)")
        else:
            reason = (f"Triton does not run on {tensor.device.type} tensors (set TRITON_INTERPRET=1 before "
                      "importing hf_scatter to interpret the kernels on CPU)")
        warnings.warn(f"hf_scatter: {op} uses the pure-torch reference path: {reason}.", RuntimeWarning, stacklevel=3)
    return False


def warn_missing_library(op: str, package: str, fallback: str) -> None:
    """Once per op: a CUDA call took ``fallback`` because ``package``, a dependency of this platform, does not
    import (an image that skipped it, a broken install). The step stays right, only slower, so it must be said."""
    if op in _warned or torch.compiler.is_compiling():
        return
    _warned.add(op)
    warnings.warn(f"hf_scatter: {op} runs {fallback} on CUDA because {package} does not import (it is a "
                  f"dependency on Linux x86-64); `pip install {package}` for the fused kernel.", RuntimeWarning,
                  stacklevel=3)


def triton_runs(tensor: torch.Tensor, op: str) -> bool:
    """:func:`use_triton` for a kernel without a float64 variant: float64 always takes the torch reference."""
    return tensor.dtype != torch.float64 and use_triton(tensor, op)


def fitting_configs(configs: list, block_limits: dict[str, int]) -> list:
    """Autotune candidates whose blocks do not overshoot the problem (``{"BLOCK_N": N, ...}``); never empty."""
    def fits(cfg) -> bool:
        return all(cfg.kwargs[block] <= max(32, 1 << max(0, dim - 1).bit_length()) for block, dim in block_limits.items())

    kept = [c for c in configs if fits(c)]
    return kept or [min(configs, key=lambda c: sum(c.kwargs[b] for b in block_limits))]


_chosen_configs: dict = {}  # (autotuner, launch key) -> the config Triton's autotuner picked for it


def launch(kernel, tuned, configs: list, block_limits: dict[str, int], grid, args: tuple, meta: dict,
           interpreter_blocks: dict, tune_key: tuple | None = None, table_config=None) -> None:
    """Run a kernel the way the current path wants it: fixed large blocks under the interpreter (its cost grows
    with programs x loop trips); on a GPU the kernel's ``table_config`` (its measured choice for this shape
    class) unless ``HF_SCATTER_AUTOTUNE=1``; autotuned where there is no table; the first fitting config
    with ``HF_SCATTER_AUTOTUNE=0``.

    A table saves the sweep at first use: Triton compiles and times every candidate per launch key, 1.5 to
    8 s per key on the H100 machine, which made the first fwd+bwd of a fine-grained MoE layer take 10-50 s.

    ``tune_key`` (at least as fine as the autotuner's own key): once Triton's autotuner has chosen a config
    for it, later calls launch that config directly. The autotuner's per-call bookkeeping cost about 75 us of
    host time per launch on the H100 machine's host, in a training step that is bound by host time.
    """
    if triton_interpreted():
        kernel[grid(interpreter_blocks)](*args, **meta, **interpreter_blocks)
        return
    cfg = planned_config(table_config)
    if cfg is None and autotune_enabled():
        cfg = _chosen_configs.get((id(tuned), tune_key)) if tune_key is not None else None
        if cfg is None:
            tuned[grid](*args, **meta)
            if tune_key is not None and getattr(tuned, "best_config", None) is not None:
                _chosen_configs[(id(tuned), tune_key)] = tuned.best_config
            return
    elif cfg is None:
        cfg = fitting_configs(configs, block_limits)[0]
    stages = _fitted_stages.get((id(kernel), tune_key, cfg.num_stages), cfg.num_stages)
    while True:
        try:
            kernel[grid(cfg.kwargs)](*args, **meta, **cfg.kwargs, num_warps=cfg.num_warps, num_stages=stages)
            break
        except Exception as error:  # Triton's OutOfResources: the pipeline did not fit this GPU's shared memory
            if type(error).__name__ != "OutOfResources" or stages <= 1:
                raise
            stages -= 1
    if stages != cfg.num_stages:
        _fitted_stages[(id(kernel), tune_key, cfg.num_stages)] = stages


def planned_config(table_config):
    """The config :func:`launch` takes on a GPU without sweeping, known before it: the kernel's table config,
    unless ``HF_SCATTER_AUTOTUNE=1`` asks Triton's autotuner to pick (None then, and without a table)."""
    return table_config if table_config is not None and autotune_setting() is not True else None


# (kernel, launch key, stages asked for) -> the stages that compiled. The tables were measured on an H100 (227 KiB
# of shared memory per block); a GPU with less (an A100 has 163 KiB), or a Triton release that buffers a
# pipeline differently, may not fit a table config: it then drops stages, once, instead of failing.
_fitted_stages: dict = {}


def fitted_block(preferred: int, dim: int) -> int:
    """``preferred`` block size, shrunk to the power of two covering ``dim`` (at least 32) for small problems."""
    return min(preferred, max(32, next_power_of_2(dim)))


SHARED_MEMORY_BYTES = 200 * 1024  # what a table config may pipeline through (H100: 227 KiB per block)


def fit_shared_memory(step: int, stages: int, bytes_per_step_unit: int) -> tuple[int, int]:
    """A GEMM tile's pipelined operand tiles take ``step * bytes_per_step_unit * stages`` bytes of shared
    memory (``step``: the reduction block); halve the step (not below 32), then drop stages (not below 2),
    until they fit."""
    while step * bytes_per_step_unit * stages > SHARED_MEMORY_BYTES:
        if step > 32:
            step //= 2
        elif stages > 2:
            stages -= 1
        else:
            break
    return step, stages
