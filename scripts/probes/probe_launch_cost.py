"""Host time per call of a Triton launch against a torch op, and of our fused norm and router against the HF
families' torch code, at sizes whose GPU time is negligible (the figures are what a host-bound step pays per
call). Triton's own launch (binding and specialising every argument, the cache key) is measured with 4 and 24
arguments, and against launching the compiled kernel it returned (CompiledKernel[grid], which skips both).

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_launch_cost.py   (writes $OUT/launch_cost.json)
"""
import os
import statistics
import time

import torch
import triton
import triton.language as tl

from hf_scatter.kernels.norms import fused_add_rms_norm
from hf_scatter.kernels.router_select import router_select
from hf_scatter.kernels.router_select import deepseek_v2_selection
from hf_scatter.common.atomic_files import write_json


@triton.jit
def _empty4(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _empty24(a, b, c, d, e, f, g, h, M, N, s0, s1, s2, s3, s4, eps, i0, i1, i2, i3,
             P: tl.constexpr, Q: tl.constexpr, R: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(b + offs, tl.load(a + offs, mask=offs < N), mask=offs < N)


def per_call_us(fn, n=2000, rounds=7):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return {"median_us": statistics.median(times), "min_us": min(times)}


def main():
    dev = "cuda"
    x = torch.randn(4096, device=dev)
    y = torch.empty_like(x)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    res["torch_add_out"] = per_call_us(lambda: torch.add(x, x, out=y))
    res["triton_4_args"] = per_call_us(lambda: _empty4[(1,)](x, y, 100, BLOCK=128))
    args24 = (x, y, x, y, x, y, x, y, 100, 100, 1, 2048, 1, 2048, 1, 1e-6, 3, 5, 7, 9)
    res["triton_24_args"] = per_call_us(lambda: _empty24[(1,)](*args24, P=1, Q=0, R=1, BLOCK=128))
    compiled = _empty24[(1,)](*args24, P=1, Q=0, R=1, BLOCK=128)
    try:
        runner = compiled[(1, 1, 1)]
        stream = torch.cuda.current_stream().cuda_stream
        runner(*args24, 1, 0, 1, 128, stream=stream)
        res["compiled_24_args"] = per_call_us(lambda: runner(*args24, 1, 0, 1, 128, stream=stream))
    except Exception as error:  # the CompiledKernel call convention differs between Triton versions
        res["compiled_24_args"] = repr(error)[:300]

    M, N = 16, 2048
    h = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    r = torch.randn_like(h)
    w = torch.ones(N, device=dev, dtype=torch.bfloat16)
    eps = 1e-6

    def hf_norm(s):
        v = s.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        return w * v.to(s.dtype)

    with torch.no_grad():
        res["norm_fwd_ours"] = per_call_us(lambda: fused_add_rms_norm(h, r, w, eps, return_sum=True))
        res["norm_fwd_ours_unchecked"] = per_call_us(
            lambda: fused_add_rms_norm(h, r, w, eps, return_sum=True, validate=False))
        res["norm_fwd_hf"] = per_call_us(lambda: (lambda s: (hf_norm(s), s))(h + r))
    hg = h.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    g = torch.randn_like(h)

    def ours_fb():
        out, s = fused_add_rms_norm(hg, r, wg, eps, return_sum=True, validate=False)
        torch.autograd.backward(out, g)

    def hf_fb():
        s = hg + r
        v = s.float()
        v = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        torch.autograd.backward(wg * v.to(s.dtype), g)

    res["norm_fwd_bwd_ours"] = per_call_us(ours_fb, n=500)
    res["norm_fwd_bwd_hf"] = per_call_us(hf_fb, n=500)

    E, k = 64, 6
    logits = torch.randn(M, E, device=dev, requires_grad=True)
    sel = deepseek_v2_selection(1, 1, False, 1.0)
    dw = torch.randn(M, k, device=dev)

    def router_ours():
        wts, idx = router_select(logits, k, sel)
        torch.autograd.backward(wts, dw)

    def router_hf():
        p = logits.softmax(dim=-1, dtype=torch.float32)
        wts, idx = torch.topk(p, k, dim=-1, sorted=False)
        torch.autograd.backward(wts, dw)

    res["router_fwd_bwd_ours"] = per_call_us(router_ours, n=500)
    res["router_fwd_bwd_hf"] = per_call_us(router_hf, n=500)
    for key, v in res.items():
        print(f"{key:28s} {v if not isinstance(v, dict) else round(v['median_us'], 1)}")
    if os.environ.get("OUT"):
        write_json(os.path.join(os.environ["OUT"], "launch_cost.json"), res)


if __name__ == "__main__":
    main()
