"""Is an SMoE layer's fwd+bwd bound by its kernels, or does the GPU wait for the host between them?

``bench moe`` times one fwd+bwd per CUDA-event pair (``do_bench``: L2 flushed, grads set to None before each call),
so every gap in which the GPU waits for Python counts. This probe times the same step of each implementation four
ways in one process, on the same routed batch:

- ``do_bench_ms``: as ``bench moe`` does;
- ``back_to_back_ms``: 20 steps issued without a sync in between, per step (the host may run ahead, as in training);
- ``graph_ms``: the step captured in one CUDA graph and replayed (kernels back to back, no host), or why it cannot be;
- ``kernel_ms``: the profiler's sum of kernel times per step (no gaps, no overlap).

``do_bench_ms`` well above ``graph_ms`` means the GPU waits for the host inside the step; ``kernel_ms`` above
``graph_ms`` means kernels overlap or the profiler slows them. ``host_ms`` is the time Python takes to issue one
step.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_moe_step_gaps.py [CONFIG ...] [--impls hf-scatter dense]
(writes $OUT/moe_step_gaps.json)
"""
import argparse
import os
import time

import torch

from hf_scatter.bench.moe import CONFIGS, _grad_leaves, _implementations, hf_experts, routed_batch
from hf_scatter.bench.profile_moe import kernel_times
from hf_scatter.common.atomic_files import write_json
from hf_scatter.common.timing import graph_replay_ms, median_ms, run_header


def step_times(fn, params, x, idx, gates, dy) -> dict:
    leaves = [x, gates, *params]

    def step():
        for t in leaves:
            t.grad = None
        fn(x, idx, gates).backward(dy)

    out = {}
    with _grad_leaves(leaves):
        step()
        out["do_bench_ms"] = median_ms(step, grad_to_none=leaves)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        host_start = time.perf_counter()
        for _ in range(20):
            step()
        out["host_ms"] = (time.perf_counter() - host_start) / 20 * 1e3
        end.record()
        torch.cuda.synchronize()
        out["back_to_back_ms"] = start.elapsed_time(end) / 20
        out["kernel_ms"] = sum(ms for _, ms, _ in kernel_times(step))
        out["kernels_per_step"] = sum(n for _, _, n in kernel_times(step, steps=1))
        try:
            out["graph_ms"] = graph_replay_ms(step, calls=20)
        except Exception as error:  # noqa: BLE001 - a host sync in the step is the finding itself
            torch.cuda.synchronize()
            out["graph_error"] = str(error).splitlines()[0][:200]
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("configs", nargs="*", default=["qwen3-30b-a3b", "fine-grained", "gpt-oss-20b"])
    parser.add_argument("--impls", nargs="+", default=["hf-scatter", "dense"])
    args = parser.parse_args()
    report = {**run_header(), "what": __doc__, "configs": {}}
    for name in args.configs:
        cfg = CONFIGS[name]
        torch.manual_seed(0)
        experts = hf_experts(cfg, "cuda", torch.bfloat16)
        x, idx, gates, dy = routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, "cuda", torch.bfloat16)
        table = _implementations(cfg, experts, "cuda", torch.bfloat16)
        report["configs"][name] = rows = {}
        for impl in args.impls:
            entry = table[impl]
            rows[impl] = {"error": entry} if isinstance(entry, str) else step_times(*entry, x, idx, gates, dy)
            print(name, impl, rows[impl], flush=True)
        del experts, table
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "moe_step_gaps.json"), report)


if __name__ == "__main__":
    main()
