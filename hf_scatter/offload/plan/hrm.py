"""HRM, the hierarchical roofline model (MoE-Lightning, sec. 3): one roofline per memory level, one across them.

For an op of ``F`` FLOPs over ``B`` bytes at intensity ``I = F / B``:

* GPU level: ``P = min(gpu_flops, gpu_bandwidth * I)``; CPU level: ``P = min(cpu_flops, cpu_bandwidth * I)``.
* Cross level (data in CPU memory, computed on the GPU): ``P = min(gpu_flops, link_bandwidth * I_link)`` with
  ``I_link`` = FLOPs per byte that must cross the CPU->GPU link.

Turning points: ``P1`` (:attr:`TurningPoints.cpu_gpu`) is the intensity above which data living in CPU memory
is better shipped to the GPU than computed where it is; ``P2`` (:attr:`TurningPoints.link_gpu`) is where the
cross-level roof meets the GPU's compute (or the kernel's achieved performance): past it, streaming no longer
limits the op. The *balance point* of an op is the batch size that puts its operating point at ``P2``.

Plain roofs over-predict. :class:`HierarchicalRoofline` therefore times ops with the measured calibration terms
of the profile, each explicit: GEMM efficiency as a function of rows (small decode GEMMs reach a fraction of
the bandwidth roof), a launch cost per GPU op, CPU decode attention at its measured, context-dependent rate
plus a per-call overhead, a per-op CPU dispatch cost and a per-copy latency. A term the profile lacks counts
as zero (or efficiency 1) and is listed in :attr:`HierarchicalRoofline.uncalibrated`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..families.spec import EXPERT_FORMATS, ModelSpec, OpCost
from .profile import HardwareProfile
from .tensor_parallel import TensorParallel, group_profile


class ProfileError(ValueError):
    """The hardware profile lacks what the model needs."""


@dataclass(frozen=True)
class Roofs:
    gpu_flops: float
    gpu_bandwidth: float
    cpu_flops: float
    cpu_bandwidth: float
    link_bandwidth: float  # CPU -> GPU, pinned

    @classmethod
    def from_profile(cls, profile: HardwareProfile) -> "Roofs":
        missing = profile.missing()
        if missing:
            from .known_profiles import KNOWN_PROFILES
            from .profile import GPU_SPECS

            raise ProfileError(f"profile {profile.name!r} lacks {', '.join(missing)}: run `hf-scatter profile` on the "
                               f"GPU host, plan for a spec-sheet GPU on this host with --gpu "
                               f"{{{','.join(GPU_SPECS)}}}, use a known profile (--profile "
                               f"{' or '.join(KNOWN_PROFILES)}), or fill them in the profile JSON")
        return cls(profile.gpu_flops, profile.gpu_bandwidth, profile.cpu_flops_bf16, profile.cpu_bandwidth,
                   profile.h2d_pinned)

    def gpu(self, intensity: float) -> float:
        return min(self.gpu_flops, self.gpu_bandwidth * intensity)

    def cpu(self, intensity: float) -> float:
        return min(self.cpu_flops, self.cpu_bandwidth * intensity)

    def cross(self, link_intensity: float, gpu_perf: float | None = None) -> float:
        """GPU computing on data that crosses the link: ``gpu_perf`` (default: the GPU roof) caps it."""
        return min(self.gpu_flops if gpu_perf is None else gpu_perf, self.link_bandwidth * link_intensity)


@dataclass(frozen=True)
class TurningPoints:
    """Intensities (FLOP/byte) where the best place or the binding roof changes."""

    gpu_ridge: float  # gpu_flops / gpu_bandwidth: compute-bound above
    cpu_ridge: float  # cpu_flops / cpu_bandwidth
    cpu_gpu: float  # P1: data in CPU memory is computed faster on the GPU above this (0: always; inf: never)
    link_gpu: float  # P2: cross-level roof meets the GPU (kernel) performance

    def to_dict(self) -> dict:
        return {"gpu_ridge": self.gpu_ridge, "cpu_ridge": self.cpu_ridge, "P1_cpu_gpu": self.cpu_gpu,
                "P2_link_gpu": self.link_gpu}


def turning_points(roofs: Roofs, gpu_perf: float | None = None) -> TurningPoints:
    """``gpu_perf``: the op's achieved GPU FLOP/s (e.g. the MoE kernel at its micro-batch); default the roof."""
    perf = roofs.gpu_flops if gpu_perf is None else gpu_perf
    return TurningPoints(gpu_ridge=roofs.gpu_flops / roofs.gpu_bandwidth,
                         cpu_ridge=roofs.cpu_flops / roofs.cpu_bandwidth,
                         cpu_gpu=_cpu_gpu_turning(roofs.cpu_flops, roofs.cpu_bandwidth, perf, roofs.link_bandwidth),
                         link_gpu=perf / roofs.link_bandwidth)


def _cpu_gpu_turning(cpu_flops: float, cpu_bw: float, gpu_flops: float, link_bw: float) -> float:
    """Smallest I from which min(gpu_flops, link_bw I) >= min(cpu_flops, cpu_bw I) for every larger I."""
    if gpu_flops < cpu_flops:
        return math.inf  # at high intensity the CPU stays ahead
    if link_bw >= cpu_bw:
        return 0.0  # the link feeds the GPU at least as fast as CPU memory feeds the CPU
    return cpu_flops / link_bw  # the CPU is compute-bound where the cross roof reaches it


class HierarchicalRoofline:
    """Roofs, turning points and calibrated op times of one hardware profile; with ``gpus`` > 1, of that many of
    its host's GPUs as one tensor-parallel group (:mod:`.tensor_parallel`: the roofs are the group's, the
    all-reduces :attr:`tensor_parallel`'s)."""

    def __init__(self, profile: HardwareProfile, gpus: int = 1):
        self.profile = profile  # per GPU: budgets and capacities are per GPU
        self.tensor_parallel, assumed = TensorParallel.from_profile(profile, gpus)
        p = group_profile(profile, self.tensor_parallel)
        self.roofs = Roofs.from_profile(p)
        self.uncalibrated: list[str] = list(assumed)
        self._gpu_seconds: dict[OpCost, float] = {}

        def term(name, value, fallback, why):
            if value is None:
                self.uncalibrated.append(f"{name} ({why})")
                return fallback
            return value

        self.launch_s = term("gpu_launch_s", p.gpu_launch_s, 0.0, "GPU launch overhead taken as zero")
        self.cpu_op_s = term("cpu_op_s", p.cpu_op_s, 0.0, "CPU dispatch overhead taken as zero")
        self.latency_s = term("transfer_latency_s", p.transfer_latency_s, 0.0, "copy latency taken as zero")
        self.d2h_bandwidth = term("d2h_pinned", p.d2h_pinned, p.h2d_pinned, "device->host taken equal to host->device")
        self.duplex_bandwidth = term("duplex_pinned", p.duplex_pinned, math.inf, "no shared-link limit")
        self.host_dram_bandwidth = term("host_dram_bandwidth", p.host_dram_bandwidth, math.inf,
                                        "no host-memory contention between CPU work and DMA")
        self.gpu_attention_bandwidth = term("gpu_attention_bandwidth", p.gpu_attention_bandwidth, p.gpu_bandwidth,
                                            "GPU attention at the copy bandwidth")
        self._gemm = _efficiency_curve(p, "gemm_efficiency")
        if self._gemm is None:
            self.uncalibrated.append("gemm_efficiency (GEMMs at the roofline: optimistic)")
        self._moe = _efficiency_curve(p, "moe_efficiency")
        if self._moe is None:
            self.uncalibrated.append("moe_efficiency (expert GEMMs at the dense GEMM efficiency)")
        # each quantized format's expert kernels (None: at bf16's curve)
        self._moe_by_format = {f: _efficiency_curve(p, f"{f}_moe_efficiency") for f in EXPERT_FORMATS if f}
        # and on models' own experts: (hidden, intermediate, format) -> curve
        self._moe_by_shape = _moe_shape_curves(p)
        # CPU attention: the profile's standard shape (its first points), and any model shapes measured besides
        by_shape: dict[tuple, list] = {}
        for pt in p.cpu_attention or []:
            by_shape.setdefault(attention_shape(pt), []).append(pt)
        self._cpu_attention_by_shape = {shape: _fit_cpu_attention(pts) for shape, pts in by_shape.items()}
        standard = next(iter(by_shape), None)
        self._cpu_attention = self._cpu_attention_by_shape.get(standard)
        self._attention_group = standard[0] / standard[1] if standard and standard[1] else 1.0
        if self._cpu_attention is None:
            self.uncalibrated.append("cpu_attention (CPU attention at the CPU copy bandwidth)")

    @property
    def gpus(self) -> int:
        return self.tensor_parallel.gpus

    # ----- calibration terms -----
    def gemm_efficiency(self, rows: float, moe: bool = False, weight_format: str = "", expert_shape: tuple = ()
                        ) -> float:
        """Achieved / roofline time of a GEMM with ``rows`` rows (``moe``: of the grouped expert kernels at
        ``rows`` per expert; ``weight_format`` "mxfp4" or "fp8": reading weights in that format, where the
        profile measured them; ``expert_shape`` (hidden, intermediate): on experts of that shape, where the
        profile measured them): log-linear between measured points, flat outside them."""
        curve = self._moe if moe and self._moe is not None else self._gemm
        if moe and self._moe_by_format.get(weight_format) is not None:
            curve = self._moe_by_format[weight_format]
        if moe and expert_shape:
            curve = self._moe_by_shape.get(moe_shape_key(expert_shape, weight_format), curve)
        if curve is None:
            return 1.0
        return float(np.interp(math.log(max(rows, 1e-9)), *curve))

    def _measured_shape(self, model: ModelSpec | None):
        """The fit of CPU attention measured at ``model``'s own attention shape, if the profile has one; for a model
        with sinks, a profile measured before they were (2026-11-28) gives its shape without them, which is closer
        than the standard shape scaled."""
        if model is None:
            return None
        shape = attention_shape(model)
        fit = self._cpu_attention_by_shape.get(shape)
        return fit if fit is not None or not shape[4] else self._cpu_attention_by_shape.get(shape[:4] + (False,))

    def cpu_attention_rate(self, context: float, model: ModelSpec | None = None) -> tuple[float, float]:
        """(KV bytes/s, seconds of overhead per call) of CPU decode attention at this context length: measured
        at ``model``'s attention shape where the profile has it, else at the profile's standard shape."""
        fit = self._measured_shape(model) or self._cpu_attention
        if fit is None:
            return self.roofs.cpu_bandwidth, 0.0
        log_ctx, rates, overhead = fit
        return float(np.exp(np.interp(math.log(max(context, 1.0)), log_ctx, np.log(rates)))), overhead

    # ----- op times -----
    def gpu_seconds(self, op: OpCost) -> float:
        """Roofline time of ``op`` on the GPU divided by the GEMM efficiency at its row count (attention:
        at the measured decode-attention bandwidth). Launch costs are separate (:attr:`launch_s`). Remembered per
        op: a policy search asks for the same ops about fifty times each."""
        seconds = self._gpu_seconds.get(op)
        if seconds is None:
            seconds = self._gpu_seconds[op] = self._gpu_roofline_seconds(op)
        return seconds

    def _gpu_roofline_seconds(self, op: OpCost) -> float:
        if op.flops == 0 and op.bytes == 0:
            return 0.0
        if op.name == "attention" and op.kv_bytes > 0 and op.weight_bytes == 0:
            memory = op.kv_bytes / self.gpu_attention_bandwidth
            return max(op.flops / self.roofs.gpu_flops, memory)
        roof = max(op.flops / self.roofs.gpu_flops, op.bytes / self.roofs.gpu_bandwidth)
        return roof / self.gemm_efficiency(op.rows, op.moe, op.weight_format, self._rank_expert_shape(op))

    def _rank_expert_shape(self, op: OpCost) -> tuple:
        """The experts one GPU of the group computes: a tensor-parallel rank holds 1/N of each expert's
        intermediate columns (``families.sharding``), so its kernels run that narrower shape."""
        if not op.expert_shape or self.gpus == 1:
            return op.expert_shape
        hidden, intermediate = op.expert_shape
        return (hidden, intermediate // self.gpus) if intermediate % self.gpus == 0 else ()

    def calibrates(self, weight_format: str) -> bool:
        """Whether the profile measured the expert kernels reading weights in ``weight_format``."""
        return not weight_format or self._moe_by_format.get(weight_format) is not None or \
            any(key[2] == weight_format for key in self._moe_by_shape)

    def cpu_attention_bytes_per_token(self, model: ModelSpec) -> float:
        """What one cached token costs CPU decode attention, in the KV bytes the measured rate counts: its K and
        V (also where the cache holds the keys once: MLA's latent is read for the scores and again as the
        values). Measured at the model's own shape, that is all; otherwise it is scaled by how many more query
        heads share each KV head than in the standard shape's points. The CPU computes for every query head:
        Qwen3-MoE (8 per KV head) took twice as long per KV byte as the profile's 4 (H100 host, 2026-11), but
        how the time grows with the group depends on the head size and the CPU, so the bench measures the
        model's shape and this scaling is only the fallback."""
        k_and_v = 2 * model.kv_dim * model.kv_dtype_bytes
        if self._measured_shape(model) is not None:
            return k_and_v
        return k_and_v * max(1.0, model.heads / model.kv_heads / self._attention_group)

    def cpu_attention_seconds(self, batch: float, context: float, bytes_per_token: float,
                              model: ModelSpec | None = None) -> float:
        """One CPU decode-attention call over ``batch`` sequences of ``context`` cached tokens
        (``bytes_per_token``: :meth:`cpu_attention_bytes_per_token`, at ``model``'s rate)."""
        rate, overhead = self.cpu_attention_rate(context, model)
        return overhead + batch * context * bytes_per_token / rate

    def cpu_seconds(self, op: OpCost) -> float:
        """A GEMM-like op on the CPU (bf16 FLOP/s, copy bandwidth)."""
        return max(op.flops / self.roofs.cpu_flops, op.bytes / self.roofs.cpu_bandwidth)

    # ----- analysis -----
    def turning_points(self, gpu_perf: float | None = None) -> TurningPoints:
        return turning_points(self.roofs, gpu_perf)

    def ffn_gpu_performance(self, model: ModelSpec, micro_batch: float) -> float:
        """Achieved FLOP/s of the (MoE) FFN on the GPU at this micro-batch, launches included."""
        op = model.decode_ops(micro_batch, 1)["ffn"]
        return op.flops / (self.gpu_seconds(op) + op.kernels * self.launch_s)

    def balance_batch_size(self, model: ModelSpec, micro_batch: float, weights_gpu_fraction: float = 0.0) -> float:
        """Batch size N at which the FFN, its weights streamed over the link, sits at P2: its link intensity
        ``2 N k / ((1 - r_w) E b)`` equals ``P_ffn(mu) / link_bandwidth``. More N no longer raises throughput."""
        if weights_gpu_fraction >= 1.0:
            return math.inf
        p2 = self.turning_points(self.ffn_gpu_performance(model, micro_batch)).link_gpu
        streamed = (1 - weights_gpu_fraction) * model.ffn_weight_bytes  # bytes over the link per layer and step
        flops_per_sequence = 6.0 * model.top_k * model.hidden * model.intermediate
        return p2 * streamed / flops_per_sequence


def _efficiency_curve(profile: HardwareProfile, field: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(log rows, efficiency) of a profile's ``[[rows, achieved / roofline], ...]`` points."""
    points = getattr(profile, field)
    return _efficiency_points(points, profile.name, field) if points else None


def _efficiency_points(points: list, name: str, field: str) -> tuple[np.ndarray, np.ndarray]:
    pts = sorted((float(m), float(e)) for m, e in points)
    if not pts or any(not 0 < e <= 1.0 for _, e in pts) or any(m <= 0 for m, _ in pts):
        raise ProfileError(f"profile {name!r}: {field} needs positive rows and values in (0, 1]")
    return np.log([m for m, _ in pts]), np.array([e for _, e in pts])


def _moe_shape_curves(profile: HardwareProfile) -> dict[tuple[int, int, str], tuple[np.ndarray, np.ndarray]]:
    """A profile's ``moe_efficiency_by_shape``, each curve under its :func:`moe_shape_key`."""
    curves = {}
    for entry in profile.moe_efficiency_by_shape or []:
        try:
            key = moe_shape_key(entry)
            points = entry["points"]
        except (KeyError, TypeError, ValueError) as error:
            raise ProfileError(f"profile {profile.name!r}: each moe_efficiency_by_shape entry needs hidden, "
                               f"intermediate, format and points; got {entry!r}") from error
        if key[2] not in ("bf16", *(f for f in EXPERT_FORMATS if f)):
            raise ProfileError(f"profile {profile.name!r}: moe_efficiency_by_shape format {key[2]!r} is not bf16 "
                               f"or one of {', '.join(f for f in EXPERT_FORMATS if f)}")
        curves[key] = _efficiency_points(points, profile.name, "moe_efficiency_by_shape")
    return curves


def moe_shape_key(source, weight_format: str = "") -> tuple[int, int, str]:
    """(hidden, intermediate, format) of one of a profile's ``moe_efficiency_by_shape`` curves (a dict), or of an
    expert shape ``(hidden, intermediate)`` whose weights are in ``weight_format`` ("": bf16)."""
    if isinstance(source, dict):
        return int(source["hidden"]), int(source["intermediate"]), str(source["format"])
    return int(source[0]), int(source[1]), weight_format or "bf16"


def attention_shape(source) -> tuple[int, int, int, bool, bool]:
    """(query heads, KV heads, head size, keys are the values, sinks) of a :class:`ModelSpec` or of a profile's CPU
    attention point: what CPU decode attention's speed per KV byte depends on besides the hardware."""
    if isinstance(source, dict):
        return (int(source["q_heads"]), int(source["kv_heads"]), int(source["head_dim"]),
                bool(source.get("values_are_keys", False)), bool(source.get("sinks", False)))
    return source.heads, source.kv_heads, source.head_dim, source.values_are_keys, source.attention_sinks


def _fit_cpu_attention(points: list) -> tuple[np.ndarray, np.ndarray, float] | None:
    """Per context: time = overhead + batch * kv_bytes_per_seq / rate, least squares over the batch sizes
    measured at that context (through the origin when only one batch, or when the fit goes negative)."""
    if not points:
        return None
    by_context: dict[float, list[tuple[float, float]]] = {}
    for p in points:
        per_seq = p["context"] * p["kv_heads"] * p["head_dim"] * 2 * p.get("dtype_bytes", 2)
        by_context.setdefault(float(p["context"]), []).append((p["batch"] * per_seq, float(p["seconds"])))
    contexts, rates, overheads = [], [], []
    for ctx in sorted(by_context):
        xs, ts = np.array(by_context[ctx]).T
        slope, intercept = (np.polyfit(xs, ts, 1) if len(set(xs)) > 1 else (0.0, -1.0))
        if slope <= 0 or intercept < 0:
            slope, intercept = float(np.dot(xs, ts) / np.dot(xs, xs)), 0.0
        contexts.append(math.log(ctx))
        rates.append(1.0 / slope)
        overheads.append(intercept)
    return np.array(contexts), np.array(rates), float(np.median(overheads))
