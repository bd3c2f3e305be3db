"""Where the library grouped GEMM starts to pay for the SwiGLU experts' output projection and input gradient:
fwd and fwd+bwd of the experts with those products on our kernels and on the library, at 64 to 1024 mean
rows per expert, for the fine-grained shapes (GPU, bf16). The figures behind
``kernels/library_gemm.LIBRARY_MIN_ROWS_PER_EXPERT`` (docs/moe-kernel-changes.md).

    python3 scripts/probes/probe_library_rows.py OUT.json
"""
import json
import sys

import torch

import hf_scatter.kernels.library_gemm as library
from hf_scatter.common.atomic_files import write_json
from hf_scatter.common.shapes import MOE_BLOCKS
from hf_scatter.common.timing import median_ms
from hf_scatter.moe import glu_experts

dev, bf = "cuda", torch.bfloat16
shapes = {name: MOE_BLOCKS[name] for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "gpt-oss-20b")}
shapes["fine-grained"] = dict(hidden=4096, intermediate=1024, experts=64, top_k=8)
results = {}
for name, s in shapes.items():
    d, inter, E, k = s["hidden"], s["intermediate"], s["experts"], s["top_k"]
    w_in = (torch.randn(E, 2 * inter, d, device=dev) * 0.02).to(bf).requires_grad_(True)
    w_out = (torch.randn(E, d, inter, device=dev) * 0.02).to(bf).requires_grad_(True)
    for rows in (64, 128, 256, 512, 1024):
        T = rows * E // k
        x = torch.randn(T, d, device=dev, dtype=bf, requires_grad=True)
        g, idx = torch.softmax(torch.randn(T, E, device=dev), -1).topk(k, -1)
        g = (g / g.sum(-1, keepdim=True)).to(bf)
        dy = torch.randn(T, d, device=dev, dtype=bf)
        r = {}
        for mode, threshold in (("ours", 1 << 40), ("library", 0)):
            library.LIBRARY_MIN_ROWS_PER_EXPERT = threshold

            def forward():
                with torch.no_grad():
                    return glu_experts(x, w_in, w_out, idx, g)

            r[f"{mode}_fwd"] = median_ms(forward)
            r[f"{mode}_fwdbwd"] = median_ms(lambda: glu_experts(x, w_in, w_out, idx, g).backward(dy))
        results[f"{name}/{rows}"] = r
        print(name, rows, json.dumps({key: round(v, 3) for key, v in r.items()}), flush=True)
    del w_in, w_out
write_json(sys.argv[1], results)
