"""Where one GPU's prefill time goes at GPT-OSS-120B layer shapes (16 GiB, MTBench-like prompts): the prefill of a
batch with prompt attention as one variable-length FlashAttention call per chunk (what the pipeline runs on the GPU)
and with the padded calls of the CPU path, each timed whole, then the first under torch.profiler: the kernels and
host ops that take the device and the host time.

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_prefill_chunks.py [OUT.json]
Settings (environment): LAYERS (default 2), REQUESTS (1024), GPU_MEMORY (16GiB), PROFILE (a saved profile JSON).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import torch

import hf_scatter
from hf_scatter.bench.offload_workload import build_model, left_padded, prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import Workload, load_profile


def prefill_seconds(off, ids, mask) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    off.generate(ids, attention_mask=mask, max_new_tokens=1, progress=False)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    layers, requests = int(os.environ.get("LAYERS", 2)), int(os.environ.get("REQUESTS", 1024))
    config = builtin_config("gpt-oss-120b", num_hidden_layers=layers)
    reqs = prompts(requests, config.vocab_size)
    ids, mask = left_padded(reqs)
    off = hf_scatter.offload_model(functools.partial(build_model, layers, model="gpt-oss-120b"),
                                   gpu_memory=os.environ.get("GPU_MEMORY", "16GiB"),
                                   profile=load_profile(os.environ.get("PROFILE", "docs/results/history/profile-h100-x4.json")),
                                   workload=Workload.from_prompts([len(r) for r in reqs], 1), progress=False)
    result = {"layers": layers, "requests": requests, "torch": torch.__version__, "plan": off.describe()}
    # each way timed on its second run: the first of a batch this large allocates its pinned buffers (seconds)
    result["flash varlen, s"] = min(prefill_seconds(off, ids, mask) for _ in range(2))
    flash, off.pipe.flash_prompts = off.pipe.flash_prompts, False  # the padded calls, as on the CPU
    try:
        result["padded calls, s"] = min(prefill_seconds(off, ids, mask) for _ in range(2))
    finally:
        off.pipe.flash_prompts = flash
    print({k: v for k, v in result.items() if k != "plan"})
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_seconds(off, ids, mask)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=30)
    host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
    print(table)
    print(host)
    result["by_device_time"], result["by_host_time"] = table, host
    off.close()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
