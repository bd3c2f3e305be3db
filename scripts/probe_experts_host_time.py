"""Mixtral vs DBRX expert layouts at the 1.5B training shape: GPU kernel time vs host time per layer (GPU)."""
import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

from hf_scatter.kernels.ops import swiglu, swiglu_pair
from hf_scatter.bench.moe import routed_batch
from hf_scatter.moe import expert_mlp

T, H, I, E, k = 8192, 1024, 3584, 8, 2
dev, dt = "cuda", torch.bfloat16
torch.manual_seed(0)
x, idx, gates, dy = routed_batch(T, H, E, k, dev, dt)
x, gates = x.requires_grad_(True), gates.to(dt).requires_grad_(True)
gate_up = (torch.randn(E, 2 * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)  # Mixtral
down = (torch.randn(E, H, I, device=dev, dtype=dt) * I ** -0.5).requires_grad_(True)
w1 = (torch.randn(E * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)  # DBRX
v1 = (torch.randn(E * I, H, device=dev, dtype=dt) * H ** -0.5).requires_grad_(True)
w2 = (torch.randn(E * I, H, device=dev, dtype=dt) * I ** -0.5).requires_grad_(True)

variants = {
    "mixtral": lambda: expert_mlp(x, (gate_up.transpose(1, 2),), down.transpose(1, 2), idx, gates,
                                  lambda h: swiglu(h, True), validate=False),
    "dbrx": lambda: expert_mlp(x, (w1.view(E, I, H).transpose(1, 2), v1.view(E, I, H).transpose(1, 2)),
                               w2.view(E, I, H), idx, gates, lambda g, u: swiglu_pair(g, u, True), validate=False),
}
leaves = [x, gates, gate_up, down, w1, v1, w2]
for name, fn in variants.items():
    with torch.no_grad():
        fwd = do_bench(fn, warmup=50, rep=300, return_mode="median")
    fb = do_bench(lambda: fn().backward(dy), warmup=50, rep=300, grad_to_none=leaves, return_mode="median")
    print(f"{name:22s} fwd {fwd:7.2f} ms  fwd+bwd {fb:7.2f} ms", flush=True)
for name in ("mixtral", "dbrx"):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            variants[name]().backward(dy)
        torch.cuda.synchronize()
    print("==", name)
    rows = sorted(((e.key[:70], e.self_device_time_total / 3e3, e.count // 3) for e in prof.key_averages()
                   if e.self_device_time_total > 0), key=lambda r: -r[1])
    for key, ms, n in rows[:10]:
        print(f"  {ms:7.3f} ms x{n:<2d} {key}")

# Host-side cost: where does the Python time of one fwd+bwd go? (GPU kernels sum to far less than wall time)
import cProfile
import pstats
import time

for name in ("mixtral", "dbrx"):
    fn = variants[name]
    for _ in range(3):
        fn().backward(dy)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        fn().backward(dy)
    cpu_ms = (time.perf_counter() - t0) / 20 * 1e3  # host time to issue (async, unless something syncs)
    torch.cuda.synchronize()
    print(f"== {name}: host issue time {cpu_ms:.2f} ms per fwd+bwd")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(20):
        fn().backward(dy)
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)
