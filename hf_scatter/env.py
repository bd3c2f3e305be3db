"""What `hf-scatter env` prints: versions, the device, and which kernel path runs there."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform

import torch

from .kernels.backend import kernel_path, kernels_enabled, triton_available, triton_interpreted

_PACKAGES = ("hf-scatter", "torch", "triton", "transformers", "accelerate", "peft", "safetensors", "tokenizers")


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_report() -> dict[str, str]:
    report = {"python": platform.python_version(), "platform": platform.platform()}
    report.update({name: _version(name) for name in _PACKAGES})
    # which copy runs (an editable checkout, a wheel in some venv...): the first question when two disagree
    report["hf-scatter location"] = os.path.dirname(os.path.abspath(__file__))
    if torch.cuda.is_available():
        device = torch.device("cuda")
        props = torch.cuda.get_device_properties(device)
        report["device"] = f"cuda: {props.name}, {props.total_memory / 2**30:.1f} GiB, sm_{props.major}{props.minor}"
    else:
        device = torch.device("cpu")
        report["device"] = f"cpu: {torch.get_num_threads()} threads, no CUDA GPU"
    if not triton_available():
        report["triton mode"] = "unavailable"
    elif not kernels_enabled():
        report["triton mode"] = ("off (no CUDA GPU; set HF_SCATTER_KERNELS=triton or TRITON_INTERPRET=1 to interpret "
                                 "the kernels on CPU)")
    else:
        report["triton mode"] = "interpreted (TRITON_INTERPRET=1)" if triton_interpreted() else "native (compiled)"
    report["kernel path"] = kernel_path_summary(device)
    return report


@contextlib.contextmanager
def demo_kernels():
    """What ``hf-scatter demo`` runs under: the kernels themselves (interpreted on a machine without a GPU),
    unless ``HF_SCATTER_KERNELS`` says otherwise."""
    if os.environ.get("HF_SCATTER_KERNELS"):
        yield
        return
    os.environ["HF_SCATTER_KERNELS"] = "triton"
    try:
        yield
    finally:
        os.environ.pop("HF_SCATTER_KERNELS", None)


def needs_fresh_interpreter(device: torch.device) -> bool:
    """Whether ``hf-scatter demo`` checks the kernels in a fresh process with the interpreter on: CPU tensors on
    a machine without a GPU, where this process did not define the kernels, unless the torch path is asked."""
    return (device.type == "cpu" and not torch.cuda.is_available() and triton_available() and not kernels_enabled()
            and os.environ.get("HF_SCATTER_KERNELS", "").strip().lower() != "torch")


def kernel_path_summary(device: torch.device) -> str:
    """The path your code's tensors take on ``device``, and the one the demo checks where they differ: the
    same line in ``hf-scatter env`` and ``hf-scatter demo``."""
    yours = kernel_path(device)
    if needs_fresh_interpreter(device):
        checked = "triton-interpreter"
    else:
        with demo_kernels():
            checked = kernel_path(device)
    if checked == yours:
        return yours
    note = " (the fast CPU reference)" if yours == "torch" and device.type == "cpu" else ""
    return f"{yours} for {device.type} tensors in your code{note}; `hf-scatter demo` checks {checked}"


def format_report(report: dict[str, str]) -> str:
    width = max(map(len, report))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in report.items())
