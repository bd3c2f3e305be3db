"""Named model shapes the benchmarks, the planner and random checkpoints share: each written once.

Keys follow :func:`hf_scatter.tiny.tiny_mixtral_config`'s arguments, so ``tiny_mixtral_config(**shape)``
builds a Mixtral shape (with any number of layers).
"""

from __future__ import annotations

# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1's config.json)
MIXTRAL_8X7B = dict(hidden=4096, intermediate=14336, experts=8, top_k=2, heads=32, kv_heads=8, vocab=32000)
MIXTRAL_8X7B_LAYERS = 32

# One MoE block of today's fine-grained families (their published config.json files): hidden size, expert
# intermediate size, routed experts, experts per token, and always-on shared experts of the same size.
MOE_BLOCKS = {
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, experts=128, top_k=8),  # Qwen/Qwen3-30B-A3B
    "olmoe-1b-7b": dict(hidden=2048, intermediate=1024, experts=64, top_k=8),  # allenai/OLMoE-1B-7B-0924
    "deepseek-v2-lite": dict(hidden=2048, intermediate=1408, experts=64, top_k=6, shared_experts=2),
    "gpt-oss-20b": dict(hidden=2880, intermediate=2880, experts=32, top_k=4),  # openai/gpt-oss-20b
}


__all__ = ["MIXTRAL_8X7B", "MIXTRAL_8X7B_LAYERS", "MOE_BLOCKS"]
