"""The experts' first projection (gathered rows times W_in[e], SwiGLU epilogue) over the two weight layouts
transformers ships: K contiguous (Mixtral / Qwen3-MoE's [E, 2I, d], read through a transposed view) and N
contiguous (GPT-OSS's [E, d, 2I]), each with [gate; up] columns concatenated and interleaved. Same routing,
same values (the layouts are copies of one weight), same kernel; outputs checked equal. Qwen3-30B-A3B and
GPT-OSS-20B at 16,384 tokens, GPU time of CUDA-graph replays. Beside it, the output projection as the
library grouped GEMM runs it (``torch._grouped_mm`` on grouped rows) over the same two layouts of W_out.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_first_projection_layout.py
(writes $OUT/first_projection_layout.json)
"""
import os

import torch

from hf_scatter.common.timing import graph_replay_ms, run_header
from hf_scatter.kernels.scatter2scatter import scatter2scatter_swiglu
from hf_scatter.kernels.swiglu import GateForm
from hf_scatter.moe import flatten_sort_count
from hf_scatter.common.atomic_files import write_json

SHAPES = {"qwen3-30b-a3b": (16384, 128, 8, 2048, 768), "gpt-oss-20b": (16384, 32, 4, 2880, 2880)}


def weights(w: torch.Tensor, interleaved: bool) -> dict:
    """``w`` [E, d, 2I] ([gate; up] columns) as each layout holds it, all [E, d, 2I] views of the same values."""
    if interleaved:
        half = w.shape[2] // 2
        w = torch.stack((w[..., :half], w[..., half:]), -1).flatten(2)  # [g0, u0, g1, u1, ...]
    return {"k_contiguous": w.transpose(1, 2).contiguous().transpose(1, 2), "n_contiguous": w.contiguous()}


def main():
    report = {**run_header(), "what": __doc__, "shapes": {}}
    for name, (T, E, k, d, I) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, d, 2 * I, device="cuda", dtype=torch.bfloat16) * d ** -0.5
        idx = torch.rand(T, E, device="cuda").topk(k, -1).indices
        se, ss, off = flatten_sort_count(idx, E)
        rows = {}
        for interleaved in (False, True):
            form = GateForm(interleaved=interleaved)
            outputs = {}
            for layout, wl in weights(w, interleaved).items():
                outputs[layout] = scatter2scatter_swiglu(x, wl, se, ss, off, k, form)[1]
                key = f"{layout}, {'interleaved' if interleaved else 'concatenated'}"
                rows[key] = graph_replay_ms(lambda: scatter2scatter_swiglu(x, wl, se, ss, off, k, form))
                print(f"{name} {key}: {rows[key]:.3f} ms", flush=True)
            if not torch.equal(outputs["k_contiguous"], outputs["n_contiguous"]):
                diff = (outputs["k_contiguous"].float() - outputs["n_contiguous"].float()).abs().max().item()
                rows[f"max_diff, {'interleaved' if interleaved else 'concatenated'}"] = diff
        h = torch.randn(T * k, I, device="cuda", dtype=torch.bfloat16)
        w_out = torch.randn(E, I, d, device="cuda", dtype=torch.bfloat16) * I ** -0.5
        offs = off.to(torch.int32)
        for layout, wl in (("k_contiguous", w_out.transpose(1, 2).contiguous().transpose(1, 2)),
                           ("n_contiguous", w_out)):
            key = f"output projection (library), {layout}"
            rows[key] = graph_replay_ms(lambda: torch._grouped_mm(h, wl, offs=offs))
            print(f"{name} {key}: {rows[key]:.3f} ms", flush=True)
        report["shapes"][name] = rows
        del x, w, h, w_out
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "first_projection_layout.json"), report)


if __name__ == "__main__":
    main()
