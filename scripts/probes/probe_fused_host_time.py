"""Host time of one fused add + LayerNorm call at BERT-base size (2560 x 768 fp16), by layer of the call
stack, against torch's add + layer_norm (GPU). Small kernels: the figures are the Python cost per call."""
import time

import torch
import torch.nn.functional as F

from hf_scatter.kernels import norms
from hf_scatter.kernels.norms import fused_add_layer_norm
from hf_scatter.models.fused_norms import add_layer_norm

x = torch.randn(2560, 768, device="cuda", dtype=torch.float16)
r = torch.randn_like(x)
ln = torch.nn.LayerNorm(768).to("cuda", torch.float16)
w, b = ln.weight, ln.bias
y, s = torch.empty_like(x), torch.empty_like(x)
mean = torch.empty(2560, device="cuda")
rstd = torch.empty(2560, device="cuda")


def per_call_us(fn, n=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return host


with torch.no_grad():
    rows = {
        "torch add + layer_norm": lambda: F.layer_norm(x + r, (768,), w, b),
        "triton launch only (add_norm_fwd_triton)": lambda: norms.add_norm_fwd_triton(
            x, r, None, w, b, 1e-5, False, y, s, mean, rstd),
        "fused_add_layer_norm (validation + autograd.Function)": lambda: fused_add_layer_norm(x, r, w, b),
        "models.fused_norms.add_layer_norm (model path)": lambda: add_layer_norm(x, r, ln),
    }
    for name, fn in rows.items():
        print(f"{per_call_us(fn):8.1f} us  {name}", flush=True)
    import cProfile
    import pstats
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        add_layer_norm(x, r, ln)
    prof.disable()
    pstats.Stats(prof).sort_stats("cumtime").print_stats(25)
