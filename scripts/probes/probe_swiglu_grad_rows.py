"""The SwiGLU backward's row pass (``swiglu_grad_gemm``'s second kernel) over its tile shapes: rows per program,
columns per step and warps, at the Qwen3-30B-A3B, fine-grained (d 4096, I 1024, E 64, k 8) and GPT-OSS-20B
experts' training shapes (16,384 tokens); GPU time of CUDA-graph replays and the bytes moved per second.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_swiglu_grad_rows.py   (writes $OUT/swiglu_grad_rows.json)
"""
import os

import torch
import triton

from hf_scatter.common.timing import graph_replay_ms, run_header
from hf_scatter.kernels import swiglu_grad_gemm as sg
from hf_scatter.kernels.swiglu import SILU
from hf_scatter.common.atomic_files import write_json



def main():
    report = {**run_header(), "what": __doc__, "shapes": {}}
    for name, (M, I) in {"qwen3-30b-a3b": (131072, 768), "fine-grained": (131072, 1024),
                         "gpt-oss-20b": (65536, 2880)}.items():
        torch.manual_seed(0)
        da = torch.randn(M, I, device="cuda", dtype=torch.bfloat16)  # [M, I] ungated input gradient of h
        gate_up = torch.randn(M, 2 * I, device="cuda", dtype=torch.bfloat16)  # [M, 2I] pre-activation
        coeff = torch.rand(M, device="cuda")  # [M] routing gates
        h = torch.empty(M, I, device="cuda", dtype=torch.bfloat16)
        dots = torch.empty(M, device="cuda")
        gate, up = SILU.halves(gate_up)
        moved = 2 * M * I * 2 + 2 * M * 2 * I * 2  # da and h; the pre-activation read and written over
        row = {}
        for rows in (1, 2, 4, 8, 16):
            for cols in (128, 256, 512, 1024):
                for warps in (1, 2, 4, 8):
                    if rows * cols < 128 * warps or rows * cols > 8192:
                        continue
                    ms = graph_replay_ms(lambda: sg._swiglu_grad_rows_kernel[(triton.cdiv(M, rows),)](
                        da, gate, up, coeff, h, dots, M, I, da.stride(0), gate.stride(0), gate.stride(1),
                        up.stride(0), up.stride(1), h.stride(0), *SILU.numbers, STORE_H=True, SCALE_H=False,
                        INTERLEAVED=False, BLOCK_M=rows, BLOCK_N=cols, num_warps=warps))
                    row[f"rows{rows}_cols{cols}_warps{warps}"] = {"us": ms * 1e3, "tb_per_s": moved / ms / 1e9}
        report["shapes"][name] = row
        best = min(row, key=lambda key: row[key]["us"])
        print(name, "best", best, round(row[best]["us"], 1), "us", flush=True)
        del da, gate_up, h
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "swiglu_grad_rows.json"), report)


if __name__ == "__main__":
    main()
