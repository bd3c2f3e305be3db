"""`hf-scatter bench loss`: the LM head plus cross-entropy, unfused (transformers' way) against the fused linear
cross-entropy libraries hf-scatter can depend on, in one process (GPU).

transformers computes ``logits = hidden @ W.T`` for every token, upcasts them to float32 and takes the
cross-entropy: at 8192 tokens and a 32k vocabulary that is 0.5 GB of bf16 logits plus 1 GB in float32, twice
more in the backward. The fused libraries never hold [tokens, vocab]: Liger-Kernel's
``LigerFusedLinearCrossEntropyLoss`` (chunks of tokens, the gradient computed in the forward) and Apple's
``cut-cross-entropy`` (blockwise log-sum-exp; by default it skips gradient blocks whose softmax is below
bf16 resolution, ``filter_eps``; ``cce-exact`` turns that off), and hf-scatter's own (chunks of tokens, one
Triton program per row, nothing read back on the host). Reports fwd+bwd time, peak extra memory and
the loss and gradient error against a float32 reference.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.timing import median_ms, peak_extra_gib, run_header
from .availability import check_names, require_cuda


@dataclasses.dataclass(frozen=True)
class LossConfig:
    tokens: int
    hidden: int
    vocab: int


CONFIGS = {
    "mixtral-1.5b": LossConfig(8192, 1024, 32000),  # bench train's batch 4 x 2048 at d 1024
    "qwen3-30b-a3b": LossConfig(8192, 2048, 151936),  # Qwen3's vocabulary
}
IMPLS = ("torch", "hf-scatter", "liger", "cce", "cce-exact")
NEEDS_GPU = True


def _torch_loss(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=-100)


def _implementations() -> dict[str, Callable | str]:
    from ..kernels.linear_cross_entropy import linear_cross_entropy

    table: dict[str, Callable | str] = {"torch": _torch_loss, "hf-scatter": linear_cross_entropy}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss(ignore_index=-100)
        table["liger"] = lambda h, w, y: liger(w, h, y)
    except ImportError:
        table["liger"] = "not installed (pip install liger-kernel)"
    try:
        from cut_cross_entropy import linear_cross_entropy

        table["cce"] = lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=-100)
        table["cce-exact"] = lambda h, w, y: linear_cross_entropy(h, w, y, ignore_index=-100, filter_eps=None)
    except ImportError:
        table["cce"] = table["cce-exact"] = "not installed (pip install cut-cross-entropy)"
    return table


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def run_config(cfg: LossConfig, impls) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(cfg.tokens, cfg.hidden, device="cuda", generator=g)).bfloat16().requires_grad_(True)
    w = (torch.randn(cfg.vocab, cfg.hidden, device="cuda", generator=g) * cfg.hidden ** -0.5).bfloat16()
    w.requires_grad_(True)
    y = torch.randint(cfg.vocab, (cfg.tokens,), device="cuda", generator=g)
    y[::7] = -100  # padding / prompt tokens
    hf, wf = h.detach().float().requires_grad_(True), w.detach().float().requires_grad_(True)
    ref = _torch_loss(hf, wf, y)
    ref.backward()
    out = {}
    for name, fn in _implementations().items():
        if name not in impls:
            continue
        if isinstance(fn, str):
            out[name] = {"skipped": fn}
            continue

        def step():
            loss = fn(h, w, y)
            loss.backward()
            return loss

        h.grad = w.grad = None
        loss = step()
        out[name] = {"loss_rel_err": _rel(loss.detach(), ref.detach()), "dh_rel_err": _rel(h.grad, hf.grad),
                     "dw_rel_err": _rel(w.grad, wf.grad)}
        h.grad = w.grad = None
        out[name]["peak_extra_gib"] = peak_extra_gib(step)
        out[name]["fwd_bwd_ms"] = median_ms(step, grad_to_none=[h, w])
    return out


def add_arguments(parser) -> None:
    parser.add_argument("--configs", nargs="*", metavar="CONFIG", default=list(CONFIGS),
                        help=f"subset of {', '.join(CONFIGS)} (default: all)")
    parser.add_argument("--impls", nargs="*", metavar="IMPL", default=list(IMPLS),
                        help=f"subset of {', '.join(IMPLS)} (default: all)")


def run(configs=tuple(CONFIGS), impls=IMPLS) -> dict:
    require_cuda()
    check_names("config", configs, CONFIGS)
    check_names("implementation", impls, IMPLS)
    report = {**run_header(), "results": {}}
    for name in configs:
        report["results"][name] = r = {"config": dataclasses.asdict(CONFIGS[name]), "impls": run_config(CONFIGS[name],
                                                                                                      impls)}
        for impl, v in r["impls"].items():
            print(f"  {name:16s} {impl:10s} " + (v.get("skipped") or f"{v['fwd_bwd_ms']:7.2f} ms  "
                  f"peak {v['peak_extra_gib']:5.2f} GiB  dW err {v['dw_rel_err']:.1e}"), flush=True)
    return report


def to_markdown(report: dict) -> str:
    rows = []
    for name, r in report["results"].items():
        base = r["impls"].get("torch", {})
        for impl, v in r["impls"].items():
            if "skipped" in v:
                rows.append([name, impl, v["skipped"], "", "", "", ""])
                continue
            speed = f"{base['fwd_bwd_ms'] / v['fwd_bwd_ms']:.2f}x" if "fwd_bwd_ms" in base else ""
            rows.append([name, impl, f"{v['fwd_bwd_ms']:.2f}", speed, f"{v['peak_extra_gib']:.2f}",
                         f"{v['loss_rel_err']:.1e}", f"{v['dh_rel_err']:.1e} / {v['dw_rel_err']:.1e}"])
    return markdown_table(["config", "implementation", "fwd+bwd ms", "speed vs torch", "peak extra GiB",
                           "loss error", "dh / dW error (vs fp32)"], rows)


def plot(report: dict, path: str) -> None:
    """fwd+bwd time and peak memory per implementation and config, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
    labels, times, peaks = [], [], []
    for name, r in report["results"].items():
        for impl, v in r["impls"].items():
            if "fwd_bwd_ms" in v:
                labels.append(f"{name} {impl}")
                times.append(v["fwd_bwd_ms"])
                peaks.append(v["peak_extra_gib"])
    colors = ["tab:gray" if label.endswith("torch") else "tab:blue" for label in labels]
    axes[0].barh(labels, times, color=colors)
    axes[0].set_xlabel("fwd+bwd ms (lower is better)")
    axes[1].barh(labels, peaks, color=colors)
    axes[1].set_xlabel("peak extra GiB (lower is better)")
    for ax in axes:
        ax.invert_yaxis()
    fig.suptitle(f"LM head + cross-entropy, bf16, {report['device']}")
    fig.tight_layout()
    save_figure(fig, path)
