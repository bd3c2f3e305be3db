"""Where a padded BERT-base call of a large batch spends its wall time, phase by phase on the host, in a loop of
back-to-back calls as `hf-scatter bench bert` times them: reading the mask on the host (the copy waits for the
previous call's graph), the layout, packing into the graph's inputs, the graph launch, unpacking. Beside it,
each graph's launch with the GPU idle and its GPU time, and its kernel count, for the batch of 20 (lengths
5..500) and B=1, S=40.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_bert_call_phases.py   (writes $OUT/bert_call_phases.json)
"""
import copy
import json
import os
import statistics
import time

import torch

import hf_scatter
from hf_scatter.bench.bert import bert_base, padded, requests
from hf_scatter.common.timing import median_ms, run_header
from hf_scatter.turbo.runtime import token_bucket
from hf_scatter.turbo.hf_forward import runtime_of
from hf_scatter.turbo.packing import mask_layout, unpack_rows
from hf_scatter.common.atomic_files import write_json

CALLS = 200


def graph_figures(graph) -> dict:
    """Host time of one launch with the GPU idle, GPU time per replay back to back, kernels per replay."""
    launch = []
    for _ in range(50):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        launch.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(50):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return {"launch_idle_ms": statistics.median(launch), "replay_gpu_ms": begin.elapsed_time(end) / 50,
            "kernels": kernels}


def main():
    report = {**run_header(), "what": __doc__}
    vanilla = bert_base("cuda")
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    ids, mask = padded(requests(20, 5, 500, seed=1), "cuda")
    B, S = ids.shape
    with torch.inference_mode():
        patched(ids, attention_mask=mask)
        runtime = runtime_of(patched)
        report["whole_call_ms"] = median_ms(lambda: patched(ids, attention_mask=mask), 100, 1000)
        report["vanilla_ms"] = median_ms(lambda: vanilla(ids, attention_mask=mask), 100, 1000)
        phases = {name: [] for name in ("mask_to_host", "layout_rest", "pack", "launch", "unpack")}
        for _ in range(CALLS):  # the call's own steps, back to back
            t0 = time.perf_counter()
            keep = mask.detach().cpu()
            t1 = time.perf_counter()
            layout = mask_layout(keep, (B, S))
            t2 = time.perf_counter()
            captured = runtime._graph_for(token_bucket(layout.num_tokens), False, None)
            index = runtime._fill_padded(captured, ids, layout, None, None)
            t3 = time.perf_counter()
            captured.graph.replay()
            t4 = time.perf_counter()
            unpack_rows(captured.hidden, index, layout.shape)
            t5 = time.perf_counter()
            for name, (a, b) in zip(phases, ((t0, t1), (t1, t2), (t2, t3), (t3, t4), (t4, t5))):
                phases[name].append((b - a) * 1e3)
        torch.cuda.synchronize()
        report["batch20_phases_ms"] = {name: statistics.median(v) for name, v in phases.items()}
        report["batch20_graph"] = graph_figures(captured.graph)
        small = torch.randint(1000, 30000, (1, 40), device="cuda")
        patched(small, attention_mask=torch.ones_like(small))
        report["b1s40_graph"] = graph_figures(next(reversed(runtime.graphs.values())).graph)
    print(json.dumps({k: v for k, v in report.items() if k != "what"}, indent=1))
    write_json(os.path.join(os.environ.get("OUT", "."), "bert_call_phases.json"), report)


if __name__ == "__main__":
    main()
