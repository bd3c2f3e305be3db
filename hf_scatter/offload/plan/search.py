"""Policy search: the placement that minimises predicted time per generated token within both memories.

Exhaustive over the discrete choices (batch size N and micro-batch size mu as powers of two, attention on
CPU or GPU, expert FFN on CPU or GPU, every expert or only the routed ones streamed, the prefill chunk); for
each, the two fractions (weights and KV cache on the GPU) are found exactly by
:func:`~hf_scatter.offload.pwl.minimize` (the cost and the memory use are piecewise-linear and linear in them).
MoE-Lightning's Eqs. 12-14 as an integer grid plus a tiny LP; Mixtral-8x7B plans in about two seconds.
"""

from __future__ import annotations

import dataclasses
import math

from ...common.units import format_bytes, parse_bytes
from ..families.spec import ModelSpec
from .activations import CHUNK_CHOICES, MIN_CHUNK_TOKENS, prefill_chunk
from .cost_model import (CostOptions, Lin, as_roofline, decode_groups, default_cpu_limit, memory_use, objective,
                         predict)
from .hrm import HierarchicalRoofline, ProfileError
from .known_profiles import load_profile
from .policy import PlanError, Policy, Workload
from .profile import HardwareProfile
from .pwl import minimize, pruned
from .tensor_parallel import check_divisible

MAX_BATCH = 16384
# Limits a hair inside the budgets: the minimiser accepts a vertex up to 1e-9 (relative) beyond a constraint, and a
# plan that fills the GPU lies on one.
INSIDE = 1 - 1e-9
MAX_MICRO_BATCHES = 256  # CGOPipe pages a layer's weights into one page per micro-batch


def _powers_of_two_upto(limit: int) -> list[int]:
    out = [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]
    return out + ([limit] if out[-1] != limit else [])


def _resolve(model, profile, gpus: int) -> tuple[ModelSpec, HierarchicalRoofline]:
    spec = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
    if not isinstance(profile, (HardwareProfile, HierarchicalRoofline)):
        profile = load_profile(profile)
    try:  # a GPU count the model cannot split or the host does not have
        check_divisible(spec, gpus)
        return spec, as_roofline(profile, gpus)
    except ProfileError:
        raise
    except ValueError as e:
        raise PlanError(str(e)) from None


def search_policy(model, profile, workload: Workload, gpu_memory: int | float | str,
                  cpu_memory: int | float | str | None = None, options: CostOptions | None = None,
                  max_batch: int = MAX_BATCH, placements=None, gpus: int | None = None) -> Policy:
    """The best :class:`Policy` (with its ``prediction``) for ``workload`` on ``profile`` within ``gpu_memory``
    (bytes or e.g. "16GiB") and ``cpu_memory`` (default: 90% of the profile's CPU memory). ``model``: a
    :class:`ModelSpec` or anything :meth:`ModelSpec.from_config` takes; ``profile``: a profile, or a known
    name / JSON path. ``placements``: the ``(attention_on_gpu, experts_on_gpu)`` pairs to consider (default
    all four; the CGOPipe runtime executes ``(False, True)``). ``gpus``: that many GPUs of the profile's host
    as one tensor-parallel group, ``gpu_memory`` on each (default: a roofline's own count, else 1). Raises
    :class:`PlanError` when nothing fits.

    Where several fractions predict the same time (a step bound by the CPU attention, which resident weights do
    not shorten), the one that keeps the most on the GPU wins: memory left free helps nothing, while every byte
    streamed instead crosses a link whose traffic slows the CPU attention and the prefill beside it."""
    options = options or CostOptions()
    if gpus is None:
        gpus = profile.gpus if isinstance(profile, HierarchicalRoofline) else 1
    spec, hrm = _resolve(model, profile, gpus)
    gpu_limit = parse_bytes(gpu_memory, "GPU memory")
    cpu_limit = (parse_bytes(cpu_memory, "CPU memory") if cpu_memory is not None
                 else default_cpu_limit(hrm.profile, options))
    capacity = hrm.profile.gpu_memory
    if capacity is not None and gpu_limit > capacity * (1 + 1e-9):
        raise PlanError(f"GPU memory budget {format_bytes(gpu_limit)} exceeds the {format_bytes(capacity)} of the GPU "
                        f"in profile {hrm.profile.name!r}: lower --gpu-memory")
    gpu_usable = gpu_limit * (1 - options.gpu_margin)
    _check_feasible(spec, workload, gpu_usable, cpu_limit, options, gpus)

    cap = min(max_batch, workload.num_requests or max_batch)
    best = None
    for n in _powers_of_two_upto(cap):
        for mu in _powers_of_two_upto(n):
            if math.ceil(n / mu) > MAX_MICRO_BATCHES:
                continue
            for attention_on_gpu in (False, True):
                for experts_on_gpu in (True, False):
                    if placements is not None and (attention_on_gpu, experts_on_gpu) not in placements:
                        continue
                    for routed in _routed_choices(spec, n, experts_on_gpu):
                        template = Policy(n, mu, attention_on_gpu, experts_on_gpu, routed_experts=routed, gpus=gpus)
                        found = _best_chunk(hrm, spec, template, workload, options, gpu_usable, cpu_limit)
                        if found is not None and (best is None or _better(found[0], best[0])):
                            best = found
    if best is None:
        raise PlanError(f"no policy fits {spec.name} in {format_bytes(gpu_limit)} of GPU{_per_gpu(gpus)} and "
                        f"{format_bytes(cpu_limit)} "
                        f"of CPU memory for {workload.describe()}: give more memory or shorten prompt/generation")
    _, policy, chunked = best
    prediction = predict(policy, spec, hrm, workload, gpu_limit, cpu_limit, chunked)
    return dataclasses.replace(policy, prediction=prediction)


def _best_chunk(hrm: HierarchicalRoofline, spec: ModelSpec, template: Policy, workload: Workload,
                options: CostOptions, gpu_usable: float, cpu_limit: float):
    """(key, policy, options) of ``template`` at its best prefill chunk, ``None`` where nothing fits. The chunk is
    a choice: a larger one takes fewer calls of the prefill's kernels but reserves more activation memory, which a
    streamed plan may rather keep weights in (4096-token chunks of GPT-OSS-120B at 1024 requests need 2.3 GiB of a
    16 GiB budget, and shut the bf16 experts' double buffer out of batches above 16). From the largest the batch's
    prompts can use down, halving while the time improves; where the largest does not fit, the smallest is tried
    next, and a template that does not fit even then is dropped."""
    largest = prefill_chunk(template.batch_size * workload.prompt_len, options.prefill_chunk_tokens)
    chunks = [c for c in CHUNK_CHOICES if c <= largest] or [largest]
    fix_y = not template.attention_on_gpu
    decode = [(w, pruned(pieces, fix_y)) for w, pieces in decode_groups(hrm, spec, template, workload, options)]

    def solve(chunk: int):
        return _solve(hrm, spec, template, workload, dataclasses.replace(options, prefill_chunk_tokens=chunk), decode,
                      gpu_usable, cpu_limit)

    found = None
    for i, chunk in enumerate(chunks):
        solution = solve(chunk)
        if solution is None:
            if i == 0 and len(chunks) > 1 and solve(chunks[-1]) is None:
                return None
            continue
        key, policy = solution
        if found is not None and not _better(key, found[0]):
            break
        found = (key, policy, dataclasses.replace(options, prefill_chunk_tokens=chunk))
    return found


def _solve(hrm, spec, template: Policy, workload: Workload, options: CostOptions, decode: list, gpu_usable: float,
           cpu_limit: float):
    """(key, policy) of ``template`` at its best fractions (``decode``: its decode steps' cost groups,
    :func:`~.pwl.pruned`), ``None`` where nothing fits."""
    gpu_mem, cpu_mem = memory_use(spec, template, workload, options)
    gpu_total, cpu_total = sum(gpu_mem.values(), Lin()), sum(cpu_mem.values(), Lin())
    constraints = [gpu_total / (gpu_usable * INSIDE) + (-1.0), cpu_total / (cpu_limit * INSIDE) + (-1.0)]
    solution = minimize(objective(hrm, spec, template, workload, options, decode), constraints,
                        fix_y=not template.attention_on_gpu, tiebreak=gpu_total * -1.0)
    if solution is None:
        return None
    x, y, seconds = solution
    key = (seconds / (template.batch_size * workload.gen_len), gpu_total.at(x, y), template.batch_size)
    return key, dataclasses.replace(template, weights_gpu_fraction=x, kv_gpu_fraction=y)


ROUTED_MAX_SHARE = 0.95  # routed streaming is priced only where the batch's rows leave this share of experts or less


def _routed_choices(spec: ModelSpec, n: int, experts_on_gpu: bool) -> tuple[bool, ...]:
    """Every expert streamed, and routed streaming where it can pay: experts on the GPU, and a batch of ``n``
    rows expected to leave some experts unchosen."""
    if experts_on_gpu and spec.is_moe and spec.active_experts(n) <= ROUTED_MAX_SHARE * spec.experts:
        return (False, True)
    return (False,)


def _better(key, incumbent) -> bool:
    """Less time per token; within 1e-9 relative, less GPU memory, then the smaller batch."""
    if key[0] < incumbent[0] * (1 - 1e-9):
        return True
    if key[0] > incumbent[0] * (1 + 1e-9):
        return False
    return key[1:] < incumbent[1:]


def _per_gpu(gpus: int) -> str:
    return f" on each of {gpus} GPUs" if gpus > 1 else ""


def _check_feasible(spec: ModelSpec, workload: Workload, gpu_usable: float, cpu_limit: float,
                    options: CostOptions, gpus: int = 1) -> None:
    """The two ways a plan is impossible whatever the policy, each with its own message (``gpu_usable``: per
    GPU, ``gpus`` of them)."""
    if spec.weight_bytes > gpus * gpu_usable + cpu_limit:
        raise PlanError(
            f"{spec.name} has {format_bytes(spec.weight_bytes)} of weights but the GPU ({format_bytes(gpu_usable)} "
            f"usable{_per_gpu(gpus)}) and CPU ({format_bytes(cpu_limit)}) budgets together hold only "
            f"{format_bytes(gpus * gpu_usable + cpu_limit)}: raise --cpu-memory / --gpu-memory or use a machine "
            "with more memory (offloading to disk is not supported)")
    smallest = Policy(1, 1, attention_on_gpu=False, experts_on_gpu=True, gpus=gpus)
    smallest_chunk = dataclasses.replace(options, prefill_chunk_tokens=MIN_CHUNK_TOKENS)
    gpu_mem, _ = memory_use(spec, smallest, workload, smallest_chunk)
    floor = sum(v.at(0.0, 0.0) for v in gpu_mem.values())
    if floor > gpu_usable:
        raise PlanError(
            f"{format_bytes(gpu_usable)} of usable GPU memory{_per_gpu(gpus)} is too small for {spec.name}: the "
            f"embedding and LM head "
            f"({format_bytes(spec.other_weight_bytes)}) plus a double buffer for one streamed layer "
            f"({format_bytes(2 * spec.largest_layer_weight_bytes)}) and activations need at least {format_bytes(floor)} "
            f"(plus the {options.gpu_margin:.0%} fragmentation margin): raise --gpu-memory")
