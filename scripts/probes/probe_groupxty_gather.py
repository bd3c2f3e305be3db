"""groupXTY with a scattered operand gathered in place vs a grouped copy + the plain kernel, and the decode
expert GEMMs (GPU, bf16, autotuned). The figures behind ``moe/parallel_linear._copy_pays`` and
``scatter2scatter._block_m`` (docs/moe.md)."""
import json

import torch

from hf_scatter.common.timing import median_ms
from hf_scatter.kernels.group import group
from hf_scatter.kernels.groupxty import groupXTY
from hf_scatter.kernels.scatter2scatter import scatter2scatter
from hf_scatter.moe import flatten_sort_count, glu_experts

dev, bf = "cuda", torch.bfloat16
torch.manual_seed(0)


def routing(T, E, k):
    idx = torch.rand(T, E, device=dev).topk(k, -1).indices
    return idx, flatten_sort_count(idx, E)


for name, (T, E, k, d, I) in {"paper-unit": (61440, 32, 4, 4096, 2048), "fine-grained": (16384, 64, 8, 4096, 1024)}.items():
    idx, (se, ss, off) = routing(T, E, k)
    M = T * k
    x = torch.randn(T, d, device=dev, dtype=bf)
    xg = x[ss // k].contiguous()
    dgu = torch.randn(M, 2 * I, device=dev, dtype=bf)
    h = torch.randn(M, I, device=dev, dtype=bf)
    dy = torch.randn(T, d, device=dev, dtype=bf)
    dyg = dy[ss // k].contiguous()
    dw1 = torch.empty(E, d, 2 * I, device=dev, dtype=bf)
    dw2 = torch.empty(E, I, d, device=dev, dtype=bf)
    r = {"dW1, X grouped": median_ms(lambda: groupXTY(xg, dgu, off, dw1)),
         "dW1, X gathered in place": median_ms(lambda: groupXTY(x, dgu, off, dw1, sorted_scattered_idxs=ss, x_fan_out=k)),
         "grouped copy of X": median_ms(lambda: group(x, ss, k)),
         "dW2, dY grouped": median_ms(lambda: groupXTY(h, dyg, off, dw2)),
         "dW2, dY gathered in place": median_ms(lambda: groupXTY(h, dy, off, dw2, sorted_scattered_idxs=ss, dy_fan_out=k))}
    print(name, json.dumps({key: round(v, 2) for key, v in r.items()}), flush=True)
    del x, xg, dgu, h, dy, dyg, dw1, dw2

T, E, k, d, I = 64, 8, 2, 4096, 14336  # Mixtral-8x7B decode
gu = torch.randn(E, 2 * I, d, device=dev, dtype=bf) * d ** -0.5
dn = torch.randn(E, d, I, device=dev, dtype=bf) * I ** -0.5
idx, (se, ss, off) = routing(T, E, k)
x, g = torch.randn(T, d, device=dev, dtype=bf), torch.rand(T, k, device=dev)
hh = torch.randn(T * k, I, device=dev, dtype=bf)
r = {"layer": median_ms(lambda: glu_experts(x, gu, dn, idx, g, validate=False)),
     "gate_up scatter2scatter": median_ms(lambda: scatter2scatter(x, gu.transpose(1, 2), se, ss, off, k, y_grouped=True)),
     "down scatter2scatter": median_ms(lambda: scatter2scatter(hh, dn.transpose(1, 2), se, ss, off, 1, x_grouped=True))}
print("decode T=64", json.dumps({key: round(v, 3) for key, v in r.items()}))
