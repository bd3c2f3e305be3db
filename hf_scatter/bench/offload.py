"""Offloaded generation on published shapes: hf-scatter's CGOPipe against HF accelerate offload, and against what
the HRM predicts for the policy it chose.

One process, one GPU budget: a model of a built-in shape (``--model``: Mixtral-8x7B by default, Qwen3-30B-A3B,
GPT-OSS-120B, ...) with ``layers`` of its layers (random bf16 weights, built on the meta device and filled from a
tiled random block, so building takes seconds) is run

* by HF accelerate: ``infer_auto_device_map`` + ``dispatch_model`` within the same GPU budget (what
  ``from_pretrained(device_map="auto", max_memory=...)`` does), ``model.generate`` on a small batch with a
  few new tokens (it is slow: every step moves the CPU layers over PCIe from pageable memory);
* by ``hf_scatter.offload_model(model, gpu_memory=...)`` with the HRM's policy for the workload, on every
  request with ``new_tokens`` new tokens each, optionally writing a Chrome trace.

Prompts are MTBench-like: lengths drawn uniformly from 40..114 tokens (mean 77), random token ids. Throughput of
the whole model is the measured one scaled by layers / all layers (decode time grows with the layer count; the
embedding and head are a small share), labelled as such.

``--routed-batches 1,4,16,64`` measures instead when routed expert streaming pays: on one weight store (the
HRM's policy for the largest of those batches), each batch size decodes with every expert paged ahead and with
only the chosen experts fetched after routing, side by side, against the HRM's prediction for both.
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch

from ..common.argtypes import byte_size, int_at_least, positive_int, positive_ints
from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.timing import run_header
from .availability import require_cuda
from .offload_formats import FORMATS, check_formats
from .offload_workload import (
    DEFAULT_MODEL, PROMPT_LENS, bench_profile, build_model, left_padded, offload_models, prompts,
)



# ----------------------------------------------------------------------------- the HF accelerate peer
def run_accelerate(model, requests: list[torch.Tensor], gpu_budget: int, new_tokens: int) -> dict:
    """``model.generate`` under accelerate's CPU offload within ``gpu_budget``; the model is handed back
    on the CPU, hooks removed."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.hooks import remove_hook_from_module

    from ..offload import ModelSpec

    ids, mask = left_padded(requests)
    spec = ModelSpec.from_config(model.config)
    # HF keeps the KV cache and activations on the GPU: leave them room inside the same budget
    kv = len(requests) * ids.shape[1] + len(requests) * new_tokens
    kv_bytes = kv * spec.layers * spec.kv_bytes_per_token
    headroom = int(kv_bytes + ids.numel() * spec.ffn_width * 2 * 8 + 2**30)
    device_map = infer_auto_device_map(model, max_memory={0: max(gpu_budget - headroom, 0), "cpu": 2**50},
                                       no_split_module_classes=model._no_split_modules, dtype=torch.bfloat16)
    on_gpu = sorted(k for k, v in device_map.items() if v != "cpu")
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()  # what this process held already is not the run's
    dispatch_model(model, device_map)
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(ids.to(0), attention_mask=mask.to(0), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated() - before
    finally:
        remove_hook_from_module(model, recurse=True)
        for name in on_gpu:
            (model.get_submodule(name) if name else model).to("cpu")
        for attr in ("to", "cuda", "half", "float", "double", "hf_device_map"):  # accelerate's wrappers
            model.__dict__.pop(attr, None)
        torch.cuda.empty_cache()
    generated = (out.shape[1] - ids.shape[1]) * len(requests)
    return {"batch": len(requests), "new_tokens": new_tokens, "seconds": seconds,
            "tokens_per_s": generated / seconds, "max_memory_allocated": peak, "modules_on_gpu": on_gpu,
            "layers_on_gpu": sum(1 for k in on_gpu if ".layers." in k)}


# ----------------------------------------------------------------------------- HRM validation
# Policies that put different resources on the critical path, each run for a short generation beside the
# main one: (what it exercises, GPU budget: "run" = the run's, "resident" = room for every weight, policy).
VALIDATION_POLICIES = (
    ("every weight streamed: the CPU->GPU link", "run", (128, 32, 0.0)),
    ("15% resident, 4 micro-batches: the link, compute overlapped", "run", (512, 128, 0.15)),
    ("every weight resident, 4 micro-batches: CPU attention beside the GPU", "resident", (512, 128, 1.0)),
    ("every weight resident, one micro-batch of 32: nothing overlaps", "resident", (32, 32, 1.0)),
)
VALIDATION_TOLERANCE = 0.25  # predicted per-layer decode time within +-25% of the measured


def validate_hrm(model, reqs: list[torch.Tensor], prof, spec, budget: int, new_tokens: int) -> list[dict]:
    """Measured against predicted per-layer decode time for :data:`VALIDATION_POLICIES` (the model keeps
    its weights: each policy gets its own weight store, freed before the next)."""
    import hf_scatter
    from ..offload import Workload, predict
    from ..offload.plan.policy import Policy

    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for what, where, (n, micro, fraction) in VALIDATION_POLICIES:
        gpu = budget if where == "run" else min(total - 4 * 2**30, weights + 8 * 2**30)
        batch = reqs[:n]
        ids, mask = left_padded(batch)
        off = hf_scatter.offload_model(model, gpu_memory=gpu, policy=Policy(n, micro, weights_gpu_fraction=fraction),
                                       profile=prof, release_weights=False, progress=False)
        try:
            off.generate(ids, attention_mask=mask, max_new_tokens=2, progress=False)  # kernels, CPU cache pages
            stats = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True,
                                 progress=False).stats
            realised = Policy(n, micro, weights_gpu_fraction=off.store.layout.fraction)
            cpu_budget, options = off.cpu_budget, off.cost_options
        finally:
            off.close()
        workload = Workload.from_prompts([len(r) for r in batch], new_tokens)
        prediction = predict(realised, spec, prof, workload, gpu, cpu_budget, options)
        rows.append(_validation_row(what, gpu, realised, stats, prediction, spec.layers))
    return rows


def _validation_row(what: str, gpu_budget: int, policy, stats: dict, prediction, layers: int) -> dict:
    measured = stats["decode_s"] / max(stats["decode_steps"], 1) / layers
    predicted = prediction.decode_layer.seconds
    return {"what": what, "gpu_budget": gpu_budget, "batch_size": policy.batch_size,
            "micro_batch_size": policy.micro_batch_size, "weights_gpu_fraction": policy.weights_gpu_fraction,
            "decode_steps": stats["decode_steps"], "measured_layer_s": measured, "predicted_layer_s": predicted,
            "predicted_bottleneck": prediction.decode_layer.bottleneck, "error": predicted / measured - 1,
            "within_tolerance": abs(predicted / measured - 1) <= VALIDATION_TOLERANCE}


# ----------------------------------------------------------------------------- the run
NEEDS_GPU = True


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench offload``, named after :func:`run`'s arguments."""
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in shape of a family the offloaded runtime runs (default {DEFAULT_MODEL}; "
                             "mixtral-8x22b, dbrx, qwen3-30b-a3b, olmoe-1b-7b, gpt-oss-120b, ...)")
    parser.add_argument("--layers", type=positive_int, default=12,
                        help="layers of the model, at most its published count (default 12)")
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="tokens generated per request")
    parser.add_argument("--requests", type=positive_int, default=1024, help="number of MTBench-like requests")
    parser.add_argument("--gpu-memory", type=byte_size, default="16GiB", help="GPU memory budget of both systems")
    parser.add_argument("--profile", help="hardware profile for the HRM (a known name or JSON; default: measured "
                                          "at the start of the run)")
    parser.add_argument("--trace", help="write the Chrome trace of the measured run here")
    parser.add_argument("--validate-tokens", type=int_at_least(0), default=16,
                        help="new tokens of each HRM validation policy (per-layer decode time, predicted vs "
                             "measured); 0 skips them")
    parser.add_argument("--routed-batches", type=positive_ints,
                        help="instead of the comparison: at these batch sizes (e.g. 1,4,16,64) decode with every "
                             "expert streamed and with only the routed ones, against the HRM's prediction for each")
    parser.add_argument("--weights", nargs="+", choices=FORMATS,
                        help="instead of the comparison: offload the same layers with their experts in each of these "
                             "formats (mxfp4 bf16: GPT-OSS as shipped against bf16; fp8 bf16: Qwen3-MoE's block-scaled "
                             "FP8 release against bf16) at one GPU and one host budget, "
                             "against the HRM's prediction for each and for all the model's layers")
    parser.add_argument("--cpu-memory", type=byte_size, default="80GiB",
                        help="host memory budget of the --weights runs (default 80GiB)")
    parser.add_argument("--gpus", type=positive_ints,
                        help="instead of the comparison: generate on each of these GPU counts of this host (e.g. "
                             "1,2,4; tensor parallelism, one torchrun each, --gpu-memory per GPU) against the HRM's "
                             "prediction for each")


def check_flags(layers: int = 12, model: str = DEFAULT_MODEL, routed_batches: list[int] | None = None,
                requests: int = 1024, gpus: list[int] | None = None, weights: list[str] | None = None, **_) -> int:
    """The model's published layer count, after checking ``model`` is an offloadable built-in and ``layers`` at
    most its layer count (here, not as argparse choices: listing them builds every built-in config)."""
    from ..offload.families.spec import ModelSpec
    from ..offload.plan.tensor_parallel import check_divisible

    if sum(map(bool, (gpus, routed_batches, weights))) > 1:
        raise ValueError("--gpus, --routed-batches and --weights are different runs: pass one of them")

    if routed_batches and max(routed_batches) > requests:
        raise ValueError(f"--routed-batches {max(routed_batches)} exceeds --requests {requests}: a batch is made of "
                         "the requests")
    if model not in offload_models():
        raise ValueError(f"--model {model!r}: choose a built-in shape of a family offloading runs: "
                         f"{', '.join(offload_models())}")
    if weights:
        check_formats(weights, model)
    spec = ModelSpec.from_config(model, weights="bf16")  # the --gpus runs build bf16 experts
    if layers > spec.layers:
        raise ValueError(f"--layers {layers}: {model} has {spec.layers} layers; pass --layers {spec.layers} or fewer")
    for n in gpus or []:
        check_divisible(spec, n)
    return spec.layers


def run(layers: int = 12, new_tokens: int = 128, requests: int = 1024, gpu_memory: str = "16GiB",
        peer_batch: int = 16, peer_new_tokens: int = 8, profile: str | None = None, trace: str | None = None,
        validate_tokens: int = 16, progress: bool = True, model: str = DEFAULT_MODEL,
        routed_batches: list[int] | None = None, gpus: list[int] | None = None, weights: list[str] | None = None,
        cpu_memory: str = "80GiB") -> dict | None:
    """The whole comparison (one GPU run of a few minutes), with ``routed_batches`` the routed-streaming
    sweep, with ``gpus`` the GPU-count sweep (:mod:`.offload_gpus`; under torchrun: one count of it, the report
    on rank 0). Kernel autotuning is off unless HF_SCATTER_AUTOTUNE is set: the link bounds this workload, and
    tuning every shape would spend minutes compiling candidates."""
    from . import offload_formats, offload_gpus
    from .engines import under_torchrun

    published = check_flags(layers=layers, model=model, routed_batches=routed_batches, requests=requests, gpus=gpus,
                            weights=weights)
    saved = os.environ.get("HF_SCATTER_AUTOTUNE")
    os.environ.setdefault("HF_SCATTER_AUTOTUNE", "0")
    shared = dict(model=model, layers=layers, published_layers=published, new_tokens=new_tokens, requests=requests,
                  gpu_memory=gpu_memory, profile=profile, progress=progress)
    try:
        if gpus:
            return offload_gpus.run_counts(sorted(set(gpus)), trace=trace, **shared)
        if weights:
            return offload_formats.run_formats(list(dict.fromkeys(weights)), cpu_memory=cpu_memory, trace=trace,
                                               **shared)
        if under_torchrun():
            return offload_gpus.run_rank(trace=trace, **shared)
        if routed_batches:
            return _run_routed(layers, new_tokens, gpu_memory, profile, progress, model, published,
                               sorted(set(routed_batches)))
        return _run(layers, new_tokens, requests, gpu_memory, peer_batch, peer_new_tokens, profile, trace,
                    validate_tokens, progress, model, published)
    finally:
        if saved is None:
            os.environ.pop("HF_SCATTER_AUTOTUNE", None)


def _run(layers, new_tokens, requests, gpu_memory, peer_batch, peer_new_tokens, profile, trace, validate_tokens,
         progress, model_name, published_layers) -> dict:
    import hf_scatter
    from ..offload import ModelSpec, Workload, load_profile, parse_bytes, predict

    require_cuda()
    header = run_header()
    prof, profile_s = bench_profile(profile, model_name, progress)
    budget = parse_bytes(gpu_memory, "gpu_memory")
    start = time.perf_counter()
    model = build_model(layers, model=model_name)
    build_s = time.perf_counter() - start
    reqs = prompts(requests, model.config.vocab_size)
    lens = [len(r) for r in reqs]
    workload = Workload.from_prompts(lens, new_tokens)
    peer = run_accelerate(model, reqs[:peer_batch], budget, peer_new_tokens)
    spec = ModelSpec.from_config(model.config, name=f"{model_name} ({layers} of {published_layers} layers)")
    validation = validate_hrm(model, reqs, prof, spec, budget, validate_tokens) if validate_tokens else []

    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    start = time.perf_counter()
    offloaded = hf_scatter.offload_model(model, gpu_memory=budget, profile=prof, workload=workload, progress=progress)
    offload_s = time.perf_counter() - start
    policy = offloaded.policy
    ids, mask = left_padded(reqs)
    warm = min(len(reqs), policy.batch_size)
    offloaded.generate(ids[:warm], attention_mask=mask[:warm], max_new_tokens=3, progress=False)  # kernels
    result = offloaded.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True,
                                progress=progress, trace=trace)
    peak = torch.cuda.max_memory_allocated() - before
    stats = result.stats
    realised = dataclasses.replace(policy, weights_gpu_fraction=offloaded.store.layout.fraction, prediction=None)
    options = offloaded.cost_options
    predicted = {prof.name: predict(realised, spec, prof, workload, budget, offloaded.cpu_budget, options)}
    if prof.name != "h100-host-anchors":
        predicted["h100-host-anchors"] = predict(realised, spec, load_profile("h100-host-anchors"), workload, budget,
                                                 offloaded.cpu_budget, options)
    ours = stats["tokens_per_s"]
    main_prediction = predicted[prof.name]  # the profile the policy was planned with
    report = {
        **header, "model": model_name, "layers": layers, "published_layers": published_layers,
        "gpu_budget": budget, "cpu_budget": offloaded.cpu_budget,
        "workload": {"requests": requests, "prompt_lens": PROMPT_LENS, "mean_prompt": workload.prompt_len,
                     "new_tokens": new_tokens},
        "profile": prof.name, "profile_s": profile_s, "build_s": build_s, "offload_s": offload_s,
        "policy": policy.to_dict(), "policy_markdown": offloaded.describe(),
        "autotune": os.environ.get("HF_SCATTER_AUTOTUNE"),
        "weights_gpu_fraction": {"policy": policy.weights_gpu_fraction, "realised": offloaded.store.layout.fraction},
        "hf_scatter": {**{k: v for k, v in stats.items() if k != "trace"}, "max_memory_allocated": peak},
        "trace": stats.get("trace"),
        "accelerate": peer,
        "predicted": {k: {"tokens_per_s": p.tokens_per_s, "bottleneck": p.decode_layer.bottleneck,
                          "decode_layer_s": p.decode_layer.seconds, "decode_step_s": p.decode_step_s,
                          "prefill_s": p.prefill_s, "batch_s": p.batch_s} for k, p in predicted.items()},
        "decode_step_s": stats["decode_s"] / max(stats["decode_steps"], 1),
        "hrm_validation": validation + [_validation_row(
            "the policy the HRM chose (the run above)", budget, realised, stats, predicted[prof.name], layers)],
        # the whole model's throughput if decode and prefill time grow with the layer count (labelled: scaled)
        "full_model_tokens_per_s_scaled": ours * layers / published_layers,
        "speedup_vs_accelerate": ours / peer["tokens_per_s"],
        "fraction_of_prediction": ours / main_prediction.tokens_per_s,
        "within_budget": peak <= budget,
    }
    offloaded.close()
    return report


def _check_something_streams(offloaded, layers: int, gpu_memory: str) -> None:
    """A sweep where every streamed stage keeps its own GPU slot measures nothing: decode never reloads them."""
    from ..offload.runtime.paging import SLOTS

    streamed = len(offloaded.store.streamed_stages)
    if streamed <= SLOTS:
        offloaded.close()
        raise ValueError(f"--layers {layers} at --gpu-memory {gpu_memory} streams {streamed} stage(s), which stay in "
                         f"the {SLOTS} GPU slots: decode reloads no weights, so routed streaming has nothing to save; "
                         f"give more --layers or a smaller --gpu-memory")


def _run_routed(layers, new_tokens, gpu_memory, profile, progress, model_name, published_layers,
                batches: list[int]) -> dict:
    """When routed expert streaming pays: see the module docstring."""
    import hf_scatter
    from ..offload import ModelSpec, Workload, parse_bytes

    require_cuda()
    header = run_header()
    prof, _ = bench_profile(profile, model_name, progress)
    budget = parse_bytes(gpu_memory, "gpu_memory")
    model = build_model(layers, model=model_name)
    reqs = prompts(max(batches), model.config.vocab_size)
    workload = Workload.from_prompts([len(r) for r in reqs], new_tokens)
    spec = ModelSpec.from_config(model.config, name=f"{model_name} ({layers} of {published_layers} layers)")
    offloaded = hf_scatter.offload_model(model, gpu_memory=budget, profile=prof, workload=workload, progress=progress)
    _check_something_streams(offloaded, layers, gpu_memory)
    plan = {"cpu_budget": offloaded.cpu_budget, "policy": offloaded.policy.to_dict(),
            "weights_gpu_fraction": offloaded.store.layout.fraction}
    try:
        rows = [routed_row(offloaded, reqs[:n], prof, spec, budget, new_tokens) for n in batches]
    finally:
        offloaded.close()
    return {
        **header, "model": model_name, "layers": layers, "published_layers": published_layers, "gpu_budget": budget,
        "profile": prof.name, "new_tokens": new_tokens, "experts": spec.experts, "top_k": spec.top_k, **plan,
        "routed_sweep": rows,
        "pays_up_to": max([r["batch_size"] for r in rows if r["routed_pays"]], default=None),
        "hrm_agrees": sum(r["hrm_choice"] == ("routed" if r["routed_pays"] else "all") for r in rows),
    }


def routed_row(offloaded, batch: list[torch.Tensor], prof, spec, budget: int, new_tokens: int) -> dict:
    """One batch decoded both ways on ``offloaded``'s weight store: measured and predicted per-layer decode
    time, and the experts fetched per layer and step (uniform routing predicts ``spec.active_experts(n)``)."""
    from ..offload import Workload, predict
    from ..offload.plan.policy import Policy

    ids, mask = left_padded(batch)
    n = len(batch)
    workload = Workload.from_prompts([len(r) for r in batch], new_tokens)
    row = {"batch_size": n, "expected_experts": spec.active_experts(n)}
    for mode in ("all", "routed"):
        offloaded.expert_streaming = mode
        offloaded.generate(ids, attention_mask=mask, max_new_tokens=2, progress=False)  # kernels for this shape
        stats = offloaded.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=[],
                                   return_dict=True, progress=False).stats
        policy = Policy(stats["batch_size"], stats["micro_batch_size"],  # the batches the runtime ran
                        weights_gpu_fraction=offloaded.store.layout.fraction, routed_experts=mode == "routed")
        prediction = predict(policy, spec, prof, workload, budget, offloaded.cpu_budget, offloaded.cost_options)
        row[mode] = {"measured_layer_s": stats["decode_s"] / max(stats["decode_steps"], 1) / spec.layers,
                     "predicted_layer_s": prediction.decode_layer.seconds,
                     "predicted_bottleneck": prediction.decode_layer.bottleneck,
                     "tokens_per_s": stats["tokens_per_s"], "batches": stats["batches"],
                     "micro_batch_size": stats["micro_batch_size"],
                     "experts_per_layer_step": stats.get("routed_experts_per_layer_step")}
    measured = row["all"]["measured_layer_s"] / row["routed"]["measured_layer_s"]
    predicted = row["all"]["predicted_layer_s"] / row["routed"]["predicted_layer_s"]
    row.update(speedup=measured, predicted_speedup=predicted, routed_pays=measured > 1.0,
               hrm_choice="routed" if predicted > 1.0 else "all")
    return row


# ----------------------------------------------------------------------------- output
def to_markdown(report: dict) -> str:
    if "by_weights" in report:
        from . import offload_formats

        return offload_formats.to_markdown(report)
    if "by_gpus" in report:
        from . import offload_gpus

        return offload_gpus.to_markdown(report)
    if "routed_sweep" in report:
        return (f"{_shape(report)}, GPU budget {report['gpu_budget'] / 2**30:.0f} GiB, "
                f"{report['weights_gpu_fraction']:.1%} of every layer resident, {report['device']}\n\n"
                + routed_table(report))
    gib = 2**30
    peer, ours = report["accelerate"], report["hf_scatter"]
    rows = [
        [f"HF accelerate offload (B={peer['batch']}, {peer['new_tokens']} new tokens, "
         f"{peer['layers_on_gpu']}/{report['layers']} layers on GPU)", f"{peer['tokens_per_s']:,.1f}",
         f"{peer['max_memory_allocated'] / gib:.1f}", "1.0x"],
        [f"hf-scatter CGOPipe (N={ours['batch_size']}, mu={ours['micro_batch_size']}, "
         f"{report['workload']['new_tokens']} new tokens)", f"{ours['tokens_per_s']:,.1f}",
         f"{ours['max_memory_allocated'] / gib:.1f}", f"{report['speedup_vs_accelerate']:.1f}x"],
    ]
    for name, p in report["predicted"].items():
        rows.append([f"HRM prediction for this policy ({name})", f"{p['tokens_per_s']:,.1f}", "", ""])
    table = markdown_table(["system", "tokens/s", "GPU peak GiB", "vs accelerate"], rows)
    first = next(iter(report["predicted"].values()))
    lines = [f"{_shape(report)}, GPU budget {report['gpu_budget'] / gib:.0f} GiB, "
             f"{report['workload']['requests']} requests of {report['workload']['mean_prompt']:.0f} prompt tokens "
             f"(mean), {report['device']}", "", table, "",
             f"measured / predicted: {report['fraction_of_prediction']:.0%}; decode step "
             f"{report['decode_step_s']:.3f} s measured vs {first['decode_step_s']:.3f} s predicted; prefill "
             f"{ours['prefill_s']:.1f} s vs {first['prefill_s']:.1f} s; GPU memory within budget: "
             f"{report['within_budget']}"]
    if report.get("full_model_tokens_per_s_scaled") is not None and report["layers"] < report["published_layers"]:
        lines.append(f"all {report['published_layers']} layers, scaled by layers from this run (not measured): "
                     f"{report['full_model_tokens_per_s_scaled']:,.1f} tokens/s")
    trace = report.get("trace")
    if trace and trace.get("weight_transfer_overlap") is not None:
        lines.append(f"weight transfer overlapped with GPU or CPU compute: {trace['weight_transfer_overlap']:.0%} of "
                     f"{trace['weight_transfer_s']:.1f} s; compute under a transfer: "
                     f"{trace.get('compute_under_transfer') or 0:.0%} of {trace.get('compute_s', 0):.1f} s; link busy "
                     f"{trace['weight_transfer_s'] / (trace['span_s'] or 1):.0%} of the run (trace: {trace['path']})")
        if trace.get("prefill_s"):
            busy = trace["prefill_busy_s"]
            lines.append(f"prefill {trace['prefill_s']:.2f} s: GPU compute busy {busy['GPU compute']:.2f} s, weights "
                         f"arriving {busy['H2D weights']:.2f} s, prompt KV stores {busy['CPU attention']:.2f} s")
    if report.get("hrm_validation"):
        lines += ["", "HRM validation: per-layer decode time, predicted against measured", "",
                  validation_markdown(report["hrm_validation"])]
    lines += ["", report["policy_markdown"]]
    return "\n".join(lines)


def _shape(report: dict) -> str:
    """'qwen3-30b-a3b shape, 24 of 48 layers' (reports from before ``--model`` are Mixtral-8x7B's)."""
    return (f"{report.get('model', DEFAULT_MODEL)} shape, {report['layers']} of {report.get('published_layers', 32)} "
            "layers")


def validation_markdown(rows: list[dict]) -> str:
    table = [[r["what"], f"{r['batch_size']} / {r['micro_batch_size']}", f"{r['weights_gpu_fraction']:.1%}",
              f"{r['gpu_budget'] / 2**30:.1f}", f"{r['measured_layer_s'] * 1e3:.2f}",
              f"{r['predicted_layer_s'] * 1e3:.2f}", r["predicted_bottleneck"], f"{r['error']:+.0%}"] for r in rows]
    return markdown_table(["policy", "N / mu", "weights on GPU", "GPU GiB", "measured ms/layer",
                           "predicted ms/layer", "predicted bottleneck", "error"], table)


def throughput_table(report: dict) -> str:
    """The docs' view of a ``bench offload`` report: the peer, hf-scatter and the HRM's predictions, tokens/s."""
    gib = 2**30
    peer, ours = report["accelerate"], report["hf_scatter"]
    rows = [[f"HF accelerate offload (`infer_auto_device_map` + `dispatch_model`, B={peer['batch']}, "
             f"{peer['new_tokens']} new tokens, {peer['layers_on_gpu']} of {report['layers']} layers on the GPU)",
             f"{peer['tokens_per_s']:,.1f}", f"{peer['max_memory_allocated'] / gib:.1f}", "1.0x"],
            [f"hf-scatter CGOPipe (N={ours['batch_size']}, mu={ours['micro_batch_size']}, "
             f"{ours['weights_gpu_fraction']:.1%} of every layer resident, "
             f"{report['workload']['new_tokens']} new tokens)",
             f"{ours['tokens_per_s']:,.1f}", f"{ours['max_memory_allocated'] / gib:.1f}",
             f"{report['speedup_vs_accelerate']:.0f}x"]]
    for name, p in report["predicted"].items():
        rows.append([f"HRM prediction for that policy, profile `{name}`", f"{p['tokens_per_s']:,.1f}", "", ""])
    return markdown_table(["system", "tokens/s", "GPU peak GiB", "vs accelerate"], rows)


def routed_table(report: dict) -> str:
    """Routed expert streaming against every expert streamed, per batch size: measured and predicted."""
    rows = []
    for r in report["routed_sweep"]:
        a, b = r["all"], r["routed"]
        fetched = b["experts_per_layer_step"]
        rows.append([r["batch_size"], f"{'n/a' if fetched is None else f'{fetched:.1f}'} / {r['expected_experts']:.1f}",
                     f"{a['measured_layer_s'] * 1e3:.2f} / {a['predicted_layer_s'] * 1e3:.2f}",
                     f"{b['measured_layer_s'] * 1e3:.2f} / {b['predicted_layer_s'] * 1e3:.2f}",
                     f"{r['speedup']:.2f}x / {r['predicted_speedup']:.2f}x", r["hrm_choice"]])
    return markdown_table(["rows N", f"experts fetched per layer (of {report['experts']}): measured / uniform",
                           "every expert: ms/layer measured / predicted", "routed: ms/layer measured / predicted",
                           "routed speed-up measured / predicted", "HRM picks"], rows)


def validation_table(report: dict) -> str:
    """The HRM validation of a ``bench offload`` report: per-layer decode time, predicted against measured."""
    return validation_markdown(report["hrm_validation"])


def policy_table(report: dict) -> str:
    """The plan the run used, as ``hf-scatter plan`` prints it (the HRM's prediction, stored with the report)."""
    return report["policy_markdown"].split("\n\n")[0]


def runtime_table(report: dict) -> str:
    """What the runtime realised of that plan, as ``OffloadedModel.describe()`` prints it."""
    return report["policy_markdown"].split("\n\n")[1]


def profile_table(profile: dict) -> str:
    """A hardware profile as ``hf-scatter profile --out`` writes it (the JSON ``bench offload --profile`` reads):
    every measured term in the units people quote; unmeasured terms are left out."""
    def eff(points):
        return ", ".join(f"{m:g}: {e:.2f}" for m, e in points)

    terms = [("gpu_flops", "bf16 matmul 8192^3, TFLOP/s", lambda x: f"{x / 1e12:.0f}"),
             ("gpu_bandwidth", "device-to-device copy, GB/s (read + write)", lambda x: f"{x / 1e9:.0f}"),
             ("gpu_attention_bandwidth", "decode SDPA, GB/s of KV", lambda x: f"{x / 1e9:.0f}"),
             ("gpu_launch_s", _launch_what(profile), lambda x: f"{x * 1e6:.1f}"),
             ("gemm_efficiency", "GEMM efficiency by rows", eff),
             ("moe_efficiency", "MoE expert kernels' efficiency by rows per expert", eff),
             ("h2d_pinned", "host->device pinned, GB/s", lambda x: f"{x / 1e9:.1f}"),
             ("h2d_pageable", "host->device pageable, GB/s", lambda x: f"{x / 1e9:.1f}"),
             ("d2h_pinned", "device->host pinned, GB/s", lambda x: f"{x / 1e9:.1f}"),
             ("d2h_pageable", "device->host pageable, GB/s", lambda x: f"{x / 1e9:.1f}"),
             ("duplex_pinned", "both directions at once, GB/s", lambda x: f"{x / 1e9:.1f}"),
             ("transfer_latency_s", "one 4 KiB pinned copy, us", lambda x: f"{x * 1e6:.1f}"),
             ("cpu_flops_fp32", "CPU matmul 2048^3 fp32, GFLOP/s", lambda x: f"{x / 1e9:.0f}"),
             ("cpu_flops_bf16", "CPU matmul 2048^3 bf16, GFLOP/s", lambda x: f"{x / 1e9:.0f}"),
             ("cpu_bandwidth", "CPU copy, GB/s (read + write)", lambda x: f"{x / 1e9:.0f}"),
             ("host_dram_bandwidth", "CPU copies beside pinned host->device copies, GB/s of both",
              lambda x: f"{x / 1e9:.0f}"),
             ("cpu_op_s", "one small torch op on the CPU, us", lambda x: f"{x * 1e6:.1f}"),
             ("cpu_attention", "CPU decode attention (requests x context: ms)",
              lambda pts: ", ".join(f"{p['batch']} x {p['context']}: {p['seconds'] * 1e3:.2f}" for p in pts)),
             ("gpu_memory", "GPU memory, GiB", lambda x: f"{x / 2**30:.0f}"),
             ("cpu_memory", "host memory, GiB", lambda x: f"{x / 2**30:.0f}"),
             ("cpu_cores", "CPU cores", str)]
    rows = [[f"`{key}`", what, show(profile[key])] for key, what, show in terms if profile.get(key) is not None]
    return markdown_table(["field", "what", "measured"], rows)


def _launch_what(profile: dict) -> str:
    """What a profile's launch cost measured: profiles before 2026-11-28 timed one small module call."""
    if "decode stage" in profile.get("notes", {}).get("gpu_launch_s", ""):
        return "host time per kernel the planner counts, issuing the runtime's decode stages, us"
    return "host time of one small `nn.Linear` call, us"


def plot(report: dict, path: str) -> None:
    """Throughput bars (log scale) and, with a trace, how busy each lane of the pipeline was (the routed sweep:
    per-layer decode time by batch size, both ways, measured and predicted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "routed_sweep" in report:
        return _plot_routed(report, path, plt)
    if "by_gpus" in report:
        from . import offload_gpus

        return offload_gpus.plot(report, path)
    if "by_weights" in report:
        from . import offload_formats

        return offload_formats.plot(report, path)

    trace = report.get("trace")
    validation = report.get("hrm_validation")
    panels = 1 + bool(trace) + bool(validation)
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 3.8), squeeze=False)
    ax = axes[0][0]
    names = ["HF accelerate", "hf-scatter"] + [f"HRM ({k})" for k in report["predicted"]]
    values = [report["accelerate"]["tokens_per_s"], report["hf_scatter"]["tokens_per_s"]] + \
             [p["tokens_per_s"] for p in report["predicted"].values()]
    colors = ["tab:gray", "tab:orange"] + ["tab:blue"] * len(report["predicted"])
    ax.bar(names, values, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel("generated tokens/s (log)")
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=8)
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    ax.set_title(f"{_shape(report)}, {report['gpu_budget'] / 2**30:.0f} GiB GPU", fontsize=10)
    if trace:
        ax = axes[0][1]
        lanes = list(trace["busy_s"])
        span = trace["span_s"] or 1.0
        ax.barh(lanes, [trace["busy_s"][k] / span for k in lanes], color="tab:green")
        ax.set_xlim(0, 1)
        ax.invert_yaxis()
        ax.set_xlabel("busy fraction of the traced run")
        hidden = trace.get("compute_under_transfer")
        ax.set_title("pipeline lanes" + (f" ({hidden:.0%} of compute under a weight transfer)"
                                         if hidden is not None else ""), fontsize=10)
    if validation:
        ax = axes[0][-1]
        measured = [r["measured_layer_s"] * 1e3 for r in validation]
        predicted = [r["predicted_layer_s"] * 1e3 for r in validation]
        low, top = min(measured + predicted) / 1.5, max(measured + predicted) * 1.5
        ax.fill_between([low, top], [low * 0.75, top * 0.75], [low * 1.25, top * 1.25], color="tab:blue", alpha=0.12,
                        label="+-25%")
        ax.plot([low, top], [low, top], color="tab:blue", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        from matplotlib.ticker import FuncFormatter, NullFormatter

        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            axis.set_minor_formatter(NullFormatter())
        ax.scatter(measured, predicted, color="tab:orange", zorder=3)
        for i, (m, p) in enumerate(zip(measured, predicted)):
            ax.annotate(f"N={validation[i]['batch_size']}/{validation[i]['micro_batch_size']}, "
                        f"{validation[i]['weights_gpu_fraction']:.0%} res.", (m, p), fontsize=7,
                        xytext=(4, -10), textcoords="offset points")
        ax.set_xlim(low, top)
        ax.set_ylim(low, top)
        ax.set_xlabel("measured decode ms per layer")
        ax.set_ylabel("HRM predicted ms per layer")
        ax.set_title("HRM validation", fontsize=10)
        ax.legend(fontsize=8, loc="upper left")
    _save(fig, path)


def _save(fig, path: str) -> None:
    fig.tight_layout()
    save_figure(fig, path)


def _plot_routed(report: dict, path: str, plt) -> None:
    rows = report["routed_sweep"]
    n = [r["batch_size"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for mode, color, label in (("all", "tab:gray", "every expert streamed"), ("routed", "tab:orange",
                                                                             "only the routed experts")):
        ax.plot(n, [r[mode]["measured_layer_s"] * 1e3 for r in rows], "o-", color=color, label=f"{label}, measured")
        ax.plot(n, [r[mode]["predicted_layer_s"] * 1e3 for r in rows], "x--", color=color,
                label=f"{label}, HRM")
    ax.set_xscale("log", base=2)
    ax.set_xticks(n, [str(v) for v in n])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("rows in the decode batch")
    ax.set_ylabel("decode ms per layer")
    ax.set_title(f"{_shape(report)}, {report['experts']} experts, top-{report['top_k']}, "
                 f"{report['weights_gpu_fraction']:.0%} resident", fontsize=10)
    ax.legend(fontsize=8)
    _save(fig, path)
