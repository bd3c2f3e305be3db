"""The backends the parity harness compares, each a way to turn one checkpoint into an lm-eval model.

``vanilla`` is transformers as it is (lm-eval's ``hf`` model), ``patched`` the same checkpoint through
the ``hf-scatter`` lm-eval model, ``eager`` transformers with its eager experts loop (a noise floor),
``offloaded`` the checkpoint through :func:`hf_scatter.offload` (the ``hf-scatter-offloaded`` lm-eval
model). A new backend is one :func:`register_backend` call with a function from :class:`LoadSettings` to
an lm-eval model.
BERT-family encoders are scored by pseudo-log-likelihood (``masked_lm.py``) in every backend alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class LoadSettings:
    model: str  # checkpoint directory (absolute)
    tokenizer: str  # tokenizer directory (absolute)
    dtype: str  # "float32", "bfloat16", "float16" or "auto"
    device: str
    batch_size: int
    max_length: int | None = None
    encoder: bool = False  # a masked LM (BERT family): pseudo-log-likelihood scoring, no generation
    seed: int = 0  # weights missing from the checkpoint initialise identically in every backend
    gpu_memory: str = "16GiB"  # the offloaded backend's GPU budget
    profile: str | None = None  # the offloaded backend's hardware profile (default: this machine's saved one)
    # log-probabilities are computed and summed in this dtype: float64 for a float32 model, whose differences
    # would otherwise drown in float32's rounding of a document's sum (its steps reach 6e-5 at a sum of -600)
    scoring_dtype: str = "float32"


@dataclass(frozen=True)
class Backend:
    name: str
    label: str  # column header in the report
    build: Callable[[LoadSettings], object] | None  # None: not available in this version
    unavailable_reason: str = ""
    # why this backend cannot run the checkpoint of this config.json (None: it can), asked before any model loads
    refuses: Callable[[dict], str | None] = lambda config: None


class BackendUnavailable(RuntimeError):
    pass


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    BACKENDS[backend.name] = backend
    return backend


def _seeded(settings: LoadSettings):
    import torch

    torch.manual_seed(settings.seed)


def _causal(settings: LoadSettings, patched: bool):
    _seeded(settings)
    if patched:
        from .lm_model import HFScatterLM as cls
    else:
        from lm_eval.models.huggingface import HFLM as cls
    pretrained, loaded_as = settings.model, None
    if not patched and (why := _fp8_kernel_missing(settings)) is not None:
        pretrained, loaded_as = _dequantized_fp8(settings), f"FP8 dequantized by transformers ({why})"
    # log-softmax in fp32: lm-eval's default (the model's dtype) rounds every log-probability to bf16, which
    # would bury kernel differences under quantisation steps of up to 0.5 on a sum of -100
    lm = cls(pretrained=pretrained, tokenizer=settings.tokenizer, dtype=settings.dtype, device=settings.device,
             batch_size=settings.batch_size, max_length=settings.max_length, softmax_dtype=settings.scoring_dtype)
    _float32_throughout(lm.model, settings.dtype)
    lm.loaded_as = loaded_as
    return lm


def _fp8_kernel_missing(settings: LoadSettings) -> str | None:
    """Why transformers cannot run this block-scaled FP8 checkpoint as FP8 here, or None (it can, or the checkpoint
    is not FP8). On CUDA its FP8 layers call a kernel it fetches from the Hub (``kernels-community/finegrained-fp8``
    through the ``kernels`` package); offline, or without ``kernels``, the first forward would fail. On the CPU it
    dequantizes by itself."""
    import json
    import os

    if not str(settings.device).startswith("cuda"):
        return None
    with open(os.path.join(settings.model, "config.json")) as f:
        quantization = json.load(f).get("quantization_config") or {}
    if quantization.get("quant_method") != "fp8" or quantization.get("dequantize"):
        return None
    try:
        from transformers.integrations.finegrained_fp8 import load_finegrained_fp8_kernel

        load_finegrained_fp8_kernel()
    except Exception as e:  # noqa: BLE001 (ImportError, or the Hub unreachable: either way it cannot run FP8)
        return f"its FP8 kernel did not load: {str(e).splitlines()[0].split('. ')[0]}"
    return None


def _dequantized_fp8(settings: LoadSettings):
    """The checkpoint through transformers' own FP8 loader with ``dequantize=True``: the weights' values in the
    model's dtype, computed by transformers' own layers (what it does on the CPU)."""
    import json
    import os

    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers import AutoQuantizationConfig

    with open(os.path.join(settings.model, "config.json")) as f:
        quantization = AutoQuantizationConfig.from_dict({**json.load(f)["quantization_config"], "dequantize": True})
    dtype = "auto" if settings.dtype == "auto" else getattr(torch, settings.dtype)
    model = AutoModelForCausalLM.from_pretrained(settings.model, dtype=dtype, quantization_config=quantization)
    return model.to(settings.device).eval()


def _float32_throughout(model, dtype) -> None:
    """A float32 evaluation computes in float32 everywhere: transformers 5.17 dequantizes MXFP4 experts to bf16
    whatever dtype was asked (their values are the format's, exact in either), which would put bf16 rounding into
    the comparison. Casting up loses nothing; other dtypes are left as loaded (float32 routers stay float32), and
    so are weights kept as shipped in an 8-bit float format (FP8 checkpoints: their kernels decode them)."""
    import torch

    if dtype not in ("float32", torch.float32):
        return
    for param in model.parameters():
        if param.is_floating_point() and param.dtype.itemsize > 1 and param.dtype != torch.float32:
            param.data = param.data.to(torch.float32)


def _masked(settings: LoadSettings, patched: bool):
    from .masked_lm import MaskedLMScorer

    _seeded(settings)
    return MaskedLMScorer(settings.model, tokenizer=settings.tokenizer, dtype=settings.dtype, device=settings.device,
                          batch_size=settings.batch_size, max_length=settings.max_length, patch=patched,
                          scoring_dtype=settings.scoring_dtype)


def _build(patched: bool) -> Callable[[LoadSettings], object]:
    return lambda s: (_masked if s.encoder else _causal)(s, patched)


def _eager_experts(settings: LoadSettings):
    """transformers with its own eager (per-expert loop) experts: the rounding noise between two of
    transformers' implementations, a floor to read hf-scatter's differences against."""
    from hf_scatter.models import is_interface_experts

    if settings.encoder:
        raise BackendUnavailable("the eager backend swaps MoE experts; this checkpoint has none")
    lm = _causal(settings, patched=False)
    if not any(is_interface_experts(m) for m in lm.model.modules()):
        raise BackendUnavailable(f"the eager backend needs experts behind transformers' experts_implementation "
                                 f"switch (Mixtral-style); {type(lm.model).__name__} has none")
    lm.model.set_experts_implementation("eager")
    return lm


def _offload_refuses(config: dict) -> str | None:
    from hf_scatter.offload import offloaded_model_types

    if config.get("model_type") not in offloaded_model_types():
        return (f"the offloaded backend runs the causal MoE families {', '.join(offloaded_model_types())}; this "
                f"checkpoint is model_type {config.get('model_type')!r}")
    return None


def _offloaded(settings: LoadSettings):
    """The checkpoint through hf_scatter.offload (CGOPipe) within ``settings.gpu_memory``."""
    if settings.encoder:
        raise BackendUnavailable("the offloaded backend runs causal MoE language models; this checkpoint is a "
                                 "masked LM")
    _seeded(settings)
    from .offloaded_lm import OffloadedLM

    try:
        return OffloadedLM(pretrained=settings.model, tokenizer=settings.tokenizer, dtype=settings.dtype,
                           device=settings.device, batch_size=settings.batch_size, max_length=settings.max_length,
                           softmax_dtype=settings.scoring_dtype, gpu_memory=settings.gpu_memory,
                           profile=settings.profile)
    except (FileNotFoundError, NotImplementedError) as e:  # no hardware profile; a family offload cannot run
        raise BackendUnavailable(str(e)) from e


def _patch_refuses(config: dict) -> str | None:
    """An architecture hf-scatter does not patch is named before the reference backend's whole evaluation."""
    import hf_scatter

    try:
        hf_scatter.check_supported(config)
    except ValueError as e:
        return str(e).removeprefix("hf_scatter: ")
    return None


register_backend(Backend("vanilla", "vanilla", _build(False)))
register_backend(Backend("patched", "hf-scatter", _build(True), refuses=_patch_refuses))
register_backend(Backend("eager", "hf eager experts", _eager_experts))
register_backend(Backend("offloaded", "offloaded", _offloaded, refuses=_offload_refuses))


def resolve(names: list[str]) -> list[Backend]:
    """The named backends, checked before anything loads; the first is the reference."""
    unknown = [n for n in names if n not in BACKENDS]
    if unknown:
        raise BackendUnavailable(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    if len(names) < 2 or len(set(names)) != len(names):
        raise BackendUnavailable(f"--backends needs at least two different backends (the first is the reference), "
                                 f"got {','.join(names)}")
    for name in names:
        if BACKENDS[name].build is None:
            raise BackendUnavailable(f"backend {name!r} is not available yet: {BACKENDS[name].unavailable_reason}")
    return [BACKENDS[n] for n in names]
