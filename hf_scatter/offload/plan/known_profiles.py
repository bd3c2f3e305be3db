"""The hardware profiles hf-scatter knows by name, and :func:`load_profile`: a known name, a JSON file, or this
machine's saved profile."""

from __future__ import annotations

import json
import os
from typing import Callable

from .profile import HardwareProfile, current_machine, default_profile_path


# The team's reference measurements of the H100 host hf-scatter is benchmarked on (November 2026).
_ANCHORS = "hf-scatter reference measurements, H100 host, 2026-11"


def h100_host_anchors() -> HardwareProfile:
    """The H100 machine hf-scatter is benchmarked on, from the team's reference measurements (torch 2.11,
    November 2026). Derived entries say how they were derived."""
    notes = {key: _ANCHORS for key in ("gpu_flops", "gpu_bandwidth", "h2d_pinned", "d2h_pinned", "duplex_pinned",
                                       "cpu_flops_fp32", "cpu_bandwidth", "cpu_attention", "cpu_cores")}
    notes.update(
        gpu_memory="H100 80GB (nominal)",
        h2d_pageable=_ANCHORS,
        cpu_memory="lent H100 machine description: 16 CPU cores, 128 GiB memory",
        gemm_efficiency=("derived from the reference measurements: rows 16 = Mixtral decode T=64, HF grouped_mm 1.89 ms vs HBM floor "
                         "0.95 ms; rows 2048 = Mixtral prefill T=8192, grouped_mm 13.3 ms = 434 of 778 TFLOP/s; "
                         "rows 16384 = cuBLAS 16384x4096x28672, 724 of 778 TFLOP/s"),
        gpu_launch_s=("derived from the reference measurements: BERT-base B=1 S=40 HF eager 8.7 ms, launch-bound, about 220 "
                      "small ops -> ~40 us per op"),
        cpu_flops_bf16=_ANCHORS,
    )
    return HardwareProfile(
        name="h100-host-anchors", host="H100 machine (reference measurements)", device="NVIDIA H100 80GB HBM3",
        source=_ANCHORS, date="2026-11", gpu_flops=778e12, gpu_bandwidth=2954e9, gpu_memory=80e9,
        gpu_launch_s=40e-6, gemm_efficiency=[[16, 0.95 / 1.89], [2048, 434 / 778], [16384, 724 / 778]],
        h2d_pinned=55e9, h2d_pageable=18e9, d2h_pinned=55e9, duplex_pinned=91e9, cpu_cores=16, cpu_threads=16,
        cpu_flops_fp32=680e9, cpu_flops_bf16=900e9, cpu_bandwidth=57e9, cpu_memory=128 * 2**30,
        cpu_attention=[dict(batch=64, context=512, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2, seconds=4.4e-3),
                       dict(batch=64, context=2048, q_heads=32, kv_heads=8, head_dim=128, dtype_bytes=2,
                            seconds=20.7e-3)],
        notes=notes)


KNOWN_PROFILES: dict[str, Callable[[], HardwareProfile]] = {"h100-host-anchors": h100_host_anchors}


def load_profile(ref: str | None = None) -> HardwareProfile:
    """A known profile by name, a JSON file (a profile, or a bench report: the profile it ran on, under
    ``"profile"``), or (``None``) the saved profile of this host and device."""
    if ref in KNOWN_PROFILES:
        return KNOWN_PROFILES[ref]()
    path = ref or default_profile_path()
    if not os.path.isfile(path):
        if ref is None:
            host, device = current_machine()
            raise FileNotFoundError(
                f"no saved profile for this machine (host {host!r}, device {device!r}) at {path}: run "
                f"`hf-scatter profile`, or pass one of the known profiles ({', '.join(KNOWN_PROFILES)}) or a JSON file")
        raise FileNotFoundError(f"profile {ref!r} is neither a known profile ({', '.join(KNOWN_PROFILES)}) nor a file")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
    if isinstance(data, dict) and isinstance(data.get("profile"), dict):
        data = data["profile"]  # a bench report's own profile: plan again on the host it measured
    return HardwareProfile.from_dict(data, origin=path)
