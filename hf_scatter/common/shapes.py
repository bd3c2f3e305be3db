"""Named model shapes the benchmarks, the planner and random checkpoints share: each written once.

Keys follow :func:`hf_scatter.tiny.tiny_mixtral_config`'s arguments, so ``tiny_mixtral_config(**shape)``
builds the shape (with any number of layers).
"""

from __future__ import annotations

# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1's config.json)
MIXTRAL_8X7B = dict(hidden=4096, intermediate=14336, experts=8, top_k=2, heads=32, kv_heads=8, vocab=32000)
MIXTRAL_8X7B_LAYERS = 32


__all__ = ["MIXTRAL_8X7B", "MIXTRAL_8X7B_LAYERS"]
