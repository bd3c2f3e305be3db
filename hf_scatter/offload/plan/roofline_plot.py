"""The hierarchical roofline as a PNG: roofs per level, the cross-level roof, turning points, and where each
op of a decode layer sits under the chosen policy."""

from __future__ import annotations

import math

from ...common.atomic_files import save_figure
from ..families.spec import ModelSpec
from .hrm import HierarchicalRoofline
from .policy import Policy

_OP_COLORS = {"qkv": "tab:purple", "attention": "tab:orange", "o_proj": "tab:brown", "router": "tab:gray",
              "ffn": "tab:red", "ffn (GPU share)": "tab:pink"}


def operating_points(policy: Policy, link_bandwidth: float) -> list[dict]:
    """Each op of the mean decode layer: its intensity against the memory it reads and its achieved FLOP/s;
    for ops whose data crosses the link also its FLOP per link byte and FLOP/s with the link time as a floor."""
    points = []
    for op in policy._predicted().decode_layer.ops.values():
        if op.flops <= 0 or op.seconds <= 0:
            continue
        point = dict(name=op.name, device=op.device, intensity=op.flops / max(op.bytes, 1.0),
                     flops_per_s=op.flops / op.seconds)
        if op.link_bytes > 0:
            point["link_intensity"] = op.flops / op.link_bytes
            point["link_flops_per_s"] = op.flops / max(op.seconds, op.link_bytes / link_bandwidth)
        points.append(point)
    return points


def plot_roofline(policy: Policy, model: ModelSpec, hrm: HierarchicalRoofline, path: str) -> str:
    """Draw the roofline of ``hrm`` with ``policy``'s operating points (log-log) into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    r = hrm.roofs
    ffn_perf = hrm.ffn_gpu_performance(model, policy.micro_batch_size)
    tp_peak, tp_ffn = hrm.turning_points(), hrm.turning_points(ffn_perf)
    lo = 10 ** math.floor(math.log10(min(0.05, tp_peak.cpu_ridge / 100)))
    hi = 10 ** math.ceil(math.log10(max(tp_peak.link_gpu, tp_ffn.link_gpu) * 10))
    intensity = np.logspace(math.log10(lo), math.log10(hi), 400)

    fig, ax = plt.subplots(figsize=(10, 6.5))
    ax.loglog(intensity, np.minimum(r.gpu_flops, r.gpu_bandwidth * intensity), color="tab:blue", lw=2,
              label=f"GPU roof ({r.gpu_flops / 1e12:.0f} TFLOP/s, {r.gpu_bandwidth / 1e9:.0f} GB/s)")
    ax.loglog(intensity, np.minimum(r.cpu_flops, r.cpu_bandwidth * intensity), color="tab:green", lw=2,
              label=f"CPU roof ({r.cpu_flops / 1e9:.0f} GFLOP/s, {r.cpu_bandwidth / 1e9:.0f} GB/s)")
    ax.loglog(intensity, np.minimum(r.gpu_flops, r.link_bandwidth * intensity), color="tab:red", lw=2, ls="--",
              label=f"cross-level roof: CPU->GPU link {r.link_bandwidth / 1e9:.0f} GB/s (x-axis: FLOP per link byte)")
    ax.axhline(ffn_perf, color="tab:red", lw=0.8, ls=":",
               label=f"FFN kernel at mu={policy.micro_batch_size}: {ffn_perf / 1e12:.1f} TFLOP/s")

    marks = [("P1", tp_peak.cpu_gpu, r.cpu_flops), ("P2", tp_peak.link_gpu, r.gpu_flops),
             (f"P2(mu={policy.micro_batch_size})", tp_ffn.link_gpu, ffn_perf)]
    for label, x, y in marks:
        if 0 < x < math.inf:
            ax.plot([x], [y], "k*", ms=12)
            ax.annotate(f"{label}\nI={x:,.0f}", (x, y), textcoords="offset points", xytext=(6, -22), fontsize=8)
    for label, x, y in (("GPU ridge", tp_peak.gpu_ridge, r.gpu_flops), ("CPU ridge", tp_peak.cpu_ridge, r.cpu_flops)):
        ax.plot([x], [y], "kD", ms=5)
        ax.annotate(f"{label} I={x:,.0f}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)

    for p in operating_points(policy, r.link_bandwidth):
        color = _OP_COLORS.get(p["name"], "black")
        ax.plot([p["intensity"]], [p["flops_per_s"]], "o" if p["device"] == "gpu" else "s", color=color, ms=8,
                mec="black", label=f"{p['name']} on {p['device'].upper()}")
        if "link_intensity" in p:  # the same op seen from the link
            ax.plot([p["link_intensity"]], [p["link_flops_per_s"]], "^", color=color, ms=8, mec="black")
            ax.plot([p["intensity"], p["link_intensity"]], [p["flops_per_s"], p["link_flops_per_s"]], color=color,
                    lw=0.6, ls=":")
    ax.set_xlabel("operational intensity (FLOP/byte): memory of the level for o/s markers, link for ^ markers")
    ax.set_ylabel("attainable performance (FLOP/s)")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(r.cpu_flops, r.link_bandwidth * lo) / 3, r.gpu_flops * 3)
    ax.grid(True, which="major", alpha=0.3)
    pred = policy._predicted()
    ax.set_title(f"Hierarchical roofline: {pred.model} on {pred.hardware}\nN={policy.batch_size}, "
                 f"mu={policy.micro_batch_size}, attention {'GPU' if policy.attention_on_gpu else 'CPU'}, FFN "
                 f"{'GPU' if policy.experts_on_gpu else 'CPU'}, weights on GPU {policy.weights_gpu_fraction:.1%}: "
                 f"{pred.tokens_per_s:,.0f} tokens/s predicted", fontsize=10)
    ax.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)
    return path
