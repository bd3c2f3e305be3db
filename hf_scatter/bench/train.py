"""`hf-scatter bench train`: whole training steps of ~1-2B MoE models of each family hf-scatter patches.

Mixtral and DBRX at the ScatterMoE paper's 1.5B configuration; Qwen3-MoE, GPT-OSS and DeepSeek-V3 at the
real families' proportions (:data:`FAMILY_SHAPES`). Vanilla (transformers' grouped_mm / eager experts),
Liger-Kernel's patch for the family (``apply_liger_kernel_to_<family>``, its defaults: RMSNorm, RoPE,
SwiGLU / fused experts, fused linear cross-entropy) and hf-scatter's patch, in one process, from one seed
and on the same random tokens. Reports tokens/s (median step), peak memory (weights, gradients and optimizer
states included) and the first-step loss (patched must equal vanilla within bf16 noise), plus a
per-category GPU time breakdown of one step.

``--fsdp`` runs every variant under PyTorch FSDP2 with world size 1 (``fully_shard`` per decoder layer and
on the model, after the patch; bf16 parameters, float32 gradient reduction): what the sharding wrapper
costs each variant, measured on one GPU, next to the same command without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import statistics
from typing import Callable

import torch

from ..common.argtypes import positive_int
from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.timing import run_header
from .availability import check_names, require_cuda


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    hidden: int = 1024
    intermediate: int = 3584
    experts: int = 8
    top_k: int = 2
    layers: int = 16
    heads: int = 16
    kv_heads: int = 8
    vocab: int = 32000
    batch: int = 4
    seq: int = 2048
    shared_experts: int = 0  # DeepSeek's shared experts (each of the routed experts' size)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


PAPER_1P5B = TrainConfig()
SMOKE = TrainConfig(hidden=64, intermediate=96, experts=4, layers=2, heads=4, kv_heads=2, vocab=384, batch=2, seq=16)
# The fine-grained families at ~1-2B with their real proportions (d_expert / d, E, k, shared experts).
FAMILY_SHAPES = {
    "mixtral": PAPER_1P5B, "dbrx": PAPER_1P5B,
    "qwen3_moe": TrainConfig(intermediate=384, experts=64, top_k=8, kv_heads=4),
    "gpt_oss": TrainConfig(intermediate=1024, experts=32, top_k=4),
    "deepseek_v3": TrainConfig(intermediate=384, experts=64, top_k=8, shared_experts=2),  # MLA: kv_heads = heads
}
IMPLS = ("mixtral-grouped_mm", "mixtral-eager", "mixtral-liger", "mixtral-hf-scatter-experts", "mixtral-hf-scatter",
         "mixtral-hf-scatter-graphs", "mixtral-hf-scatter-layer-graphs", "dbrx-eager", "dbrx-hf-scatter",
         "dbrx-hf-scatter-graphs", "qwen3_moe-grouped_mm", "qwen3_moe-liger", "qwen3_moe-hf-scatter",
         "qwen3_moe-hf-scatter-graphs", "qwen3_moe-hf-scatter-layer-graphs",
         "gpt_oss-grouped_mm", "gpt_oss-liger", "gpt_oss-hf-scatter", "gpt_oss-hf-scatter-layer-graphs",
         "deepseek_v3-grouped_mm", "deepseek_v3-liger", "deepseek_v3-hf-scatter", "deepseek_v3-hf-scatter-graphs",
         "deepseek_v3-hf-scatter-layer-graphs")
# "-experts": only the experts on hf-scatter's kernels (norms and router stay transformers' own);
# "-graphs": the default patch plus moe_graphs=True (MoE blocks replayed as CUDA graphs);
# "-layer-graphs": the default patch plus layer_graphs=True (whole decoder layers replayed as CUDA graphs);
# "-liger": Liger-Kernel's patch for the family with its defaults
_VARIANT_OPTIONS = {"experts": {"norms": False, "router": False}, "graphs": {"moe_graphs": True},
                    "layer-graphs": {"layer_graphs": True}}


def _hf_config(family: str, cfg: TrainConfig):
    import transformers

    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq)
    head_dim = cfg.hidden // cfg.heads
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=cfg.intermediate, num_local_experts=cfg.experts,
                                          num_experts_per_tok=cfg.top_k)
    if family == "dbrx":
        return transformers.DbrxConfig(
            d_model=cfg.hidden, n_heads=cfg.heads, n_layers=cfg.layers, max_seq_len=cfg.seq, vocab_size=cfg.vocab,
            attn_config={"kv_n_heads": cfg.kv_heads, "rope_theta": 10000.0, "clip_qkv": 8.0},
            ffn_config={"hidden_size": cfg.hidden, "ffn_hidden_size": cfg.intermediate,
                        "moe_num_experts": cfg.experts, "moe_top_k": cfg.top_k})
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, moe_intermediate_size=cfg.intermediate, head_dim=head_dim,
                                           num_experts=cfg.experts, num_experts_per_tok=cfg.top_k, norm_topk_prob=True)
    if family == "gpt_oss":
        return transformers.GptOssConfig(**common, intermediate_size=cfg.intermediate, num_local_experts=cfg.experts,
                                         num_experts_per_tok=cfg.top_k, head_dim=head_dim,
                                         rope_parameters={"rope_type": "default", "rope_theta": 150000.0})
    if family == "deepseek_v3":  # DeepSeek-V3's attention ranks scaled with d; 8 groups, 4 kept, as V3 has
        groups = 8 if cfg.experts % 8 == 0 and cfg.experts >= 16 else 1
        return transformers.DeepseekV3Config(
            **{**common, "num_key_value_heads": cfg.heads}, intermediate_size=4 * cfg.intermediate,
            moe_intermediate_size=cfg.intermediate, n_routed_experts=cfg.experts, num_experts_per_tok=cfg.top_k,
            n_shared_experts=max(cfg.shared_experts, 1), n_group=groups, topk_group=max(groups // 2, 1),
            first_k_dense_replace=1, q_lora_rank=cfg.hidden * 3 // 8, kv_lora_rank=cfg.hidden // 8,
            qk_rope_head_dim=head_dim // 2, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
            routed_scaling_factor=2.5, norm_topk_prob=True)
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILY_SHAPES)}")


@contextlib.contextmanager
def liger_patched(family: str, model):
    """Liger-Kernel's patch of ``family`` applied to ``model``. Liger also rebinds names in transformers'
    modeling module (RoPE, norm classes, the LM forward): those are restored on exit, so models built
    afterwards in the same process stay vanilla."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    saved = dict(vars(module))
    try:
        from liger_kernel.transformers import monkey_patch
    except ImportError as error:
        raise RuntimeError("the -liger variants need liger-kernel (pip install liger-kernel)") from error
    getattr(monkey_patch, f"apply_liger_kernel_to_{family}")(model=model)
    try:
        yield model
    finally:
        vars(module).update(saved)


def family_shape(impl: str, cfg: TrainConfig | None, batch: int | None = None) -> TrainConfig:
    """The shape an implementation runs: ``cfg`` if given (one shape for all, e.g. the smoke test), else its
    family's :data:`FAMILY_SHAPES` entry; ``batch`` sequences per step instead of its own."""
    shape = cfg or FAMILY_SHAPES[impl.split("-", 1)[0]]
    return shape if batch is None else dataclasses.replace(shape, batch=batch)


def build_model(impl: str, cfg: TrainConfig, device: torch.device, dtype: torch.dtype, seed: int = 0,
                fsdp: bool = False):
    """The model an implementation name stands for, initialised from ``seed`` (same weights per family);
    ``fsdp``: wrapped by FSDP2 after patching (a process group must exist)."""
    from transformers import AutoModelForCausalLM

    from .. import patch_model

    family, choice = impl.split("-", 1)
    config = _hf_config(family, cfg)
    patched = choice.startswith("hf-scatter")
    kwargs = {"experts_implementation": choice} if family != "dbrx" and choice in ("grouped_mm", "eager") else {}
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    if patched:
        patch_model(model, **_VARIANT_OPTIONS.get(choice.removeprefix("hf-scatter").removeprefix("-"), {}))
    if fsdp:
        _fully_shard(model)
    return model.train()


def _fully_shard(model) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    base = model.base_model
    for layer in getattr(base, "layers", None) or base.blocks:  # DBRX: transformer.blocks
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)


@contextlib.contextmanager
def _process_group(on: bool):
    """A one-process NCCL group for ``--fsdp`` (unless the caller made one, e.g. under torchrun)."""
    import torch.distributed as dist

    if not on or dist.is_initialized():
        yield
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:  # the group's file store lives as long as the group
        dist.init_process_group("nccl", init_method=f"file://{tmp}/init", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _step_fn(model, ids: torch.Tensor) -> tuple[Callable[[], torch.Tensor], torch.optim.Optimizer]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ids.is_cuda)

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step, opt


def _categories(model) -> dict[str, list[torch.nn.Module]]:
    groups: dict[str, list[torch.nn.Module]] = {"attention": [], "experts": [], "router": [], "norms": [],
                                                "lm_head": []}
    for name, module in model.named_modules():
        cls = type(module).__name__
        if cls.endswith("Attention"):
            groups["attention"].append(module)
        elif "Experts" in cls and not name.endswith(".mlp"):
            groups["experts"].append(module)
        elif cls.endswith("Router"):
            groups["router"].append(module)
        elif "Norm" in cls and "Attention" not in cls:
            groups["norms"].append(module)
        elif name == "lm_head":
            groups["lm_head"].append(module)
    return groups


def time_breakdown(model, step: Callable[[], torch.Tensor]) -> dict[str, float]:
    """GPU ms per category for one step, from CUDA events recorded around each module's forward and
    backward (hooks are Python, so this step runs slower than the timed ones: compare shares, not sums)."""
    events: dict[str, list[tuple[torch.cuda.Event, torch.cuda.Event]]] = {}
    open_events: dict[tuple[int, str], torch.cuda.Event] = {}
    handles = []

    def mark(category: str, phase: str, module, start: bool):
        key = (id(module), phase)
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        if start:
            open_events[key] = event
        elif key in open_events:
            events.setdefault(f"{category} {phase}", []).append((open_events.pop(key), event))

    for category, modules in _categories(model).items():
        for m in modules:
            handles += [
                m.register_forward_pre_hook(lambda mod, a, c=category: mark(c, "fwd", mod, True)),
                m.register_forward_hook(lambda mod, a, o, c=category: mark(c, "fwd", mod, False)),
                m.register_full_backward_pre_hook(lambda mod, g, c=category: mark(c, "bwd", mod, True)),
                m.register_full_backward_hook(lambda mod, gi, go, c=category: mark(c, "bwd", mod, False)),
            ]
    try:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        step()
        end.record()
        torch.cuda.synchronize()
    finally:
        for h in handles:
            h.remove()
    out = {k: sum(a.elapsed_time(b) for a, b in v) for k, v in sorted(events.items())}
    out["step (hooked)"] = begin.elapsed_time(end)
    out["rest: embeddings, residuals, loss, optimizer, launch gaps"] = out["step (hooked)"] - sum(
        v for k, v in out.items() if k != "step (hooked)")
    return out


def measure(impl: str, cfg: TrainConfig, ids: torch.Tensor, warmup: int, steps: int, breakdown: bool,
            dtype=torch.bfloat16, fsdp: bool = False) -> dict:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    model = build_model(impl, cfg, ids.device, dtype, fsdp=fsdp)
    family, choice = impl.split("-", 1)
    with liger_patched(family, model) if choice == "liger" else contextlib.nullcontext():
        result = _timed_steps(impl, model, cfg, ids, warmup, steps, breakdown)
    del model
    return result


def _timed_steps(impl: str, model, cfg: TrainConfig, ids: torch.Tensor, warmup: int, steps: int,
                 breakdown: bool) -> dict:
    step, opt = _step_fn(model, ids)
    first_loss = step().item()
    for _ in range(warmup - 1):
        step()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    result = {"first_step_loss": first_loss, "step_ms_median": statistics.median(times),
              "step_ms_all": times, "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
              # graph replays allocate nothing: their pool shows in reserved memory, not in allocated
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    result["tokens_per_s"] = cfg.tokens / (result["step_ms_median"] / 1e3)
    if breakdown and not impl.endswith("-graphs"):  # hooks send graphed blocks eager: that is the eager step
        try:
            result["breakdown_ms"] = time_breakdown(model, step)
        except RuntimeError as error:  # a family whose modules refuse full backward hooks: report, go on
            result["breakdown_error"] = str(error)
    del opt, step
    return result


NEEDS_GPU = True


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench train``, named after :func:`run`'s arguments."""
    parser.add_argument("--configs", dest="impls", nargs="*", metavar="IMPL", default=list(IMPLS),
                        help=f"subset of {', '.join(IMPLS)} (default: all)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps after 3 warm-up steps")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip the per-category time breakdown")
    parser.add_argument("--liger-autotune", choices=("on", "off"), default="on",
                        help="Liger's fused-MoE autotuner in the -liger variants (its default: on)")
    parser.add_argument("--batch", type=positive_int,
                        help="sequences per step for every variant (default: each family's shape, 4 of 2048 tokens)")
    parser.add_argument("--fsdp", action="store_true",
                        help="every variant under FSDP2 with world size 1 (fully_shard per decoder layer, after the "
                             "patch); no time breakdown")


def run(impls=IMPLS, cfg: TrainConfig | None = None, warmup: int = 3, steps: int = 10,
        breakdown: bool = True, liger_autotune: str = "on", fsdp: bool = False, batch: int | None = None) -> dict:
    """``cfg``: one shape for every implementation (the smoke test); None runs each family at its
    :data:`FAMILY_SHAPES` entry. ``batch``: sequences per step instead of the shape's."""
    check_names("implementation", impls, IMPLS)
    if fsdp and any(impl.endswith("-liger") or impl.endswith("-graphs") for impl in impls):
        raise ValueError("--fsdp: the -liger variants patch after construction and the -graphs variants do not run "
                         "under a sharding engine; leave them out of --configs")
    require_cuda()
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "1" if liger_autotune == "on" else "0")  # read at import
    families = dict.fromkeys(impl.split("-", 1)[0] for impl in impls)
    configs = {family: dataclasses.asdict(family_shape(family, cfg, batch)) for family in families}
    report = {**run_header(), "config": next(iter(configs.values())), "configs": configs, "warmup": warmup,
              "steps": steps, "liger_autotune": liger_autotune, "fsdp": fsdp, "results": {}}
    with _process_group(fsdp):
        for impl in impls:
            _run_one(report, impl, family_shape(impl, cfg, batch), warmup, steps, breakdown and not fsdp, fsdp)
    return report


def _run_one(report: dict, impl: str, shape: TrainConfig, warmup: int, steps: int, breakdown: bool,
             fsdp: bool) -> None:
    ids = torch.randint(shape.vocab, (shape.batch, shape.seq), generator=torch.Generator().manual_seed(0)).cuda()
    try:
        r = measure(impl, shape, ids, warmup, steps, breakdown, fsdp=fsdp)
    except torch.cuda.OutOfMemoryError:  # a peer that cannot run this batch: said in the report, the rest go on
        report.setdefault("out_of_memory", {})[impl] = f"out of memory at batch {shape.batch}x{shape.seq}"
        print(f"  {impl:20s} out of memory at batch {shape.batch}x{shape.seq}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        return
    report["results"][impl] = r
    print(f"  {impl:20s} {r['tokens_per_s'] / 1e3:8.1f}k tok/s  peak {r['peak_gib']:.1f} GiB  "
          f"first loss {r['first_step_loss']:.4f}", flush=True)


BASELINES = {"mixtral": "mixtral-grouped_mm", "dbrx": "dbrx-eager", "qwen3_moe": "qwen3_moe-grouped_mm",
             "gpt_oss": "gpt_oss-grouped_mm", "deepseek_v3": "deepseek_v3-grouped_mm"}


def to_markdown(report: dict) -> str:
    res = report["results"]
    rows = []
    for impl, r in res.items():
        base = res.get(BASELINES[impl.split("-")[0]])
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else ""
        mem = f"{r['peak_gib'] / base['peak_gib']:.2f}x" if base else ""
        reserved = r.get("peak_reserved_gib")
        reserved_ratio = f"{reserved / base['peak_reserved_gib']:.2f}x" if base and reserved and \
            base.get("peak_reserved_gib") else ""
        rows.append([impl, f"{r['tokens_per_s'] / 1e3:.1f}k", f"{r['step_ms_median']:.1f}", f"{r['peak_gib']:.1f}",
                     speedup, mem, f"{reserved:.1f}" if reserved else "", reserved_ratio,
                     f"{r['first_step_loss']:.4f}"])
    table = markdown_table(["implementation", "tokens/s", "step ms", "peak GiB", "vs family baseline",
                            "peak vs baseline", "peak reserved GiB", "reserved vs baseline", "first-step loss"], rows)
    parts = [table] + [f"\n{impl}: {why}" for impl, why in report.get("out_of_memory", {}).items()]
    for impl, r in res.items():
        if "breakdown_ms" in r:
            b = r["breakdown_ms"]
            total = b["step (hooked)"]
            parts.append(f"\n{impl}: one hooked step, GPU ms (share)\n\n" + markdown_table(
                ["category", "ms", "share"], [[k, f"{v:.1f}", f"{v / total:.0%}"] for k, v in b.items()]))
    return "\n".join(parts)


def summary_table(report: dict) -> str:
    """The docs' view of a ``bench train`` report: one row per implementation, ratios against its family's
    vanilla baseline (``BASELINES``), allocated and reserved peaks side by side."""
    res = report["results"]
    rows = []
    for impl, r in res.items():
        base = res.get(BASELINES[impl.split("-")[0]])
        reserved, base_reserved = r.get("peak_reserved_gib"), (base or {}).get("peak_reserved_gib")
        rows.append([impl, f"{r['tokens_per_s'] / 1e3:.1f}k", f"{r['step_ms_median']:.1f}",
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "", f"{r['peak_gib']:.1f}",
                     f"{reserved:.1f}" if reserved else "",
                     f"{reserved / base_reserved:.2f}x" if reserved and base_reserved else "",
                     f"{r['first_step_loss']:.4f}"])
    return markdown_table(["implementation", "tokens/s", "step ms", "vs family baseline", "peak GiB allocated",
                           "peak GiB reserved", "reserved vs baseline", "first-step loss"], rows)


def peers_table(report: dict) -> str:
    """Each hf-scatter variant against its family's transformers default and Liger's patch: tokens/s ratios,
    and peak memory allocated / reserved side by side (a graphed variant's replays allocate nothing: its
    pool shows only in reserved memory)."""
    res = report["results"]
    rows = []
    for impl, r in res.items():
        family, choice = impl.split("-", 1)
        if not choice.startswith("hf-scatter"):
            continue
        base, liger = res.get(BASELINES[family]), res.get(f"{family}-liger")
        ratio = lambda peer: f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x" if peer else ""  # noqa: E731
        peaks = lambda run: f"{run['peak_gib']:.1f} / {run['peak_reserved_gib']:.1f}" if run else ""  # noqa: E731
        rows.append([impl, f"{r['tokens_per_s'] / 1e3:.1f}k", ratio(base), ratio(liger), peaks(r), peaks(base),
                     peaks(liger)])
    return markdown_table(["hf-scatter variant", "tokens/s", "vs transformers default", "vs Liger",
                           "peak GiB (allocated / reserved)", "default's", "Liger's"], rows)


_BREAKDOWN_ROWS = (("experts forward", ("experts fwd",)), ("experts backward", ("experts bwd",)),
                   ("attention forward", ("attention fwd",)),
                   ("attention backward (as far as the hooks see it)", ("attention bwd",)),
                   ("norms forward + backward", ("norms fwd", "norms bwd")),
                   ("router forward + backward", ("router fwd", "router bwd")),
                   ("lm_head forward + backward", ("lm_head fwd", "lm_head bwd")),
                   ("rest", ("rest: embeddings, residuals, loss, optimizer, launch gaps",)),
                   ("whole hooked step", ("step (hooked)",)))


def breakdown_table(report: dict) -> str:
    """GPU ms per category of one hooked step, one column per implementation that has a breakdown."""
    impls = [impl for impl, r in report["results"].items() if "breakdown_ms" in r]
    rows = [[label] + [f"{sum(report['results'][i]['breakdown_ms'][k] for k in keys):.1f}" for i in impls]
            for label, keys in _BREAKDOWN_ROWS]
    return markdown_table(["category (ms)"] + impls, rows)


def host_time_table(report: dict) -> str:
    """A ``scripts/probe_train_host_time.py`` report (``$OUT/train-host.json``): the host's issue time of one
    step, the GPU's work with the queue kept full, and the step as it runs."""
    rows = [[impl, f"{r['host_issue_ms']:.1f}", f"{r['gpu_ms_queue_full']:.1f}", f"{r['step_ms']:.1f}"]
            for impl, r in report.items()]
    return markdown_table(["implementation", "host issue ms", "GPU ms (queue full)", "step ms"], rows)


def plot(report: dict, path: str) -> None:
    """Tokens/s and peak memory per implementation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    colors = ["tab:orange" if "hf-scatter" in n else "tab:gray" for n in names]
    axes[0].barh(names, [res[n]["tokens_per_s"] / 1e3 for n in names], color=colors)
    axes[0].set_xlabel("k tokens/s (higher is better)")
    reserved = [res[n].get("peak_reserved_gib", 0.0) for n in names]
    if any(reserved):  # graph replays allocate nothing: their pool only shows in reserved memory
        axes[1].barh(names, reserved, color="none", edgecolor="black", hatch="//", label="reserved")
    axes[1].barh(names, [res[n]["peak_gib"] for n in names], color=colors, label="allocated")
    axes[1].set_xlabel("peak GiB (lower is better)")
    if any(reserved):
        axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    for ax in axes:
        ax.invert_yaxis()
    configs = report.get("configs") or {"": report["config"]}
    if len(configs) == 1:
        c = next(iter(configs.values()))
        fig.suptitle(f"Training step, {c['layers']}-layer MoE (d {c['hidden']}, d_expert {c['intermediate']}, E "
                     f"{c['experts']}, k {c['top_k']}), batch {c['batch']}x{c['seq']}, bf16 AdamW, {report['device']}")
    else:
        fig.suptitle(f"Training step of each family at its own ~1-2B shape, bf16 AdamW, {report['device']}")
    fig.tight_layout()
    save_figure(fig, path)

