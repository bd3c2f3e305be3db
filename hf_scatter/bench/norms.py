"""Fused reductions against their torch peers in one run (GPU): GB/s against the measured copy bandwidth.

Each case moves a known number of bytes (every tensor read or written once, the least any kernel must
move); GB/s = bytes / median time. The copy roof is ``y.copy_(x)`` of the largest case in the same run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.timing import median_ms, run_header
from .availability import require_cuda

BIG = (65536, 4096)  # the acceptance shape, bf16
BERT_ROWS = (65536, 768)  # add + LayerNorm at BERT-base width, fp16


def _torch_rms(x, weight, eps=1e-6):
    """MixtralRMSNorm's own arithmetic."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _backward_ms(fn, inputs: list[torch.Tensor]) -> float:
    """Median time of the backward alone: one forward graph, replayed with ``retain_graph``."""
    out = fn()
    dy = torch.randn_like(out)
    return median_ms(lambda: torch.autograd.grad(out, inputs, dy, retain_graph=True))


def _norm_cases(dev) -> dict[str, tuple]:
    from ..kernels.norms import fused_add_layer_norm, fused_add_rms_norm

    hidden = BIG[1]
    bf16, fp16 = torch.bfloat16, torch.float16
    x = torch.randn(*BIG, device=dev, dtype=bf16, requires_grad=True)
    w = torch.randn(hidden, device=dev, dtype=bf16, requires_grad=True)
    b = torch.randn(hidden, device=dev, dtype=bf16, requires_grad=True)
    act = x.numel() * x.element_size()
    cases = {
        # name: (ours, torch, bytes moved, backward inputs or None)
        "LayerNorm fwd 65536x4096 bf16": (lambda: fused_add_layer_norm(x, None, w, b),
                                          lambda: F.layer_norm(x, (hidden,), w, b), 2 * act, None),
        "LayerNorm bwd 65536x4096 bf16": (lambda: fused_add_layer_norm(x, None, w, b),
                                          lambda: F.layer_norm(x, (hidden,), w, b), 3 * act, [x, w, b]),
        "RMSNorm fwd 65536x4096 bf16": (lambda: fused_add_rms_norm(x, None, w),
                                        lambda: _torch_rms(x, w), 2 * act, None),
        "RMSNorm bwd 65536x4096 bf16": (lambda: fused_add_rms_norm(x, None, w),
                                        lambda: _torch_rms(x, w), 3 * act, [x, w]),
    }
    r = torch.randn_like(x)
    cases["add+RMSNorm fwd 65536x4096 bf16 (+sum)"] = (
        lambda: fused_add_rms_norm(x, r, w, return_sum=True),
        lambda: (lambda s: (_torch_rms(s, w), s))(x + r), 4 * act, None)
    bert_hidden = BERT_ROWS[1]
    h = torch.randn(*BERT_ROWS, device=dev, dtype=fp16)
    res = torch.randn_like(h)
    wh = torch.randn(bert_hidden, device=dev, dtype=fp16)
    bh = torch.randn(bert_hidden, device=dev, dtype=fp16)
    cases["add+LayerNorm fwd 65536x768 fp16 (BERT)"] = (
        lambda: fused_add_layer_norm(h, res, wh, bh), lambda: F.layer_norm(h + res, (bert_hidden,), wh, bh),
        3 * h.numel() * 2, None)
    return cases


def _softmax_router_cases(dev) -> dict[str, tuple]:
    from ..kernels.router import router_topk
    from ..kernels.softmax import fused_masked_softmax

    scores = torch.randn(20, 12, 128, 128, device=dev, dtype=torch.float16)
    mask = torch.zeros(20, 1, 1, 128, device=dev, dtype=torch.float16)
    mask[::2, ..., 100:] = torch.finfo(torch.float16).min
    scale = 64 ** -0.5
    logits = torch.randn(65536, 8, device=dev, dtype=torch.bfloat16)

    def torch_router():
        top, idx = torch.softmax(logits.float(), -1).topk(2, -1)
        return top / top.sum(-1, keepdim=True), idx

    return {
        "masked softmax fwd 240x128x128 fp16 (BERT-base)": (
            lambda: fused_masked_softmax(scores, mask, scale),
            lambda: torch.softmax(scores * scale + mask, -1), 2 * scores.numel() * 2, None),
        "router top-2 of 8, 65536 tokens": (
            lambda: router_topk(logits, 2), torch_router, logits.numel() * 2 + 65536 * 2 * (4 + 8), None),
    }


def _bert_forward(dev) -> dict:
    import copy

    from transformers import AutoModel, BertConfig

    import hf_scatter

    torch.manual_seed(0)
    vanilla = AutoModel.from_config(BertConfig(), attn_implementation="sdpa").to(dev, torch.float16).eval()
    patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
    ids = torch.randint(1000, 30000, (20, 128), device=dev)
    with torch.no_grad():
        err = (patched(ids).last_hidden_state.float() - vanilla(ids).last_hidden_state.float()).abs().max().item()
        times = {name: median_ms(lambda m=m: m(ids), 50, 500) for name, m in
                 (("vanilla (sdpa)", vanilla), ("hf-scatter (sdpa + fused add+LayerNorm)", patched))}
    return {"batch": [20, 128], "dtype": "float16", "ms": times, "max_abs_diff": err}


NEEDS_GPU = True


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench norms``, named after :func:`run`'s arguments."""
    parser.add_argument("--configs", nargs="*", metavar="SUBSTRING",
                        help="only the cases whose name contains one of these (\"bert\" adds the BERT-base forward)")


def run(configs=None) -> dict:
    require_cuda()
    dev = torch.device("cuda")
    src = torch.randn(*BIG, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_gbps = 2 * src.numel() * 2 / median_ms(lambda: dst.copy_(src)) / 1e6
    del src, dst
    cases = {**_norm_cases(dev), **_softmax_router_cases(dev)}
    results = {}
    for name, (ours, peer, nbytes, grad_inputs) in cases.items():
        if configs and not any(c in name for c in configs):
            continue
        if grad_inputs is None:
            with torch.no_grad():
                ms = {"hf-scatter": median_ms(ours), "torch": median_ms(peer)}
        else:
            ms = {"hf-scatter": _backward_ms(ours, grad_inputs), "torch": _backward_ms(peer, grad_inputs)}
        results[name] = {"ms": ms, "bytes": nbytes,
                         "gbps": {k: nbytes / v / 1e6 for k, v in ms.items()}}
        print(f"  {name:48s} ours {ms['hf-scatter']:.3f} ms  torch {ms['torch']:.3f} ms", flush=True)
    report = {**run_header(), "copy_gbps": copy_gbps, "results": results}
    if not configs or any("bert" in c.lower() for c in configs):
        report["bert_base_forward"] = _bert_forward(dev)
    return report


def to_markdown(report: dict) -> str:
    parts = [f"{report['device']}, device copy {report['copy_gbps']:.0f} GB/s (bytes = each tensor read or "
             "written once)\n", results_table(report)]
    bert = report.get("bert_base_forward")
    if bert:
        (va, vt), (pa, pt) = bert["ms"].items()
        parts.append(f"\nBERT-base forward, batch {bert['batch'][0]} x {bert['batch'][1]}, fp16: {va} {vt:.3f} ms, "
                     f"{pa} {pt:.3f} ms ({vt / pt:.2f}x), max |diff| {bert['max_abs_diff']:.2g}")
    return "\n".join(parts)


def results_table(report: dict) -> str:
    """The docs' view of a ``bench norms`` report: ``to_markdown``'s table alone (the docs quote the copy roof and
    the BERT-base forward in their text, each with its source)."""
    roof = report["copy_gbps"]
    rows = []
    for name, r in report["results"].items():
        ours, peer = r["gbps"]["hf-scatter"], r["gbps"]["torch"]
        rows.append([name, f"{r['ms']['hf-scatter']:.3f}", f"{ours:.0f}", f"{ours / roof:.0%}",
                     f"{r['ms']['torch']:.3f}", f"{peer:.0f}", f"{peer / roof:.0%}",
                     f"{r['ms']['torch'] / r['ms']['hf-scatter']:.2f}x"])
    return markdown_table(["case", "ours ms", "ours GB/s", "of copy", "torch ms", "torch GB/s", "of copy",
                           "speedup"], rows)


def plot(report: dict, path: str) -> None:
    """Share of the copy bandwidth per case, ours next to torch, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["results"])
    roof = report["copy_gbps"]
    fig, ax = plt.subplots(figsize=(10, 0.5 * len(names) + 1.5))
    ys = range(len(names))
    for offset, impl, color in ((-0.2, "hf-scatter", "tab:orange"), (0.2, "torch", "tab:gray")):
        ax.barh([y + offset for y in ys], [100 * report["results"][n]["gbps"][impl] / roof for n in names],
                height=0.4, color=color, label=impl)
    ax.set_yticks(list(ys), names)
    ax.invert_yaxis()
    ax.axvline(100, color="black", lw=0.8)
    ax.set_xlabel(f"% of device copy bandwidth ({roof:.0f} GB/s); higher is better")
    ax.legend(loc="lower right")
    ax.set_title(f"Fused reductions vs torch, {report['device']}")
    fig.tight_layout()
    save_figure(fig, path)
