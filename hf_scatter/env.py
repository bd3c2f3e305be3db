"""What `hf-scatter env` prints: versions, the device, and which kernel path runs there."""

from __future__ import annotations

import importlib.metadata
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
        report["triton mode"] = "off (no CUDA GPU; set TRITON_INTERPRET=1 to interpret the kernels on CPU)"
    else:
        report["triton mode"] = "interpreted (TRITON_INTERPRET=1)" if triton_interpreted() else "native (compiled)"
    path = kernel_path(device)
    if path == "torch" and device.type == "cpu" and triton_interpreted():
        path += " (the CPU reference; HF_SCATTER_KERNELS=triton runs the interpreted Triton kernels)"
    report["kernel path"] = path
    return report


def format_report(report: dict[str, str]) -> str:
    width = max(map(len, report))
    return "\n".join(f"{key:<{width}}  {value}" for key, value in report.items())
