"""GPU time of gate_mix (the k-sum of each token's expert outputs, gate-weighted) per tile shape, with the k slot
rows loaded in a rolled loop (the kernel before, copied here) or unrolled (the kernel now), and the kernel as it
stands with its own tile, at decode and training shapes of Qwen3-30B-A3B (d 2048, k 8), Mixtral (d 4096, k 2) and
GPT-OSS (d 2880, k 4).
Each variant's largest error against a float32 mix is kept beside its time (CUDA-graph replays, microseconds).

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_gate_mix_blocks.py   (writes $OUT/gate_mix_blocks.json)
"""
import os

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

from hf_scatter.kernels import gating
from hf_scatter.common.atomic_files import write_json

SHAPES = ((64, 2048, 8), (64, 4096, 2), (64, 2880, 4), (16384, 2048, 8), (8192, 4096, 2))
TILES = ((16, 256), (4, 256), (4, 128), (2, 256), (8, 128), (1, 512), (16, 128))


@triton.jit
def _mix_rolled(y_ptr, g_ptr, out_ptr, T, N, stride_ym, stride_gt, stride_ot,
                K_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_mask = tokens < T
    mask = t_mask[:, None] & (cols < N)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    for j in range(K_SLOTS):
        slot = tokens.to(tl.int64) * K_SLOTS + j
        y = tl.load(y_ptr + slot[:, None] * stride_ym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        acc += y * tl.load(g_ptr + tokens * stride_gt + j, mask=t_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + tokens[:, None].to(tl.int64) * stride_ot + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


def main():
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "tile": [gating.MIX_BLOCK_T, gating.MIX_BLOCK_N], "shapes": {}}
    for T, N, k in SHAPES:
        y = torch.randn(T * k, N, device="cuda", dtype=torch.bfloat16)
        g = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
        want = (y.view(T, k, N).float() * g.float()[..., None]).sum(1)

        def timed(fn):
            fn()
            torch.cuda.synchronize()
            return {"us": do_bench_cudagraph(fn, rep=50) * 1e3, "max_err": (out.float() - want).abs().max().item()}

        row = {"current": timed(lambda: gating.gate_mix_triton(y, g, out, None, k))}
        for bt, bn in TILES:
            grid = (triton.cdiv(T, bt), triton.cdiv(N, bn))
            row[f"rolled_{bt}x{bn}"] = timed(lambda grid=grid, bt=bt, bn=bn: _mix_rolled[grid](
                y, g, out, T, N, y.stride(0), g.stride(0), out.stride(0), K_SLOTS=k, BLOCK_T=bt, BLOCK_N=bn,
                num_warps=4))
            row[f"unrolled_{bt}x{bn}"] = timed(lambda grid=grid, bt=bt, bn=bn: gating._gate_mix_kernel[grid](
                y, g, out, out, T, N, y.stride(0), g.stride(0), g.stride(1), out.stride(0), K_SLOTS=k,
                HAS_GATES=True, GATHER=False, BLOCK_T=bt, BLOCK_N=bn, num_warps=4))
        row["bytes"] = (T * k + T) * N * 2
        row["current_tb_per_s"] = row["bytes"] / (row["current"]["us"] * 1e-6) / 1e12
        res["shapes"][f"T{T}_N{N}_k{k}"] = row
        print(f"T {T} N {N} k {k}: current {row['current']['us']:.2f} us, rolled 16x256 "
              f"{row['rolled_16x256']['us']:.2f} us, {row['current_tb_per_s']:.2f} TB/s", flush=True)
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "gate_mix_blocks.json"), res)


if __name__ == "__main__":
    main()
