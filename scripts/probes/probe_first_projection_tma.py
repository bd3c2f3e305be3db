"""The experts' two products that read gathered rows, with the weight through TMA descriptors in persistent
programs (the default at training-sized tiles) and with plain loads, one program per tile (``HF_SCATTER_TMA=0``),
timed alternately (``alternating_replay_ms``: the order of forms in one process biases one-after-another timing),
beside the library's grouped GEMM on pre-grouped rows and cuBLAS on one matrix of the same FLOPs. The products: the
first projection with its SwiGLU epilogue (transformers' K-contiguous [E, 2I, d] weight, descriptor over its rows)
and the SwiGLU backward's GEMM dY W_out^T (the N-contiguous [E, d, I] weight read as it lies). Outputs of the two
forms are compared bit for bit. GPU time of CUDA-graph replays, 16k-token batches (Mixtral's 8k, the paper unit's
61,440).

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_first_projection_tma.py [SHAPE ...]
(writes $OUT/first_projection_tma.json)
"""
import os
import sys

import torch

from hf_scatter.common.timing import alternating_replay_ms, run_header
from hf_scatter.kernels.group import group
from hf_scatter.kernels.scatter2scatter import scatter2scatter, scatter2scatter_swiglu
from hf_scatter.moe import flatten_sort_count
from hf_scatter.common.atomic_files import write_json

SHAPES = {"qwen3-30b-a3b": (16384, 128, 8, 2048, 768), "fine-grained": (16384, 64, 8, 4096, 1024),
          "olmoe-1b-7b": (16384, 64, 8, 2048, 1024), "deepseek-v2-lite": (16384, 64, 6, 2048, 1408),
          "gpt-oss-20b": (16384, 32, 4, 2880, 2880), "mixtral-prefill": (8192, 8, 2, 4096, 14336),
          "paper-unit": (61440, 32, 4, 4096, 2048)}  # tokens, experts, top-k, d, d_expert


def plain_loads(fn):
    """``fn`` run with HF_SCATTER_TMA=0 (captured into its graph that way)."""
    def run():
        os.environ["HF_SCATTER_TMA"] = "0"
        try:
            return fn()
        finally:
            del os.environ["HF_SCATTER_TMA"]
    return run


def main(names):
    props = torch.cuda.get_device_properties(0)
    # persistent programs need this property (0 or missing: one program per tile, TMA alone)
    report = {**run_header(), "what": __doc__, "multiprocessors": props.multi_processor_count,
              "shared_memory_per_multiprocessor": getattr(props, "shared_memory_per_multiprocessor", None),
              "shapes": {}}
    for name in names:
        T, E, k, d, inter = SHAPES[name]
        torch.manual_seed(0)
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        w_in = (torch.randn(E, 2 * inter, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5).transpose(1, 2)
        w_out_t = torch.randn(E, d, inter, device="cuda", dtype=torch.bfloat16) * d ** -0.5  # dY W_out^T's weight
        se, ss, off = flatten_sort_count(torch.rand(T, E, device="cuda").topk(k, -1).indices, E)
        xg = group(x, ss, k)
        first = lambda: scatter2scatter_swiglu(x, w_in, se, ss, off, k)  # noqa: E731
        grad = lambda: scatter2scatter(dy, w_out_t, se, ss, off, fan_out=k, y_grouped=True)  # noqa: E731
        row = {"flops_first": 2 * T * k * d * 2 * inter, "flops_grad": 2 * T * k * d * inter,
               "first_bit_equal": all(torch.equal(a, b) for a, b in zip(first(), plain_loads(first)())),
               "grad_bit_equal": bool(torch.equal(grad(), plain_loads(grad)()))}
        row["ms"] = alternating_replay_ms({
            "first_tma": first, "first_plain": plain_loads(first),
            "first_library_on_grouped_rows": lambda: torch._grouped_mm(xg, w_in, offs=off.to(torch.int32)),
            "first_cublas_one_matrix": lambda: torch.mm(xg, w_in[0]),
            "grad_tma": grad, "grad_plain": plain_loads(grad)})
        print(name, row, flush=True)
        report["shapes"][name] = row
        del x, dy, w_in, w_out_t, xg
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "first_projection_tma.json"), report)


if __name__ == "__main__":
    main(sys.argv[1:] or list(SHAPES))
