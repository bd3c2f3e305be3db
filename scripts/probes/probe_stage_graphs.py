"""Offloaded decode with its stages as CUDA graphs against the same stages issued eagerly, side by side in one
process on one plan: GPT-OSS-120B-shape layers (MXFP4 experts as shipped), runs alternating between the two
ways, then one traced run of each (busy seconds per lane, the driver's issue spans).

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_stage_graphs.py OUT_DIR
Settings (environment): PROFILE (a profile JSON or a bench report holding one; default: the 10-layer
report it was run on), MODEL (gpt-oss-120b), WEIGHTS (mxfp4), LAYERS (10), REQUESTS (1024), NEW_TOKENS (32), ROUNDS (3),
GPU_MEMORY (16GiB), CPU_MEMORY (80GiB).
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

import hf_scatter
from hf_scatter.bench.offload_workload import build_model, left_padded, prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import Workload, load_profile


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out_dir, exist_ok=True)
    model, layers = os.environ.get("MODEL", "gpt-oss-120b"), int(os.environ.get("LAYERS", 10))
    weights, new_tokens = os.environ.get("WEIGHTS", "mxfp4"), int(os.environ.get("NEW_TOKENS", 32))
    profile = load_profile(os.environ.get("PROFILE", "docs/results/history/offload-formats-gpt-oss-120b-before-plan-fidelity-h200.json"))
    reqs = prompts(int(os.environ.get("REQUESTS", 1024)), builtin_config(model).vocab_size)
    ids, mask = left_padded(reqs)
    off = hf_scatter.offload_model(build_model(layers, model=model, weights=weights),
                                   gpu_memory=os.environ.get("GPU_MEMORY", "16GiB"),
                                   cpu_memory=os.environ.get("CPU_MEMORY", "80GiB"), profile=profile,
                                   workload=Workload.from_prompts([len(r) for r in reqs], new_tokens), progress=False)
    graphs = off.pipe.graphs
    assert graphs.enabled, "decode graphs are off (HF_SCATTER_OFFLOAD_GRAPHS=0?)"

    def generate(graphed: bool, trace: str | None = None) -> dict:
        graphs.enabled = graphed
        result = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True, progress=False,
                              trace=trace)
        stats = result.stats
        row = {k: stats[k] for k in ("tokens_per_s", "decode_s", "prefill_s", "decode_steps", "graph_replays",
                                     "max_memory_allocated")}
        row["decode_step_s"] = stats["decode_s"] / stats["decode_steps"]
        row["memory_reserved"] = torch.cuda.memory_reserved()
        if trace:
            summary = stats["trace"]
            row["busy_s"], row["driver_issue_s"] = summary["busy_s"], summary["driver_issue_s"]
        return row

    generate(True)  # warms both: the eager first steps compile, the graphs capture
    generate(False)
    runs = {"graphs": [], "eager": []}
    for _ in range(int(os.environ.get("ROUNDS", 3))):
        for way in ("graphs", "eager"):
            runs[way].append(generate(way == "graphs"))
            print(way, json.dumps(runs[way][-1]), flush=True)
    traced = {way: generate(way == "graphs", os.path.join(out_dir, f"trace-{way}.json")) for way in runs}
    summary = {way: {"decode_step_s_median": statistics.median(r["decode_step_s"] for r in rows),
                     "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rows)}
               for way, rows in runs.items()}
    summary["graphs_over_eager_tokens_per_s"] = (summary["graphs"]["tokens_per_s_median"]
                                                 / summary["eager"]["tokens_per_s_median"])
    report = {"what": f"{model} shape, {layers} layers, {weights} experts, offloaded decode with CUDA-graphed stages "
                      f"and eager stages alternating in one process on one plan "
                      f"(scripts/probes/probe_stage_graphs.py)",
              "device": torch.cuda.get_device_name(), "policy": off.policy.to_dict(), "runs": runs, "traced": traced,
              "summary": summary}
    off.close()
    with open(os.path.join(out_dir, "stage-graphs.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
