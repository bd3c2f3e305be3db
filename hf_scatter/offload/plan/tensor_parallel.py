"""Several GPUs of one host as one tensor-parallel group (MoE-Lightning, sec. 5): what changes in the model.

Every projection is split across the ``N`` GPUs as Megatron-LM splits it (attention by heads, each expert's
gate/up by columns and down by rows), so each GPU holds and streams ``1/N`` of every weight over its own host
link and computes ``1/N`` of every matrix product; the hidden states are replicated, and each block ends in an
all-reduce of the micro-batch's hidden states (two per layer: after attention, after the FFN; OLMoE adds a small
one for its q/k norms). The host is shared: CPU attention does the same total work (each rank over its heads,
their dispatch in parallel; MLA's latent, which every head reads, is cached and read once per rank:
:func:`group_model`), and every link's copies come out of one host memory.

So the group is planned as one wider GPU (:func:`group_profile`: ``N`` times the compute, HBM bandwidth and
memory, the links' measured aggregate) plus the all-reduces (:meth:`TensorParallel.allreduce_seconds`) on the
GPU's critical path, with replicated activations counted on every GPU. More GPU memory keeps more weights
resident, so less crosses the links per token: the reason the paper's throughput grows faster than ``N``
until the shared CPU or host memory binds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from ..families.sharding import indivisible
from .profile import HardwareProfile

# Assumptions where the profile has no multi-GPU measurement (each listed as uncalibrated where used): NVLink 4
# (H100 SXM) moves 450 GB/s per direction per GPU, and a small NCCL all-reduce over NVLink takes ~20 us.
NVLINK4_BUS_BANDWIDTH = 450e9
ALLREDUCE_LATENCY_S = 20e-6


@dataclass(frozen=True)
class TensorParallel:
    """``gpus`` GPUs splitting every projection: their host links' aggregate and their all-reduce."""

    gpus: int
    link_scale: float  # host->device bandwidth of the group over one GPU's (gpus where the links are independent)
    allreduce_bus_bandwidth: float  # bytes/s, NCCL's bus bandwidth: 2 (N - 1) / N x size / time
    allreduce_latency_s: float
    links_measured: bool = False  # link_scale comes from copies to these GPUs at once on this host
    # the group's CPU attention time over one process's (the slowest rank, each its share of heads and cores)
    attention_scale: float = 1.0

    def allreduce_seconds(self, nbytes: float) -> float:
        """One all-reduce of ``nbytes`` over the group (ring): nothing on one GPU."""
        if self.gpus == 1:
            return 0.0
        return self.allreduce_latency_s + 2 * (self.gpus - 1) / self.gpus * nbytes / self.allreduce_bus_bandwidth

    @classmethod
    def from_profile(cls, profile: HardwareProfile, gpus: int) -> tuple["TensorParallel", list[str]]:
        """The group of ``gpus`` of ``profile``'s host, and the terms it had to assume (uncalibrated)."""
        if int(gpus) != gpus or gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {gpus}")
        if profile.gpus is not None and gpus > profile.gpus:
            raise ValueError(f"{gpus} GPUs asked but profile {profile.name!r} was measured on a host of "
                             f"{profile.gpus}: plan for at most {profile.gpus}, or profile a larger host")
        if gpus == 1:
            return cls(1, 1.0, math.inf, 0.0), []
        assumed = []
        scale = _link_scale(profile, gpus)
        measured = scale is not None
        if not measured:
            scale = float(gpus)
            assumed.append("h2d_pinned_concurrent (each GPU's host link taken as independent: not measured)")
        bus = profile.allreduce_bus_bandwidth
        if bus is None:
            bus = NVLINK4_BUS_BANDWIDTH
            assumed.append("allreduce_bus_bandwidth (NVLink 4 spec, 450 GB/s: not measured)")
        latency = profile.allreduce_latency_s
        if latency is None:
            latency = ALLREDUCE_LATENCY_S
            assumed.append("allreduce_latency_s (20 us assumed: not measured)")
        attention = _measured_at(profile.cpu_attention_group, gpus)
        if attention is None:
            # decode attention streams the KV cache: bound by memory more than by threads, so a rank's share of the
            # heads on its few threads took no longer than one process over all of them on every core (H100 x4 host,
            # GPT-OSS shape: busy 5.4-6.2 s a rank at 2 ranks x 12 threads, 2.7-2.9 s at 4 x 12, in
            # docs/results/history/offload-rank-threads-h100-x4.json; one process 12.7 s in the multi-GPU table's
            # repeats); scaling by the threads kept said 2.6x slower
            attention = 1.0
            assumed.append("cpu_attention_group (the ranks' CPU attention at once taken as fast as one process's "
                           "over all heads: not measured)")
        return cls(int(gpus), scale, bus, latency, measured, attention), assumed


def _measured_at(points, gpus: int) -> float | None:
    """``[[GPUs, value]]`` interpolated at ``gpus`` (None where nothing was measured at or beyond it)."""
    points = sorted((int(n), float(v)) for n, v in points or [])
    if not points or points[-1][0] < gpus:
        return None
    counts, values = zip(*points)
    return float(np.interp(gpus, counts, values))


def _link_scale(profile: HardwareProfile, gpus: int) -> float | None:
    """Measured aggregate pinned host->device bandwidth to ``gpus`` GPUs at once over one GPU's, interpolated
    between the measured GPU counts (None where nothing was measured at or beyond ``gpus``)."""
    if not profile.h2d_pinned:
        return None
    together = [p for p in profile.h2d_pinned_concurrent or [] if int(p[0]) > 1]
    rate = _measured_at([[1, profile.h2d_pinned]] + together, gpus)
    return None if rate is None else rate / profile.h2d_pinned


# a group's ranks attend on teams of at most this many threads: larger ones stalled (see attention_threads)
GROUP_TEAM_MAX = 12


def attention_threads(cores: int, ranks: int = 1) -> int:
    """Intra-op threads of one process's CPU attention when ``ranks`` processes share ``cores``. Alone: every core
    but the two its GPU-driving and paging threads take. In a group: its share less four (its driver, pager, NCCL's
    polling proxy and one to spare), and at most :data:`GROUP_TEAM_MAX`: each rank's OpenMP team spins between
    regions beside the other ranks' teams, drivers, pagers and proxies, and a team waits at every barrier for a
    descheduled member, so the larger the team the more it stalls. In one torchrun, interleaved (H100 x4 host,
    GPT-OSS-120B shape, 2026-11): two ranks of 28 threads spent 16.9-37.5 s each in CPU attention where two of 12
    spent 5.4-6.2 s (792-1560 against 2051-2336 tokens/s); four ranks of 12, 6 and 3 threads spent 2.7-2.9,
    3.3-4.2 and 5.2-5.5 s."""
    if ranks == 1:
        return max(1, int(cores) - 2)
    return max(1, min(int(cores) // int(ranks) - 4, GROUP_TEAM_MAX))


def group_profile(profile: HardwareProfile, tp: TensorParallel) -> HardwareProfile:
    """``profile`` with its GPU widened to the group: compute, HBM bandwidth, memory and attention bandwidth
    times ``N``, the host links at their aggregate; CPU attention at the ranks' measured time at once (else at one
    process's: :meth:`TensorParallel.from_profile`); per-op overheads unchanged (each rank launches
    its own kernels in parallel). Host memory is shared too, but where copies to the group's GPUs at once were
    measured, it delivered at least their aggregate: the host-memory roof (measured with one GPU's copies beside a
    CPU copy) is raised to that, not left below what was seen."""
    if tp.gpus == 1:
        return profile
    n = tp.gpus

    def times(value, k):
        return None if value is None else value * k

    host_dram = profile.host_dram_bandwidth
    if host_dram is not None and tp.links_measured and profile.h2d_pinned:
        host_dram = max(host_dram, profile.h2d_pinned * tp.link_scale)
    # CPU attention was measured in one process; the group's ranks attend at once, their heads each
    cpu_attention = [{**point, "seconds": point["seconds"] * tp.attention_scale} for point in profile.cpu_attention]
    return dataclasses.replace(
        profile, name=f"{n} x {profile.name}",
        gpu_flops=times(profile.gpu_flops, n), gpu_bandwidth=times(profile.gpu_bandwidth, n),
        gpu_memory=times(profile.gpu_memory, n), gpu_attention_bandwidth=times(profile.gpu_attention_bandwidth, n),
        h2d_pinned=times(profile.h2d_pinned, tp.link_scale), d2h_pinned=times(profile.d2h_pinned, tp.link_scale),
        duplex_pinned=times(profile.duplex_pinned, tp.link_scale), host_dram_bandwidth=host_dram,
        cpu_attention=cpu_attention)


def group_model(model, gpus: int):
    """``model`` (a :class:`~..families.spec.ModelSpec`) as a group of ``gpus`` caches it, for counting KV bytes:
    MLA's one latent head is every rank's (each caches the whole latent and reads it for its ``1/gpus`` of the
    query heads), so the group holds ``gpus`` latent heads; other models split their KV heads and are unchanged.
    Only for byte counts: CPU attention's time stays the whole model's at its own shape's rate. Setting, not
    scaling, the count: applying it twice is applying it once."""
    return dataclasses.replace(model, kv_heads=gpus) if model.is_mla and gpus > 1 else model


def check_divisible(model, gpus: int) -> None:
    """Tensor parallelism splits the attention heads, the KV heads (MLA's latent stays whole) and every MLP's
    columns ``gpus`` ways; raises ValueError naming what does not split."""
    if gpus == 1:
        return
    odd = indivisible(model, gpus)
    if odd:
        dequantized = " (or a dequantized load: --weights bf16)" if model.expert_format else ""
        raise ValueError(f"tensor parallelism over {gpus} GPUs splits the heads and the experts' columns, but "
                         f"{model.name} has {', '.join(odd)}: plan for a GPU count that divides them{dequantized}")
