"""Hardware profile: the format of the measured roofs the performance model runs on, and where profiles live.

Published performance models of offloaded inference over-predict because they take peak figures; this
one takes what ``hf-scatter profile`` measures on the machine (achieved matmul FLOP/s, copy bandwidths,
pinned and pageable PCIe in each direction and both at once, CPU decode attention, GEMM efficiency at
small row counts, launch overhead). Profiles are JSON, keyed by host and GPU, and can be written by hand;
a GPU from a spec sheet (:data:`GPU_SPECS`) can be put on a measured host (:meth:`HardwareProfile.with_gpu`)
to plan for a machine you are not on. Built-in profiles: :mod:`.known_profiles`; measuring one:
:mod:`hf_scatter.offload.measure`.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
from dataclasses import dataclass, field

from ...common.atomic_files import write_json

FORMAT = "hf-scatter-profile/1"

# Fields the performance model cannot do without; the rest are calibration terms that sharpen it.
REQUIRED = ("gpu_flops", "gpu_bandwidth", "h2d_pinned", "cpu_flops_bf16", "cpu_bandwidth", "cpu_memory")


@dataclass
class HardwareProfile:
    """Achieved rates of one host + GPU, SI units: FLOP/s, bytes/s (copies count bytes read + written),
    bytes, seconds. ``None`` means not measured; ``notes`` says where each figure comes from."""

    name: str
    host: str = ""
    device: str = ""
    source: str = "hand-written"
    date: str = ""
    # GPU
    gpu_flops: float | None = None  # bf16 dense matmul, large square
    gpu_bandwidth: float | None = None  # device-to-device copy
    gpu_memory: float | None = None
    gpu_attention_bandwidth: float | None = None  # KV bytes/s of bf16 decode attention
    gpu_launch_s: float | None = None  # host time to issue one GPU kernel the planner counts (its notes say how timed)
    gemm_efficiency: list = field(default_factory=list)  # [[rows M, achieved / roofline of an [M,K]x[K,N] bf16 GEMM]]
    # [[rows per expert, achieved / roofline]] of the offloaded runtime's SwiGLU expert kernels (Mixtral-8x7B's
    # expert shape, block sizes as the runtime runs them): decode-sized MoE GEMMs reach less than dense ones
    moe_efficiency: list = field(default_factory=list)
    # the same kernels reading MXFP4 weights (GPT-OSS as shipped), against the roofline of MXFP4's bytes: decoding
    # in registers makes them slower per FLOP than bf16's on GPUs without FP4 tensor cores
    mxfp4_moe_efficiency: list = field(default_factory=list)
    # and reading block-scaled FP8 weights (Qwen3-FP8, DeepSeek-V3 as shipped), against the roofline of FP8's bytes
    fp8_moe_efficiency: list = field(default_factory=list)
    # the same kernels on a planned model's own experts (``bench offload``, ``hf-scatter profile --model``), which the
    # planner prefers for that shape: [{"hidden", "intermediate", "format": "bf16" | "mxfp4" | "fp8", "points":
    # [[rows per expert, achieved / roofline]]}]. GPT-OSS-120B's 2880-wide MXFP4 experts ran a 2048-token prefill
    # stage in 4.3 ms where Mixtral's curve priced it at 3.6 (H200 host)
    moe_efficiency_by_shape: list = field(default_factory=list)
    # CPU <-> GPU link
    h2d_pinned: float | None = None
    h2d_pageable: float | None = None
    d2h_pinned: float | None = None
    d2h_pageable: float | None = None
    duplex_pinned: float | None = None  # both directions at once, total
    transfer_latency_s: float | None = None  # one small pinned copy
    # CPU
    cpu_cores: int | None = None
    cpu_threads: int | None = None
    cpu_flops_fp32: float | None = None
    cpu_flops_bf16: float | None = None
    cpu_bandwidth: float | None = None  # copy, read + write
    cpu_memory: float | None = None
    # raw points: batch, context, q_heads, kv_heads, head_dim, dtype_bytes, seconds
    cpu_attention: list = field(default_factory=list)
    cpu_op_s: float | None = None  # one small torch op on the CPU
    host_dram_bandwidth: float | None = None  # CPU copy + pinned H2D running at once, total bytes/s
    # several GPUs of the host (tensor-parallel plans, :mod:`.tensor_parallel`)
    gpus: int | None = None  # GPUs on the host
    h2d_pinned_concurrent: list = field(default_factory=list)  # [[GPUs, total bytes/s]] pinned H2D to each at once
    allreduce_bus_bandwidth: float | None = None  # NCCL all-reduce of a block's hidden states, bus bytes/s
    allreduce_latency_s: float | None = None  # one small all-reduce
    # [[ranks, time]]: a decode step's CPU attention with that many ranks at once (each its share of the heads and
    # cores; the slowest rank) over one process's with every head and core
    cpu_attention_group: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)

    # ----- persistence -----
    def to_dict(self) -> dict:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    @classmethod
    def from_dict(cls, data: dict, origin: str = "profile") -> "HardwareProfile":
        data = dict(data)
        fmt = data.pop("format", FORMAT)
        if fmt != FORMAT:
            raise ValueError(f"{origin}: format {fmt!r} is not {FORMAT!r}; re-run `hf-scatter profile`")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{origin}: unknown field(s) {', '.join(unknown)}; valid fields: "
                             f"{', '.join(sorted(known))}")
        if "name" not in data:
            data["name"] = os.path.basename(origin)
        for key, value in data.items():
            if key in ("gemm_efficiency", "moe_efficiency", "mxfp4_moe_efficiency", "fp8_moe_efficiency",
                       "moe_efficiency_by_shape", "cpu_attention", "h2d_pinned_concurrent", "notes",
                       "cpu_attention_group", "name", "host", "device", "source", "date"):
                continue
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{origin}: {key} must be a positive number or null, got {value!r}")
        return cls(**data)

    def save(self, path: str | None = None) -> str:
        """Write JSON atomically; default: the cache file for this profile's host and device."""
        return write_json(path or default_profile_path(self.host, self.device), self.to_dict(), make_parents=True)

    # ----- use -----
    def missing(self, fields: tuple[str, ...] = REQUIRED) -> list[str]:
        return [name for name in fields if getattr(self, name) is None]

    def with_gpu(self, gpu: str) -> "HardwareProfile":
        """This host with a GPU from :data:`GPU_SPECS` (spec-sheet peaks, no efficiency data)."""
        if gpu not in GPU_SPECS:
            raise ValueError(f"unknown GPU {gpu!r}: choose one of {', '.join(GPU_SPECS)}")
        spec = dict(GPU_SPECS[gpu])
        note = spec.pop("note")
        link = spec.pop("pcie")
        measured_on_the_gpu = ("gpu_flops", "gpu_bandwidth", "gpu_memory", "gpu_attention_bandwidth", "gemm_efficiency",
                               "moe_efficiency", "mxfp4_moe_efficiency", "fp8_moe_efficiency",
                               "moe_efficiency_by_shape")
        notes = {k: v for k, v in self.notes.items() if k not in measured_on_the_gpu}
        for key in ("gpu_flops", "gpu_bandwidth", "gpu_memory"):
            notes[key] = note
        for key in ("h2d_pinned", "d2h_pinned", "duplex_pinned"):
            notes[key] = f"{gpu}: PCIe peak per direction from the bus generation (not measured)"
        return dataclasses.replace(
            self, name=f"{gpu} (spec sheet) on {self.name}", device=gpu, source=f"{gpu} spec sheet + {self.source}",
            gpu_attention_bandwidth=None, gemm_efficiency=[], moe_efficiency=[], mxfp4_moe_efficiency=[],
            fp8_moe_efficiency=[], moe_efficiency_by_shape=[], h2d_pinned=link, d2h_pinned=link,
            duplex_pinned=2 * link, h2d_pageable=None, d2h_pageable=None, h2d_pinned_concurrent=[],
            allreduce_bus_bandwidth=None, allreduce_latency_s=None, notes=notes, **spec)

    def summary_rows(self) -> list[list[str]]:
        """(quantity, value, source) rows for a Markdown table."""

        def rate(v, unit, scale):
            return "not measured" if v is None else f"{v / scale:,.1f} {unit}"

        rows = [
            ("GPU bf16 matmul", "gpu_flops", rate(self.gpu_flops, "TFLOP/s", 1e12)),
            ("GPU copy bandwidth (read+write)", "gpu_bandwidth", rate(self.gpu_bandwidth, "GB/s", 1e9)),
            ("GPU decode attention (KV bytes)", "gpu_attention_bandwidth",
             rate(self.gpu_attention_bandwidth, "GB/s", 1e9)),
            ("GPU memory", "gpu_memory", rate(self.gpu_memory, "GiB", 2**30)),
            ("GPU op launch", "gpu_launch_s", rate(self.gpu_launch_s, "us", 1e-6)),
            ("GEMM efficiency (rows: achieved/roofline)", "gemm_efficiency",
             ", ".join(f"{int(m)}: {e:.2f}" for m, e in self.gemm_efficiency) or "not measured"),
            ("expert kernels on models' own experts (rows per expert: achieved/roofline)", "moe_efficiency_by_shape",
             "; ".join(f"{c['hidden']}x{c['intermediate']} {c['format']}: "
                       + ", ".join(f"{m:g}: {e:.2f}" for m, e in c["points"]) for c in self.moe_efficiency_by_shape)
             or "not measured"),
            ("host->device pinned / pageable", "h2d_pinned",
             f"{rate(self.h2d_pinned, 'GB/s', 1e9)} / {rate(self.h2d_pageable, 'GB/s', 1e9)}"),
            ("device->host pinned / pageable", "d2h_pinned",
             f"{rate(self.d2h_pinned, 'GB/s', 1e9)} / {rate(self.d2h_pageable, 'GB/s', 1e9)}"),
            ("both directions at once (total)", "duplex_pinned", rate(self.duplex_pinned, "GB/s", 1e9)),
            ("small-copy latency", "transfer_latency_s", rate(self.transfer_latency_s, "us", 1e-6)),
            ("CPU matmul fp32 / bf16", "cpu_flops_fp32",
             f"{rate(self.cpu_flops_fp32, 'GFLOP/s', 1e9)} / {rate(self.cpu_flops_bf16, 'GFLOP/s', 1e9)}"),
            ("CPU copy bandwidth (read+write)", "cpu_bandwidth", rate(self.cpu_bandwidth, "GB/s", 1e9)),
            ("CPU memory", "cpu_memory", rate(self.cpu_memory, "GiB", 2**30)),
            ("CPU decode attention", "cpu_attention",
             "; ".join(f"B={p['batch']} ctx={p['context']}: {p['seconds'] * 1e3:.2f} ms" for p in self.cpu_attention)
             or "not measured"),
            ("CPU small op", "cpu_op_s", rate(self.cpu_op_s, "us", 1e-6)),
            ("host DRAM, CPU copy + H2D at once", "host_dram_bandwidth", rate(self.host_dram_bandwidth, "GB/s", 1e9)),
            ("GPUs on the host", "gpus", "not measured" if self.gpus is None else str(self.gpus)),
            ("pinned host->device to several GPUs at once (total)", "h2d_pinned_concurrent",
             ", ".join(f"{int(n)} GPUs: {r / 1e9:,.1f} GB/s" for n, r in self.h2d_pinned_concurrent)
             or "not measured"),
            ("all-reduce bus bandwidth / latency", "allreduce_bus_bandwidth",
             f"{rate(self.allreduce_bus_bandwidth, 'GB/s', 1e9)} / {rate(self.allreduce_latency_s, 'us', 1e-6)}"),
            ("CPU attention of several ranks at once, over one process's", "cpu_attention_group",
             ", ".join(f"{int(n)} ranks: {r:.2f}x" for n, r in self.cpu_attention_group) or "not measured"),
        ]
        return [[label, value, self.notes.get(key, self.source if getattr(self, key) not in (None, []) else "")]
                for label, key, value in rows]


# ----- where profiles live -----
def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "unknown"


def profile_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hf_scatter", "profiles")


def current_machine() -> tuple[str, str]:
    """(host, device) of this process: the device is the first CUDA GPU's name, or 'cpu'."""
    import torch

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return platform.node(), device


def default_profile_path(host: str | None = None, device: str | None = None) -> str:
    if host is None or device is None:
        here = current_machine()
        host, device = host or here[0], device or here[1]
    return os.path.join(profile_dir(), f"{_slug(host)}__{_slug(device)}.json")


def host_memory_bytes() -> float | None:
    """Physical memory of this machine, or None where the OS does not say."""
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


# ----- spec sheets -----
_GEN3, _GEN4, _GEN5 = 15.75e9, 31.5e9, 63.0e9  # PCIe x16 peak per direction
GPU_SPECS = {
    "t4": dict(gpu_flops=65e12, gpu_bandwidth=320e9, gpu_memory=16e9, pcie=_GEN3,
               note="NVIDIA T4 spec sheet: 65 TFLOP/s fp16 tensor (no bf16), 320 GB/s, 16 GB, PCIe Gen3 x16; peak"),
    "l4": dict(gpu_flops=121e12, gpu_bandwidth=300e9, gpu_memory=24e9, pcie=_GEN4,
               note="NVIDIA L4 spec sheet: 121 TFLOP/s bf16 dense, 300 GB/s, 24 GB, PCIe Gen4 x16; peak"),
    "a100-40gb": dict(gpu_flops=312e12, gpu_bandwidth=1555e9, gpu_memory=40e9, pcie=_GEN4,
                      note="NVIDIA A100 40GB spec sheet: 312 TFLOP/s bf16 dense, 1555 GB/s, PCIe Gen4 x16; peak"),
    "h100-pcie": dict(gpu_flops=756e12, gpu_bandwidth=2000e9, gpu_memory=80e9, pcie=_GEN5,
                      note="NVIDIA H100 PCIe spec sheet: 756 TFLOP/s bf16 dense, 2.0 TB/s, PCIe Gen5 x16; peak"),
}
