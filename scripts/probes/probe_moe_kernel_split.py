"""Where an SMoE layer's fwd+bwd GPU time goes, beside the dense SwiGLU MLP of equal FLOPs that `bench moe`
compares with: profiler kernel time per step, split into GEMMs (ours, CUTLASS's grouped GEMM, cuBLAS) and
everything else (routing, mixes, grouped copies, the SwiGLU passes; the dense MLP's own elementwise work).

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_moe_kernel_split.py qwen3-30b-a3b fine-grained gpt-oss-20b
(writes $OUT/moe_kernel_split.json)
"""
import os
import sys

import torch

from hf_scatter.bench.moe import CONFIGS, _dense_swiglu
from hf_scatter.bench.profile_moe import kernel_times, routed_layer
from hf_scatter.common.timing import run_header
from hf_scatter.moe import glu_experts
from hf_scatter.common.atomic_files import write_json

# the GEMM kernels by name: CUTLASS (torch._grouped_mm), cuBLAS on sm90 (nvjet) and sm80 (xmma, s16816gemm), ours
GEMM_KERNELS = ("cutlass", "nvjet", "xmma", "s16816gemm", "scatter2scatter", "groupxty")


def split(rows):
    gemm = sum(ms for name, ms, _ in rows if any(word in name.lower() for word in GEMM_KERNELS))
    total = sum(ms for _, ms, _ in rows)
    return {"total_ms": total, "gemm_ms": gemm, "other_ms": total - gemm, "kernels": rows}


def main(names):
    report = {**run_header(), "what": __doc__, "configs": {}}
    for name in names:
        cfg = CONFIGS[name]
        (experts, x, idx, gates, dy), ours = routed_layer(cfg)
        dense, dense_params = _dense_swiglu(cfg.top_k * cfg.intermediate, cfg.hidden, "cuda", torch.bfloat16)
        for p in dense_params:
            p.requires_grad_(True)

        def ours_forward():
            with torch.no_grad():
                glu_experts(x, experts.gate_up_proj, experts.down_proj, idx, gates, validate=False)

        def dense_step():
            x.grad = None
            for p in dense_params:
                p.grad = None
            dense(x).backward(dy)

        report["configs"][name] = {"ours_fwdbwd": split(kernel_times(ours)),
                                   "ours_fwd": split(kernel_times(ours_forward)),
                                   "dense_fwdbwd": split(kernel_times(dense_step))}
        for key, part in report["configs"][name].items():
            print(f"{name} {key}: {part['total_ms']:.2f} ms, GEMMs {part['gemm_ms']:.2f}, other {part['other_ms']:.2f}")
        del experts, dense, dense_params
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "moe_kernel_split.json"), report)


if __name__ == "__main__":
    main(sys.argv[1:] or ["qwen3-30b-a3b", "fine-grained", "gpt-oss-20b"])
