"""Hardware profile: the measured roofs the performance model runs on.

Published performance models of offloaded inference over-predict because they take peak figures; this
one takes what ``hf-scatter profile`` measures on the machine (achieved matmul FLOP/s, copy bandwidths,
pinned and pageable PCIe in each direction and both at once, CPU decode attention, GEMM efficiency at
small row counts, launch overhead). Profiles are JSON, keyed by host and GPU, and can be written by hand;
a few are built in (:data:`KNOWN_PROFILES`) and a GPU from a spec sheet can be put on a measured host
(:meth:`HardwareProfile.with_gpu`) to plan for a machine you are not on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import re
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

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
    gpu_launch_s: float | None = None  # host time to issue one small GPU op (Python + dispatcher + launch)
    gemm_efficiency: list = field(default_factory=list)  # [[rows M, achieved / roofline of an [M,K]x[K,N] bf16 GEMM]]
    # [[rows per expert, achieved / roofline]] of the offloaded runtime's SwiGLU expert kernels (Mixtral-8x7B's
    # expert shape, block sizes as the runtime runs them): decode-sized MoE GEMMs reach less than dense ones
    moe_efficiency: list = field(default_factory=list)
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
            if key in ("gemm_efficiency", "moe_efficiency", "cpu_attention", "notes", "name", "host", "device",
                       "source", "date"):
                continue
            if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
                raise ValueError(f"{origin}: {key} must be a positive number or null, got {value!r}")
        return cls(**data)

    def save(self, path: str | None = None) -> str:
        """Write JSON atomically; default: the cache file for this profile's host and device."""
        path = path or default_profile_path(self.host, self.device)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)
        return path

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
        notes = {k: v for k, v in self.notes.items()
                 if k not in ("gpu_flops", "gpu_bandwidth", "gpu_memory", "gpu_attention_bandwidth", "gemm_efficiency")}
        for key in ("gpu_flops", "gpu_bandwidth", "gpu_memory"):
            notes[key] = note
        for key in ("h2d_pinned", "d2h_pinned", "duplex_pinned"):
            notes[key] = f"{gpu}: PCIe peak per direction from the bus generation (not measured)"
        return dataclasses.replace(
            self, name=f"{gpu} (spec sheet) on {self.name}", device=gpu, source=f"{gpu} spec sheet + {self.source}",
            gpu_attention_bandwidth=None, gemm_efficiency=[], h2d_pinned=link, d2h_pinned=link,
            duplex_pinned=2 * link, h2d_pageable=None, d2h_pageable=None, notes=notes, **spec)

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


def load_profile(ref: str | None = None) -> HardwareProfile:
    """A known profile by name, a JSON file, or (``None``) the saved profile of this host and device."""
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
    return HardwareProfile.from_dict(data, origin=path)


# ----- known hardware -----
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


# ----- measurement -----
def _median_s(fn: Callable[[], object], budget_s: float = 0.3, min_reps: int = 3, max_reps: int = 50) -> float:
    """Median wall time of ``fn`` (host work, or device work that ends in a synchronize)."""
    fn()
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (len(times) < max_reps and time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _cpu_matmul_flops(dtype, n: int) -> float:
    import torch

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2.0 * n**3 / _median_s(lambda: torch.mm(a, b))


def _cpu_copy_bandwidth(nbytes: int) -> float:
    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / _median_s(lambda: dst.copy_(src))


def _sdpa_decode(q, k, v):
    import torch.nn.functional as F

    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    except TypeError:  # torch < 2.5: expand the KV heads
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1))


def _attention_inputs(batch, context, q_heads, kv_heads, head_dim, device="cpu"):
    import torch

    q = torch.randn(batch, q_heads, 1, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(batch, kv_heads, context, head_dim, dtype=torch.bfloat16, device=device)
    return q, k, torch.randn_like(k)


def _cpu_attention_point(worker, batch: int, context: int, q_heads=32, kv_heads=8, head_dim=128) -> dict:
    """One decode step of ``batch`` requests of about ``context`` cached tokens through the runtime's own
    path: :meth:`KVCache.attend` (new K/V written, masked SDPA over one length bucket of prompts within
    +-10% of each other) on the attention worker thread, waited for by another thread: the per-call cost
    the runtime pays (about 0.3 ms on the H100 host)."""
    import torch

    from .cpu_attention import KVCache

    # longest first, mean ``context``
    lens = [round(context * (1.1 - 0.2 * i / (batch - 1))) for i in range(batch)] if batch > 1 else [context]
    cache = KVCache([[(p, p + 1) for p in lens]], 1, kv_heads, head_dim, q_heads, torch.bfloat16)
    qkv = torch.randn(batch, (q_heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    out = torch.empty(batch, q_heads * head_dim, dtype=torch.bfloat16)
    seconds = _median_s(lambda: worker.submit(cache.attend, 0, 0, 0, qkv, out).result(), budget_s=0.5)
    return dict(batch=batch, context=context, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=2,
                seconds=seconds)


@contextlib.contextmanager
def _link_traffic():
    """Pinned host->device copies running meanwhile (as the weights stream during decode: they take host
    memory bandwidth from the CPU's attention); nothing without a GPU."""
    import torch

    if not torch.cuda.is_available():
        yield False
        return
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    stop = threading.Event()

    def pump():
        stream = torch.cuda.Stream()
        while not stop.is_set():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    try:
        yield True
    finally:
        stop.set()
        thread.join()


def _cpu_op_seconds(calls: int = 2000) -> float:
    import torch

    a, b, out = torch.ones(8), torch.ones(8), torch.empty(8)
    torch.add(a, b, out=out)
    start = time.perf_counter()
    for _ in range(calls):
        torch.add(a, b, out=out)
    return (time.perf_counter() - start) / calls


def _cpu_memory_bytes() -> float | None:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def _gpu_measurements(quick: bool) -> list[tuple[str, Callable[[HardwareProfile], None]]]:
    """(label, step) pairs that fill the GPU and link fields."""
    import torch

    from ..bench.timing import median_ms

    dev = torch.device("cuda")
    copy_bytes = (64 if quick else 256) * 2**20

    def gpu_flops(p):
        n = 4096 if quick else 8192
        a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
        p.gpu_flops = 2.0 * n**3 / (median_ms(lambda: a @ b) / 1e3)
        p.gpu_memory = float(torch.cuda.get_device_properties(0).total_memory)

    def gpu_bandwidth(p):
        x = torch.empty((2**28 if quick else 2**30) // 2, device=dev, dtype=torch.bfloat16)  # 256 MiB / 1 GiB
        y = torch.empty_like(x)
        p.gpu_bandwidth = 2.0 * x.numel() * 2 / (median_ms(lambda: y.copy_(x)) / 1e3)

    def gemm_efficiency(p):
        k, n = 4096, 14336
        w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        points = []
        for m in ((1, 16, 256, 4096) if quick else (1, 4, 16, 64, 256, 1024, 4096, 16384)):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            seconds = median_ms(lambda: x @ w) / 1e3
            roofline = max(2.0 * m * k * n / p.gpu_flops, 2.0 * (k * n + m * k + m * n) / p.gpu_bandwidth)
            points.append([m, min(1.0, roofline / seconds)])
        p.gemm_efficiency = points

    def moe_efficiency(p):
        from ..kernels.backend import autotune_override
        from ..moe.mlp import expert_mlp, glu_activation

        E, H, inter, k = 8, 4096, (4096 if quick else 14336), 2  # Mixtral-8x7B's experts (quick: narrower)
        w_in = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        w_out = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        act = glu_activation(torch.nn.functional.silu)
        points = []
        with torch.no_grad(), autotune_override(False):  # as the offloaded runtime runs them
            for tokens in ((8, 128, 2048) if quick else (4, 16, 64, 256, 1024, 4096)):
                x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
                experts = torch.randint(0, E, (tokens, k), device=dev)
                gates = torch.rand(tokens, k, device=dev, dtype=torch.bfloat16)
                seconds = median_ms(lambda: expert_mlp(x, (w_in,), w_out, experts, gates, act, validate=False)) / 1e3
                active = torch.unique(experts).numel()
                flops = 6.0 * tokens * k * H * inter
                roofline = max(flops / p.gpu_flops, 3.0 * active * H * inter * 2 / p.gpu_bandwidth)
                points.append([tokens * k / E, min(1.0, roofline / seconds)])
        p.moe_efficiency = points

    def gpu_attention(p):
        q, kk, v = _attention_inputs(64, 2048, 32, 8, 128, device=dev)
        p.gpu_attention_bandwidth = 2.0 * kk.numel() * 2 / (median_ms(lambda: _sdpa_decode(q, kk, v)) / 1e3)

    def launch(p, calls=2000):
        # A tiny module call, as a decoder layer issues its ops: Python + nn.Module + dispatcher + launch.
        layer = torch.nn.Linear(16, 16, device=dev)
        x = torch.ones(1, 16, device=dev)
        with torch.no_grad():
            layer(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                layer(x)
            torch.cuda.synchronize()
        p.gpu_launch_s = (time.perf_counter() - start) / calls
        p.notes["gpu_launch_s"] = "measured: host time of one small nn.Linear call on the GPU"

    def link(p):
        n = copy_bytes // 2
        pinned_h = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        pageable_h = torch.empty(n, dtype=torch.bfloat16)
        d = torch.empty(n, device=dev, dtype=torch.bfloat16)
        d2 = torch.empty_like(d)
        rate = lambda fn: copy_bytes / (median_ms(fn) / 1e3)  # noqa: E731
        p.h2d_pinned = rate(lambda: d.copy_(pinned_h, non_blocking=True))
        p.h2d_pageable = rate(lambda: d.copy_(pageable_h))
        p.d2h_pinned = rate(lambda: pinned_h.copy_(d, non_blocking=True))
        p.d2h_pageable = rate(lambda: pageable_h.copy_(d))
        back_h = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

        def both():
            with torch.cuda.stream(s1):
                d.copy_(pinned_h, non_blocking=True)
            with torch.cuda.stream(s2):
                back_h.copy_(d2, non_blocking=True)
            torch.cuda.synchronize()

        p.duplex_pinned = 2 * copy_bytes / _median_s(both)
        small_h = torch.empty(2048, dtype=torch.bfloat16, pin_memory=True)
        small_d = torch.empty(2048, device=dev, dtype=torch.bfloat16)

        def small():
            small_d.copy_(small_h, non_blocking=True)
            torch.cuda.synchronize()

        p.transfer_latency_s = _median_s(small, budget_s=0.1)

    def host_dram(p):
        n = copy_bytes // 2
        pinned_h = torch.empty(n, dtype=torch.bfloat16, pin_memory=True)
        d = torch.empty(n, device=dev, dtype=torch.bfloat16)
        src, dst = torch.ones(copy_bytes // 4), torch.empty(copy_bytes // 4)
        repeats = 16
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.cuda.stream(side):
            for _ in range(repeats):
                d.copy_(pinned_h, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        cpu_bytes = 0
        while not done.query():
            dst.copy_(src)
            cpu_bytes += 2 * copy_bytes
        elapsed = time.perf_counter() - start
        if cpu_bytes < 4 * copy_bytes:  # the copies did not overlap long enough to say anything
            p.notes["host_dram_bandwidth"] = "not measured: the CPU copies did not overlap the transfers"
            return
        p.host_dram_bandwidth = (cpu_bytes + repeats * copy_bytes) / elapsed
        p.notes["host_dram_bandwidth"] = (f"measured: CPU copy {cpu_bytes / elapsed / 1e9:.1f} GB/s while pinned H2D "
                                          f"ran {repeats * copy_bytes / elapsed / 1e9:.1f} GB/s")

    steps = [("GPU matmul", gpu_flops), ("GPU copy", gpu_bandwidth), ("GEMM efficiency", gemm_efficiency),
             ("MoE kernel efficiency", moe_efficiency),
             ("GPU attention", gpu_attention), ("GPU launch", launch), ("PCIe", link), ("host DRAM", host_dram)]
    return steps


def measure_profile(quick: bool = False, progress: bool = True) -> HardwareProfile:
    """Measure this machine (about 30 s with a GPU, ``quick``: a few seconds). Without a CUDA GPU only the CPU
    terms are filled and ``notes['gpu']`` says the GPU terms are missing."""
    import torch
    from tqdm import tqdm

    host, device = current_machine()
    profile = HardwareProfile(name=f"{host} / {device}", host=host, device=device, source="measured",
                              date=time.strftime("%Y-%m-%d %H:%M:%S"), cpu_cores=os.cpu_count(),
                              cpu_threads=torch.get_num_threads(), cpu_memory=_cpu_memory_bytes())
    n = 1024 if quick else 2048
    contexts = (256, 2048) if quick else (256, 1024, 4096)

    def attention(p):
        from .cpu_attention import AttentionWorker, attention_threads

        worker = AttentionWorker(attention_threads(p))
        try:
            with _link_traffic() as busy:
                p.cpu_attention = [_cpu_attention_point(worker, b, c) for c in contexts for b in (1, 4, 32)]
        finally:
            worker.close()
        p.notes["cpu_attention"] = ("measured: KVCache.attend on the attention worker, one masked length bucket"
                                    + (", pinned host->device copies running meanwhile" if busy else ""))

    steps = [
        ("CPU fp32 matmul", lambda p: setattr(p, "cpu_flops_fp32", _cpu_matmul_flops(torch.float32, n))),
        ("CPU bf16 matmul", lambda p: setattr(p, "cpu_flops_bf16", _cpu_matmul_flops(torch.bfloat16, n))),
        ("CPU copy", lambda p: setattr(p, "cpu_bandwidth", _cpu_copy_bandwidth((64 if quick else 256) * 2**20))),
        ("CPU attention", attention),
        ("CPU op overhead", lambda p: setattr(p, "cpu_op_s", _cpu_op_seconds())),
    ]
    if torch.cuda.is_available():
        steps += _gpu_measurements(quick)
    else:
        profile.notes["gpu"] = ("no CUDA device: GPU and PCIe terms not measured (run `hf-scatter profile` on the "
                                "GPU host)")
    for label, step in tqdm(steps, desc="profile", disable=not progress):
        step(profile)
    return profile
