"""Offloaded decode with each micro-batch's next step issued as soon as its token is chosen, against every stage
issued in order (the CPU idle at each step's turn), alternating in one process on one plan: GPT-OSS-120B-shape
layers (MXFP4 experts as shipped); then one traced run each way (the CPU attention lane's idle time between calls).

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_step_turn.py OUT.json
Settings (environment): PROFILE (default: the 10-layer report it was run on), LAYERS (10), REQUESTS (1024),
NEW_TOKENS (32), ROUNDS (3).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch

import hf_scatter
from hf_scatter.bench.offload_workload import build_model, left_padded, prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import Workload, load_profile


def attention_idle(path: str) -> dict:
    """Idle time of the CPU attention lane between its decode calls, and the calls' median (overall and by decode
    step), from a trace."""
    events = json.load(open(path))["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    calls = [e for e in events
             if e["ph"] == "X" and lanes[e["tid"]] == "CPU attention" and e["name"].startswith("step")]
    by_step = {}
    for e in calls:  # named "step T L<layer> mb <j>"
        by_step.setdefault(int(e["name"].split()[1]), []).append(e["dur"] / 1e3)
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in calls)
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:]) if b[0] > a[1]]
    return {"calls": len(calls), "call_ms_median": statistics.median(e["dur"] / 1e3 for e in calls),
            "call_ms_median_by_step": {t: statistics.median(v) for t, v in sorted(by_step.items())},
            "idle_ms_total": sum(gaps) / 1e3, "gaps_over_0.5_ms": sum(g > 500 for g in gaps)}


def main() -> None:
    layers, new_tokens = int(os.environ.get("LAYERS", 10)), int(os.environ.get("NEW_TOKENS", 32))
    profile = load_profile(os.environ.get("PROFILE", "docs/results/history/offload-formats-gpt-oss-120b-before-plan-fidelity-h200.json"))
    reqs = prompts(int(os.environ.get("REQUESTS", 1024)), builtin_config("gpt-oss-120b").vocab_size)
    ids, mask = left_padded(reqs)
    off = hf_scatter.offload_model(build_model(layers, model="gpt-oss-120b", weights="mxfp4"), gpu_memory="16GiB",
                                   cpu_memory="80GiB", profile=profile,
                                   workload=Workload.from_prompts([len(r) for r in reqs], new_tokens), progress=False)
    streamer = off.pipe.streamer
    resident = streamer.resident
    assert resident(0) is not None, "the first stage streams on this plan: nothing to compare"

    def generate(ahead: bool, trace: str | None = None) -> dict:
        streamer.resident = resident if ahead else (lambda stage: None)
        stats = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True, progress=False,
                             trace=trace).stats
        row = {k: stats[k] for k in ("tokens_per_s", "decode_s", "prefill_s", "decode_steps")}
        row["decode_step_s"] = stats["decode_s"] / stats["decode_steps"]
        return row

    first = {way: generate(way == "ahead") for way in ("ahead", "in order")}  # warm: compile, capture
    runs = {"ahead": [], "in order": []}
    for _ in range(int(os.environ.get("ROUNDS", 3))):
        for way in runs:
            runs[way].append(generate(way == "ahead"))
            print(way, json.dumps(runs[way][-1]), flush=True)
    traced = {}
    with tempfile.TemporaryDirectory() as tmp:
        for way in runs:
            path = os.path.join(tmp, "trace.json")
            traced[way] = {**generate(way == "ahead", path), **attention_idle(path)}
            print(way, "traced", json.dumps(traced[way]), flush=True)
    summary = {way: {"decode_step_s_median": statistics.median(r["decode_step_s"] for r in rows),
                     "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows)}
               for way, rows in runs.items()}
    summary["ahead_over_in_order_tokens_per_s"] = (summary["ahead"]["tokens_per_s_median"]
                                                   / summary["in order"]["tokens_per_s_median"])
    summary["predicted_tokens_per_s"] = getattr(off.policy.prediction, "tokens_per_s", None)
    report = {"what": f"gpt-oss-120b shape, {layers} layers, mxfp4 experts, offloaded decode with each micro-batch's "
                      "next step issued ahead against every stage in order, alternating in one process on one plan "
                      "(scripts/probes/probe_step_turn.py)",
              "device": torch.cuda.get_device_name(), "policy": off.policy.to_dict(), "warm": first, "runs": runs,
              "traced": traced, "summary": summary}
    off.close()
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
