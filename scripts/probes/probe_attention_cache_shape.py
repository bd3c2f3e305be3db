"""Which property of the pipeline's KV cache makes its CPU decode attention slower than the profile's call: one
factor at a time on the profile's own call (GPT-OSS-120B's attention shape, ``KVCache.attend`` on the attention
worker, pinned copies and a thread issuing GPU work beside it, as the profile measures). Factors: room left for the
generated tokens (capacity prompt + NEW - 1 instead of prompt + 1: the keys read are a strided slice), the rows'
spread of lengths (a bucket spans up to 1.25x, the profile's +-10%), the rows per call, and every layer its own
cache (calls in turn over LAYERS caches instead of one).

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_attention_cache_shape.py OUT.json
Settings (environment): CONTEXT (100), NEW (32), LAYERS (10).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import statistics
import sys
import time

import torch

from hf_scatter.offload.families.adapter import LayerAttention
from hf_scatter.offload.measure import _driver_load, _link_traffic
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker, KVCache, attention_threads

Q_HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64  # GPT-OSS-120B


def lengths(rows: int, context: int, spread: float) -> list[int]:
    """Longest first, mean ``context``, the longest ``1 + spread`` times the shortest."""
    lo = 2 * context / (2 + spread)
    return [round(lo * (1 + spread) - lo * spread * i / max(rows - 1, 1)) for i in range(rows)]


def call_ms(worker, rows: int, context: int, spread: float, room: int, layers: int) -> float:
    lens = lengths(rows, context, spread)
    sinks = torch.randn(Q_HEADS, generator=torch.Generator().manual_seed(0))
    cache = KVCache([[(p, p + 1 + room) for p in lens]], layers, KV_HEADS, HEAD_DIM, Q_HEADS, torch.bfloat16,
                    attention=[LayerAttention(sinks=sinks)] * layers)
    qkv = torch.randn(rows, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16)
    out = torch.empty(rows, Q_HEADS * HEAD_DIM, dtype=torch.bfloat16)
    layer = itertools.cycle(range(layers))
    for _ in range(layers):
        worker.submit(cache.attend, next(layer), 0, 0, qkv, out).result()
    times = []
    start = time.perf_counter()
    while len(times) < 5 or (len(times) < 60 and time.perf_counter() - start < 0.6):
        t0 = time.perf_counter()
        worker.submit(cache.attend, next(layer), 0, 0, qkv, out).result()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    context, new, layers = (int(os.environ.get(k, v)) for k, v in (("CONTEXT", 100), ("NEW", 32), ("LAYERS", 10)))
    worker = AttentionWorker(attention_threads())
    variants = [("profile's call", 256, 0.2, 0, 1), ("room for the new tokens", 256, 0.2, new - 1, 1),
                ("a bucket's spread", 256, 0.25, 0, 1), ("both", 256, 0.25, new - 1, 1),
                ("both, every layer its cache", 256, 0.25, new - 1, layers),
                ("profile's call, 512 rows", 512, 0.2, 0, 1), ("both, 512 rows", 512, 0.25, new - 1, 1),
                ("profile's call, 128 rows", 128, 0.2, 0, 1), ("both, 128 rows", 128, 0.25, new - 1, 1)]
    report = {"threads": attention_threads(), "context": context, "new": new, "rows": []}
    with contextlib.ExitStack() as stack:
        stack.enter_context(_link_traffic())
        stack.enter_context(_driver_load(0.5))
        for _ in range(3):  # passes in turn: a slow spell of the host moves one pass, not one variant
            for name, rows, spread, room, n_layers in variants:
                ms = call_ms(worker, rows, context, spread, room, n_layers)
                report["rows"].append({"variant": name, "rows": rows, "spread": spread, "room": room,
                                       "layers": n_layers, "call_ms": ms})
                print(f"{name:32s} {rows:4d} rows  {ms:6.2f} ms", flush=True)
    worker.close()
    medians = {}
    for r in report["rows"]:
        medians.setdefault(r["variant"], []).append(r["call_ms"])
    report["median_call_ms"] = {k: statistics.median(v) for k, v in medians.items()}
    print(json.dumps(report["median_call_ms"], indent=1))
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
