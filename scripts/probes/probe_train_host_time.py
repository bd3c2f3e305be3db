"""Is a training step of a bench-train model (each family at its own shape) host-bound? Host time to issue one step against its GPU
time, per implementation, and the host-side hot spots of the patched step (GPU; torch profiler). PYPROFILE=1 adds
cProfile's Python view; FSDP=1 wraps every model in FSDP2 with world size 1, as ``bench train --fsdp`` does
(RESHARD=0: parameters kept gathered from forward to backward; PREFETCH=next; REDUCE=bfloat16). LIGER=1: the
patched loss through Liger-Kernel's fused linear cross-entropy instead of hf-scatter's own. SHAPE=qwen3-30b-a3b LAYERS=8 BATCH=4:
a published model's dimensions instead of the family shapes."""
import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_scatter.bench import engines
from hf_scatter.bench.engines import adamw_step, process_group
from hf_scatter.bench.train import build_model, family_shape, published_shape
from hf_scatter.common.atomic_files import write_json

impls = sys.argv[1:] or ["mixtral-grouped_mm", "mixtral-hf-scatter-experts", "mixtral-hf-scatter", "mixtral-hf-scatter-graphs",
                         "dbrx-hf-scatter"]
out = {}
fsdp = bool(os.environ.get("FSDP"))
options = engines.Fsdp2Options(reshard_after_forward=os.environ.get("RESHARD", "1") != "0",
                               prefetch=os.environ.get("PREFETCH", "none"),
                               reduce_dtype=os.environ.get("REDUCE", "float32"))
if os.environ.get("LIGER"):
    import functools

    import hf_scatter.models.fused_loss as fused_loss
    fused_loss.linear_cross_entropy = functools.partial(fused_loss.linear_cross_entropy, use_liger=True)
shape = published_shape(os.environ["SHAPE"], int(os.environ.get("LAYERS", 0)) or None) if os.environ.get("SHAPE") else None
batch = int(os.environ["BATCH"]) if os.environ.get("BATCH") else None
group = process_group(fsdp)
group.__enter__()
for impl in impls:
    cfg = family_shape(impl, shape, batch)
    ids = torch.randint(cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0)).cuda()
    model = build_model(impl, cfg, ids.device, torch.bfloat16)
    if fsdp:
        engines.fully_shard_layers(model, torch.bfloat16, options)
    step, opt = adamw_step(model, ids)
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    host, total = [], []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append((t1 - t0) * 1e3)
        total.append((t2 - t0) * 1e3)
    # GPU-only time: the same step, replayed with the host far ahead (queue filled by a long sleep kernel).
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of GPU time: the host issues the whole step while the GPU sleeps
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    step()
    b.record()
    torch.cuda.synchronize()
    r = {"host_issue_ms": sorted(host)[2], "step_ms": sorted(total)[2], "gpu_ms_queue_full": a.elapsed_time(b)}
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    r["top_self_cpu_ms"] = [(e.key[:70], round(e.self_cpu_time_total / 1e3, 2), e.count) for e in rows]
    if os.environ.get("PYPROFILE"):  # Python-level: which functions the host time is spent in
        import cProfile
        import pstats
        pr = cProfile.Profile()
        pr.enable()
        step()
        pr.disable()
        torch.cuda.synchronize()
        stats = pstats.Stats(pr).sort_stats("tottime")
        r["python_tottime_ms"] = [(f"{fn[0].split('site-packages/')[-1]}:{fn[1]}({fn[2]})", round(st[2] * 1e3, 2), st[1])
                                  for fn, st in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:40]]
        r["python_cumtime_ms"] = [(f"{fn[0].split('site-packages/')[-1]}:{fn[1]}({fn[2]})", round(st[3] * 1e3, 2), st[1])
                                  for fn, st in sorted(stats.stats.items(), key=lambda kv: -kv[1][3])[:60]]
        r["python_calls"] = sum(st[1] for st in stats.stats.values())
    out[impl] = r
    print(impl, json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in r.items() if not isinstance(v, list)}), flush=True)
    for key in ("top_self_cpu_ms", "python_tottime_ms", "python_cumtime_ms"):
        for row in r.get(key, [])[:60]:
            print("    ", row)
    del model, opt, step
    torch.cuda.empty_cache()
group.__exit__(None, None, None)
if os.environ.get("OUT"):
    write_json(os.path.join(os.environ["OUT"], f"train-host{os.environ.get('TAG', '')}.json"), out)
