"""``hf-scatter bench offload --weights mxfp4|fp8 bf16``: the same layers offloaded with their experts in each format,
side by side in one process, at one GPU and one host budget, each against the HRM's prediction.

Each format builds its own model of the built-in shape (random weights; MXFP4 or FP8 experts as a checkpoint loaded
as shipped holds them, never a bf16 copy), is planned by the HRM for the workload, generates every request and is
closed before the next format builds, so the host holds one model at a time. The host budget applies to both: a
format the planner cannot fit in it gets the planner's reason in its row, and the others still run. Beside each
measured row, the HRM's plan for
the published layer count at the same budgets says what the whole model would do (or that it does not fit).
"""

from __future__ import annotations

import dataclasses
import gc
import time

import torch

from ..common.markdown import markdown_table
from ..common.timing import run_header
from .availability import require_cuda
from .offload_workload import PROMPT_LENS, bench_profile, build_model, left_padded, prompts

FORMATS = ("mxfp4", "fp8", "bf16")
# the families whose quantized releases the runtime streams as shipped: GPT-OSS in MXFP4; DeepSeek-V3, Qwen3-MoE
# (Qwen3-FP8) and the other Llama-style layers in block-scaled FP8
SHIPPED_FAMILIES = {"mxfp4": ("gpt_oss",),
                    "fp8": ("qwen3_moe", "deepseek_v3", "deepseek_v2", "mixtral", "qwen2_moe", "olmoe")}


def check_formats(formats: list[str], model: str) -> None:
    """Refuses a format the model's family does not ship in, naming the ones it does."""
    from ..common.shapes import builtin_config

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"--weights {','.join(unknown)}: choose from {', '.join(FORMATS)}")
    family = builtin_config(model).model_type
    for fmt in formats:
        if fmt in SHIPPED_FAMILIES and family not in SHIPPED_FAMILIES[fmt]:
            raise ValueError(f"--weights {fmt}: offloading {family} experts in {fmt.upper()} is not built; it is for "
                             f"{', '.join(SHIPPED_FAMILIES[fmt])} models")


def run_formats(formats: list[str], *, model: str, layers: int, published_layers: int, new_tokens: int,
                requests: int, gpu_memory, cpu_memory, profile: str | None, progress: bool,
                trace: str | None = None) -> dict:
    """The runs side by side; ``trace``: each format writes its Chrome trace beside it (``<trace>.<format>.json``)."""
    import os

    from ..offload import PlanError, Workload, parse_bytes

    require_cuda()
    header = run_header()
    prof, profile_s = bench_profile(profile, model, progress)
    budget = parse_bytes(gpu_memory, "gpu_memory")
    host = parse_bytes(cpu_memory, "cpu_memory")
    rows = {}
    for weights in formats:
        lm = None
        try:
            built = time.perf_counter()
            lm = build_model(layers, model=model, weights=weights)
            build_s = time.perf_counter() - built
            reqs = prompts(requests, lm.config.vocab_size)
            workload = Workload.from_prompts([len(r) for r in reqs], new_tokens)
            traced = f"{os.path.splitext(trace)[0]}.{weights}.json" if trace else None
            whole = _whole_model(model, weights, prof, workload, budget, host)
            try:
                measured = _measure(lm, reqs, workload, prof, budget, host, progress, traced)
            except PlanError as e:  # these layers do not fit the budgets in this format
                measured = {"error": str(e)}
            rows[weights] = {**measured, "build_s": build_s, "whole_model": whole}
        finally:
            lm = None
            gc.collect()
            torch.cuda.empty_cache()
    report = {**header, "model": model, "layers": layers, "published_layers": published_layers,
              "gpu_budget": budget, "cpu_budget": host, "profile": prof.to_dict(), "profile_s": profile_s,
              "workload": {"requests": requests, "prompt_lens": PROMPT_LENS, "new_tokens": new_tokens},
              "by_weights": rows}
    for fmt in SHIPPED_FAMILIES:
        if all("tokens_per_s" in rows.get(w, {}) for w in (fmt, "bf16")):
            a, b = rows[fmt], rows["bf16"]
            report[f"{fmt}_over_bf16"] = {
                "measured_tokens_per_s": a["tokens_per_s"] / b["tokens_per_s"],
                "measured_decode_step": b["decode_step_s"] / a["decode_step_s"],
                "predicted_tokens_per_s": a["predicted"]["tokens_per_s"] / b["predicted"]["tokens_per_s"]}
    return report


def _measure(lm, reqs, workload, prof, budget: int, host: int, progress: bool, trace: str | None) -> dict:
    """One format's offloaded run: tokens/s, decode step, GPU peak, and the HRM's prediction for the policy as
    realised (its resident fraction)."""
    import hf_scatter
    from ..offload import predict

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # what this process held already is not the run's
    offloaded = hf_scatter.offload_model(lm, gpu_memory=budget, cpu_memory=host, profile=prof, workload=workload,
                                         progress=progress)
    try:
        policy, layout = offloaded.policy, offloaded.store.layout
        ids, mask = left_padded(reqs)
        warm = min(len(reqs), policy.batch_size)
        offloaded.generate(ids[:warm], attention_mask=mask[:warm], max_new_tokens=3, progress=False)  # kernels
        stats = offloaded.generate(ids, attention_mask=mask, max_new_tokens=workload.gen_len, return_dict=True,
                                   progress=progress, trace=trace).stats
        peak = torch.cuda.max_memory_allocated() - before
        realised = dataclasses.replace(policy, weights_gpu_fraction=layout.fraction, prediction=None)
        spec = offloaded.spec  # the experts priced in the format they stream in
        p = predict(realised, spec, prof, workload, budget, offloaded.cpu_budget, offloaded.cost_options)
        decode_step = stats["decode_s"] / max(stats["decode_steps"], 1)
        return {"expert_format": spec.expert_format or "bf16", "policy": policy.to_dict(),
                "weights_gpu_fraction": layout.fraction, "streamed_bytes": layout.host_bytes,
                "resident_bytes": layout.resident_bytes, "tokens_per_s": stats["tokens_per_s"],
                "decode_step_s": decode_step, "prefill_s": stats["prefill_s"], "wall_s": stats["wall_s"],
                "max_memory_allocated": peak, "within_budget": peak <= budget,
                "predicted": {"tokens_per_s": p.tokens_per_s, "decode_step_s": p.decode_step_s,
                              "prefill_s": p.prefill_s, "bottleneck": p.decode_layer.bottleneck,
                              "decode_terms": p.decode_layer.terms},
                "fraction_of_prediction": stats["tokens_per_s"] / p.tokens_per_s,
                "policy_markdown": offloaded.describe(), "trace": stats.get("trace")}
    finally:
        offloaded.close()


def _whole_model(model: str, weights: str, prof, workload, budget: int, host: int) -> dict:
    """The HRM's plan for every published layer at the same budgets, in this format."""
    from ..offload import ModelSpec, PlanError, search_policy
    from ..offload.runtime.offloaded import CGOPIPE_PLACEMENT

    spec = ModelSpec.from_config(model, weights={"mxfp4": "shipped"}.get(weights, weights))
    try:
        policy = search_policy(spec, prof, workload, budget, host, placements=[CGOPIPE_PLACEMENT])
    except PlanError as e:
        return {"fits": False, "weight_bytes": spec.weight_bytes, "why": str(e)}
    return {"fits": True, "weight_bytes": spec.weight_bytes, "tokens_per_s": policy.prediction.tokens_per_s,
            "bottleneck": policy.prediction.decode_layer.bottleneck, "policy": policy.to_dict()}


def _label(weights: str) -> str:
    return weights if weights == "bf16" else weights.upper()


def to_markdown(report: dict) -> str:
    gib = 2**30
    rows = []
    for weights, r in report["by_weights"].items():
        if "error" in r:
            rows.append([_label(weights), r["error"]] + [""] * 8)
            continue
        p, whole = r["predicted"], r["whole_model"]
        rows.append([_label(weights), f"{r['policy']['batch_size']} / "
                     f"{r['policy']['micro_batch_size']}", f"{r['weights_gpu_fraction']:.0%}",
                     f"{r['streamed_bytes'] / gib:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['decode_step_s']:.3f}",
                     f"{p['tokens_per_s']:,.0f} ({p['bottleneck']})", f"{r['fraction_of_prediction']:.0%}",
                     f"{r['max_memory_allocated'] / gib:.1f}",
                     f"{whole['tokens_per_s']:,.0f} ({whole['bottleneck']})" if whole["fits"] else
                     f"does not fit ({whole['weight_bytes'] / gib:.0f} GiB of weights)"])
    header = ["experts", "N / mu", "resident", "streamed GiB", "tokens/s", "decode step s", "HRM tokens/s",
              "measured / HRM", "GPU peak GiB", f"HRM, all {report['published_layers']} layers"]
    lines = [f"{report['model']} shape, {report['layers']} of {report['published_layers']} layers, "
             f"{report['gpu_budget'] / gib:.0f} GiB GPU, {report['cpu_budget'] / gib:.0f} GiB host, "
             f"{report['workload']['requests']} requests, {report['workload']['new_tokens']} new tokens, "
             f"{report['device']}", "", markdown_table(header, rows)]
    for fmt in SHIPPED_FAMILIES:
        ratio = report.get(f"{fmt}_over_bf16")
        if ratio:
            lines += ["", f"{fmt.upper()} over bf16: {ratio['measured_tokens_per_s']:.2f}x tokens/s measured "
                          f"({ratio['measured_decode_step']:.2f}x decode step), "
                          f"{ratio['predicted_tokens_per_s']:.2f}x predicted"]
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Tokens/s of each format, measured beside the HRM's prediction for these layers and for all of them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common.atomic_files import save_figure

    rows = {w: r for w, r in report["by_weights"].items() if "error" not in r}
    fig, ax = plt.subplots(figsize=(6, 3.8))
    width = 0.27
    for i, weights in enumerate(rows):
        r = rows[weights]
        whole = r["whole_model"]
        bars = [(r["tokens_per_s"], "measured"), (r["predicted"]["tokens_per_s"], "HRM, these layers"),
                (whole.get("tokens_per_s", 0.0), f"HRM, all {report['published_layers']} layers")]
        for j, (value, label) in enumerate(bars):
            ax.bar(i + (j - 1) * width, value, width, color=f"C{j}", label=label if i == 0 else None)
        if not whole["fits"]:
            ax.text(i + width, 0, "does not fit", rotation=90, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [_label(w) for w in rows])
    ax.set_ylabel("tokens/s")
    ax.set_title(f"{report['model']}, {report['layers']} layers, {report['gpu_budget'] / 2**30:.0f} GiB GPU, "
                 f"{report['cpu_budget'] / 2**30:.0f} GiB host", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
