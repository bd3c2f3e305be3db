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


def build_model(layers: int, seed: int = 0, model: str = DEFAULT_MODEL):
    """A causal LM of built-in shape ``model`` with ``layers`` layers, random bf16 weights (std 0.02, norms 1),
    built without running transformers' initialisation on billions of parameters."""
    from transformers import AutoModelForCausalLM

    from ..common.shapes import builtin_config

    config = builtin_config(model, num_hidden_layers=layers)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    lm = lm.to_empty(device="cpu").eval()
    g = torch.Generator().manual_seed(seed)
    block = (torch.randn(2 * FILL_BLOCK, generator=g) * 0.02).to(torch.bfloat16)
    shift = 0
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.fill_(1.0)
                continue
            flat = p.view(-1)
            for start in range(0, flat.numel(), FILL_BLOCK):
                n = min(FILL_BLOCK, flat.numel() - start)
                shift = (shift + 7919) % FILL_BLOCK
                flat[start:start + n].copy_(block[shift:shift + n])
        for buffer in lm.buffers():  # left uninitialised by to_empty (DeepSeek-V3's score-correction bias: 0)
            buffer.zero_()
    rotary = lm.model.rotary_emb
    lm.model.rotary_emb = type(rotary)(config)  # its tables, computed again
    return lm


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
