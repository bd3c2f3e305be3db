"""Whether decode-sized expert calls are limited by scatter2scatter's launch config: the GPU time of the whole
Qwen3-30B-A3B and Mixtral-8x7B expert call at 64 tokens (replayed from a CUDA graph) with each of 23 configs
(BLOCK_N, BLOCK_K, warps, stages) forced on both GEMMs.
Run: PYTHONPATH=. python3 scripts/probes/probe_decode_launch_configs.py (writes $OUT/decode_launch_configs.json)"""
import os

import torch
import triton

from hf_scatter.bench import moe as bm
from hf_scatter.kernels import scatter2scatter as s2s
from hf_scatter.common.timing import captured_graph, median_ms, run_header
from hf_scatter.common.atomic_files import write_json

CFGS = [(128, 128, 4, 4), (128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 6),
        (64, 128, 4, 2), (64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 2), (64, 256, 4, 3), (128, 256, 8, 2),
        (128, 256, 8, 3), (256, 64, 8, 3), (256, 128, 8, 3), (128, 128, 8, 3), (128, 128, 8, 4), (64, 64, 4, 4),
        (64, 64, 4, 6), (32, 256, 4, 3), (32, 128, 4, 4), (64, 128, 2, 3), (32, 256, 2, 3)]
res = {}
for name in ("qwen3-decode", "mixtral-decode"):
    cfg = bm.CONFIGS[name]
    experts = bm.hf_experts(cfg, "cuda", torch.bfloat16)
    fn = bm._implementations(cfg, experts, "cuda", torch.bfloat16, False)["hf-scatter"][0]
    x, idx, gates, _ = bm.routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, "cuda", torch.bfloat16)
    res[name] = {}
    for bn, bk, w, st in CFGS:
        c = triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8}, num_warps=w, num_stages=st)
        s2s._table_config = lambda *args, c=c, **kwargs: c  # the config every launch of this run takes
        try:
            with torch.no_grad():
                fn(x, idx, gates)  # compiles this config
                torch.cuda.synchronize()
                g = captured_graph(lambda: fn(x, idx, gates))
                ms = median_ms(g.replay, 50, 300)
                del g
        except Exception as error:  # noqa: BLE001 - a config that cannot run is recorded as such
            ms = str(error).splitlines()[0][:100]
        res[name][f"{bn}x{bk}w{w}s{st}"] = ms
        print(name, bn, bk, w, st, ms, flush=True)
report = {"what": __doc__.split("Run:")[0].strip(), "header": run_header(), "default": "128x128w4s4", "gpu_ms": res}
write_json(os.path.join(os.environ.get("OUT", "/tmp"), "decode_launch_configs.json"), report)
