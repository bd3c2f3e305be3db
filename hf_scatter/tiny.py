"""Tiny random models of every family hf-scatter patches, and a byte-level tokenizer, built offline.

Tests, the demo and the eval harness need real transformers models without a hub download: these
builders make them from configs in milliseconds, seeded, with odd sizes on request.
"""

from __future__ import annotations

import functools

import torch

TINY_VOCAB = 384

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Mixture-of-experts models route each token to a few "
    "experts. ScatterMoE groups tokens by expert without padding. BERT encodes sentences of varied length. "
    "Offloaded generation pages weights from pinned host memory while the CPU computes attention. "
    "0123456789 +-*/=()[]{}<>.,;:!?'\" hello world, tokens and layers, training and inference."
)


def byte_level_tokenizer(vocab_size: int = TINY_VOCAB):
    """A byte-level BPE tokenizer trained on an embedded corpus (every byte encodes: no unknown tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<pad>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def _seeded(build, seed: int, dtype: torch.dtype):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.to(dtype).eval()


def tiny_mixtral_config(hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                        intermediate: int = 96, heads: int = 4, kv_heads: int = 2, vocab: int = TINY_VOCAB, **extra):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        num_local_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=256,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def tiny_dbrx_config(hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                     intermediate: int = 96, heads: int = 4, kv_heads: int = 2, vocab: int = TINY_VOCAB,
                     normalize_expert_weights: float | None = 1.0, jitter_eps: float | None = None, **extra):
    from transformers import DbrxConfig

    return DbrxConfig(
        d_model=hidden, n_heads=heads, n_layers=layers, max_seq_len=256, vocab_size=vocab,
        attn_config={"kv_n_heads": kv_heads, "clip_qkv": 8.0, "rope_theta": 10000.0},
        ffn_config={"hidden_size": hidden, "ffn_hidden_size": intermediate, "moe_num_experts": experts,
                    "moe_top_k": top_k, "moe_normalize_expert_weights": normalize_expert_weights,
                    "moe_jitter_eps": jitter_eps},
        pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)


def tiny_bert_config(hidden: int = 64, layers: int = 2, heads: int = 4, intermediate: int = 128,
                     vocab: int = TINY_VOCAB, **extra):
    from transformers import BertConfig

    return BertConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      intermediate_size=intermediate, max_position_embeddings=512, pad_token_id=0, **extra)


def tiny_mixtral(seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A random ``MixtralForCausalLM``; keyword arguments go to :func:`tiny_mixtral_config`."""
    from transformers import MixtralForCausalLM

    return _seeded(lambda: MixtralForCausalLM(tiny_mixtral_config(**config)), seed, dtype)


def tiny_dbrx(seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A random ``DbrxForCausalLM``; keyword arguments go to :func:`tiny_dbrx_config`."""
    from transformers import DbrxForCausalLM

    return _seeded(lambda: DbrxForCausalLM(tiny_dbrx_config(**config)), seed, dtype)


def tiny_bert(seed: int = 0, dtype: torch.dtype = torch.float32, head: str = "base", **config):
    """A random BERT: ``head`` is 'base', 'sequence-classification', 'token-classification' or 'masked-lm'."""
    import transformers

    classes = {"base": "BertModel", "sequence-classification": "BertForSequenceClassification",
               "token-classification": "BertForTokenClassification", "masked-lm": "BertForMaskedLM"}
    if head not in classes:
        raise ValueError(f"tiny_bert: unknown head {head!r}; choose one of {sorted(classes)}")
    cls = getattr(transformers, classes[head])
    return _seeded(lambda: cls(tiny_bert_config(**config)), seed, dtype)


def _decoder(hidden, layers, heads, kv_heads, vocab) -> dict:
    return dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                num_key_value_heads=kv_heads, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                eos_token_id=2)


def _qwen3_moe(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    return "Qwen3MoeConfig", dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate,
                                  head_dim=hidden // heads, num_experts=experts, num_experts_per_tok=top_k,
                                  norm_topk_prob=True)


def _qwen2_moe(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    return "Qwen2MoeConfig", dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate,
                                  shared_expert_intermediate_size=intermediate + 8, num_experts=experts,
                                  num_experts_per_tok=top_k, norm_topk_prob=False)


def _olmoe(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    return "OlmoeConfig", dict(intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=top_k)


def _deepseek(version):
    def config(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
        groups = 2 if experts % 2 == 0 and experts >= 4 else 1  # group-limited routing at tiny sizes
        extra = dict(topk_method="group_limited_greedy") if version == 2 else dict(norm_topk_prob=True)
        return f"DeepseekV{version}Config", dict(
            intermediate_size=2 * intermediate, moe_intermediate_size=intermediate, n_routed_experts=experts,
            num_experts_per_tok=top_k, n_shared_experts=1, first_k_dense_replace=1, n_group=groups, topk_group=1,
            routed_scaling_factor=1.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=hidden // heads, num_key_value_heads=heads, **extra)

    return config


_LINEAR_ATTENTION = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                         linear_value_head_dim=16, linear_conv_kernel_dim=4)  # the gated delta net's, tiny


def _qwen3_next(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    """Qwen3-Next's hybrid stack: linear-attention (gated delta net) layers with a full-attention layer every
    second one, each with a routed MoE and a shared expert."""
    return "Qwen3NextConfig", dict(intermediate_size=2 * intermediate, moe_intermediate_size=intermediate,
                                   shared_expert_intermediate_size=intermediate + 8, num_experts=experts,
                                   num_experts_per_tok=top_k, norm_topk_prob=True, head_dim=hidden // heads,
                                   full_attention_interval=2, **_LINEAR_ATTENTION)


def _qwen3_5_moe(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    """Qwen3.5-MoE's text model: Qwen3-Next's hybrid stack (here linear attention, then full attention)."""
    kinds = ["linear_attention", "full_attention"] * (layers // 2) + ["linear_attention"] * (layers % 2)
    return "Qwen3_5MoeTextConfig", dict(moe_intermediate_size=intermediate,
                                        shared_expert_intermediate_size=intermediate + 8, num_experts=experts,
                                        num_experts_per_tok=top_k, head_dim=hidden // heads, layer_types=kinds,
                                        **_LINEAR_ATTENTION)


def _gpt_oss(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    return "GptOssConfig", dict(intermediate_size=intermediate, num_local_experts=experts, num_experts_per_tok=top_k,
                                head_dim=hidden // heads, sliding_window=8,
                                rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _granitemoe(hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab):
    return "GraniteMoeConfig", dict(intermediate_size=intermediate, num_local_experts=experts,
                                    num_experts_per_tok=top_k, residual_multiplier=0.7, embedding_multiplier=2.0,
                                    attention_multiplier=0.3, logits_scaling=1.5)


# model_type -> (hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab) -> (config class, kwargs)
_DECODER_CONFIGS = {"qwen3_moe": _qwen3_moe, "qwen2_moe": _qwen2_moe, "olmoe": _olmoe, "deepseek_v3": _deepseek(3),
                    "deepseek_v2": _deepseek(2), "gpt_oss": _gpt_oss, "granitemoe": _granitemoe,
                    "qwen3_next": _qwen3_next, "qwen3_5_moe_text": _qwen3_5_moe}
DECODER_FAMILIES = tuple(_DECODER_CONFIGS)


def tiny_decoder_config(family: str, hidden: int = 64, layers: int = 2, experts: int = 4, top_k: int = 2,
                        intermediate: int = 96, heads: int = 4, kv_heads: int = 2, vocab: int = TINY_VOCAB, **extra):
    """A tiny config of one of :data:`DECODER_FAMILIES` (DeepSeek's first layer is dense, so it gets one more
    layer: ``layers`` counts MoE layers everywhere)."""
    import transformers

    if family not in _DECODER_CONFIGS:
        raise ValueError(f"tiny_decoder_config: unknown family {family!r}; choose one of {', '.join(DECODER_FAMILIES)}")
    cls, kwargs = _DECODER_CONFIGS[family](hidden, layers, experts, top_k, intermediate, heads, kv_heads, vocab)
    layers += family.startswith("deepseek")
    return getattr(transformers, cls)(**{**_decoder(hidden, layers, heads, kv_heads, vocab), **kwargs, **extra})


def tiny_decoder(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config):
    """A random ``AutoModelForCausalLM`` of ``family``; keyword arguments go to :func:`tiny_decoder_config`."""
    from transformers import AutoModelForCausalLM

    return _seeded(lambda: AutoModelForCausalLM.from_config(tiny_decoder_config(family, **config)), seed, dtype)


TINY_BUILDERS = {"mixtral": tiny_mixtral, "dbrx": tiny_dbrx, "bert": tiny_bert,
                 **{family: functools.partial(tiny_decoder, family) for family in DECODER_FAMILIES}}


__all__ = ["DECODER_FAMILIES", "TINY_BUILDERS", "TINY_VOCAB", "byte_level_tokenizer", "tiny_bert", "tiny_bert_config",
           "tiny_dbrx", "tiny_dbrx_config", "tiny_decoder", "tiny_decoder_config", "tiny_mixtral",
           "tiny_mixtral_config"]
