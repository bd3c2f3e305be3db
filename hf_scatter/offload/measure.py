"""``hf-scatter profile``: measure this machine's roofs into a :class:`HardwareProfile` (GPU, CPU, PCIe; a minute
or two). It runs the offloaded runtime's own CPU attention and expert kernels, so it sits above both the
planner (whose profile format it fills) and the runtime (whose kernels it times)."""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import tempfile
import threading
import time
from typing import Callable

import torch

from ..common.shapes import MIXTRAL_8X7B
from ..common.timing import median_ms
from ..kernels.backend import autotune_override
from ..kernels import fp8_blocks, mxfp4
from ..kernels.swiglu import gpt_oss_gate
from ..moe.mlp import FusedSwiGLU, expert_mlp, glu_activation
from ..tiny import TINY_BUILDERS
from .families.adapter import LayerAttention
from .families.spec import ModelSpec
from .plan.policy import Policy
from .plan.profile import HardwareProfile, current_machine, host_memory_bytes
from .plan.hrm import attention_shape
from .runtime.cpu_attention import AttentionWorker, KVCache, attention_threads


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

    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2.0 * n**3 / _median_s(lambda: torch.mm(a, b))


def _cpu_copy_bandwidth(nbytes: int) -> float:

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

    q = torch.randn(batch, q_heads, 1, head_dim, dtype=torch.bfloat16, device=device)
    k = torch.randn(batch, kv_heads, context, head_dim, dtype=torch.bfloat16, device=device)
    return q, k, torch.randn_like(k)


# Mixtral's: query heads, KV heads, head size, keys are the values, sinks
STANDARD_ATTENTION_SHAPE = (32, 8, 128, False, False)


def _attention_call(worker, batch: int, context: int, shape=STANDARD_ATTENTION_SHAPE):
    """(the point's description, one call): one decode step of ``batch`` requests of about ``context`` cached
    tokens through the runtime's own path, :meth:`KVCache.attend` (new K/V written, masked SDPA over one length
    bucket of prompts within +-10% of each other) on the attention worker thread, waited for by another
    thread: the per-call cost the runtime pays (about 0.3 ms on the H100 host)."""
    q_heads, kv_heads, head_dim, values_are_keys, sinks = shape
    # the sinks' rescaling of every head (GPT-OSS): 12-28% more time per call on the H200 host
    attention = [LayerAttention(sinks=torch.randn(q_heads, generator=torch.Generator().manual_seed(0)))] if sinks \
        else None
    # longest first, mean ``context``
    lens = [round(context * (1.1 - 0.2 * i / (batch - 1))) for i in range(batch)] if batch > 1 else [context]
    cache = KVCache([[(p, p + 1) for p in lens]], 1, kv_heads, head_dim, q_heads, torch.bfloat16,
                    attention=attention, values_are_keys=values_are_keys)
    qkv = torch.randn(batch, (q_heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    out = torch.empty(batch, q_heads * head_dim, dtype=torch.bfloat16)
    point = dict(batch=batch, context=context, q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype_bytes=2)
    point.update({"values_are_keys": True} if values_are_keys else {}, **({"sinks": True} if sinks else {}))
    return point, lambda: worker.submit(cache.attend, 0, 0, 0, qkv, out).result()


def _cpu_attention_point(worker, batch: int, context: int, shape=STANDARD_ATTENTION_SHAPE) -> dict:
    """One point of :func:`_attention_call`, its median over half a second."""
    point, call = _attention_call(worker, batch, context, shape)
    return {**point, "seconds": _median_s(call, budget_s=0.5)}


ATTENTION_PASSES = 3  # medians of this many passes over every point


def _cpu_attention_points(worker, cases, passes: int = ATTENTION_PASSES, budget_s: float = 0.2) -> list[dict]:
    """:func:`_attention_call` of every ``(batch, context, shape)`` case, each point the median of ``passes``
    interleaved passes over all of them: a slow spell of the host (the link pump and the driver thread beside
    it starting, another process's burst) then moves one pass of many points rather than every sample of
    one, whose error the plan would carry into every step it prices at that context."""
    calls = [_attention_call(worker, *case) for case in cases]
    times = [[] for _ in calls]
    for _ in range(passes):
        for (_, call), samples in zip(calls, times):
            samples.append(_median_s(call, budget_s=budget_s))
    return [{**point, "seconds": statistics.median(samples)} for (point, _), samples in zip(calls, times)]


@contextlib.contextmanager
def _beside(work: Callable[[threading.Event], None]):
    """``work(stop)`` on a thread of its own while the block runs: a load the measurement inside must share the
    host with, as it does in the pipeline (``work`` returns once ``stop`` is set)."""
    stop = threading.Event()
    thread = threading.Thread(target=work, args=(stop,), daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def _link_traffic(device: int = 0):
    """Pinned host->device copies to GPU ``device`` running meanwhile (as the weights stream during decode: they
    take host memory bandwidth from the CPU's attention); nothing without a GPU."""

    if not torch.cuda.is_available():
        yield False
        return
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=f"cuda:{device}")

    def pump(stop):
        stream = torch.cuda.Stream(device)
        while not stop.is_set():
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            stream.synchronize()

    with _beside(pump):
        yield True


# How much of the time the driver issues while the CPU attends, as the profile's attention is measured: its issue
# spans took 35-60% of a micro-batch's stage in traces of one to four GPUs; beside a thread issuing half or all
# of the time, one call of GPT-OSS's shape (512 rows, context 96, sinks) took 7.2 and 7.6 ms where the pipeline's
# took 7-8.4 ms, and 5.9 ms with the copies alone (H200 host, 2026-11)
DRIVER_DUTY = 0.5


@contextlib.contextmanager
def _driver_load(duty: float, period_s: float = 4e-3):
    """A thread issuing small GPU ops for ``duty`` of every ``period_s`` and sleeping the rest, as the pipeline's
    driver issues a micro-batch's stage while the CPU attends another: Python holding the interpreter lock between
    ops, which the attention thread needs between its own; nothing without a GPU or at ``duty`` 0."""
    if duty <= 0 or not torch.cuda.is_available():
        yield False
        return
    layer = torch.nn.Linear(16, 16, device="cuda")
    x = torch.ones(1, 16, device="cuda")

    def issue(stop):
        with torch.no_grad():
            while not stop.is_set():
                start = time.perf_counter()
                while time.perf_counter() - start < duty * period_s:
                    layer(x)
                torch.cuda.synchronize()
                time.sleep((1 - duty) * period_s)

    with _beside(issue):
        yield True


@contextlib.contextmanager
def _attention_load(on: bool = True, rows: int = 256, context: int = 256):
    """CPU attention of the standard shape running back to back on an attention worker of this host's thread count
    meanwhile, as the pipeline's CPU attends while its driver issues; nothing when not ``on``."""
    if not on:
        yield
        return
    q_heads, kv_heads, head_dim = STANDARD_ATTENTION_SHAPE[:3]
    cache = KVCache([[(context, context + 1)] * rows], 1, kv_heads, head_dim, q_heads, torch.bfloat16)
    qkv = torch.randn(rows, (q_heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)
    out = torch.empty(rows, q_heads * head_dim, dtype=torch.bfloat16)
    worker = AttentionWorker(attention_threads())

    def attend(stop):
        while not stop.is_set():
            worker.submit(cache.attend, 0, 0, 0, qkv, out).result()

    try:
        with _beside(attend):
            yield
    finally:
        worker.close()


def _cpu_op_seconds(calls: int = 2000) -> float:

    a, b, out = torch.ones(8), torch.ones(8), torch.empty(8)
    torch.add(a, b, out=out)
    start = time.perf_counter()
    for _ in range(calls):
        torch.add(a, b, out=out)
    return (time.perf_counter() - start) / calls


def _copy_bytes(quick: bool) -> int:
    return (64 if quick else 256) * 2**20


def _gpu_flops(p: HardwareProfile, quick: bool) -> None:
    """bf16 matmul rate of a large square product, and the GPU's memory."""
    dev = torch.device("cuda")
    n = 4096 if quick else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    p.gpu_flops = 2.0 * n**3 / (median_ms(lambda: a @ b) / 1e3)
    p.gpu_memory = float(torch.cuda.get_device_properties(0).total_memory)

def _gpu_bandwidth(p: HardwareProfile, quick: bool) -> None:
    """Device-to-device copy rate (bytes read + written)."""
    dev = torch.device("cuda")
    x = torch.empty((2**28 if quick else 2**30) // 2, device=dev, dtype=torch.bfloat16)  # 256 MiB / 1 GiB
    y = torch.empty_like(x)
    p.gpu_bandwidth = 2.0 * x.numel() * 2 / (median_ms(lambda: y.copy_(x)) / 1e3)

def _gemm_efficiency(p: HardwareProfile, quick: bool) -> None:
    """Achieved / roofline of an [M, 4096] x [4096, 14336] GEMM for M from 1 row up: small-M decode GEMMs reach less."""
    dev = torch.device("cuda")
    k, n = 4096, 14336
    w = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
    points = []
    for m in ((1, 16, 256, 4096) if quick else (1, 4, 16, 64, 256, 1024, 4096, 16384)):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        seconds = median_ms(lambda: x @ w) / 1e3
        roofline = max(2.0 * m * k * n / p.gpu_flops, 2.0 * (k * n + m * k + m * n) / p.gpu_bandwidth)
        points.append([m, min(1.0, roofline / seconds)])
    p.gemm_efficiency = points

def _moe_efficiency(p: HardwareProfile, quick: bool, models=()) -> None:
    """Achieved / roofline of the offloaded runtime's SwiGLU expert kernels on Mixtral-8x7B's experts, untuned
    as it runs them, with bf16 weights and with MXFP4 and block-scaled FP8 weights read as shipped; then the same
    on each of ``models``' own experts (their :class:`ModelSpec`) whose shape differs, in every format that
    shape can be stored in (``moe_efficiency_by_shape``)."""
    shape = MIXTRAL_8X7B  # its experts (quick: narrower)
    inter = 4096 if quick else shape["intermediate"]
    # MXFP4 with GPT-OSS's clamped gate (the fused kernel), FP8 with SiLU, as Qwen3-FP8 and DeepSeek-V3
    points = _moe_points(p, quick, shape["experts"], shape["top_k"], shape["hidden"], inter,
                         {"bf16": False, "mxfp4": True, "fp8": False})
    p.moe_efficiency, p.mxfp4_moe_efficiency, p.fp8_moe_efficiency = points["bf16"], points["mxfp4"], points["fp8"]
    done = {(shape["hidden"], shape["intermediate"])}  # the curves above stand for Mixtral's experts (quick too)
    for m in models:
        if not m.is_moe or (m.hidden, m.intermediate) in done:
            continue
        done.add((m.hidden, m.intermediate))
        gpt_oss = m.model_type == "gpt_oss"  # its clamped gate whatever the format, as the runtime runs it
        # a few experts stand for all of them: the curve is per rows per expert, and E of them would not fit a
        # small GPU (GPT-OSS-120B's 128 in bf16: 6.4 GB)
        experts = min(m.experts, MOE_SHAPE_EXPERTS)
        found = _moe_points(p, quick, experts, max(1, min(m.top_k, experts // 4)), m.hidden, m.intermediate,
                            {"bf16": gpt_oss, "mxfp4": gpt_oss, "fp8": gpt_oss})
        p.moe_efficiency_by_shape += [{"hidden": m.hidden, "intermediate": m.intermediate, "format": name,
                                       "points": pts} for name, pts in found.items()]


MOE_SHAPE_EXPERTS = 16  # experts of a model's own shape in its efficiency curve


def _moe_points(p: HardwareProfile, quick: bool, E: int, k: int, H: int, inter: int, formats: dict[str, bool]
                ) -> dict[str, list]:
    """[[rows per expert, achieved / roofline]] of the expert kernels on ``E`` experts of ``H`` x ``inter``, ``k``
    routes a token, per weight format (bf16, mxfp4, fp8) the shape can be stored in; ``formats`` maps each to
    whether it runs GPT-OSS's clamped gate (else SiLU)."""
    dev = torch.device("cuda")
    w_in = torch.randn(E, 2 * inter, H, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    w_out = torch.randn(E, H, inter, device=dev, dtype=torch.bfloat16).transpose(1, 2)
    gates = {False: glu_activation(torch.nn.functional.silu),
             True: FusedSwiGLU(gpt_oss_gate(1.702, 7.0)._replace(interleaved=False))}
    stored = {"bf16": lambda w: w, "mxfp4": lambda w: mxfp4.random_experts(*w.shape, device=dev),
              "fp8": lambda w: fp8_blocks.random_experts(*w.shape, device=dev)}
    sizes = {"bf16": 2.0, "mxfp4": mxfp4.BYTES_PER_WEIGHT, "fp8": fp8_blocks.BYTES_PER_WEIGHT}
    holds = {"bf16": True, "mxfp4": H % mxfp4.GROUP == 0 and inter % mxfp4.GROUP == 0,  # groups of 32 along d_in
             "fp8": all(d % b == 0 for d in (H, inter) for b in fp8_blocks.BLOCK)}  # 128 x 128 blocks
    curves = {name: ([stored[name](w) for w in (w_in, w_out)], sizes[name], gates[clamped])
              for name, clamped in formats.items() if holds[name]}
    points = {name: [] for name in curves}
    per_expert = (2, 32, 512) if quick else (1, 4, 16, 64, 256, 1024)  # rows per expert, decode to prefill
    with torch.no_grad(), autotune_override(False):  # as the offloaded runtime runs them
        for rows in per_expert:
            tokens = max(1, rows * E // k)
            x = torch.randn(tokens, H, device=dev, dtype=torch.bfloat16)
            experts = torch.randint(0, E, (tokens, k), device=dev)
            weights = torch.rand(tokens, k, device=dev, dtype=torch.bfloat16)
            active = torch.unique(experts).numel()
            flops = 6.0 * tokens * k * H * inter
            for name, ((a, b), bytes_per_weight, gate) in curves.items():
                seconds = median_ms(lambda: expert_mlp(x, (a,), b, experts, weights, gate, validate=False)) / 1e3
                roofline = max(flops / p.gpu_flops, 3.0 * active * H * inter * bytes_per_weight / p.gpu_bandwidth)
                points[name].append([tokens * k / E, min(1.0, roofline / seconds)])
    return points


def _gpu_attention(p: HardwareProfile, quick: bool) -> None:
    """KV bytes/s of bf16 decode attention on the GPU."""
    dev = torch.device("cuda")
    q, kk, v = _attention_inputs(64, 2048, 32, 8, 128, device=dev)
    p.gpu_attention_bandwidth = 2.0 * kk.numel() * 2 / (median_ms(lambda: _sdpa_decode(q, kk, v)) / 1e3)

# The tiny model whose decode stages time the host's issuing: sizes every kernel accepts (the host's time per call
# hardly depends on them), one micro-batch, half the weights streamed (the pager's thread runs beside the driver, as
# in a real plan)
ISSUE_MODEL = {"hidden": 256, "layers": 2, "experts": 8, "top_k": 2, "intermediate": 256, "heads": 4, "kv_heads": 2}
ISSUE_ROWS, ISSUE_PROMPT = 64, 16


def stage_issue_seconds(family: str = "mixtral", device: str = "cuda", new_tokens: int = 16) -> tuple[float, int]:
    """(host seconds to issue one micro-batch's decode stage, kernels the planner counts for it) for a tiny
    ``family`` model run by the offloaded runtime: the driver's median "issue pre" + "issue post" spans. On a GPU
    the stages replay CUDA graphs (:mod:`.runtime.stage_graphs`), so this is mostly two graph launches and the
    pipeline's events; issued op by op, Python, custom ops and Triton's launcher took 2-4 ms a stage. It is timed
    with CPU attention of the standard shape running meanwhile, as it runs beside the driver in the pipeline (the
    attention thread takes the interpreter lock between its ops)."""
    from .runtime.offloaded import offload_model  # the runtime's whole stack, only when this step runs

    model = TINY_BUILDERS[family](dtype=torch.bfloat16, **ISSUE_MODEL)
    spec = ModelSpec.from_config(model.config)
    kernels = sum(op.kernels for name, op in spec.decode_ops(ISSUE_ROWS, ISSUE_PROMPT).items() if name != "attention")
    policy = Policy(ISSUE_ROWS, ISSUE_ROWS, weights_gpu_fraction=0.5)
    off = offload_model(model, gpu_memory="2GiB", policy=policy, device=device, progress=False)
    try:
        ids = torch.randint(0, model.config.vocab_size, (ISSUE_ROWS, ISSUE_PROMPT),
                            generator=torch.Generator().manual_seed(0))
        off.generate(ids, max_new_tokens=3, progress=False)  # compiles the kernels at these shapes
        with tempfile.TemporaryDirectory(prefix="hf-scatter-profile-") as tmp, \
                _attention_load(on=torch.device(device).type == "cuda"):
            out = off.generate(ids, max_new_tokens=new_tokens, return_dict=True, progress=False,
                               trace=os.path.join(tmp, "trace.json"))
    finally:
        off.close()
    issue = out.stats["trace"]["driver_issue_s"]
    return issue["pre"] + issue["post"], kernels


def _gpu_launch(p: HardwareProfile, quick: bool, family: str = "mixtral") -> None:
    """Host time per GPU kernel the planner counts (:data:`~.families.spec.KERNELS`), from the runtime's own issuing
    of decode stages: 12 us per counted kernel as CUDA graphs (tiny GPT-OSS, H200, 2026-11); issued op by op,
    10-14 times a small module call's 17-18 us (H100 and H200 hosts)."""
    seconds, kernels = stage_issue_seconds(family, "cuda", new_tokens=8 if quick else 16)
    p.gpu_launch_s = seconds / kernels
    p.notes["gpu_launch_s"] = (f"measured: host time of issuing one micro-batch's decode stage of a tiny {family} "
                               f"through the offloaded runtime ({seconds * 1e3:.2f} ms), per kernel the planner "
                               f"counts ({kernels:g})")

def _link(p: HardwareProfile, quick: bool) -> None:
    """PCIe: pinned and pageable copies each way, both ways at once, and one small copy's latency."""
    dev = torch.device("cuda")
    copy_bytes = _copy_bytes(quick)
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

def _host_dram(p: HardwareProfile, quick: bool) -> None:
    """Host memory bandwidth shared by CPU copies and pinned host-to-device transfers running together."""
    dev = torch.device("cuda")
    copy_bytes = _copy_bytes(quick)
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


def _multi_gpu(p: HardwareProfile, quick: bool) -> None:
    """The host's GPUs together (tensor-parallel plans): pinned host->device copies to 2..N of them at once (do
    their links share a switch?), and an NCCL all-reduce over all N of a block's hidden states (4 MiB) and of
    a small tensor (its latency)."""
    count = torch.cuda.device_count()
    p.gpus = count
    if count < 2:
        p.notes["h2d_pinned_concurrent"] = "one GPU on this host"
        return
    copy_bytes = _copy_bytes(quick)
    n = copy_bytes // 2
    pinned = [torch.empty(n, dtype=torch.bfloat16, pin_memory=True) for _ in range(count)]
    device = [torch.empty(n, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(count)]

    def copies(k):
        for i in range(k):
            with torch.cuda.device(i):
                device[i].copy_(pinned[i], non_blocking=True)
        for i in range(k):
            torch.cuda.synchronize(i)

    one = copy_bytes / _median_s(lambda: copies(1))  # the same method at one GPU: the ratios compare alike
    p.h2d_pinned_concurrent = [[k, k * copy_bytes / _median_s(lambda k=k: copies(k)) * p.h2d_pinned / one]
                               for k in range(2, count + 1)] if p.h2d_pinned else []
    p.notes["h2d_pinned_concurrent"] = ("measured: pinned copies to that many GPUs issued together, total bytes/s, "
                                        "scaled to h2d_pinned by the same copies to one GPU")
    import torch.cuda.nccl as nccl

    def allreduce_seconds(numel):
        tensors = [torch.ones(numel, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(count)]

        def once():
            nccl.all_reduce(tensors)
            for i in range(count):
                torch.cuda.synchronize(i)

        once()  # NCCL's communicators are made on the first call
        return _median_s(once)

    block = 4 * 2**20
    p.allreduce_latency_s = allreduce_seconds(2048)
    # the model adds the latency to the bytes' time: the bandwidth is the block's time beyond it
    beyond = allreduce_seconds(block // 2) - p.allreduce_latency_s
    p.allreduce_bus_bandwidth = 2 * (count - 1) / count * block / max(beyond, 1e-9)
    p.notes["allreduce_bus_bandwidth"] = (f"measured: NCCL all-reduce of 4 MiB of bf16 over the {count} GPUs "
                                          "(torch.cuda.nccl, one process), bus bandwidth 2 (N-1)/N x size / "
                                          "(time - latency)")
    p.notes["allreduce_latency_s"] = f"measured: NCCL all-reduce of 4 KiB over the {count} GPUs"


GROUP_ATTENTION_ROWS, GROUP_ATTENTION_CONTEXT = 256, 512  # one micro-batch of a decode step


def _attend_in_lockstep(rank: int, ranks: int, calls: int, rows: int, context: int) -> list[float]:
    """One of ``ranks`` processes attending its share of the standard shape's heads on its share of the cores, a
    barrier per call (as the group's all-reduces make them), pinned copies to its GPU running meanwhile where it has
    one: its call times after three warm-up calls."""
    import torch.distributed as dist

    heads, kv_heads, head_dim = STANDARD_ATTENTION_SHAPE[:3]
    heads, kv_heads = heads // ranks, kv_heads // ranks
    lens = [round(context * (1.1 - 0.2 * i / (rows - 1))) for i in range(rows)]
    cache = KVCache([[(p, p + 1) for p in lens]], 1, kv_heads, head_dim, heads, torch.bfloat16)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim).to(torch.bfloat16)  # [rows, (H + 2 KV) * D]
    out = torch.empty(rows, heads * head_dim, dtype=torch.bfloat16)  # [rows, H * D]
    worker = AttentionWorker(attention_threads(os.cpu_count(), ranks))
    busy = _link_traffic(rank) if torch.cuda.device_count() > rank else contextlib.nullcontext(False)
    times = []
    try:
        with busy:
            for _ in range(calls + 3):
                dist.barrier()
                start = time.perf_counter()
                worker.submit(cache.attend, 0, 0, 0, qkv, out).result()
                times.append(time.perf_counter() - start)
    finally:
        worker.close()
    return times[3:]


def _group_attention_rank(rank: int, world: int, sizes: list[int], rounds: int, calls: int, store: str, results,
                          rows: int = GROUP_ATTENTION_ROWS, context: int = GROUP_ATTENTION_CONTEXT) -> None:
    """Rank ``rank`` of ``world`` processes measuring the group's CPU attention at each of ``sizes`` ranks in turn,
    ``rounds`` times over (ranks outside a size keep the barriers and idle): one process group for every
    measurement, and the sizes interleaved so that a slow spell of the host falls on one round of each, not on one
    size. Rank 0 puts ``{size: [the slowest rank's mean step, one per round]}`` on ``results``."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        steps = {n: [] for n in sizes}
        for _ in range(rounds):
            for n in sizes:
                times = _attend_in_lockstep(rank, n, calls, rows, context) if rank < n else None
                if times is None:
                    for _ in range(calls + 3):
                        dist.barrier()
                gathered = [None] * world
                dist.all_gather_object(gathered, times)
                steps[n].append(statistics.mean(max(step) for step in zip(*gathered[:n])))
        if rank == 0:
            results.put(steps)
    finally:
        dist.destroy_process_group()


def group_attention_seconds(sizes, calls: int = 20, rounds: int = 5, rows: int = GROUP_ATTENTION_ROWS,
                            context: int = GROUP_ATTENTION_CONTEXT) -> dict[int, list[float]]:
    """A decode step's CPU attention (:data:`STANDARD_ATTENTION_SHAPE`, ``rows`` requests of about ``context``
    cached tokens: a micro-batch) for each of ``sizes`` processes of this host at once, each over its share of the
    heads with the threads it keeps: per size, the slowest rank's mean time per step (what the group waits for),
    one figure per round, the sizes taking turns within each round."""
    import torch.multiprocessing as mp

    sizes = [int(n) for n in sizes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"group attention sizes must be positive rank counts, got {sizes}")
    world = max(sizes)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_group_attention_rank,
                             args=(r, world, sizes, rounds, calls, f"{tmp}/store", results, rows, context))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        try:
            return _first_result(results, procs)
        finally:
            for proc in procs:
                proc.join()


def _first_result(results, procs, timeout_s: float = 300.0):
    """What rank 0 puts on ``results``; raises as soon as a rank has died instead (its exit code named), or after
    ``timeout_s``."""
    import queue

    deadline = time.monotonic() + timeout_s
    problem = f"took over {timeout_s:.0f} s"
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead:
                problem = f"failed: rank(s) {dead} exited with an error (their traceback is above)"
                break
    for p in procs:
        p.kill()
    raise RuntimeError(f"the group attention measurement {problem}")


def _group_attention(p: HardwareProfile, quick: bool) -> None:
    """The ranks' CPU attention at once, against one process's over every head (the planner's group attention):
    for 2, 4, ... ranks up to the host's GPUs. One process and each group take turns, five rounds; the ratio kept
    is the median of the rounds' ratios, the notes give their range (a single pass of 30 calls a size put four ranks
    at 0.84x and, on a later lease of the same host kind, 1.81x one process's)."""
    count = torch.cuda.device_count()
    kv_heads = STANDARD_ATTENTION_SHAPE[1]
    sizes = [n for n in (2, 4, 8) if n <= count and kv_heads % n == 0]
    if not sizes:
        return
    rounds = 1 if quick else 5
    steps = group_attention_seconds([1, *sizes], calls=10 if quick else 20, rounds=rounds)
    ratios = {n: [group / one for group, one in zip(steps[n], steps[1])] for n in sizes}
    p.cpu_attention_group = [[n, statistics.median(ratios[n])] for n in sizes]
    spread = "; ".join(f"{n} ranks {min(r):.2f}-{max(r):.2f}x" for n, r in ratios.items())
    p.notes["cpu_attention_group"] = (
        f"measured: {GROUP_ATTENTION_ROWS} rows at context {GROUP_ATTENTION_CONTEXT}, that many processes at once, "
        "each its share of the heads and cores and copies to its GPU; the slowest rank per step over one process, "
        f"median of {rounds} rounds taking turns (range: {spread})")


# (label, step) pairs that fill the GPU and link fields, in order (the efficiency fits read the roofs).
GPU_STEPS = [("GPU matmul", _gpu_flops), ("GPU copy", _gpu_bandwidth), ("GEMM efficiency", _gemm_efficiency),
             ("MoE kernel efficiency", _moe_efficiency), ("GPU attention", _gpu_attention), ("GPU launch", _gpu_launch),
             ("PCIe", _link), ("host DRAM", _host_dram), ("several GPUs", _multi_gpu),
             ("CPU attention of several ranks", _group_attention)]


def measure_profile(quick: bool = False, progress: bool = True, attention_shapes=()) -> HardwareProfile:
    """Measure this machine (about a minute with a GPU, up to a minute more with several; ``quick``: a few
    seconds). Without a CUDA GPU only the CPU terms are filled and ``notes['gpu']`` says the GPU terms are missing.
    ``attention_shapes``: models (their :class:`ModelSpec`) whose own CPU attention shape is measured too (query
    heads per KV head, head size and MLA's shared key and value change the speed per KV byte by up to 8x on the
    H100 host), and, on a GPU, the expert kernels on their own experts (:func:`_moe_efficiency`)."""
    from tqdm import tqdm

    host, device = current_machine()
    profile = HardwareProfile(name=f"{host} / {device}", host=host, device=device, source="measured",
                              date=time.strftime("%Y-%m-%d %H:%M:%S"), cpu_cores=os.cpu_count(),
                              cpu_threads=torch.get_num_threads(), cpu_memory=host_memory_bytes())
    n = 512 if quick else 2048  # quick: a bf16 matmul of 1024 took 3 s a call on a CPU without bf16 instructions
    # context 64: short prompts' decode steps, where a row's fixed costs weigh more than its KV bytes (below the
    # smallest measured context the rate is held flat: from 256 down, the H200 host's 10-layer GPT-OSS table,
    # at context 93, ran at 75-77% of its prediction; with 64 measured and the plan's activations and prefill
    # chunk as the runtime's, at 79-94% in five runs, docs/offload-planning.md); 128: where such prompts decode
    # (contexts 80-145), measured rather than read off the line between 64 and 256
    contexts = (256, 2048) if quick else (64, 128, 256, 1024, 4096)
    # a model's own shape also at the rows per call its plans use: 256 and 512, a micro-batch's buckets (the small
    # batches cost DeepSeek's latent 7x more per row on the H100 host; and the line through 4, 32 and 256 rows
    # priced a 512-row GPT-OSS call at context 100 at 5.4 ms where it took 5.8-6.3, H200 host)
    model_rows = (4, 32, 256) if quick else (4, 32, 256, 512)

    def attention(p):
        worker = AttentionWorker(attention_threads(p))
        try:
            standard = STANDARD_ATTENTION_SHAPE  # first
            models = [s for s in dict.fromkeys(attention_shape(m) for m in attention_shapes) if s != standard]
            # as the pipeline runs it: the weights streaming over the link and the driver issuing GPU work beside it
            with _link_traffic() as busy, _driver_load(DRIVER_DUTY) as driving:
                cases = [(b, c, standard) for c in contexts for b in (1, 4, 32)]
                cases += [(b, c, shape) for shape in models for c in contexts for b in model_rows]
                p.cpu_attention = _cpu_attention_points(worker, cases, passes=1 if quick else ATTENTION_PASSES)
        finally:
            worker.close()
        p.notes["cpu_attention"] = ("measured: KVCache.attend on the attention worker, one masked length bucket"
                                    + (", pinned host->device copies running meanwhile" if busy else "")
                                    + (f", a thread issuing small GPU ops {DRIVER_DUTY:.0%} of the time" if driving
                                       else ""))

    steps = [
        ("CPU fp32 matmul", lambda p: setattr(p, "cpu_flops_fp32", _cpu_matmul_flops(torch.float32, n))),
        ("CPU bf16 matmul", lambda p: setattr(p, "cpu_flops_bf16", _cpu_matmul_flops(torch.bfloat16, n))),
        ("CPU copy", lambda p: setattr(p, "cpu_bandwidth", _cpu_copy_bandwidth(_copy_bytes(quick)))),
        ("CPU attention", attention),
        ("CPU op overhead", lambda p: setattr(p, "cpu_op_s", _cpu_op_seconds())),
    ]
    if torch.cuda.is_available():
        # the launch cost is timed on the first given model's family where the runtime has a tiny one
        family = next((m.model_type for m in attention_shapes if m.model_type in TINY_BUILDERS), "mixtral")
        extra = {_gpu_launch: {"family": family}, _moe_efficiency: {"models": tuple(attention_shapes)}}
        steps += [(label, functools.partial(step, quick=quick, **extra.get(step, {}))) for label, step in GPU_STEPS]
    else:
        profile.notes["gpu"] = ("no CUDA device: GPU and PCIe terms not measured (run `hf-scatter profile` on the "
                                "GPU host)")
    for label, step in tqdm(steps, desc="profile", disable=not progress):
        step(profile)
    return profile
