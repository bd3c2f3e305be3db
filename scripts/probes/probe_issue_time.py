"""How long the offloaded pipeline's driver thread takes to issue one decode stage, and where that host time goes:
one process on one GPU builds GPT-OSS-120B-shape layers in each format of WEIGHTS, generates with a trace (the
driver's "issue pre" / "issue post" spans per micro-batch, their count, median and mean), then generates again under
cProfile (the driver thread's Python functions by own time) and under torch.profiler (host ops by own time).

The question: the HRM prices a stage's host issue time as kernels x the profile's launch cost (one small
nn.Linear call), about 0.3 ms a layer, where a trace of MXFP4 decode showed 2.4-3.3 ms per micro-batch issuing the
post-attention alone; with one micro-batch (four GPUs) that time sits on the dependency chain unpriced.

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_issue_time.py OUT_DIR
Settings (environment): WEIGHTS ("bf16,mxfp4"), MODEL (gpt-oss-120b), LAYERS (6), REQUESTS (1024), NEW_TOKENS (8),
GPU_MEMORY (16GiB), CPU_MEMORY (80GiB), DEVICE (cuda; cpu: a smoke test of the script), PROFILE (a profile JSON,
or a bench report holding one).
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

import hf_scatter
from hf_scatter.bench.offload_workload import build_model, left_padded, prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import Workload, load_profile


def driver_spans(trace_path: str) -> dict:
    """The Driver lane's spans by kind: count, median and mean milliseconds, total seconds."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    kinds: dict[str, list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and lanes.get(e["tid"]) == "Driver":
            kind = " ".join(e["name"].split()[:2])
            kinds.setdefault(kind, []).append(e["dur"] / 1e3)
    return {k: {"count": len(v), "median_ms": statistics.median(v), "mean_ms": statistics.fmean(v),
                "total_s": sum(v) / 1e3} for k, v in sorted(kinds.items())}


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    model, layers = os.environ.get("MODEL", "gpt-oss-120b"), int(os.environ.get("LAYERS", 6))
    new_tokens = int(os.environ.get("NEW_TOKENS", 8))
    profile = load_profile(os.environ.get("PROFILE", "docs/results/history/offload-formats-gpt-oss-120b-before-plan-fidelity-h200.json"))
    config = builtin_config(model, num_hidden_layers=layers)
    reqs = prompts(int(os.environ.get("REQUESTS", 1024)), config.vocab_size)
    ids, mask = left_padded(reqs)
    workload = Workload.from_prompts([len(r) for r in reqs], new_tokens)
    report = {}
    for weights in os.environ.get("WEIGHTS", "bf16,mxfp4").split(","):
        begun = time.perf_counter()
        off = hf_scatter.offload_model(build_model(layers, model=model, weights=weights),
                                       gpu_memory=os.environ.get("GPU_MEMORY", "16GiB"),
                                       cpu_memory=os.environ.get("CPU_MEMORY", "80GiB"), profile=profile,
                                       workload=workload, progress=False,
                                       device=os.environ.get("DEVICE", "cuda"))
        off.generate(ids[:off.policy.batch_size], attention_mask=mask[:off.policy.batch_size], max_new_tokens=3,
                     progress=False)
        trace = os.path.join(out_dir, f"trace-{weights}.json")
        out = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True, progress=False,
                           trace=trace)
        stats = dict(out.stats)
        summary = stats.pop("trace")
        profiler = cProfile.Profile()
        profiler.enable()
        off.generate(ids, attention_mask=mask, max_new_tokens=4, progress=False)
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(60)
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        with open(os.path.join(out_dir, f"cprofile-{weights}.txt"), "w") as f:
            f.write(text.getvalue())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            off.generate(ids, attention_mask=mask, max_new_tokens=4, progress=False)
        with open(os.path.join(out_dir, f"torchprof-{weights}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
        report[weights] = {"policy": off.policy.to_dict(), "describe": off.describe(), "stats": stats,
                           "busy_s": summary["busy_s"], "driver": driver_spans(trace),
                           "seconds": time.perf_counter() - begun}
        print(weights, json.dumps(report[weights]["driver"], indent=1), flush=True)
        off.close()
        del off
    with open(os.path.join(out_dir, "issue-time.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
