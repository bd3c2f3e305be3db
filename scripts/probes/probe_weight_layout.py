"""Which stored expert-weight layout do the kernels read fastest? (GPU; one layout per process, so each
gets its own autotuning.) Usage: python scripts/probes/probe_weight_layout.py {hf,kernel} -> one JSON line.

hf:     gate_up [E, 2I, H], down [E, H, I] (transformers' modules, the hf-scatter checkpoint layout), read as
        K-contiguous [E, d_in, d_out] views.
kernel: gate_up [E, H, 2I], down [E, I, H] stored contiguous [E, d_in, d_out].
Mixtral-8x7B expert shapes, 4096 tokens, top-2, bf16.
"""
import json
import sys

import torch

from hf_scatter.common.timing import median_ms
from hf_scatter.kernels.swiglu import swiglu
from hf_scatter.bench.moe import routed_batch
from hf_scatter.moe import expert_mlp

layout = sys.argv[1]
T, H, I, E, k = 4096, 4096, 14336, 8, 2
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
x, idx, gates, dy = routed_batch(T, H, E, k, dev, dt)
x, gates = x.requires_grad_(True), gates.to(dt).requires_grad_(True)
if layout == "hf":
    gate_up = (torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)
    down = (torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5).requires_grad_(True)
    w_in, w_out = gate_up.transpose(1, 2), down.transpose(1, 2)
else:
    gate_up = (torch.randn(E, H, 2 * I, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)
    down = (torch.randn(E, I, H, device=dev, dtype=dt) * I ** -0.5).requires_grad_(True)
    w_in, w_out = gate_up, down


def fn():
    return expert_mlp(x, (w_in,), w_out, idx, gates, lambda h: swiglu(h, True), validate=False)


with torch.no_grad():
    fwd = median_ms(fn, 100, 500)
fwd_bwd = median_ms(lambda: fn().backward(dy), 100, 500, grad_to_none=[x, gates, gate_up, down])
print(json.dumps({"layout": layout, "device": torch.cuda.get_device_name(), "fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd}))
