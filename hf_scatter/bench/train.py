"""`hf-scatter bench train`: whole training steps of MoE models of each family hf-scatter patches, on one GPU or
on several under torchrun.

Mixtral and DBRX at the ScatterMoE paper's 1.5B configuration; Qwen3-MoE, GPT-OSS and DeepSeek-V3 at the
real families' proportions (:data:`FAMILY_SHAPES`); or, with ``--shape``, a published model's own dimensions
(:data:`SHAPES`) with ``--layers`` of its layers. Vanilla (transformers' grouped_mm / eager experts),
Liger-Kernel's patch for the family (``apply_liger_kernel_to_<family>``, its defaults: RMSNorm, RoPE,
SwiGLU / fused experts, fused linear cross-entropy) and hf-scatter's patch, in one process group, from one seed
and on the same random tokens. Reports tokens/s (median step), model TFLOP/s (:func:`model_flops`), peak memory
(weights, gradients and optimizer states included) and the first-step loss (patched must equal vanilla within
bf16 noise), plus a per-category GPU time breakdown of one unwrapped step.

``--engine`` runs every variant under a distributed engine (:mod:`.engines`): PyTorch FSDP2 (``--fsdp`` is its
old name), transformers' expert parallelism or DeepSpeed ZeRO-3, at the world size torchrun gives. Each rank
measures its own steps (and, with the profiler, its communication); rank 0 gathers them, reports the
per-GPU figures and alone prints and writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import statistics
import time
from typing import Callable, Sequence

import torch

from ..common.argtypes import positive_int
from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.shapes import BUILTIN_MODELS, builtin_config
from ..common.timing import run_header
from ..offload.families.spec import ModelSpec
from . import engines
from .availability import RunStopped, require_cuda


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
    batch: int = 4  # sequences per step, on each rank
    seq: int = 2048
    shared_experts: int = 0  # DeepSeek's shared experts (each of the routed experts' size)
    head_dim: int | None = None  # None: hidden // heads (the family shapes); the published shapes have their own
    preset: str | None = None  # a published model (:data:`SHAPES`) whose config the model is built from

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
BASELINES = {"mixtral": "mixtral-grouped_mm", "dbrx": "dbrx-eager", "qwen3_moe": "qwen3_moe-grouped_mm",
             "gpt_oss": "gpt_oss-grouped_mm", "deepseek_v3": "deepseek_v3-grouped_mm",
             "deepseek_v2": "deepseek_v2-grouped_mm"}
# The built-in published models (common.shapes) whose family has variants here, by family: ``--shape NAME``
_FAMILY_OF_CONFIG = {"MixtralConfig": "mixtral", "DbrxConfig": "dbrx", "Qwen3MoeConfig": "qwen3_moe",
                     "GptOssConfig": "gpt_oss", "DeepseekV3Config": "deepseek_v3", "DeepseekV2Config": "deepseek_v2"}
SHAPES = {name: _FAMILY_OF_CONFIG[cls] for name, (cls, _) in BUILTIN_MODELS.items() if cls in _FAMILY_OF_CONFIG}
_CHOICES = ("grouped_mm", "eager", "liger", "hf-scatter", "hf-scatter-experts", "hf-scatter-graphs",
            "hf-scatter-layer-graphs")  # what a --shape family's variants may be


def published_shape(name: str, layers: int | None = None) -> TrainConfig:
    """The dimensions of published model ``name`` (:data:`SHAPES`, from ``common.shapes``' configs) with ``layers``
    of its layers (default: all of them); the model is built from that config itself."""
    spec = ModelSpec.from_config(builtin_config(name, **({"num_hidden_layers": layers} if layers else {})))
    if spec.dense_layers == spec.layers:
        raise ValueError(f"--shape {name}: its first {spec.dense_layers} layers hold dense MLPs, no experts: give "
                         f"--layers more than that")
    mla = spec.is_mla  # its spec prices the absorbed form (one latent head): the heads as trained instead
    return TrainConfig(hidden=spec.hidden, intermediate=spec.intermediate, experts=spec.experts, top_k=spec.top_k,
                       layers=spec.layers, heads=spec.heads, kv_heads=spec.heads if mla else spec.kv_heads,
                       head_dim=spec.qk_nope_dim + spec.qk_rope_dim if mla else spec.head_dim, vocab=spec.vocab,
                       shared_experts=spec.shared_intermediate // spec.intermediate, preset=name)


def _hf_config(family: str, cfg: TrainConfig):
    import transformers

    if cfg.preset:
        return builtin_config(cfg.preset, num_hidden_layers=cfg.layers)
    common = dict(vocab_size=cfg.vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seq)
    head_dim = cfg.head_dim or cfg.hidden // cfg.heads
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=cfg.intermediate, num_local_experts=cfg.experts,
                                          num_experts_per_tok=cfg.top_k, head_dim=head_dim)
    if family == "dbrx":
        if head_dim * cfg.heads != cfg.hidden:
            raise ValueError(f"DBRX's heads are hidden / heads wide: head_dim {head_dim} with {cfg.heads} heads of "
                             f"{cfg.hidden}")
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
    raise ValueError(f"unknown family {family!r}; choose from {', '.join(FAMILY_SHAPES)} (or a --shape)")


def model_flops(spec: ModelSpec, seq: int, sequences: float = 1) -> float:
    """Model FLOPs of one training step (forward and backward) on ``sequences`` sequences of ``seq`` tokens,
    counted the way Megatron-LM's ``num_floating_point_operations`` counts an MoE model, plus the router:

        step    = 3 x forward                      (backward: input and weight gradients, a forward's worth each)
        forward = 2 x tokens x (L x attention + MoE layers x (3 d (k f + f_shared) + d E)
                                + dense layers x 3 d f_dense + d V)
        attention = d (q + 2 kv) + q d + q s       (q = heads x head_dim, kv = kv_heads x head_dim; QK^T and PV
                                                    over the causal half: 2 x q x s / 2)
        MLA attention = q projection (through q_lora_rank where it has one) + d (r_kv + rope) + r_kv heads
                        (nope + v) + heads v d + s/2 x heads (nope + rope + v)

    d hidden, f an expert's intermediate size, k experts per token, f_shared the shared experts' total width, E
    routed experts, V vocabulary, s = ``seq``; every matrix product of the active parameters counted as 2 FLOPs
    per multiply-add. Megatron-LM counts the same but for the router's d E and, under MLA, the widths of its
    low-rank norms (element-wise, no products); neither counts GPT-OSS's sliding windows (full causal attention
    on every layer) nor the embedding lookup."""
    d = spec.hidden
    if spec.is_mla:
        qk = spec.qk_nope_dim + spec.qk_rope_dim
        query = spec.q_lora_rank * (d + spec.heads * qk) if spec.q_lora_rank else d * spec.heads * qk
        latent = d * (spec.kv_lora_rank + spec.qk_rope_dim) + spec.kv_lora_rank * spec.heads * (
            spec.qk_nope_dim + spec.v_head_dim)
        attention = query + latent + spec.heads * spec.v_head_dim * d + seq / 2 * spec.heads * (qk + spec.v_head_dim)
    else:
        attention = d * (spec.q_dim + 2 * spec.kv_dim) + spec.q_dim * d + spec.q_dim * seq
    moe = 3 * d * (spec.top_k * spec.intermediate + spec.shared_intermediate) + d * spec.experts
    per_token = (spec.layers * attention + (spec.layers - spec.dense_layers) * moe
                 + spec.dense_layers * 3 * d * spec.dense_intermediate + d * spec.vocab)
    return 6 * per_token * seq * sequences


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
                fsdp: bool = False, distributed_config=None):
    """The model an implementation name stands for, initialised from ``seed`` (same weights per family);
    ``fsdp``: wrapped by FSDP2 after patching (a process group must exist); ``distributed_config``: built
    expert-parallel by transformers, patched at construction (its weights initialised by transformers)."""
    from transformers import AutoModelForCausalLM

    from .. import patch_model

    family, choice = impl.split("-", 1)
    config = _hf_config(family, cfg)
    options = _VARIANT_OPTIONS.get(choice.removeprefix("hf-scatter").removeprefix("-"), {})
    patched = choice.startswith("hf-scatter")
    kwargs = {"experts_implementation": choice} if family != "dbrx" and choice in ("grouped_mm", "eager") else {}
    torch.manual_seed(seed)
    if distributed_config is not None:
        return _expert_parallel_model(config, dtype, distributed_config, options if patched else None, kwargs).train()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    if patched:
        patch_model(model, **options)
    if fsdp:
        engines.fully_shard_layers(model, torch.bfloat16)
    return model.train()


def _expert_parallel_model(config, dtype: torch.dtype, distributed_config, patch: dict | None, kwargs: dict):
    """transformers builds the model already split (``from_pretrained`` with ``distributed_config`` is where it
    does), from no checkpoint: it initialises every weight itself, each rank its own part. The patch goes on
    the classes it builds from, as for any expert-parallel load."""
    import transformers

    from .. import patch_transformers, unpatch_transformers

    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # its load report would list every weight as missing, per rank
    if patch is not None:
        patch_transformers(**patch)
    try:
        return transformers.MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].from_pretrained(
            None, config=config, state_dict={}, dtype=dtype, distributed_config=distributed_config, **kwargs)
    finally:
        unpatch_transformers()
        transformers.logging.set_verbosity(verbosity)


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
            dtype=torch.bfloat16, setup: engines.Setup | None = None, comm_profile: bool = False,
            shared_by: int = 1) -> dict:
    """This rank's numbers for ``impl`` under ``setup`` (default: unwrapped): the model built, wrapped, trained
    ``warmup`` + ``steps`` steps, let go. ``shared_by``: ranks this batch is shared by (its tokens and FLOPs
    count once over them)."""
    setup = setup or engines.Setup("none")
    cuda = ids.is_cuda
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    family, choice = impl.split("-", 1)
    sequences = cfg.batch / shared_by
    flops = model_flops(ModelSpec.from_config(_hf_config(family, cfg)), cfg.seq, sequences)
    with contextlib.ExitStack() as stack:
        def build(distributed_config=None):
            model = build_model(impl, cfg, ids.device, dtype, distributed_config=distributed_config)
            if choice == "liger":
                stack.enter_context(liger_patched(family, model))
            return model

        model, step = stack.enter_context(engines.trained(setup, build, ids, dtype))
        result = _timed_steps(impl, model, step, warmup, steps, breakdown, cuda)
        result["comm_ms"] = engines.profile_comm(step, cuda) if comm_profile else engines.NOT_MEASURED
        del model, step
    result["tokens"] = sequences * cfg.seq
    result["model_flops"] = flops
    result["tokens_per_s"] = result["tokens"] / (result["step_ms_median"] / 1e3)
    result["tflops"] = flops / (result["step_ms_median"] / 1e3) / 1e12
    return result


def _timed_steps(impl: str, model, step: Callable[[], torch.Tensor], warmup: int, steps: int, breakdown: bool,
                 cuda: bool) -> dict:
    first_loss = step().item()
    for _ in range(warmup - 1):
        step()
    times, host = zip(*[_step_ms(step, cuda) for _ in range(steps)])
    result = {"first_step_loss": first_loss, "step_ms_median": statistics.median(times), "step_ms_all": list(times),
              # how long the host took to issue a step: near the step time, the host sets the pace (a sync inside
              # the step, or more host work than GPU work), and faster kernels cannot show
              "host_issue_ms_median": statistics.median(host),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
              # what lives across steps (weights, gradients, optimizer states): a batch sweep's prediction
              "resident_gib": torch.cuda.memory_allocated() / 2**30 if cuda else None,
              "capacity_gib": torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
              if cuda else None,
              # graph replays allocate nothing: their pool shows in reserved memory, not in allocated
              "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None}
    if breakdown and cuda and not impl.endswith("-graphs"):  # hooks send graphed blocks eager: the eager step
        try:
            result["breakdown_ms"] = time_breakdown(model, step)
        except RuntimeError as error:  # a family whose modules refuse full backward hooks: report, go on
            result["breakdown_error"] = str(error)
    return result


def _step_ms(step: Callable[[], torch.Tensor], cuda: bool) -> tuple[float, float]:
    """(one step's time: CUDA events on the GPU, the wall clock on the CPU; the host's time to issue it)."""
    if not cuda:
        begin = time.perf_counter()
        step()
        ms = (time.perf_counter() - begin) * 1e3
        return ms, ms
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    begin = time.perf_counter()
    step()
    issued = (time.perf_counter() - begin) * 1e3
    b.record()
    b.synchronize()
    return a.elapsed_time(b), issued


# run() checks for the GPU itself: the smoke shape (``--shape smoke``) runs on the CPU where there is none
NEEDS_GPU = False


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench train``, named after :func:`run`'s arguments."""
    parser.add_argument("--configs", dest="impls", nargs="*", metavar="IMPL",
                        help=f"subset of {', '.join(IMPLS)} (default: all); with --shape, variants of its family "
                             f"(default: the family's transformers default and hf-scatter)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps after 3 warm-up steps")
    parser.add_argument("--no-breakdown", dest="breakdown", action="store_false",
                        help="skip the per-category time breakdown")
    parser.add_argument("--liger-autotune", choices=("on", "off"), default="on",
                        help="Liger's fused-MoE autotuner in the -liger variants (its default: on)")
    parser.add_argument("--batch", type=positive_int, nargs="+", metavar="ROWS",
                        help="sequences per step on each rank, every variant (default: the shape's, 4); several: "
                             "each variant runs at each, smallest first, skipping those its measured memory says "
                             "will not fit, and reports its fastest (each side at its best batch)")
    parser.add_argument("--shape", choices=("smoke", *SHAPES), metavar="NAME",
                        help=f"a published model's dimensions instead of the families' ~1-2B ones: "
                             f"{', '.join(SHAPES)}; or smoke, a tiny model that checks a launch (on the CPU where "
                             f"there is no GPU)")
    parser.add_argument("--layers", type=positive_int, help="decoder layers (default: the shape's)")
    parser.add_argument("--seq", type=positive_int, help="tokens per sequence (default: the shape's, 2048)")
    parser.add_argument("--engine", choices=engines.ENGINES,
                        help="none (one unwrapped process, the default), fsdp2, ep (transformers' expert "
                             "parallelism) or zero3 (DeepSpeed through accelerate); under torchrun, all its processes")
    parser.add_argument("--fsdp", action="store_true", help="the same as --engine fsdp2")
    parser.add_argument("--baseline", metavar="JSON",
                        help="report of an unwrapped one-process run of the same shape and batch: scaling "
                             "efficiency = tokens/s per GPU / its tokens/s")
    parser.add_argument("--no-comm-profile", dest="comm_profile", action="store_false",
                        help="skip the profiled steps that split GPU time into NCCL and compute")
    parser.add_argument("--reshard-after-forward", choices=("auto", "true", "false"), default="auto",
                        help="fsdp2: free each layer's gathered parameters after forward (auto: true, "
                             "fully_shard's default)")
    parser.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="fsdp2: dtype of the gradient reduce-scatter")
    parser.add_argument("--prefetch", choices=("none", "next"), default="none",
                        help="fsdp2: next = each layer gathers the next one's parameters in forward and the "
                             "previous one's in backward explicitly (torchtitan's schedule)")


@dataclasses.dataclass(frozen=True)
class _Plan:
    impls: list[str]
    shapes: dict[str, TrainConfig]  # each variant's, at the smallest batch
    batches: tuple[int, ...]  # rows per rank to sweep, smallest first; () with one batch (no sweep)
    setup: engines.Setup
    device: str
    baseline: dict | None


def check_flags(**flags) -> None:
    """Refuses, before any model is built, what cannot run: unknown variants or shape, variants of another
    family than the shape's, an engine the world size or the shape cannot take, FSDP2 knobs without FSDP2, a
    --baseline of another run. Raises ValueError."""
    _plan(**flags)


def _plan(impls=None, cfg: TrainConfig | None = None, engine: str | None = None, fsdp: bool = False,
          shape: str | None = None, layers: int | None = None, batch: int | Sequence[int] | None = None,
          seq: int | None = None, baseline: str | None = None, reshard_after_forward: str = "auto",
          reduce_dtype: str = "float32", prefetch: str = "none", device: str | None = None, **_) -> _Plan:
    if fsdp and engine not in (None, "fsdp2"):
        raise ValueError(f"--fsdp is --engine fsdp2: it does not go with --engine {engine}")
    engine = engine or ("fsdp2" if fsdp else "none")
    if engine not in engines.ENGINES:
        raise ValueError(f"unknown --engine {engine!r}; choose from {', '.join(engines.ENGINES)}")
    if shape is not None and shape != "smoke" and shape not in SHAPES:
        raise ValueError(f"unknown --shape {shape!r}; choose from smoke, {', '.join(SHAPES)}")
    if shape is not None:
        cfg = SMOKE if shape == "smoke" else published_shape(shape, layers)
    family = SHAPES.get(shape)
    if not impls:  # under an engine, every variant that runs under one
        impls = [BASELINES[family], f"{family}-hf-scatter"] if family else [
            impl for impl in IMPLS if engine == "none" or not impl.endswith(("-liger", "-graphs"))]
    known = [f"{family}-{c}" for c in _CHOICES if (family, c) != ("dbrx", "grouped_mm")] if family else IMPLS
    unknown = sorted(set(impls) - set(known))
    if unknown:
        raise ValueError(f"unknown implementation(s) {', '.join(unknown)}"
                         + (f" for --shape {shape} (a {family} model)" if family else "")
                         + f"; choose from {', '.join(known)}")
    batches = sorted(set(batch)) if isinstance(batch, Sequence) else [batch] if batch is not None else []
    if any(b < 1 for b in batches) or (isinstance(batch, Sequence) and not batches):
        raise ValueError(f"--batch takes one or more positive row counts, not {batch}")
    shapes = {}
    for impl in impls:
        found = family_shape(impl, cfg, batches[0] if batches else None)
        shapes[impl] = dataclasses.replace(found, layers=layers or found.layers, seq=seq or found.seq)
    world = engines.world_size()
    setup = engines.Setup(engine, world, _fsdp2_options(engine, reshard_after_forward, reduce_dtype, prefetch))
    _check_engine(setup, shapes)
    device = device or ("cpu" if shape == "smoke" and not torch.cuda.is_available() else "cuda")
    sweep = tuple(batches) if len(batches) > 1 else ()
    return _Plan(impls, shapes, sweep, setup, device, _read_baseline(baseline, shapes, sweep) if baseline else None)


def _fsdp2_options(engine: str, reshard_after_forward: str, reduce_dtype: str, prefetch: str) -> engines.Fsdp2Options:
    """``auto`` reshards after forward at every world size: ``fully_shard``'s default (and torchtitan's without
    pipeline parallelism), so a run at world size 1 differs from one on N GPUs by the communication only."""
    if engine != "fsdp2" and (reshard_after_forward, reduce_dtype, prefetch) != ("auto", "float32", "none"):
        raise ValueError("--reshard-after-forward, --reduce-dtype and --prefetch set up FSDP2: they go with "
                         "--engine fsdp2")
    return engines.Fsdp2Options(reshard_after_forward=reshard_after_forward != "false", reduce_dtype=reduce_dtype,
                                prefetch=prefetch)


def _check_engine(setup: engines.Setup, shapes: dict[str, TrainConfig]) -> None:
    engine, world = setup.engine, setup.world
    if engine == "none":
        if world > 1:
            raise ValueError(f"--engine none runs one unwrapped process, but this run has {world}: under torchrun "
                             f"pick --engine fsdp2, ep or zero3")
        return
    if any(impl.endswith("-liger") or impl.endswith("-graphs") for impl in shapes):
        raise ValueError(f"--engine {engine}: the -liger variants patch after construction and the -graphs "
                         f"variants do not run under a sharding engine; leave them out of --configs")
    if engine in ("ep", "zero3") and not (engines.under_torchrun() or torch.distributed.is_initialized()):
        raise ValueError(f"--engine {engine} runs under torchrun: torchrun --nproc_per_node N -m hf_scatter.cli "
                         f"bench train --engine {engine} ...")
    if engine == "zero3":
        import importlib.util

        missing = [name for name in ("deepspeed", "accelerate") if importlib.util.find_spec(name) is None]
        if missing:
            raise ValueError(f"--engine zero3 needs {' and '.join(missing)} (pip install {' '.join(missing)})")
    if engine == "ep":
        if world < 2:
            raise ValueError("--engine ep splits the experts over 2 or more processes; this run has 1")
        for impl, shape in shapes.items():
            config = _hf_config(impl.split("-", 1)[0], shape)
            if hasattr(config, "base_model_ep_plan") and not config.base_model_ep_plan:
                raise ValueError(f"--engine ep: transformers has no expert-parallel plan for {impl}'s family")
            if shape.experts % world:
                raise ValueError(f"--engine ep: {impl} has {shape.experts} experts, which {world} processes "
                                 f"cannot split evenly")


def _read_baseline(path: str, shapes: dict[str, TrainConfig], sweep: tuple[int, ...] = ()) -> dict:
    """The ``--baseline`` report: one unwrapped process at the same shape and rows per GPU as this run (with a
    ``sweep``, at the same shape and at one or more of its batches: efficiency where the rows match)."""
    try:
        with open(path) as f:
            report = json.load(f)
        world, engine = report.get("world", 1), report.get("engine", "fsdp2" if report.get("fsdp") else "none")
        results = report["results"]
    except OSError as e:
        raise ValueError(f"--baseline {path}: {e.strerror.lower()}") from None
    except (ValueError, KeyError, AttributeError) as e:
        raise ValueError(f"--baseline {path}: not a report of `hf-scatter bench train` ({e})") from None
    if (engine, world) != ("none", 1):
        raise ValueError(f"--baseline {path}: the reference is one unwrapped process (--engine none), not "
                         f"{engine} on {world}")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    for impl, shape in shapes.items():
        family = impl.split("-", 1)[0]
        saved = _family_config(report, family) if impl in results else None
        if saved is None:
            continue
        theirs = TrainConfig(**{k: v for k, v in saved.items() if k in fields})
        same = dataclasses.replace(theirs, batch=shape.batch) == shape and any(
            _rows_tokens_per_s(results[impl], theirs.batch, rows) for rows in sweep or (shape.batch,))
        if not same:
            raise ValueError(f"--baseline {path}: {family} ran at another shape or batch there ({saved}) than "
                             f"here ({dataclasses.asdict(shape)}" + (f", rows {list(sweep)})" if sweep else ")"))
    return report


def _family_config(report: dict, family: str) -> dict | None:
    """The shape a report ran ``family`` at (reports before ``configs`` hold one ``config``)."""
    return (report.get("configs") or {}).get(family, report.get("config"))


def _reference_tokens_per_s(report: dict, impl: str, rows: int) -> float | None:
    """An unwrapped report's tokens/s per GPU for ``impl`` at ``rows`` per rank: what scaling efficiency divides
    by; None if it did not run that batch."""
    result = report.get("results", {}).get(impl)
    if result is None:
        return None
    return _rows_tokens_per_s(result, (_family_config(report, impl.split("-", 1)[0]) or {}).get("batch"), rows)


def _rows_tokens_per_s(result: dict, batch: int, rows: int) -> float | None:
    """A report's tokens/s per GPU for one variant at ``rows`` per rank (``batch``: its config's), from its
    result or its batch sweep; None if it did not run that batch."""
    if result.get("rows_per_rank", batch) == rows:
        return result["tokens_per_s"]
    return next((e["tokens_per_s"] for e in result.get("batch_sweep", ())
                 if e.get("rows_per_rank") == rows and "tokens_per_s" in e), None)


def run(impls=None, cfg: TrainConfig | None = None, warmup: int = 3, steps: int = 10, breakdown: bool = True,
        liger_autotune: str = "on", fsdp: bool = False, batch: int | Sequence[int] | None = None,
        engine: str | None = None,
        shape: str | None = None, layers: int | None = None, seq: int | None = None, baseline: str | None = None,
        comm_profile: bool = True, reshard_after_forward: str = "auto", reduce_dtype: str = "float32",
        prefetch: str = "none", device: str | None = None) -> dict | None:
    """``cfg``: one shape for every implementation (the smoke test); None runs each family at its
    :data:`FAMILY_SHAPES` entry, ``shape`` a published model's (or the smoke shape). ``batch``: sequences per
    step and rank instead of the shape's; several: a sweep, each variant reported at its fastest. ``device``:
    cuda, or cpu for the smoke shape where no GPU is (the
    tests' gloo runs). Returns the report on rank 0, None on the other ranks (rank 0 alone writes and prints)."""
    plan = _plan(impls, cfg, engine, fsdp, shape, layers, batch, seq, baseline, reshard_after_forward, reduce_dtype,
                 prefetch, device)
    if plan.device == "cuda":
        require_cuda()
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "1" if liger_autotune == "on" else "0")  # read at import
    setup, cuda = plan.setup, plan.device == "cuda"
    families = {impl.split("-", 1)[0]: dataclasses.asdict(s) for impl, s in plan.shapes.items()}
    first_rows = next(iter(plan.shapes.values())).batch  # the sweep's smallest batch
    rows = list(plan.batches) or first_rows
    with engines.process_group(setup.engine != "none", plan.device):
        me = engines.rank()
        report = {**run_header(), "dtype": "bfloat16" if cuda else "float32", "config": next(iter(families.values())),
                  "configs": families, "shape": shape, "warmup": warmup, "steps": steps,
                  "liger_autotune": liger_autotune, "fsdp": setup.engine == "fsdp2",
                  **setup.describe(first_rows, cuda),
                  "rows_per_rank": rows, "comm_profile": comm_profile, "flops": "Megatron-LM's count plus the "
                  "router (model_flops in hf_scatter/bench/train.py, docs/distributed-bench.md)", "results": {}}
        if plan.baseline:
            report["baseline"] = {key: plan.baseline.get(key) for key in ("device", "date", "host")} | {
                "path": baseline}
        for impl in plan.impls:
            _run_one(report, impl, plan, warmup, steps, breakdown and setup.engine == "none", comm_profile, me)
    return report if me == 0 else None


def _run_one(report: dict, impl: str, plan: _Plan, warmup: int, steps: int, breakdown: bool, comm_profile: bool,
             me: int) -> None:
    """One variant at its batch, or at each batch of the sweep (smallest first, until one will not fit): its
    fastest batch's figures in ``report["results"]``, every batch's under ``batch_sweep``."""
    if not plan.batches:
        r = _run_rows(report, impl, plan.shapes[impl], plan, warmup, steps, breakdown, comm_profile, me)
        if r is not None and me == 0:
            report["results"][impl] = r
        return
    sweep = []
    for rows in plan.batches:
        # one process tries every batch (running out of memory there is caught); several skip what will not fit
        why = _will_not_fit(sweep, rows) if sweep and plan.setup.world > 1 else None
        try:
            r = None if why else _run_rows(report, impl, dataclasses.replace(plan.shapes[impl], batch=rows),
                                           plan, warmup, steps, breakdown, comm_profile, me, in_sweep=True)
        except torch.cuda.OutOfMemoryError as error:  # several processes: all stop, the batches so far are kept
            sweep.append({"rows_per_rank": rows, "skipped": "out of memory: the run stopped here"})
            _keep_fastest(report, impl, sweep, me)
            why = (f"{impl} ran out of memory at {rows} rows per GPU, which the sweep's prediction let through; "
                   f"under {plan.setup.world} processes that stops the run. The report keeps what ran before it: "
                   f"rerun the rest with --batch below {rows}.")
            report["stopped"] = why
            raise RunStopped(report if me == 0 else None, why) from error
        if r is None:
            why = why or "out of memory"
            sweep += [{"rows_per_rank": rest, "skipped": why if rest == rows else f"after {rows} rows: {why}"}
                      for rest in plan.batches if rest >= rows]
            if me == 0:
                print(f"  {impl:20s} {rows} rows per GPU and more skipped: {why}", flush=True)
            break
        sweep.append(r)
    _keep_fastest(report, impl, sweep, me)


def _keep_fastest(report: dict, impl: str, sweep: list[dict], me: int) -> None:
    """Rank 0's report takes the sweep's fastest batch as the variant's figures, every batch under
    ``batch_sweep``."""
    measured = [e for e in sweep if "skipped" not in e]
    if me != 0:
        return
    if not measured:
        tried = [e["rows_per_rank"] for e in sweep]
        report.setdefault("out_of_memory", {})[impl] = f"out of memory at every batch of {tried}"
        return
    best = max(measured, key=lambda e: e["tokens_per_s"])
    report["results"][impl] = {**best, "batch_sweep": sweep}
    print(f"  {impl:20s} fastest at {best['rows_per_rank']} rows per GPU", flush=True)


# Largest share of a GPU's memory a sweep lets its predicted peak take: the rest is the allocator's slack
# (reserved over allocated: 5-20% in these runs) and other processes' contexts.
SWEEP_MEMORY_SHARE = 0.92


def _will_not_fit(measured: list[dict], rows: int) -> str | None:
    """Why ``rows`` per rank will not fit, from the batches measured so far (None: it will, or no GPU to tell).
    Peak memory is linear in the batch: through the last two measured peaks; after one, through it and what
    lives across steps (weights, gradients, optimizer states), which over-predicts where a transient part does
    not grow with the batch (FSDP2's gathered layers): start a sweep small enough to measure two. Each figure is
    the largest rank's, and every rank decides on the same gathered numbers, so all of them skip together (one
    rank out of memory would leave the others waiting in a collective)."""
    ranks = [r for e in measured[-2:] for r in e["ranks"]]
    if any(r.get("peak_gib") is None or r.get("resident_gib") is None for r in ranks):
        return None
    last = measured[-1]
    peak = max(r["peak_gib"] for r in last["ranks"])
    if len(measured) >= 2:
        before = measured[-2]
        slope = (peak - max(r["peak_gib"] for r in before["ranks"])) / (last["rows_per_rank"] - before["rows_per_rank"])
    else:
        slope = (peak - max(r["resident_gib"] for r in last["ranks"])) / last["rows_per_rank"]
    capacity = min(r["capacity_gib"] for r in ranks)
    predicted = peak + max(slope, 0.0) * (rows - last["rows_per_rank"])
    limit = SWEEP_MEMORY_SHARE * capacity
    if predicted <= limit:
        return None
    return (f"predicted peak {predicted:.1f} GiB per GPU over {limit:.1f} GiB ({SWEEP_MEMORY_SHARE:.0%} of "
            f"{capacity:.1f})")


def _run_rows(report: dict, impl: str, shape: TrainConfig, plan: _Plan, warmup: int, steps: int, breakdown: bool,
              comm_profile: bool, me: int, in_sweep: bool = False) -> dict | None:
    """``impl`` at ``shape``'s batch on every rank: its figures over the ranks (on every rank, so that all can
    decide a sweep's next batch alike), None if it ran out of memory (one process only: under several, every
    rank stops)."""
    setup = plan.setup
    shared = setup.shared_batch
    data = torch.Generator().manual_seed(0 if shared else me)  # each rank its own rows, unless they share them
    ids = torch.randint(shape.vocab, (shape.batch, shape.seq), generator=data).to(
        torch.device("cuda", torch.cuda.current_device()) if plan.device == "cuda" else "cpu")
    dtype = torch.bfloat16 if ids.is_cuda else torch.float32
    try:
        mine = measure(impl, shape, ids, warmup, steps, breakdown, dtype, setup=setup, comm_profile=comm_profile,
                       shared_by=setup.world if shared else 1)
    except torch.cuda.OutOfMemoryError:  # a peer that cannot run this batch: said in the report, the rest go on
        if setup.world > 1:  # the other ranks wait in a collective: stop them all
            raise
        if not in_sweep:
            report.setdefault("out_of_memory", {})[impl] = f"out of memory at batch {shape.batch}x{shape.seq}"
            print(f"  {impl:20s} out of memory at batch {shape.batch}x{shape.seq}", flush=True)
        gc.collect()
        torch.cuda.empty_cache()
        return None
    ranks = engines.gather({"rank": me, **{k: v for k, v in mine.items() if not k.startswith("breakdown")}})
    r = {"engine": setup.engine, "world": setup.world, "rows_per_rank": shape.batch, **engines.aggregate(ranks),
         **{k: v for k, v in mine.items() if k.startswith("breakdown")}}
    reference = _reference_tokens_per_s(plan.baseline, impl, shape.batch) if plan.baseline else None
    if reference:
        r["efficiency"] = r["tokens_per_s"] / reference
    if me == 0:
        peak = f"peak {r['peak_gib']:.1f} GiB  " if r["peak_gib"] is not None else ""
        rows = f" [{shape.batch} rows]" if in_sweep else ""
        print(f"  {impl:20s}{rows} {r['tokens_per_s'] / 1e3:8.1f}k tok/s per GPU  {r['tflops_per_gpu']:.1f} "
              f"TFLOP/s  {peak}first loss {r['first_step_loss']:.4f}", flush=True)
    return r


def _gib(value) -> str:
    return f"{value:.1f}" if value is not None else "n/a"


def to_markdown(report: dict) -> str:
    res = report["results"]
    table = _engine_table(report) if "engine" in report else _one_gpu_table(report)
    parts = [table] + [f"\n{impl}: {why}" for impl, why in report.get("out_of_memory", {}).items()]
    if report.get("shared_batch"):
        parts.append(f"\nThe {report['world']} ranks share one batch (transformers' expert parallelism on the "
                     f"tensor-parallel group): its tokens are counted once, split over the ranks.")
    for impl, r in res.items():
        if "breakdown_ms" in r:
            b = r["breakdown_ms"]
            total = b["step (hooked)"]
            parts.append(f"\n{impl}: one hooked step, GPU ms (share)\n\n" + markdown_table(
                ["category", "ms", "share"], [[k, f"{v:.1f}", f"{v / total:.0%}"] for k, v in b.items()]))
    return "\n".join(parts)


def _one_gpu_table(report: dict) -> str:
    """Reports from before --engine: one process, ratios against each family's baseline."""
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
    return markdown_table(["implementation", "tokens/s", "step ms", "peak GiB", "vs family baseline",
                           "peak vs baseline", "peak reserved GiB", "reserved vs baseline", "first-step loss"], rows)


def _engine_table(report: dict) -> str:
    """One row per variant: per-GPU throughput and model TFLOP/s (means over the ranks), the scaling efficiency
    against --baseline, peak memory and communication of the largest rank."""
    res = report["results"]
    efficiency = any("efficiency" in r for r in res.values())
    rows = []
    for impl, r in res.items():
        base = res.get(BASELINES[impl.split("-")[0]])
        comm = r["comm_ms"]
        rows.append([impl, r["engine"], r["world"], r["rows_per_rank"], f"{r['tokens_per_s'] / 1e3:.1f}k",
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "", f"{r['tflops_per_gpu']:.1f}"]
                    + ([f"{r['efficiency']:.0%}" if "efficiency" in r else ""] if efficiency else [])
                    + [f"{_gib(r['peak_gib'])} / {_gib(r['peak_reserved_gib'])}", f"{r['step_ms_median']:.1f}",
                       comm if isinstance(comm, str) else f"{comm['nccl_ms']:.1f} / {comm['exposed_comm_ms']:.1f}",
                       f"{r['first_step_loss']:.4f}"])
    return markdown_table(["variant", "engine", "world", "rows/rank", "tokens/s per GPU", "vs family default",
                           "model TFLOP/s per GPU"] + (["scaling efficiency"] if efficiency else [])
                          + ["peak GiB per GPU (allocated / reserved)", "step ms",
                             "NCCL / exposed comm ms per step", "first-step loss"], rows)


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


def combine_rows(reports: list[dict], command: str) -> dict:
    """One file for a multi-GPU table: the reports of its rows (one torchrun each), and the command that made them.
    A row that ran without ``--baseline`` gets its scaling efficiency from the file's unwrapped row of the same
    shape, where that row ran the same rows per GPU (``efficiency_from`` says so)."""
    unwrapped = {_row_name(r): r for r in reports if r.get("engine") == "none"}
    for report in reports:
        base = unwrapped.get(_row_name(report))
        if report.get("engine") == "none" or report.get("baseline") or base is None:
            continue
        for impl, r in report["results"].items():
            if "efficiency" not in r:
                reference = _reference_tokens_per_s(base, impl, r["rows_per_rank"])
                if reference:
                    r["efficiency"] = r["tokens_per_s"] / reference
                    r["efficiency_from"] = f"the unwrapped row of {base['date']}"
    return {"command": command, "rows": reports}


def _row_name(report: dict) -> str:
    c = report["config"]
    return f"{c.get('preset') or 'family shape'}, {c['layers']} layers"


def _engine_label(report: dict, short: bool = False) -> str:
    """The engine's name, with the FSDP2 settings a row changed from the defaults (``--reduce-dtype`` etc.);
    ``short`` (a plot's legend): only that some changed."""
    options = report.get("fsdp2") or {}
    changed = [text for text, on in (("bf16 reduce", options.get("reduce_dtype") == "bfloat16"),
                                     ("prefetch next", options.get("prefetch") == "next"),
                                     ("kept after forward", options.get("reshard_after_forward") is False)) if on]
    if not changed:
        return report["engine"]
    return f"{report['engine']}, tuned" if short else f"{report['engine']} ({', '.join(changed)})"


def _default_and_ours(report: dict) -> tuple[dict, dict] | None:
    """A row's family default (``BASELINES``) and plain hf-scatter variant; None if either has no figures
    (out of memory at every batch, or a run that stopped before it)."""
    res = report["results"]
    default = next((r for impl, r in res.items() if BASELINES[impl.split("-")[0]] == impl), None)
    ours = next((r for impl, r in res.items() if impl.split("-", 1)[1] == "hf-scatter"), None)
    return (default, ours) if default is not None and ours is not None else None


def scaling_table(combined: dict) -> str:
    """Rows of :func:`combine_rows`, one line per (shape, engine, GPUs): the family's transformers default and
    hf-scatter side by side; tokens/s per GPU (higher is better) and their ratio, model TFLOP/s per GPU, scaling
    efficiency against the unwrapped one-GPU run, peak allocated memory per GPU (max over ranks) and the
    communication no computation hid (exposed NCCL time, max over ranks), default / hf-scatter."""
    lines, incomplete = [], []
    for report in combined["rows"]:
        pair = _default_and_ours(report)
        if pair is None:
            incomplete.append(f"{_row_name(report)}, {_engine_label(report)}, {report['world']} GPUs")
            continue
        default, ours = pair
        exposed = [r["comm_ms"]["exposed_comm_ms"] if isinstance(r["comm_ms"], dict) else None
                   for r in (default, ours)]
        eff = [r.get("efficiency") for r in (default, ours)]
        rows = {r.get("rows_per_rank", report["rows_per_rank"]) for r in (default, ours)}
        lines.append([_row_name(report), _engine_label(report), report["world"],
                      rows.pop() if len(rows) == 1 else f"{default['rows_per_rank']} / {ours['rows_per_rank']}",
                      f"{default['tokens_per_s'] / 1e3:.1f}k", f"{ours['tokens_per_s'] / 1e3:.1f}k",
                      f"{ours['tokens_per_s'] / default['tokens_per_s']:.2f}x",
                      f"{default['tflops_per_gpu']:.0f} / {ours['tflops_per_gpu']:.0f}",
                      " / ".join("" if e is None else f"{e:.0%}" for e in eff) if any(e is not None for e in eff)
                      else "",
                      f"{_gib(default['peak_gib'])} / {_gib(ours['peak_gib'])}",
                      " / ".join("n/a" if e is None else f"{e:.0f}" for e in exposed),
                      _at_defaults_rows(default, ours), _within_defaults_peak(default, ours)])
    return markdown_table(["model layers", "engine", "GPUs", "rows per GPU (default / ours where they differ)",
                           "default tok/s per GPU",
                           "hf-scatter tok/s per GPU", "hf-scatter vs default", "TFLOP/s per GPU (default / ours)",
                           "scaling efficiency (default / ours)", "peak GiB per GPU (default / ours)",
                           "exposed comm ms per step (default / ours)",
                           "hf-scatter at the default's rows: vs default, peak GiB",
                           "hf-scatter's fastest within the default's peak: rows, vs default, peak GiB"], lines) + (
        f"\n\nRows without figures for both sides (left out): {'; '.join(incomplete)}." if incomplete else "")


def _at_defaults_rows(default: dict, ours: dict) -> str:
    """Where a sweep left the two sides at different batches: hf-scatter's speed ratio and peak memory at the
    default's batch (the like-for-like comparison beside the best-against-best one)."""
    rows = default.get("rows_per_rank")
    if ours.get("rows_per_rank") == rows:
        return ""
    same = next((e for e in ours.get("batch_sweep", ()) if e.get("rows_per_rank") == rows and "tokens_per_s" in e),
                None)
    if same is None:
        return "not run"
    return f"{same['tokens_per_s'] / default['tokens_per_s']:.2f}x, {_gib(same['peak_gib'])}"


def _within_defaults_peak(default: dict, ours: dict) -> str:
    """hf-scatter's fastest measured batch whose peak memory per GPU is at or below the default's at its fastest:
    the comparison at no more memory (blank where no batch of the sweep stayed within it)."""
    fits = [e for e in ours.get("batch_sweep") or [ours] if "tokens_per_s" in e and e.get("peak_gib") is not None
            and e["peak_gib"] <= default["peak_gib"]]
    if not fits:
        return ""
    best = max(fits, key=lambda e: e["tokens_per_s"])
    rows = best.get("rows_per_rank", ours.get("rows_per_rank"))
    return f"{rows}, {best['tokens_per_s'] / default['tokens_per_s']:.2f}x, {_gib(best['peak_gib'])}"


def plot_scaling(combined: dict, path: str) -> None:
    """Tokens/s per GPU against the GPU count, one panel per shape: each engine's default (grey) and hf-scatter
    (orange) line; the unwrapped one-GPU run as a dotted level."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(_row_name(r) for r in combined["rows"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 5.5), squeeze=False)
    styles = {"fsdp2": "-o", "ep": "--s", "zero3": ":^"}
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in combined["rows"] if _row_name(r) == shape]
        rows = [r for r in rows if _default_and_ours(r) is not None]
        for report in (r for r in rows if r["engine"] == "none"):
            for ours, r in enumerate(_default_and_ours(report)):
                ax.axhline(r["tokens_per_s"] / 1e3, color="tab:orange" if ours else "tab:gray", linestyle=":",
                           label=f"{'hf-scatter' if ours else 'default'}, unwrapped")
        for engine in dict.fromkeys(_engine_label(r, short=True) for r in rows if r["engine"] != "none"):
            series = sorted((r for r in rows if _engine_label(r, short=True) == engine), key=lambda r: r["world"])
            for ours in (0, 1):
                pick = [_default_and_ours(r)[ours] for r in series]
                ax.plot([r["world"] for r in series], [p["tokens_per_s"] / 1e3 for p in pick],
                        styles.get(engine, ":x"),
                        color="tab:orange" if ours else "tab:gray",
                        label=f"{'hf-scatter' if ours else 'default'}, {engine}")
        ax.set_xticks(sorted({r["world"] for r in rows}))
        ax.set_xlabel("GPUs")
        ax.set_ylabel("k tokens/s per GPU (higher is better)")
        ax.set_title(shape, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)  # below: never over a point
    first = combined["rows"][0]
    swept = any(isinstance(r["rows_per_rank"], list) for r in combined["rows"])
    rows = ("each side at its fastest batch" if swept
            else f"{first['config']['batch']} x {first['config']['seq']} tokens per GPU")
    fig.suptitle(f"Training step, {rows}, bf16 AdamW, {first['device']}", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)


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
    """A ``scripts/probes/probe_train_host_time.py`` report (``$OUT/train-host.json``): the host's issue time of one
    step, the GPU's work with the queue kept full, and the step as it runs."""
    rows = [[impl, f"{r['host_issue_ms']:.1f}", f"{r['gpu_ms_queue_full']:.1f}", f"{r['step_ms']:.1f}"]
            for impl, r in report.items()]
    return markdown_table(["implementation", "host issue ms", "GPU ms (queue full)", "step ms"], rows)


def plot(report: dict, path: str) -> None:
    """Tokens/s (per GPU, under an engine) and peak memory per implementation, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = report["results"]
    names = list(res)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    colors = ["tab:orange" if "hf-scatter" in n else "tab:gray" for n in names]
    axes[0].barh(names, [res[n]["tokens_per_s"] / 1e3 for n in names], color=colors)
    axes[0].set_xlabel(f"k tokens/s{' per GPU' if 'engine' in report else ''} (higher is better)")
    reserved = [res[n].get("peak_reserved_gib") or 0.0 for n in names]
    if any(reserved):  # graph replays allocate nothing: their pool only shows in reserved memory
        axes[1].barh(names, reserved, color="none", edgecolor="black", hatch="//", label="reserved")
    axes[1].barh(names, [res[n]["peak_gib"] or 0.0 for n in names], color=colors, label="allocated")
    axes[1].set_xlabel("peak GiB (lower is better)" if any(res[n]["peak_gib"] for n in names) else
                       "peak GiB: not measured on the CPU")
    if any(reserved):
        axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    for ax in axes:
        ax.invert_yaxis()
    configs = report.get("configs") or {"": report["config"]}
    where = report["device"] if report.get("world", 1) == 1 else f"{report['world']} x {report['device']}"
    engine = f", {report['engine']}" if report.get("engine", "none") != "none" else ""
    if len(configs) == 1:
        c = next(iter(configs.values()))
        name = f"{c['preset']}'s dimensions, {c['layers']} layers" if c.get("preset") else f"{c['layers']}-layer MoE"
        fig.suptitle(f"Training step, {name} (d {c['hidden']}, d_expert {c['intermediate']}, E {c['experts']}, k "
                     f"{c['top_k']}), batch {c['batch']}x{c['seq']}{engine}, "
                     f"{report.get('dtype', 'bfloat16').replace('bfloat16', 'bf16')} AdamW, {where}")
    else:
        fig.suptitle(f"Training step of each family at its own ~1-2B shape{engine}, bf16 AdamW, {where}")
    fig.tight_layout()
    save_figure(fig, path)
