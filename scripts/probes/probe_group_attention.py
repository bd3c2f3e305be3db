"""How long a decode step's CPU attention takes when N tensor-parallel ranks of one host run theirs at once, each
over its share of the heads, in lockstep as the all-reduces make them: per rank, and the slowest rank per step
(what the group waits for). With and without each rank's thread team pinned to its own cores, and with pinned
host->device copies running meanwhile on every rank's GPU (the weights stream during decode).

Measured on the H100 x4 host (64 cores, 2026-11, copies meanwhile): pinning made the slowest rank per step slower,
16.2 -> 19.8 ms (2 ranks) and 18.0 -> 19.1 ms (4 ranks), so the runtime leaves placement to the OS.

Shape: GPT-OSS-120B's attention (64 query heads, 8 KV heads of 64, sinks), 1024 MTBench-like rows at step 16.
Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_group_attention.py [OUT.json]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HEADS, KV_HEADS, HEAD_DIM, ROWS, STEP = 64, 8, 64, 1024, 16
CALLS = int(os.environ.get("CALLS", 120))


def _pump(device: int, stop: threading.Event) -> None:
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=f"cuda:{device}")
    stream = torch.cuda.Stream(device)
    while not stop.is_set():
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()


def _rank(rank: int, ranks: int, pin: bool, traffic: bool, store: str, results) -> None:
    from hf_scatter.bench.offload_workload import prompts
    from hf_scatter.offload.families.adapter import LayerAttention
    from hf_scatter.offload.plan.tensor_parallel import attention_threads
    from hf_scatter.offload.runtime.cpu_attention import AttentionWorker, KVCache

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=ranks)
    heads, kv_heads = HEADS // ranks, KV_HEADS // ranks
    lens = sorted((len(p) for p in prompts(ROWS, 1000)), reverse=True)
    torch.manual_seed(rank)
    attention = [LayerAttention(sinks=torch.randn(heads))]
    cache = KVCache([[(p, p + 32) for p in lens]], 1, kv_heads, HEAD_DIM, heads, torch.bfloat16, attention=attention)
    qkv = torch.randn(ROWS, (heads + 2 * kv_heads) * HEAD_DIM).to(torch.bfloat16)
    out = torch.empty(ROWS, heads * HEAD_DIM, dtype=torch.bfloat16)
    worker = AttentionWorker(attention_threads(os.cpu_count(), ranks))
    if pin:  # an equal share of the host's cores; the worker's thread team, started later, inherits the mask
        per = os.cpu_count() // ranks
        worker.submit(os.sched_setaffinity, 0, range(rank * per, (rank + 1) * per)).result()
    stop = threading.Event()
    pump = threading.Thread(target=_pump, args=(rank, stop), daemon=True) if traffic else None
    if pump:
        pump.start()
    times = []
    try:
        for i in range(CALLS + 10):
            dist.barrier()
            start = time.perf_counter()
            worker.submit(cache.attend, 0, 0, STEP, qkv, out).result()
            if i >= 10:
                times.append(time.perf_counter() - start)
    finally:
        stop.set()
        worker.close()
    gathered = [None] * ranks
    dist.all_gather_object(gathered, times)
    if rank == 0:
        results.put(gathered)
    dist.destroy_process_group()


def run(ranks: int, pin: bool, traffic: bool) -> dict:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank, args=(r, ranks, pin, traffic, f"{tmp}/store", results))
                 for r in range(ranks)]
        for p in procs:
            p.start()
        per_rank = results.get(timeout=600)
        for p in procs:
            p.join()
    ms = [[t * 1e3 for t in ts] for ts in per_rank]
    slowest = [max(step) for step in zip(*ms)]

    def pct(xs, q):
        return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]

    return {"ranks": ranks, "pinned": pin, "copies_meanwhile": traffic,
            "per_rank_ms": [{"mean": statistics.mean(x), "p50": pct(x, .5), "p90": pct(x, .9), "max": max(x)}
                            for x in ms],
            "slowest_rank_mean_ms": statistics.mean(slowest), "calls_ms": ms}


def main() -> None:
    gpus = torch.cuda.device_count()
    rows = [run(1, False, gpus > 0)]
    for ranks in (2, 4):
        if ranks <= max(gpus, 1) and ranks <= (os.cpu_count() or 1):
            rows += [run(ranks, pin, gpus > 0) for pin in (False, True)]
    for r in rows:
        print(f"ranks {r['ranks']} pinned {r['pinned']!s:5} copies {r['copies_meanwhile']!s:5}: "
              f"rank means {[round(x['mean'], 2) for x in r['per_rank_ms']]} ms, "
              f"p90 {[round(x['p90'], 2) for x in r['per_rank_ms']]}, "
              f"slowest per step {r['slowest_rank_mean_ms']:.2f} ms")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"cpu_cores": os.cpu_count(), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
