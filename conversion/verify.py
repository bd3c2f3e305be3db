"""``--verify``: the converted checkpoint must compute what the HF one computes.

The HF side loads into vanilla transformers, the hf-scatter side into a patched model; one model is in
memory at a time. Both load in the same dtype, so the only differences left are the kernels' rounding.
"""

from __future__ import annotations

import torch

from .safetensors_io import ConversionError

# max |logits difference| allowed, relative to the largest |logit| (kernel rounding only)
_RTOL = {torch.float32: 1e-4, torch.float64: 1e-8}
_RTOL_HALF = 5e-2  # bf16 keeps 8 bits: rounding through a few layers, not a wrong tensor (those give O(1))


def _logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def verify_logits(hf_dir: str, scatter_dir: str, dtype: torch.dtype | None = None, batch: int = 2,
                  seq_len: int = 32, seed: int = 0) -> float:
    """Max abs logits difference on random tokens; raises :class:`ConversionError` above tolerance."""
    from transformers import AutoModelForCausalLM

    import hf_scatter

    vanilla = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype or "auto").eval()
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vanilla.config.vocab_size, (batch, seq_len), generator=gen)
    reference = _logits(vanilla, tokens)
    model_dtype = vanilla.dtype
    del vanilla
    patched = hf_scatter.from_pretrained(scatter_dir, dtype=dtype or "auto").eval()
    diff = (_logits(patched, tokens) - reference).abs().max().item()
    tol = _RTOL.get(model_dtype, _RTOL_HALF) * max(1.0, reference.abs().max().item())
    if not diff <= tol:
        raise ConversionError(f"verify failed: logits of {scatter_dir} (patched) differ from {hf_dir} (vanilla) "
                              f"by {diff:.3g} on random tokens (tolerance {tol:.3g} for {model_dtype})")
    return diff
