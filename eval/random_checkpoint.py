"""Random-weight checkpoints of known shapes, for ``hf-scatter eval --random SHAPE`` (no download needed).

Parity needs no trained weights: both backends get the same bytes. A Mixtral-8x7B- or Qwen3-30B-A3B-shaped
model with a few layers exercises the real expert sizes (coarse and fine-grained); the tiny shapes, one per
family, are for CPU checks. Each checkpoint is saved with the offline byte-level tokenizer, like a hub
directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

import torch

from hf_scatter.tiny import TINY_BUILDERS

from .runner import ParityError


def _published(name: str, layers: int):
    """The planner's built-in config of ``name`` (its published config.json) with ``layers`` layers and the
    byte-level tokenizer's special tokens, as the tiny configs have them."""
    from hf_scatter.common.shapes import builtin_config

    return builtin_config(name, num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _full_size_configs() -> dict:
    """Published shapes with any number of layers (attention, experts and vocabulary as released)."""
    from hf_scatter.common.shapes import MIXTRAL_8X7B
    from hf_scatter.tiny import tiny_mixtral_config

    return {"mixtral-8x7b": lambda layers: tiny_mixtral_config(layers=layers, **MIXTRAL_8X7B),
            "qwen3-30b-a3b": lambda layers: _published("qwen3-30b-a3b", layers)}


FULL_SIZE = ("mixtral-8x7b", "qwen3-30b-a3b")  # bf16 by default; the others are tiny CPU shapes
TINY = tuple(TINY_BUILDERS)  # every family, as tiny-FAMILY
SHAPES = (*FULL_SIZE, *(f"tiny-{family}" for family in TINY))


def save_random_checkpoint(shape: str, path: str, layers: int = 2, dtype: torch.dtype = torch.bfloat16,
                           device: str = "cpu", seed: int = 0) -> str:
    """Build ``shape`` with ``layers`` layers (weights drawn on ``device``, which is faster on a GPU), save it
    and the tokenizer into ``path``; returns a one-line description."""
    from transformers import AutoModelForCausalLM

    from hf_scatter.tiny import byte_level_tokenizer, tiny_bert

    if shape not in SHAPES:
        raise ParityError(f"unknown random shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if layers < 1:
        raise ParityError(f"--random-layers must be at least 1, got {layers}")
    tokenizer = byte_level_tokenizer()
    if shape in FULL_SIZE:
        config = _full_size_configs()[shape](layers)
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    elif shape == "tiny-bert":
        tokenizer.add_special_tokens({"mask_token": "<mask>"})  # masked-LM scoring needs one
        model = tiny_bert(seed=seed, dtype=dtype, head="masked-lm", layers=layers, vocab=len(tokenizer))
    else:
        model = TINY_BUILDERS[shape.removeprefix("tiny-")](seed=seed, dtype=dtype, layers=layers)
    model.save_pretrained(path, max_shard_size="5GB")
    tokenizer.save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    return f"random {shape}, {layers} layer(s), {params / 1e9:.2f}B parameters, seed {seed}"


@contextlib.contextmanager
def temporary_random_checkpoint(shape: str, layers: int = 2, dtype: torch.dtype = torch.bfloat16,
                                device: str = "cpu", workdir: str | None = None):
    """Yields (directory, description) of a random checkpoint that is removed afterwards."""
    root = tempfile.mkdtemp(prefix="hf-scatter-eval-", dir=workdir)
    try:
        path = os.path.join(root, shape)
        yield path, save_random_checkpoint(shape, path, layers=layers, dtype=dtype, device=device)
    finally:
        shutil.rmtree(root, ignore_errors=True)
