"""Why offloaded decode's CPU attention runs slower in the pipeline than the profile measures it: the same calls over
the profile's one-layer cache and over the pipeline's (every layer its own cache, the workload's micro-batches and
length buckets, the context growing step by step), idle and beside the pipeline's loads (pinned copies, a thread
issuing GPU work); each way with the runtime's fused call and with a batched-matmul form; then (PIPELINE=1) the
real pipeline's own CPU attention spans from a traced run.

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_attention_in_pipeline.py OUT.json
Settings (environment): LAYERS (10), REQUESTS (1024), MICRO (512), NEW_TOKENS (32), PIPELINE (1), PROFILE (the
10-layer report the probe was run on, now in docs/results/history).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from hf_scatter.bench.offload_workload import prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import load_profile
from hf_scatter.offload.families.adapter import LayerAttention
from hf_scatter.offload.measure import _cpu_attention_point, _driver_load, _link_traffic
from hf_scatter.offload.plan.attention_buckets import BucketCosts
from hf_scatter.offload.runtime import cpu_attention
from hf_scatter.offload.runtime.batching import plan_batches
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker, KVCache, attention_threads
from probe_step_turn import attention_idle  # this directory is on the path of a script run from it

Q_HEADS, KV_HEADS, HEAD_DIM = 64, 8, 64  # GPT-OSS-120B


def bmm_decode(q, k, v, mask=None, sinks=None, scale=None, out=None):
    """Decode attention as two batched matmuls over [rows * kv_heads] groups (each group's query heads as rows),
    float32 softmax with the sink in the denominator."""
    n, H, d = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scores = torch.bmm(q.reshape(n * Hkv, G, d), k.reshape(n * Hkv, S, d).transpose(1, 2))  # [n Hkv, G, S]
    scores = scores.float().mul_(d ** -0.5 if scale is None else scale).view(n, H, S)
    if mask is not None:
        scores.masked_fill_(~mask[:, None, :], float("-inf"))
    top = scores.amax(-1, keepdim=True)  # [n, H, 1]
    if sinks is not None:
        top = torch.maximum(top, sinks.float().view(1, H, 1))
    probs = scores.sub_(top).exp_()
    denom = probs.sum(-1, keepdim=True)
    if sinks is not None:
        denom += (sinks.float().view(1, H, 1) - top).exp_()
    probs.div_(denom)
    o = torch.bmm(probs.to(v.dtype).view(n * Hkv, G, S), v.reshape(n * Hkv, S, d))  # [n Hkv, G, d]
    return o.view(n, H, d) if out is None else out.copy_(o.view(n, H, d))


@contextlib.contextmanager
def using(form):
    """The KV cache's attention call replaced by ``form`` meanwhile (None: the runtime's own)."""
    before = cpu_attention.decode_attention
    if form is not None:
        cpu_attention.decode_attention = form
    try:
        yield
    finally:
        cpu_attention.decode_attention = before


def pipeline_cache(lens, requests, micro, layers, new_tokens, costs):
    batch = plan_batches(lens, requests, micro)[0]
    sinks = torch.randn(Q_HEADS, generator=torch.Generator().manual_seed(0))
    mbs = [[(lens[r], lens[r] + new_tokens - 1) for r in mb.requests] for mb in batch.micro_batches]
    cache = KVCache(mbs, layers, KV_HEADS, HEAD_DIM, Q_HEADS, torch.bfloat16, costs,
                    attention=[LayerAttention(sinks=sinks)] * layers)
    for b in (x for mb in cache.buckets for x in mb):
        b.k.normal_()
        b.v.normal_()
    return cache, [len(mb) for mb in mbs]


def run_steps(worker, cache, sizes, layers, steps, use_layers):
    """Seconds per attention call over decode steps 0 .. steps - 1 (the ones storing a key), every call of a step
    queued at once as the pipeline queues them."""
    qkv = [torch.randn(n, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM).to(torch.bfloat16) for n in sizes]
    out = [torch.empty(n, Q_HEADS * HEAD_DIM, dtype=torch.bfloat16) for n in sizes]
    calls, start = 0, time.perf_counter()
    for t in range(steps):
        pending = []
        for layer in range(layers):
            for j in range(len(sizes)):
                pending.append(worker.submit(cache.attend, layer % use_layers, j, t, qkv[j], out[j]))
        for p in pending:
            p.result()
        calls += len(pending)
    return (time.perf_counter() - start) / calls


def traced_pipeline(layers, requests, new_tokens, profile):
    import hf_scatter
    from hf_scatter.bench.offload_workload import build_model, left_padded
    from hf_scatter.offload import Workload

    reqs = prompts(requests, builtin_config("gpt-oss-120b").vocab_size)
    ids, mask = left_padded(reqs)
    off = hf_scatter.offload_model(build_model(layers, model="gpt-oss-120b", weights="mxfp4"), gpu_memory="16GiB",
                                   cpu_memory="80GiB", profile=profile,
                                   workload=Workload.from_prompts([len(r) for r in reqs], new_tokens), progress=False)
    off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, progress=False)  # warm: compiles, captures
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        stats = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True, progress=False,
                             trace=path).stats
        calls = attention_idle(path)
    off.close()
    return {"policy": off.policy.to_dict(), "decode_step_s": stats["decode_s"] / stats["decode_steps"],
            "tokens_per_s": stats["tokens_per_s"], "busy_s": stats["trace"]["busy_s"], **calls}


def main() -> None:
    layers, requests = int(os.environ.get("LAYERS", 10)), int(os.environ.get("REQUESTS", 1024))
    micro, new_tokens = int(os.environ.get("MICRO", 512)), int(os.environ.get("NEW_TOKENS", 32))
    profile = load_profile(os.environ.get("PROFILE", "docs/results/history/offload-formats-gpt-oss-120b-before-plan-fidelity-h200.json"))
    report = {"host": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
              "threads": attention_threads(), "rows": []}
    worker = AttentionWorker(attention_threads())
    lens = [len(p) for p in prompts(requests, 1000)]
    costs = BucketCosts.from_profile(profile)
    cache, sizes = pipeline_cache(lens, requests, micro, layers, new_tokens, costs)
    # the same rows in one bucket per micro-batch (more padding, fewer calls)
    one, _ = pipeline_cache(lens, requests, micro, layers, new_tokens, BucketCosts(call_s=1.0, byte_s=costs.byte_s,
                                                                                   slack=10.0))
    report["buckets"] = [[(b.end - b.start, b.capacity) for b in mb] for mb in cache.buckets]
    report["bucket_costs"] = {"call_s": costs.call_s, "byte_s": costs.byte_s}
    ctx = statistics.mean(lens) + (new_tokens - 1) / 2
    report["mean_context"] = ctx
    for form_name, form, steps in (("fused", None, new_tokens - 1), ("bmm", bmm_decode, min(4, new_tokens - 1))):
        with using(form):
            for load in ("idle", "copies + driver 50%"):
                stack = contextlib.ExitStack()
                if load != "idle":
                    stack.enter_context(_link_traffic())
                    stack.enter_context(_driver_load(0.5))
                with stack:
                    row = {"form": form_name, "load": load, "steps": steps,
                           "profile_call_ms": 1e3 * _cpu_attention_point(
                               worker, micro, round(ctx), (Q_HEADS, KV_HEADS, HEAD_DIM, False, True))["seconds"]}
                    for use in (1, layers):
                        row[f"pipeline_cache_{use}_layers_call_ms"] = 1e3 * run_steps(worker, cache, sizes, layers,
                                                                                     steps, use)
                    row[f"one_bucket_{layers}_layers_call_ms"] = 1e3 * run_steps(worker, one, sizes, layers, steps,
                                                                                layers)
                print(json.dumps(row), flush=True)
                report["rows"].append(row)
    worker.close()
    del one
    for threads in (8, 12, 16):
        w = AttentionWorker(threads)
        with using(None), _link_traffic(), _driver_load(0.5):
            ms = 1e3 * run_steps(w, cache, sizes, layers, new_tokens - 1, layers)
        w.close()
        report["rows"].append({"form": "fused", "load": "copies + driver 50%", "threads": threads,
                               f"pipeline_cache_{layers}_layers_call_ms": ms})
        print(threads, ms, flush=True)
    del cache
    if os.environ.get("PIPELINE", "1") == "1":
        report["pipeline"] = traced_pipeline(layers, requests, new_tokens, profile)
        print(json.dumps({k: v for k, v in report["pipeline"].items() if k != "policy"}), flush=True)
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
