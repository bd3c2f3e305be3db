"""Kernel-level time breakdown of one hf-scatter SMoE layer step (torch profiler), for tuning and docs."""

from __future__ import annotations

import torch

from .moe import CONFIGS, hf_experts


def kernel_times(step, steps: int = 3) -> list[tuple[str, float, int]]:
    """``[(kernel name, ms per step, launches per step)]`` of ``step()`` after two warm-up calls, slowest first."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = []
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA or getattr(evt, "self_device_time_total", 0) > 0:
            t = getattr(evt, "self_device_time_total", 0) / 1e3 / steps
            if t > 0:
                rows.append((evt.key[:100], t, evt.count // steps))
    rows.sort(key=lambda r: -r[1])
    return rows


def routed_layer(cfg):
    """The experts of ``cfg`` (bf16, on the GPU) and a routed batch: ``(experts, x, idx, gates, dy)``, x and gates
    requiring grad, and ``step()``, one fwd+bwd with the gradients set to None first, as a training step would
    (no accumulation kernels)."""
    from ..moe import glu_experts

    torch.manual_seed(0)
    experts = hf_experts(cfg, "cuda", torch.bfloat16)
    x = torch.randn(cfg.tokens, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gates, idx = torch.softmax(torch.randn(cfg.tokens, cfg.experts, device="cuda"), -1).topk(cfg.top_k, -1)
    gates.requires_grad_(True)
    dy = torch.randn_like(x)

    def step():
        x.grad = gates.grad = experts.gate_up_proj.grad = experts.down_proj.grad = None
        glu_experts(x, experts.gate_up_proj, experts.down_proj, idx, gates, validate=False).backward(dy)

    return (experts, x, idx, gates, dy), step


def profile(config_names=None, steps: int = 3) -> dict:
    out = {}
    for name in config_names or [n for n, c in CONFIGS.items() if c.backward]:
        (experts, *_), step = routed_layer(CONFIGS[name])
        rows = kernel_times(step, steps)
        out[name] = rows
        print(f"== {name}: total {sum(r[1] for r in rows):.2f} ms per fwd+bwd")
        for key, ms, count in rows[:14]:
            print(f"  {ms:8.3f} ms  x{count:<3d} {key}")
        experts.gate_up_proj.grad = experts.down_proj.grad = None
        del experts
        torch.cuda.empty_cache()
    return out
