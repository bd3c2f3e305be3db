"""Where does an expert-parallel training step spend its time? Under torchrun (transformers with ``ep_size``), each
implementation is built once as ``bench train --engine ep`` builds it and trained at each of ROWS rows per rank;
for every rows setting each rank reports the step time, the host's time to issue it, the GPU's busy time (union of
kernels), NCCL's time and the part of it no other kernel overlaps, the GPU's idle gaps with the kernel before
each, the top kernels and the top host ops by self time, and the host syncs per step (torch profiler, CPU and
CUDA). SHAPE (default deepseek-v2-lite), LAYERS (default: all), ROWS (default "2 4"); arguments: implementations
(default the family's default and hf-scatter; ``<family>-hf-scatter-off-norms+router`` is the full patch less
those options). PYPROFILE=1 adds cProfile's view of one step; MEMORY=1 what the
step's own allocations held at their peak, by where they were made (the allocator's history). Writes
$OUT/ep-step-<SHAPE>.json. STEPS: timed steps (default 5); the allocator's retries and cudaMalloc/cudaFree
counts over them, the Triton kernel variants compiled or loaded during them and the time in Python's garbage
collector are reported.

    torchrun --nproc_per_node 2 scripts/probes/probe_ep_step.py
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from hf_scatter.bench import engines, train
from hf_scatter.bench.train import SHAPES, build_model, published_shape
from hf_scatter.common.intervals import length, overlap, union
from hf_scatter.common.atomic_files import write_json

SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense",
            "aten::item", "cudaMemcpyAsync")


def summarise(prof, steps: int) -> dict:
    """Per step of a ``steps``-step profile: busy, NCCL and compute time on the GPU (an NCCL kernel waiting for a
    peer counts as busy; ``compute_ms`` is the rest's union), idle gaps and what ran before each, top kernels, top
    host ops by self time, host syncs."""
    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start),
                     key=lambda k: k[1])
    busy = union([(a, b) for _, a, b in kernels])
    comm = union([(a, b) for n, a, b in kernels if "nccl" in n.lower()])
    compute = union([(a, b) for n, a, b in kernels if "nccl" not in n.lower()])
    gaps, end, last = [], None, None
    for name, a, b in kernels:
        if end is not None and a > end:
            gaps.append((a - end, last))
        if end is None or b > end:
            end, last = b, name
    by_gap: dict[str, list] = {}
    for g, name in gaps:
        if g > 50:  # us: a gap the host left, not a launch's own latency
            by_gap.setdefault(name[:80], []).append(g)
    per_kernel: dict[str, list] = {}
    for name, a, b in kernels:
        per_kernel.setdefault(name[:80], []).append(b - a)
    host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    found = {name: e for e in prof.key_averages() for name in SYNC_OPS if e.key == name}
    return {
        "gpu_busy_ms": length(busy) / steps / 1e3, "nccl_ms": length(comm) / steps / 1e3,
        "compute_ms": length(compute) / steps / 1e3,
        "exposed_nccl_ms": (length(comm) - overlap(comm, compute)) / steps / 1e3,
        "gpu_span_ms": (kernels[-1][2] - kernels[0][1]) / steps / 1e3 if kernels else 0.0,
        "idle_gaps_over_50us_ms": sum(g for g, _ in gaps if g > 50) / steps / 1e3,
        "idle_gaps_over_50us_count": sum(1 for g, _ in gaps if g > 50) / steps,
        "gaps_after": sorted(((n, round(sum(v) / steps / 1e3, 2), len(v) // steps) for n, v in by_gap.items()),
                             key=lambda r: -r[1])[:15],
        "kernels": sorted(((n, round(sum(v) / steps / 1e3, 2), len(v) // steps) for n, v in per_kernel.items()),
                          key=lambda r: -r[1])[:25],
        "kernel_launches": len(kernels) / steps,
        "host_self_ms": [(e.key[:70], round(e.self_cpu_time_total / steps / 1e3, 2), e.count // steps)
                         for e in host[:30]],
        "syncs": {name: [round(e.self_cpu_time_total / steps / 1e3, 2), e.count // steps] for name, e in found.items()},
    }


def peak_allocations(trace: list[dict], top: int = 25) -> dict:
    """Replay one device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][i]``, recorded over
    one step): the most memory the step's own allocations held at once, and what held it then, by the innermost
    frame in hf_scatter, transformers or torch.distributed (else the innermost frame)."""
    def step_through(stop: int | None):
        live, held, peak, at = {}, 0, 0, 0
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                held += e["size"]
            elif e["action"] == "free_requested" and e["addr"] in live:
                held -= live.pop(e["addr"])["size"]
            if held > peak:
                peak, at = held, i + 1
        return live, peak, at

    _, peak, at = step_through(None)
    live, _, _ = step_through(at)
    by_place: dict[str, int] = {}
    for e in live.values():
        frames = e.get("frames") or [{"filename": "?", "line": 0, "name": "?"}]
        own = next((f for f in frames if any(k in f["filename"] for k in ("hf_scatter", "transformers",
                                                                            "torch/distributed"))), frames[0])
        place = f"{own['filename'].split('site-packages/')[-1]}:{own['line']}({own['name']})"
        by_place[place] = by_place.get(place, 0) + e["size"]
    ranked = sorted(by_place.items(), key=lambda kv: -kv[1])[:top]
    return {"step_peak_gib": peak / 2**30, "held_at_peak_mib": [(k, round(v / 2**20, 1)) for k, v in ranked]}


def memory_at_peak(step) -> dict:
    """:func:`peak_allocations` of one step recorded by the CUDA caching allocator's history."""
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=500_000, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return peak_allocations(snapshot["device_traces"][torch.cuda.current_device()])


def triton_variants() -> int:
    """Compiled variants held by every Triton JIT function of the process (a new one means a compile or a disk-cache
    load during the step: Triton specialises integer arguments on divisibility by 16 and pointers on alignment)."""
    import gc
    import warnings

    from triton.runtime.jit import JITFunction

    with warnings.catch_warnings():  # isinstance() on some of torch's deprecated objects warns
        warnings.simplefilter("ignore")
        return sum(len(cache[0]) for fn in gc.get_objects() if isinstance(fn, JITFunction)
                   for cache in fn.device_caches.values())


class GcTimer:
    """Time the interpreter spends in its garbage collector (all generations) while active."""

    def __init__(self):
        self.ms, self.collections, self._t0 = 0.0, 0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.ms += (time.perf_counter() - self._t0) * 1e3
            self.collections += 1

    def __enter__(self):
        import gc
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        import gc
        gc.callbacks.remove(self)


def python_profile(step) -> dict:
    """cProfile's view of one step: the Python functions the host time goes to (self and cumulative)."""
    import cProfile
    import pstats

    dist.barrier()
    pr = cProfile.Profile()
    pr.enable()
    step()
    pr.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(pr).stats

    def where(fn):
        return f"{fn[0].split('site-packages/')[-1].split('/work/')[-1]}:{fn[1]}({fn[2]})"[-110:]

    return {"python_tottime_ms": [(where(fn), round(st[2] * 1e3, 2), st[1]) for fn, st in
                                  sorted(stats.items(), key=lambda kv: -kv[1][2])[:50]],
            "python_cumtime_ms": [(where(fn), round(st[3] * 1e3, 2), st[1]) for fn, st in
                                  sorted(stats.items(), key=lambda kv: -kv[1][3])[:120]],
            "python_calls": sum(st[1] for st in stats.values())}


def main() -> None:
    shape_name = os.environ.get("SHAPE", "deepseek-v2-lite")
    layers = int(os.environ.get("LAYERS", 0)) or None
    rows = [int(r) for r in os.environ.get("ROWS", "2 4").split()]
    family = SHAPES[shape_name]
    impls = sys.argv[1:] or [f"{family}-grouped_mm", f"{family}-hf-scatter"]
    for impl in impls:  # "<family>-hf-scatter-off-norms+router": the full patch less the named pieces
        if "-hf-scatter-off-" in impl:
            variant = impl.split("-hf-scatter-", 1)[1]
            train._VARIANT_OPTIONS[variant] = {name: False for name in variant.removeprefix("off-").split("+")}
    report: dict = {"shape": shape_name, "layers": layers, "torch": torch.__version__}
    with engines.process_group(True):
        world, me = engines.world_size(), engines.rank()
        import transformers
        report["transformers"] = transformers.__version__
        config = engines.expert_parallel_config(world, bf16=True)[0]
        for impl in impls:
            cfg = published_shape(shape_name, layers)
            t0 = time.perf_counter()
            model = build_model(impl, cfg, torch.device("cuda"), torch.bfloat16, distributed_config=config)
            built_s = time.perf_counter() - t0
            for r in rows:
                ids = torch.randint(cfg.vocab, (r, cfg.seq), generator=torch.Generator().manual_seed(me)).cuda()
                step, opt = engines.adamw_step(model, ids)
                torch.cuda.reset_peak_memory_stats()
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
                host, total = [], []
                before = torch.cuda.memory_stats()
                variants = triton_variants()
                gc_timer = GcTimer().__enter__()
                for _ in range(int(os.environ.get("STEPS", 5))):
                    dist.barrier()
                    torch.cuda.synchronize()
                    a = time.perf_counter()
                    step()
                    b = time.perf_counter()
                    torch.cuda.synchronize()
                    host.append((b - a) * 1e3)
                    total.append((time.perf_counter() - a) * 1e3)
                after = torch.cuda.memory_stats()  # the allocator's retries and cudaMalloc/cudaFree in the timed steps
                gc_timer.__exit__()
                new_variants = triton_variants() - variants
                dist.barrier()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(2):
                        step()
                    torch.cuda.synchronize()
                python = python_profile(step) if os.environ.get("PYPROFILE") else {}
                memory = memory_at_peak(step) if os.environ.get("MEMORY") else {}
                allocator = {k: after.get(k, 0) - before.get(k, 0)
                             for k in ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")}
                found = {"rows": r, "build_s": built_s, "step_ms": statistics.median(total),
                         "reserved_gib": torch.cuda.max_memory_reserved() / 2**30, **allocator,
                         "triton_new_variants": new_variants, "gc_ms": gc_timer.ms, "gc_collections": gc_timer.collections,
                         "host_issue_ms": statistics.median(host), "step_ms_all": total,
                         "peak_gib": torch.cuda.max_memory_allocated() / 2**30, **summarise(prof, 2), **python,
                         **memory}
                del prof
                ranks = engines.gather(found)
                if me == 0:
                    report.setdefault(impl, []).append(ranks)
                    short = {k: (round(v, 1) if isinstance(v, float) else v) for k, v in ranks[0].items()
                             if not isinstance(v, (list, dict))}
                    print(impl, json.dumps(short), flush=True)
                    for key in ("gaps_after", "kernels", "host_self_ms", "held_at_peak_mib"):
                        print("  ", key)
                        for row in ranks[0].get(key, [])[:15]:
                            print("     ", row)
                    print("   syncs", ranks[0]["syncs"], flush=True)
                del step, opt
                torch.cuda.empty_cache()
            del model
            torch.cuda.empty_cache()
    if me == 0 and os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], f"ep-step-{shape_name}.json"), report)


if __name__ == "__main__":
    main()
