"""`hf-scatter bench moe`: one SMoE SwiGLU layer, hf-scatter against every peer in one process.

Peers: transformers' Mixtral experts with ``experts_implementation`` eager / grouped_mm / batched_mm, and a
dense SwiGLU MLP with the same active FLOPs (k x d_expert hidden units) as the practical ceiling.
Reports median ms, achieved TFLOP/s and peak extra memory for forward (inference) and forward+backward.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Callable

import torch
import torch.nn.functional as F

from ..common.markdown import markdown_table
from ..common.shapes import MIXTRAL_8X7B
from ..common.timing import is_oom, median_ms, peak_extra_gib, run_header
from .availability import check_names, require_cuda


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    backward: bool = True

    def active_flops(self) -> float:
        return 6.0 * self.tokens * self.top_k * self.hidden * self.intermediate


_MIXTRAL = tuple(MIXTRAL_8X7B[k] for k in ("hidden", "intermediate", "experts", "top_k"))
CONFIGS = {
    "paper-unit": MoEConfig(4096, 2048, 32, 4, 61440),
    "mixtral-prefill": MoEConfig(*_MIXTRAL, 8192),
    "fine-grained": MoEConfig(4096, 1024, 64, 8, 16384),
    "mixtral-decode": MoEConfig(*_MIXTRAL, 64, backward=False),
}
IMPLS = ("hf-eager", "hf-grouped_mm", "hf-batched_mm", "hf-scatter", "dense")


def hf_experts(cfg: MoEConfig, device, dtype):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                           num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k)
    experts = MixtralExperts(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        experts.gate_up_proj.normal_(std=cfg.hidden ** -0.5)
        experts.down_proj.normal_(std=cfg.intermediate ** -0.5)
    return experts


def _implementations(cfg: MoEConfig, experts, device, dtype) -> dict[str, tuple[Callable, list]]:
    from ..moe import glu_experts

    def hf(name):
        def run(x, idx, gates):
            experts.config._experts_implementation = name
            return experts(x, idx, gates)
        return run

    dense_up = torch.randn(2 * cfg.top_k * cfg.intermediate, cfg.hidden, device=device, dtype=dtype) * cfg.hidden ** -0.5
    dense_down = torch.randn(cfg.hidden, cfg.top_k * cfg.intermediate, device=device, dtype=dtype) * cfg.intermediate ** -0.5

    def dense(x, idx, gates):
        gate, up = F.linear(x, dense_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, dense_down)

    def ours(x, idx, gates):
        return glu_experts(x, experts.gate_up_proj, experts.down_proj, idx, gates, validate=False)

    expert_params = [experts.gate_up_proj, experts.down_proj]
    return {"hf-eager": (hf("eager"), expert_params), "hf-grouped_mm": (hf("grouped_mm"), expert_params),
            "hf-batched_mm": (hf("batched_mm"), expert_params), "hf-scatter": (ours, expert_params),
            "dense": (dense, [dense_up, dense_down])}


def _measure(fn, params, x, idx, gates, dy, backward: bool) -> dict:
    out = {}
    with torch.no_grad():
        out["fwd_ms"] = median_ms(lambda: fn(x, idx, gates))
        out["fwd_peak_gib"] = peak_extra_gib(lambda: fn(x, idx, gates))
    if backward:
        leaves = [x, gates, *params]
        for t in leaves:
            t.requires_grad_(True)

        def step():
            fn(x, idx, gates).backward(dy)

        try:
            out["fwdbwd_ms"] = median_ms(step, grad_to_none=leaves)
            for t in leaves:
                t.grad = None
            out["fwdbwd_peak_gib"] = peak_extra_gib(step)
        finally:
            for t in leaves:
                t.grad = None
                t.requires_grad_(False)
    return out


def routed_batch(tokens: int, hidden: int, experts: int, top_k: int, device, dtype):
    """One SMoE layer's inputs: random activations, renormalised top-k routing, an output gradient."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gates, idx = torch.softmax(torch.randn(tokens, experts, device=device), -1).topk(top_k, -1)
    return x, idx, gates / gates.sum(-1, keepdim=True), torch.randn_like(x)


def run_config(name: str, cfg: MoEConfig, impls=IMPLS, dtype=torch.bfloat16, seed: int = 0) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(seed)
    experts = hf_experts(cfg, device, dtype)
    x, idx, gates, dy = routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, device, dtype)
    table = _implementations(cfg, experts, device, dtype)
    results: dict[str, dict] = {"config": dataclasses.asdict(cfg)}
    with torch.no_grad():  # correctness of ours against transformers' eager loop, same weights and routing
        ref = table["hf-eager"][0](x, idx, gates).float()
        got = table["hf-scatter"][0](x, idx, gates).float()
        results["hf-scatter_rel_err_vs_eager"] = ((got - ref).norm() / ref.norm()).item()
        del ref, got
    for impl in impls:
        fn, params = table[impl]
        try:
            r = _measure(fn, params, x, idx, gates, dy, cfg.backward)
        except Exception as error:  # noqa: BLE001 - an OOM peer is a result, not a crash
            if not is_oom(error):
                raise
            r = {"error": "OOM"}
        torch.cuda.empty_cache()
        if "fwd_ms" in r:
            r["fwd_tflops"] = cfg.active_flops() / r["fwd_ms"] / 1e9
        if "fwdbwd_ms" in r:
            r["fwdbwd_tflops"] = 3 * cfg.active_flops() / r["fwdbwd_ms"] / 1e9
        results[impl] = r
        print(f"  {name:16s} {impl:14s} {json.dumps(r)}", flush=True)
    return results


NEEDS_GPU = True


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench moe``, named after :func:`run`'s arguments."""
    parser.add_argument("--configs", nargs="*", metavar="CONFIG", help=f"subset of {', '.join(CONFIGS)} (default: all)")


def run(configs=None, impls=IMPLS) -> dict:
    require_cuda()
    names = configs or list(CONFIGS)
    check_names("config", names, CONFIGS)
    report = {**run_header(), "results": {}}
    for name in names:
        report["results"][name] = run_config(name, CONFIGS[name], impls)
    return report


def to_markdown(report: dict) -> str:
    rows = []
    for name, res in report["results"].items():
        dense = res.get("dense", {})
        for impl in IMPLS:
            r = res.get(impl)
            if r is None:
                continue
            if "error" in r:
                rows.append([name, impl, r["error"], "", "", "", "", ""])
                continue
            ratio = f"{r['fwdbwd_ms'] / dense['fwdbwd_ms']:.2f}" if "fwdbwd_ms" in r and "fwdbwd_ms" in dense else ""
            rows.append([name, impl, f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.0f}", f"{r['fwd_peak_gib']:.2f}",
                         f"{r['fwdbwd_ms']:.2f}" if "fwdbwd_ms" in r else "",
                         f"{r['fwdbwd_peak_gib']:.2f}" if "fwdbwd_peak_gib" in r else "", ratio])
    return markdown_table(["config", "impl", "fwd ms", "fwd TFLOP/s", "fwd peak GiB", "fwd+bwd ms",
                           "fwd+bwd peak GiB", "fwd+bwd / dense"], rows)


def results_table(report: dict) -> str:
    """The docs' view of a ``bench moe`` report: ``to_markdown``'s table with hf-scatter's name, both times and
    its fwd+bwd / dense ratio in bold."""
    header, _, *lines = to_markdown(report).split("\n")
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    bold = (1, 2, 5, 7)  # impl, fwd ms, fwd+bwd ms, fwd+bwd / dense
    for row in rows:
        if row[1] == "hf-scatter":
            row[:] = [f"**{c}**" if i in bold and c else c for i, c in enumerate(row)]
    return markdown_table([c.strip() for c in header.strip("|").split("|")], rows)


def plot(report: dict, path: str) -> None:
    """Time and peak memory per implementation per config (bars), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    metrics = [("fwd_ms", "forward ms"), ("fwdbwd_ms", "forward+backward ms"),
               ("fwd_peak_gib", "forward peak extra GiB"), ("fwdbwd_peak_gib", "forward+backward peak extra GiB")]
    width = 0.8 / len(IMPLS)
    for ax, (key, title) in zip(axes.flat, metrics):
        for i, impl in enumerate(IMPLS):
            values = [report["results"][n].get(impl, {}).get(key, float("nan")) for n in names]
            ax.bar([j + i * width for j in range(len(names))], values, width, label=impl)
        ax.set_xticks([j + width * (len(IMPLS) - 1) / 2 for j in range(len(names))], names, fontsize=8)
        ax.set_title(title)
        ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"SMoE SwiGLU layer, bf16, {report['device']} (lower is better; missing bar = OOM or n/a)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
