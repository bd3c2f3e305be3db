"""The experts' first projection (gathered rows times W_in[e], SwiGLU epilogue) in four forms of its K loop, against
the kernel as it stands and the library's grouped GEMM on pre-grouped rows: loads masked along K (the kernel
before whole K steps), unmasked, two half-width products (gate and up apart), and the weight through TMA
descriptors with the two products. Bit-equal outputs are checked. Qwen3-30B-A3B and the fine-grained shape at
16,384 tokens, GPU time of CUDA-graph replays.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_first_projection_loads.py   (writes $OUT/first_projection_loads.json)
"""
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hf_scatter.common.timing import graph_replay_ms, run_header
from hf_scatter.kernels.group import group
from hf_scatter.kernels.scatter2scatter import expert_tiles, num_tile_programs, scatter2scatter_swiglu
from hf_scatter.kernels.tiling import grouped_tile
from hf_scatter.moe import flatten_sort_count
from hf_scatter.common.atomic_files import write_json


@triton.jit
def _first_projection(x_ptr, w_ptr, w_desc, pre_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, end_ptr, scattered_ptr,
                      NUM_TILES, K, N, E, stride_xm, stride_we, stride_wn,
                      FAN_OUT: tl.constexpr, TMA: tl.constexpr, TWO: tl.constexpr, MASK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """The plain bf16 first projection over transformers' concatenated [gate; up] weight [E, 2I, d], K a multiple
    of BLOCK_K and I of BLOCK_N / 2 (the probe's shapes)."""
    HALF: tl.constexpr = BLOCK_N // 2
    I = N // 2
    pid_m, pid_n = grouped_tile(tl.program_id(0), NUM_TILES, tl.cdiv(N, BLOCK_N), GROUP_M)
    expert = tl.load(tile_expert_ptr + pid_m)
    if expert < E:
        row0 = tl.load(tile_row_ptr + pid_m)
        row_end = tl.load(end_ptr + expert)
        rows = row0 + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        x_rows = tl.load(scattered_ptr + rows, mask=row_mask, other=0) // FAN_OUT
        ks = tl.arange(0, BLOCK_K)
        hc = pid_n * HALF + tl.arange(0, HALF)
        x_p = x_ptr + x_rows[:, None].to(tl.int64) * stride_xm + ks[None, :]
        e64 = expert.to(tl.int64)
        if TWO:
            acc_g = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, HALF), dtype=tl.float32)
            g_p = w_ptr + e64 * stride_we + hc[None, :] * stride_wn + ks[:, None]
            u_p = g_p + I * stride_wn
            for k0 in range(0, tl.cdiv(K, BLOCK_K)):
                if MASK:
                    km = ks < K - k0 * BLOCK_K
                    x = tl.load(x_p, mask=row_mask[:, None] & km[None, :], other=0.0)
                else:
                    x = tl.load(x_p)
                if TMA:
                    g = w_desc.load([(expert * N + pid_n * HALF).to(tl.int32), (k0 * BLOCK_K).to(tl.int32)])
                    u = w_desc.load([(expert * N + I + pid_n * HALF).to(tl.int32), (k0 * BLOCK_K).to(tl.int32)])
                    acc_g = tl.dot(x, g.T, acc_g)
                    acc_u = tl.dot(x, u.T, acc_u)
                else:
                    g = tl.load(g_p)
                    u = tl.load(u_p)
                    acc_g = tl.dot(x, g, acc_g)
                    acc_u = tl.dot(x, u, acc_u)
                x_p += BLOCK_K
                g_p += BLOCK_K
                u_p += BLOCK_K
            gate = acc_g.to(pre_ptr.dtype.element_ty)
            up = acc_u.to(pre_ptr.dtype.element_ty)
        else:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            pairs = cols // 2
            cols = pairs + (cols % 2) * I
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            w_p = w_ptr + e64 * stride_we + cols[None, :] * stride_wn + ks[:, None]
            for k0 in range(0, tl.cdiv(K, BLOCK_K)):
                if MASK:
                    km = ks < K - k0 * BLOCK_K
                    x = tl.load(x_p, mask=row_mask[:, None] & km[None, :], other=0.0)
                    w = tl.load(w_p, mask=km[:, None] & (pairs < I)[None, :], other=0.0)
                else:
                    x = tl.load(x_p)
                    w = tl.load(w_p)
                acc = tl.dot(x, w, acc)
                x_p += BLOCK_K
                w_p += BLOCK_K
            pre = acc.to(pre_ptr.dtype.element_ty)
            gate, up = tl.split(tl.reshape(pre, (BLOCK_M, HALF, 2)))
        r64 = rows[:, None].to(tl.int64)
        m = row_mask[:, None]
        tl.store(pre_ptr + r64 * N + hc[None, :], gate, mask=m)
        tl.store(pre_ptr + r64 * N + I + hc[None, :], up, mask=m)
        gf = gate.to(tl.float32)
        h = gf * tl.sigmoid(gf) * up.to(tl.float32)
        tl.store(h_ptr + r64 * I + hc[None, :], h.to(h_ptr.dtype.element_ty), mask=m)



FORMS = {"masked": (False, False, True), "unmasked": (False, False, False), "two_products": (False, True, False),
         "tma_weight": (True, True, False)}


def main():
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    report = {**run_header(), "what": __doc__, "shapes": {}}
    for name, (T, E, k, d, I) in {"qwen3-30b-a3b": (16384, 128, 8, 2048, 768),
                                  "fine-grained": (16384, 64, 8, 4096, 1024)}.items():
        torch.manual_seed(0)
        x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(E, 2 * I, d, device="cuda", dtype=torch.bfloat16) * d ** -0.5  # transformers' layout
        idx = torch.rand(T, E, device="cuda").topk(k, -1).indices
        se, ss, off = flatten_sort_count(idx, E)
        M = T * k
        want_pre, want_h = scatter2scatter_swiglu(x, w.transpose(1, 2), se, ss, off, k)
        xg = group(x, ss, k)
        row = {"kernel_ms": graph_replay_ms(lambda: scatter2scatter_swiglu(x, w.transpose(1, 2), se, ss, off, k)),
               "library_on_grouped_rows_ms": graph_replay_ms(lambda: torch._grouped_mm(xg, w.transpose(1, 2),
                                                                                  offs=off.to(torch.int32))),
               "grouped_copy_ms": graph_replay_ms(lambda: group(x, ss, k)), "forms": {}}
        for bm, bn, bk, warps, stages in ((128, 256, 64, 8, 4), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4)):
            tile_expert, tile_row = expert_tiles(off, bm, M)
            tiles = num_tile_programs(M, E, bm)
            desc = TensorDescriptor.from_tensor(w.view(E * 2 * I, d), [bn // 2, bk])
            for form, (tma, two, mask) in FORMS.items():
                pre = torch.full((M, 2 * I), float("nan"), device="cuda", dtype=torch.bfloat16)
                h = torch.full((M, I), float("nan"), device="cuda", dtype=torch.bfloat16)
                grid = (tiles * triton.cdiv(2 * I, bn),)

                def run():
                    _first_projection[grid](x, w, desc, pre, h, tile_expert, tile_row, off, ss, tiles, d, 2 * I, E,
                                            x.stride(0), w.stride(0), w.stride(1), FAN_OUT=k, TMA=tma, TWO=two,
                                            MASK=mask, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                                            num_warps=warps, num_stages=stages)
                key = f"{form}_{bm}x{bn}x{bk}_warps{warps}_stages{stages}"
                try:
                    run()
                    torch.cuda.synchronize()
                    row["forms"][key] = {"ms": graph_replay_ms(run), "bit_equal": bool(torch.equal(pre, want_pre)
                                                                                  and torch.equal(h, want_h))}
                except Exception as error:  # a form this Triton cannot compile is a result too
                    row["forms"][key] = {"error": f"{type(error).__name__}: {str(error)[-400:]}"}
                print(name, key, row["forms"][key], flush=True)
        report["shapes"][name] = row
        del x, w, xg
        torch.cuda.empty_cache()
    write_json(os.path.join(os.environ.get("OUT", "."), "first_projection_loads.json"), report)


if __name__ == "__main__":
    main()
