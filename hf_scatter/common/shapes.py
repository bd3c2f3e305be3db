"""The one table of published model shapes: the planner's built-in models, the benchmarks' MoE blocks and the
random checkpoints all read it, so each shape is written once.

:data:`BUILTIN_MODELS` holds each model as its transformers config class and keyword arguments (no hub access,
so ``hf-scatter plan --model mixtral-8x7b`` works on any machine); :func:`builtin_config` builds the config.
:data:`MIXTRAL_8X7B` and :data:`MOE_BLOCKS` are views of it in the keys of
:func:`hf_scatter.tiny.tiny_mixtral_config`'s arguments, so ``tiny_mixtral_config(**shape)`` builds a Mixtral
shape (with any number of layers).
"""

from __future__ import annotations

# Published configs of the models users plan for, as (transformers config class, keyword arguments).
BUILTIN_MODELS: dict[str, tuple[str, dict]] = {
    # mistralai/Mixtral-8x7B-v0.1's config.json
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=32768, rope_theta=1e6)),
    "mixtral-8x22b": ("MixtralConfig", dict(
        hidden_size=6144, intermediate_size=16384, num_hidden_layers=56, num_attention_heads=48,
        num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
        max_position_embeddings=65536, rope_theta=1e6)),
    "dbrx": ("DbrxConfig", dict(
        d_model=6144, n_heads=48, n_layers=40, max_seq_len=32768, vocab_size=100352,
        attn_config={"kv_n_heads": 8, "clip_qkv": 8.0, "rope_theta": 500000.0},
        ffn_config={"ffn_hidden_size": 10752, "moe_num_experts": 16, "moe_top_k": 4})),
    # fine-grained: Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, allenai/OLMoE-1B-7B-0924
    "qwen3-30b-a3b": ("Qwen3MoeConfig", dict(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
        num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6)),
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
        num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        norm_topk_prob=True, vocab_size=151936, max_position_embeddings=40960, rope_theta=1e6)),
    "olmoe-1b-7b": ("OlmoeConfig", dict(
        hidden_size=2048, intermediate_size=1024, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=16, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
        max_position_embeddings=4096, rope_theta=10000.0)),
    # openai/gpt-oss-20b, openai/gpt-oss-120b: the rest (head_dim 64, sliding window 128 on every other layer,
    # YaRN rope, biases, clamped SwiGLU) are GptOssConfig's defaults
    "gpt-oss-20b": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, max_position_embeddings=131072)),
    "gpt-oss-120b": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=128, num_experts_per_tok=4, vocab_size=201088,
        sliding_window=128, max_position_embeddings=131072)),
    # deepseek-ai/DeepSeek-V2-Lite and DeepSeek-V3 (shapes; their YaRN rope scaling is left out, it changes no size)
    "deepseek-v2-lite": ("DeepseekV2Config", dict(
        hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6,
        first_k_dense_replace=1, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, topk_method="greedy", n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False,
        vocab_size=102400, max_position_embeddings=163840)),
    "deepseek-v3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
        num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1,
        num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, n_group=8, topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True,
        vocab_size=129280, max_position_embeddings=163840)),
    "llama-3-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)),
}


def builtin_config(name: str, **overrides):
    """The transformers config object of a built-in model name; ``overrides`` (e.g. ``num_hidden_layers``) go to
    the constructor, so what the config derives from them (GPT-OSS's ``layer_types``) follows."""
    import transformers

    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown built-in model {name!r}: choose one of {', '.join(BUILTIN_MODELS)}")
    cls_name, kwargs = BUILTIN_MODELS[name]
    return getattr(transformers, cls_name)(**{**kwargs, **overrides})


def moe_block(name: str) -> dict:
    """One MoE block of built-in model ``name`` (a Llama-style config): hidden size, one expert's intermediate
    size, routed experts, experts per token, and the always-on shared experts of the same size where it has any."""
    _, c = BUILTIN_MODELS[name]
    block = dict(hidden=c["hidden_size"], intermediate=c.get("moe_intermediate_size") or c["intermediate_size"],
                 experts=c.get("num_local_experts") or c.get("num_experts") or c["n_routed_experts"],
                 top_k=c["num_experts_per_tok"])
    if c.get("n_shared_experts"):
        block["shared_experts"] = c["n_shared_experts"]
    return block


_MIXTRAL_8X7B = BUILTIN_MODELS["mixtral-8x7b"][1]
# Mixtral-8x7B as tiny_mixtral_config takes it (any number of layers)
MIXTRAL_8X7B = dict(**moe_block("mixtral-8x7b"), heads=_MIXTRAL_8X7B["num_attention_heads"],
                    kv_heads=_MIXTRAL_8X7B["num_key_value_heads"], vocab=_MIXTRAL_8X7B["vocab_size"])
MIXTRAL_8X7B_LAYERS = _MIXTRAL_8X7B["num_hidden_layers"]

# One MoE block of today's fine-grained families
MOE_BLOCKS = {name: moe_block(name) for name in ("qwen3-30b-a3b", "olmoe-1b-7b", "deepseek-v2-lite", "gpt-oss-20b")}


__all__ = ["BUILTIN_MODELS", "MIXTRAL_8X7B", "MIXTRAL_8X7B_LAYERS", "MOE_BLOCKS", "builtin_config", "moe_block"]
