"""What ``bench offload`` runs on, in one process or in each rank of a torchrun: a model of a built-in shape with
random weights, and MTBench-like requests (prompt lengths uniform in 40..114 tokens, mean 77)."""

from __future__ import annotations

import random

import torch

DEFAULT_MODEL = "mixtral-8x7b"
PROMPT_LENS = (40, 114)  # MTBench-like: mean 77 tokens
FILL_BLOCK = (1 << 24) + 11  # elements of the random block the weights are tiled from (odd: no two experts alike)


def offload_models() -> list[str]:
    """Built-in shapes of the families the offloaded runtime runs."""
    from ..common.shapes import BUILTIN_MODELS, builtin_config
    from ..offload.families.registry import offloaded_model_types

    return [name for name in BUILTIN_MODELS if builtin_config(name).model_type in offloaded_model_types()]


def build_model(layers: int, seed: int = 0, model: str = DEFAULT_MODEL, weights: str = "bf16"):
    """A causal LM of built-in shape ``model`` with ``layers`` layers, random bf16 weights (std 0.02, norms 1),
    built without running transformers' initialisation on billions of parameters. ``weights="mxfp4"`` (GPT-OSS)
    or ``"fp8"`` (block-scaled): the experts as a checkpoint loaded as shipped holds them (random bytes and
    scales), with no bf16 copy at any time, so a model whose bf16 experts exceed host memory builds too."""
    from transformers import AutoModelForCausalLM

    from ..common.shapes import builtin_config
    from ..kernels.fp8_blocks import RANDOM_SCALE
    from ..kernels.mxfp4 import RANDOM_EXPONENTS

    config = builtin_config(model, num_hidden_layers=layers)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
        if weights == "mxfp4":
            _mxfp4_experts_on_meta(lm)
        elif weights not in ("fp8", "bf16"):
            raise ValueError(f"weights must be bf16, mxfp4 or fp8, got {weights!r}")
        lm = lm.to(torch.bfloat16)  # the float tensors (MXFP4 bytes stay uint8), before FP8 ones exist
        if weights == "fp8":
            _fp8_experts_on_meta(lm)
    lm = lm.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(2 * FILL_BLOCK, generator=g) * 0.02).to(torch.bfloat16)
    e4m3 = torch.randint(0, 255, (2 * FILL_BLOCK,), generator=g, dtype=torch.uint8)
    packed = {"blocks": torch.randint(0, 256, (2 * FILL_BLOCK,), generator=g, dtype=torch.uint8),
              "scales": torch.randint(*RANDOM_EXPONENTS, (2 * FILL_BLOCK,), generator=g, dtype=torch.uint8),
              "fp8": torch.where((e4m3 & 0x7F) == 0x7F, e4m3 - 1, e4m3).view(torch.float8_e4m3fn),  # no NaN code
              "scale_inv": torch.full((2 * FILL_BLOCK,), RANDOM_SCALE)}
    shift = 0
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            if name.endswith("scale_inv"):
                source = packed["scale_inv"]
            elif p.dtype == torch.float8_e4m3fn:
                source = packed["fp8"]
            else:
                source = packed[name.rsplit("_", 1)[-1]] if p.dtype == torch.uint8 else block
            flat = p.view(-1)
            for start in range(0, flat.numel(), FILL_BLOCK):
                n = min(FILL_BLOCK, flat.numel() - start)
                shift = (shift + 7919) % FILL_BLOCK
                flat[start:start + n].copy_(source[shift:shift + n])
        for buffer in lm.buffers():  # left uninitialised by to_empty (DeepSeek-V3's score-correction bias: 0)
            buffer.zero_()
    rotary = lm.model.rotary_emb
    lm.model.rotary_emb = type(rotary)(config)  # its tables, computed again
    return lm


def _mxfp4_experts_on_meta(lm) -> None:
    """GPT-OSS's experts replaced by their as-shipped MXFP4 modules, as the quantizer does before a load."""
    from ..models.mxfp4_experts import Mxfp4GptOssExperts

    if lm.config.model_type != "gpt_oss":
        raise ValueError(f"weights='mxfp4' is GPT-OSS's shipped format; {lm.config.model_type} ships in bf16")
    for i, layer in enumerate(lm.model.layers):
        lm.model.set_submodule(f"layers.{i}.mlp.experts", Mxfp4GptOssExperts(lm.config))


def _fp8_experts_on_meta(lm) -> None:
    """Every experts module replaced by transformers' FP8 experts (128 x 128 blocks), as a block-scaled release
    loaded as shipped holds them; the dense layers stay bf16 (offloading decodes a release's FP8 ones into the
    same bf16 values)."""
    from ..models.fp8_experts import fp8_experts_module

    for i, layer in enumerate(lm.model.layers):
        if hasattr(layer.mlp, "experts"):
            lm.model.set_submodule(f"layers.{i}.mlp.experts", fp8_experts_module(lm.config))


def bench_profile(profile: str | None, model: str, progress: bool):
    """The hardware profile a run plans with, and the seconds it took: ``profile`` (a known name or JSON) or, by
    default, measured here, the CPU attention at ``model``'s own shape included (a given profile has only its own
    points)."""
    import time

    from ..offload import ModelSpec, load_profile, measure_profile

    start = time.perf_counter()
    prof = load_profile(profile) if profile else measure_profile(progress=progress,
                                                                 attention_shapes=[ModelSpec.from_config(model)])
    return prof, time.perf_counter() - start


def prompts(count: int, vocab: int, seed: int = 0) -> list[torch.Tensor]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (rng.randint(*PROMPT_LENS),), generator=g) for _ in range(count)]


def left_padded(requests: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    longest = max(len(r) for r in requests)
    ids = torch.zeros(len(requests), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(requests):
        ids[i, longest - len(r):] = r
        mask[i, longest - len(r):] = 1
    return ids, mask
