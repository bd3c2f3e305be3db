"""GPU time of each kernel of a decode-sized expert call (Qwen3-30B-A3B's layer at 64 tokens, bf16), replayed from
a CUDA graph under the torch profiler: where the call's time goes beside the expert GEMMs.
Run: PYTHONPATH=. python3 scripts/probes/probe_decode_kernels.py [CONFIG] (a `hf-scatter bench moe` config name)"""
import collections
import os
import sys

import torch

from hf_scatter.bench import moe as bm
from hf_scatter.common.timing import captured_graph, run_header
from hf_scatter.common.atomic_files import write_json

name = sys.argv[1] if len(sys.argv) > 1 else "qwen3-decode"
cfg = bm.CONFIGS[name]
experts = bm.hf_experts(cfg, "cuda", torch.bfloat16)
fn = bm._implementations(cfg, experts, "cuda", torch.bfloat16, False)["hf-scatter"][0]
x, idx, gates, _ = bm.routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, "cuda", torch.bfloat16)
with torch.no_grad():
    for _ in range(5):
        fn(x, idx, gates)
    graph = captured_graph(lambda: fn(x, idx, gates))
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
times = collections.defaultdict(list)
for event in prof.events():
    if event.device_type == torch.autograd.DeviceType.CUDA:
        times[event.name[:90]].append(event.device_time)
kernels = {k: {"per_call": len(v) / 20, "mean_us": sum(v) / len(v)} for k, v in times.items()}
for k, v in kernels.items():
    print(f"{v['per_call']:.0f} x {v['mean_us']:8.2f} us  {k}")
write_json(os.path.join(os.environ.get("OUT", "/tmp"), f"decode_kernels_{name}.json"),
           {"what": __doc__.split("Run:")[0].strip(), "config": name, "header": run_header(), "kernels": kernels})
