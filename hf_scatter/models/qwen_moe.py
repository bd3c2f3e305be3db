"""Qwen3-MoE, Qwen2-MoE and OLMoE: softmax -> top-k -> optional renormalisation (``norm_topk_prob``), Llama-style
RMSNorm (Qwen3's and OLMoE's q/k norms included), experts on the ``"scattermoe"`` backend. Qwen2-MoE's shared
expert and its sigmoid gate run as transformers has them, inside the (optionally graphed) MoE block."""

from __future__ import annotations

from transformers.models.olmoe import modeling_olmoe as olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3

from .decoder_moe import DecoderFamily, register_decoder_family, softmax_topk_router_forward

QWEN3_MOE = register_decoder_family(DecoderFamily(
    model_type="qwen3_moe", pretrained=qwen3.Qwen3MoePreTrainedModel, decoder_layer=qwen3.Qwen3MoeDecoderLayer,
    moe_block=qwen3.Qwen3MoeSparseMoeBlock, router=qwen3.Qwen3MoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=qwen3.Qwen3MoeRMSNorm, attention=qwen3.Qwen3MoeAttention))

QWEN2_MOE = register_decoder_family(DecoderFamily(
    model_type="qwen2_moe", pretrained=qwen2.Qwen2MoePreTrainedModel, decoder_layer=qwen2.Qwen2MoeDecoderLayer,
    moe_block=qwen2.Qwen2MoeSparseMoeBlock, router=qwen2.Qwen2MoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=qwen2.Qwen2MoeRMSNorm, attention=qwen2.Qwen2MoeAttention))

OLMOE = register_decoder_family(DecoderFamily(
    model_type="olmoe", pretrained=olmoe.OlmoePreTrainedModel, decoder_layer=olmoe.OlmoeDecoderLayer,
    moe_block=olmoe.OlmoeSparseMoeBlock, router=olmoe.OlmoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=olmoe.OlmoeRMSNorm, attention=olmoe.OlmoeAttention))
