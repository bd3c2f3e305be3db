"""`hf-scatter bench moe`: one SMoE SwiGLU layer, hf-scatter against every peer in one process.

Peers: transformers' own experts module of the family (Mixtral's, or GPT-OSS's with biases and its clamped
gate) with ``experts_implementation`` eager / grouped_mm / batched_mm; Liger-Kernel's fused MoE
(``LigerFusedMoEFunction``, the same [E, 2I, H] layout; its autotuner on unless ``--liger-autotune off``);
SonicMoE (PyPI ``sonic-moe``: QuACK's CuTe DSL grouped GEMMs with the SwiGLU in the first GEMM's epilogue,
Hopper or newer, its own autotuner on) where it imports; and a dense SwiGLU MLP with the same active FLOPs
((k + shared) x d_expert hidden units) as the practical ceiling. Shared experts (DeepSeek) are one dense
SwiGLU added to every implementation alike. Reports median ms, achieved TFLOP/s, peak extra memory for
forward (inference) and forward+backward, and how long each implementation's first call took (Triton
compilation and autotuning included).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
from typing import Callable
from unittest import mock

import torch
import torch.nn.functional as F

from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.shapes import MIXTRAL_8X7B, MOE_BLOCKS, moe_block
from ..common.timing import captured_graph, is_oom, median_ms, peak_extra_gib, run_header
from .availability import check_names, require_cuda


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    tokens: int
    backward: bool = True
    shared_experts: int = 0  # always-on experts of the same size (DeepSeek), run densely beside the routed ones
    family: str = "mixtral"  # transformers experts class: "mixtral" (plain SwiGLU) or "gpt_oss" (biases, clamp)

    def active_flops(self) -> float:
        return 6.0 * self.tokens * (self.top_k + self.shared_experts) * self.hidden * self.intermediate


_MIXTRAL = tuple(MIXTRAL_8X7B[k] for k in ("hidden", "intermediate", "experts", "top_k"))


def _block(name: str, tokens: int, **extra) -> MoEConfig:
    return MoEConfig(**MOE_BLOCKS[name], tokens=tokens, **extra)


CONFIGS = {
    "paper-unit": MoEConfig(4096, 2048, 32, 4, 61440),
    "mixtral-prefill": MoEConfig(*_MIXTRAL, 8192),
    "fine-grained": MoEConfig(4096, 1024, 64, 8, 16384),
    "qwen3-30b-a3b": _block("qwen3-30b-a3b", 16384),
    "olmoe-1b-7b": _block("olmoe-1b-7b", 16384),
    "deepseek-v2-lite": _block("deepseek-v2-lite", 16384),
    "gpt-oss-20b": _block("gpt-oss-20b", 16384),
    "gpt-oss-20b-bias": _block("gpt-oss-20b", 16384, family="gpt_oss"),
    "mixtral-decode": MoEConfig(*_MIXTRAL, 64, backward=False),
    "qwen3-decode": _block("qwen3-30b-a3b", 64, backward=False),
    # Qwen3-30B-A3B's layer in inference (the FP8 release's experts are frozen): a prefill chunk
    "qwen3-prefill": _block("qwen3-30b-a3b", 8192, backward=False),
    # GPT-OSS-120B's layer as it ships (MXFP4 experts): inference only, as its quantized experts are frozen
    "gpt-oss-120b-decode": MoEConfig(**moe_block("gpt-oss-120b"), tokens=64, backward=False, family="gpt_oss"),
    "gpt-oss-120b-prefill": MoEConfig(**moe_block("gpt-oss-120b"), tokens=8192, backward=False, family="gpt_oss"),
}
IMPLS = ("hf-eager", "hf-grouped_mm", "hf-batched_mm", "liger", "sonicmoe", "hf-scatter", "hf-scatter-mxfp4",
         "hf-scatter-fp8", "hf-scatter-fp8-w8a16", "dense")
_NO_FP8 = ("n/a: 128 x 128 block-scaled FP8 weights as DeepSeek-V3 and Qwen3-FP8 ship them, for SwiGLU layers "
           "(dimensions multiples of 128) in inference (the quantized experts are frozen)")


def hf_experts(cfg: MoEConfig, device, dtype):
    """transformers' experts module of the config's family, random weights at the usual init scale."""
    if cfg.family == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        config = GptOssConfig(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                              num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k)
        experts = GptOssExperts(config).to(device=device, dtype=dtype)
    else:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts

        config = MixtralConfig(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                               num_local_experts=cfg.experts, num_experts_per_tok=cfg.top_k)
        experts = MixtralExperts(config).to(device=device, dtype=dtype)
    fan_in = {"gate_up_proj": cfg.hidden, "down_proj": cfg.intermediate}
    with torch.no_grad():
        for name, p in experts.named_parameters():
            if name.endswith("_bias"):
                p.normal_(std=0.02)
            else:
                p.normal_(std=fan_in[name] ** -0.5)
    experts.mxfp4 = experts.fp8 = None
    if cfg.family == "gpt_oss" and cfg.hidden % 32 == 0 and cfg.intermediate % 32 == 0:
        experts.mxfp4 = _as_shipped(experts)  # GPT-OSS ships MXFP4: every implementation reads those values
    elif not cfg.backward and cfg.hidden % 128 == 0 and cfg.intermediate % 128 == 0:
        experts.fp8 = _as_shipped(experts, "fp8")  # as an FP8 release ships them: the same values everywhere
    return experts


def _as_shipped(experts, form: str = "mxfp4") -> tuple:
    """Experts quantized as checkpoints ship them (GPT-OSS's MXFP4, or 128 x 128 block-scaled FP8; one expert
    at a time), their float weights set to the quantized values, so the bf16 implementations and
    ``hf-scatter-<form>`` compute with the same numbers."""
    from ..kernels import fp8_blocks, mxfp4

    quantize_experts = (mxfp4 if form == "mxfp4" else fp8_blocks).quantize_experts
    packed = []
    with torch.no_grad():
        for w in (experts.gate_up_proj, experts.down_proj):
            w = w if experts.is_transposed else w.transpose(1, 2)  # [E, in, out]
            packed.append(quantize_experts(w))
            w.copy_(packed[-1].dequantize(w.dtype))
    return tuple(packed)


def _liger_experts(cfg: MoEConfig, experts, autotune: bool) -> Callable | str:
    """Liger's fused MoE over the same weights, or why it cannot run this config."""
    if cfg.family != "mixtral":
        return "n/a: no biases or clamped gate"
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "1" if autotune else "0")  # read once, at import
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
    except ImportError:
        return "not installed (pip install liger-kernel)"

    def run(x, idx, gates):
        return LigerFusedMoEFunction.apply(x, experts.gate_up_proj, experts.down_proj, idx.to(torch.int32), gates)

    return run


def _sonicmoe_import_failure(error: BaseException) -> str:
    """Why SonicMoE did not import, with the fix where it is a known install mistake: the CuTe DSL's ``cutlass``
    package lives in ``nvidia_cutlass_dsl/python_packages``, which only its ``.pth`` file puts on the path, and
    ``pip install --target`` (how a wheel set is unpacked beside a read-only environment) skips ``.pth`` files."""
    reason = f"not importable ({type(error).__name__}: {(str(error).splitlines() or [''])[0][:160]})"
    if isinstance(error, ModuleNotFoundError) and error.name == "cutlass":
        for folder in sys.path:
            packages = os.path.join(folder or ".", "nvidia_cutlass_dsl", "python_packages")
            if os.path.isdir(os.path.join(packages, "cutlass")):
                return (f"{reason}; nvidia-cutlass-dsl is installed but its .pth was not read: add {packages} "
                        "to PYTHONPATH")
    return reason


def _sonicmoe_experts(cfg: MoEConfig, experts) -> Callable | str:
    """SonicMoE's general-routing entry point over the same weights (views, no copies), or why it cannot run."""
    if cfg.family != "mixtral":
        return "n/a: no clamped gate"
    device = experts.gate_up_proj.device
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return "n/a: needs a Hopper or newer GPU"
    try:
        from sonicmoe import moe_general_routing_inputs
        from sonicmoe.enums import ActivationType
    except Exception as error:  # noqa: BLE001 - its CuTe DSL stack fails in many ways; the reason is the result
        return _sonicmoe_import_failure(error)

    def run(x, idx, gates):
        tokens, top_k = idx.shape
        token_idxs = torch.arange(tokens, device=x.device, dtype=torch.int32).repeat_interleave(top_k)  # [T*k]
        out, _ = moe_general_routing_inputs(
            x, gates.reshape(-1), token_idxs, idx.reshape(-1).to(torch.int32),
            experts.gate_up_proj.permute(1, 2, 0),  # [E, 2I, H] -> [2I, H, E], [gate; up] halves
            None, experts.down_proj.permute(1, 2, 0), None,  # [E, H, I] -> [H, I, E]
            E=cfg.experts, stream_id=torch.cuda.current_stream().cuda_stream,
            activation_type=ActivationType.SWIGLU, is_inference_mode_enabled=not torch.is_grad_enabled(),
            concat_layout=True)
        return out

    return run


def _dense_swiglu(units: int, hidden: int, device, dtype) -> tuple[Callable, list]:
    up = torch.randn(2 * units, hidden, device=device, dtype=dtype) * hidden ** -0.5
    down = torch.randn(hidden, units, device=device, dtype=dtype) * units ** -0.5

    def mlp(x):
        gate, value = F.linear(x, up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * value, down)

    return mlp, [up, down]


def _implementations(cfg: MoEConfig, experts, device, dtype, liger_autotune: bool = True
                     ) -> dict[str, tuple[Callable, list] | str]:
    """Each implementation as (fn(x, idx, gates) -> y, its parameters), or a string saying why it cannot run."""
    from ..models.experts import SCATTERMOE
    from ..moe import glu_experts

    def hf(name):
        def run(x, idx, gates):
            experts.config._experts_implementation = name
            return experts(x, idx, gates)
        return run

    def ours_plain(x, idx, gates):
        return glu_experts(x, experts.gate_up_proj, experts.down_proj, idx, gates, validate=False)

    def ours_mxfp4(x, idx, gates):
        from ..models.mxfp4_experts import gpt_oss_mxfp4_experts

        return gpt_oss_mxfp4_experts(x, *experts.mxfp4, experts.gate_up_proj_bias, experts.down_proj_bias,
                                     float(experts.alpha), float(experts.limit), idx, gates)

    def ours_fp8(x, idx, gates):
        from ..moe.mlp import FusedSwiGLU, expert_mlp

        return expert_mlp(x, (experts.fp8[0],), experts.fp8[1], idx, gates, FusedSwiGLU(), validate=False)

    def ours_fp8_w8a16(x, idx, gates):
        # FP8 weights converted in registers at every size (W8A16), beside the default's FP8 products
        with mock.patch.dict(os.environ, HF_SCATTER_FP8_PRODUCTS="0"):
            return ours_fp8(x, idx, gates)

    expert_params = list(experts.parameters())
    routed: dict[str, Callable | str] = {
        "hf-eager": hf("eager"), "hf-grouped_mm": hf("grouped_mm"), "hf-batched_mm": hf("batched_mm"),
        "liger": _liger_experts(cfg, experts, liger_autotune),
        "sonicmoe": _sonicmoe_experts(cfg, experts),
        # the experts backend for families with their own gate; the SwiGLU experts directly otherwise
        "hf-scatter": ours_plain if cfg.family == "mixtral" else hf(SCATTERMOE),
        "hf-scatter-mxfp4": (ours_mxfp4 if experts.mxfp4 is not None and not cfg.backward else
                             "n/a: MXFP4 weights as GPT-OSS ships them, for GPT-OSS layers (dimensions multiples of "
                             "32) in inference (the quantized experts are frozen)"),
        "hf-scatter-fp8": ours_fp8 if experts.fp8 is not None else _NO_FP8,
        "hf-scatter-fp8-w8a16": ours_fp8_w8a16 if experts.fp8 is not None else _NO_FP8,
    }
    dense, dense_params = _dense_swiglu((cfg.top_k + cfg.shared_experts) * cfg.intermediate, cfg.hidden, device,
                                        dtype)
    table: dict[str, tuple[Callable, list] | str] = {"dense": (lambda x, idx, gates: dense(x), dense_params)}
    shared, shared_params = (_dense_swiglu(cfg.shared_experts * cfg.intermediate, cfg.hidden, device, dtype)
                             if cfg.shared_experts else (None, []))
    for name, fn in routed.items():
        if isinstance(fn, str):
            table[name] = fn
        elif shared is None:
            table[name] = (fn, expert_params)
        else:
            table[name] = (lambda x, idx, gates, fn=fn: fn(x, idx, gates) + shared(x), expert_params + shared_params)
    return table


@contextlib.contextmanager
def _grad_leaves(leaves: list[torch.Tensor]):
    """The inputs and parameters a fwd+bwd differentiates, requiring grad inside and left clean after."""
    for t in leaves:
        t.requires_grad_(True)
    try:
        yield leaves
    finally:
        for t in leaves:
            t.grad = None
            t.requires_grad_(False)


def _measure(fn, params, x, idx, gates, dy, backward: bool) -> dict:
    out = {}
    with torch.no_grad():
        out["fwd_ms"] = median_ms(lambda: fn(x, idx, gates))
        out["fwd_peak_gib"] = peak_extra_gib(lambda: fn(x, idx, gates))
    if backward:
        def step():
            fn(x, idx, gates).backward(dy)

        with _grad_leaves([x, gates, *params]) as leaves:
            out["fwdbwd_ms"] = median_ms(step, grad_to_none=leaves)
            for t in leaves:
                t.grad = None
            out["fwdbwd_peak_gib"] = peak_extra_gib(step)
    return out


def routed_batch(tokens: int, hidden: int, experts: int, top_k: int, device, dtype):
    """One SMoE layer's inputs: random activations, renormalised top-k routing, an output gradient."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    gates, idx = torch.softmax(torch.randn(tokens, experts, device=device), -1).topk(top_k, -1)
    return x, idx, gates / gates.sum(-1, keepdim=True), torch.randn_like(x)


def _first_call_s(fn, params, x, idx, gates, dy, backward: bool) -> float:
    """Seconds of the implementation's first call (forward, and backward where measured): what a user waits
    for at the first step, Triton compilation and autotuning included."""
    with _grad_leaves([x, gates, *params] if backward else []):
        torch.cuda.synchronize()
        start = time.perf_counter()
        if backward:
            fn(x, idx, gates).backward(dy)
        else:
            with torch.no_grad():
                fn(x, idx, gates)
        torch.cuda.synchronize()
        return time.perf_counter() - start


# Implementations whose forward records into a CUDA graph (no host syncs): their GPU time alone is measurable.
_GRAPHABLE = ("hf-grouped_mm", "liger", "sonicmoe", "hf-scatter", "hf-scatter-mxfp4", "hf-scatter-fp8",
              "hf-scatter-fp8-w8a16", "dense")


def _call_costs(impl: str, fn, x, idx, gates, calls: int = 100) -> dict:
    """Where a decode-sized forward's time goes: host time to issue one call (no sync in between), GPU time
    of one call replayed from a CUDA graph (kernels back to back), and kernel launches per call. When the
    host time exceeds the GPU time, the call is bound by the host, whatever its kernels do."""
    from torch.profiler import ProfilerActivity, profile

    out = {}
    with torch.no_grad():
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn(x, idx, gates)
        out["host_ms"] = (time.perf_counter() - start) / calls * 1e3
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                fn(x, idx, gates)
            torch.cuda.synchronize()
        out["launches"] = sum(e.count for e in prof.key_averages() if e.device_time_total > 0) / 10
        if impl in _GRAPHABLE:
            try:
                graph = captured_graph(lambda: fn(x, idx, gates))
            except Exception as error:  # noqa: BLE001 - a host sync inside the call: no GPU-only time, said so
                torch.cuda.synchronize()
                out["gpu_ms_error"] = f"no CUDA graph of the call: {str(error).splitlines()[0][:160]}"
            else:
                out["gpu_ms"] = median_ms(graph.replay)
                del graph
    return out


def run_config(name: str, cfg: MoEConfig, impls=IMPLS, dtype=torch.bfloat16, seed: int = 0,
               liger_autotune: bool = True) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(seed)
    experts = hf_experts(cfg, device, dtype)
    x, idx, gates, dy = routed_batch(cfg.tokens, cfg.hidden, cfg.experts, cfg.top_k, device, dtype)
    table = _implementations(cfg, experts, device, dtype, liger_autotune)
    results: dict[str, dict] = {"config": dataclasses.asdict(cfg)}
    with torch.no_grad():  # every implementation's output against transformers' eager loop, same weights
        ref = table["hf-eager"][0](x, idx, gates).float()
    for impl in impls:
        entry = table[impl]
        if isinstance(entry, str):
            results[impl] = r = {"error": entry}
            print(f"  {name:16s} {impl:14s} {json.dumps(r)}", flush=True)
            continue
        fn, params = entry
        r = {}
        try:
            r["first_call_s"] = _first_call_s(fn, params, x, idx, gates, dy, cfg.backward)
            if impl != "dense":
                with torch.no_grad():
                    r["rel_err_vs_eager"] = ((fn(x, idx, gates).float() - ref).norm() / ref.norm()).item()
            r.update(_measure(fn, params, x, idx, gates, dy, cfg.backward))
            if not cfg.backward:
                r.update(_call_costs(impl, fn, x, idx, gates))
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
    parser.add_argument("--impls", nargs="*", metavar="IMPL", default=list(IMPLS),
                        help=f"subset of {', '.join(IMPLS)} (default: all; hf-eager always runs once as the "
                             "correctness reference)")
    parser.add_argument("--liger-autotune", choices=("on", "off"), default="on",
                        help="Liger's own autotuner (its default: on; minutes per shape)")


def run(configs=None, impls=IMPLS, liger_autotune="on") -> dict:
    require_cuda()
    names = configs or list(CONFIGS)
    check_names("config", names, CONFIGS)
    check_names("implementation", impls, IMPLS)
    report = {**run_header(), "liger_autotune": liger_autotune, "results": {}}
    for name in names:
        report["results"][name] = run_config(name, CONFIGS[name], impls, liger_autotune=liger_autotune == "on")
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
                rows.append([name, impl, r["error"], "", "", "", "", "", ""])
                continue
            ratio = f"{r['fwdbwd_ms'] / dense['fwdbwd_ms']:.2f}" if "fwdbwd_ms" in r and "fwdbwd_ms" in dense else ""
            rows.append([name, impl, f"{r['fwd_ms']:.2f}", f"{r['fwd_tflops']:.0f}", f"{r['fwd_peak_gib']:.2f}",
                         f"{r['fwdbwd_ms']:.2f}" if "fwdbwd_ms" in r else "",
                         f"{r['fwdbwd_peak_gib']:.2f}" if "fwdbwd_peak_gib" in r else "", ratio,
                         f"{r['first_call_s']:.1f}" if "first_call_s" in r else ""])
    return markdown_table(["config", "impl", "fwd ms", "fwd TFLOP/s", "fwd peak GiB", "fwd+bwd ms",
                           "fwd+bwd peak GiB", "fwd+bwd / dense", "first call s"], rows)


def call_costs_table(report: dict) -> str:
    """Decode-sized calls: the event-timed call beside its host issue time, its GPU time alone and its launches."""
    rows = []
    for name, res in report["results"].items():
        for impl in IMPLS:
            r = res.get(impl, {})
            if "host_ms" not in r:
                continue
            impl_name = f"**{impl}**" if impl == "hf-scatter" else impl
            gpu = f"{r['gpu_ms']:.3f}" if "gpu_ms" in r else ""
            rows.append([name, impl_name, f"{r['fwd_ms']:.3f}", f"{r['host_ms']:.3f}", gpu, f"{r['launches']:.0f}"])
    return markdown_table(["config", "impl", "call ms", "host ms per call", "GPU ms per call", "launches"], rows)


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
        measured = False
        for i, impl in enumerate(IMPLS):
            values = [report["results"][n].get(impl, {}).get(key, float("nan")) for n in names]
            ax.bar([j + i * width for j in range(len(names))], values, width, label=impl)
            measured = measured or any(v > 0 for v in values)  # NaN compares False
        ax.set_xticks([j + width * (len(IMPLS) - 1) / 2 for j in range(len(names))], names, fontsize=8)
        ax.set_title(title if measured else f"{title}: not measured (inference configs)")
        if measured:
            ax.set_yscale("log")
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(f"SMoE SwiGLU layer, bf16, {report['device']} (lower is better; missing bar = OOM or n/a)")
    fig.tight_layout()
    save_figure(fig, path)
