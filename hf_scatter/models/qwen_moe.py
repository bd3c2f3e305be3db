"""Qwen3-MoE, Qwen2-MoE, OLMoE, Qwen3-Next and Qwen3.5-MoE: softmax -> top-k -> optional renormalisation
(``norm_topk_prob``; Qwen3.5-MoE always renormalises), Llama-style RMSNorm (Qwen3's and OLMoE's q/k norms included),
experts on the ``"scattermoe"`` backend. The shared expert and its sigmoid gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)
run as transformers has them (the SwiGLU fused, as in dense layers), inside the (optionally graphed) MoE block.
Qwen3-Next and Qwen3.5-MoE keep their own norms (``(1 + weight)`` scaling, rounded after the weight), attention
and linear attention; their routers and experts are fused."""

from __future__ import annotations

from transformers.models.olmoe import modeling_olmoe as olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from .decoder_moe import (DecoderFamily, register_decoder_family, renormalized_softmax_topk_router_forward,
                          softmax_topk_router_forward)


QWEN3_MOE = register_decoder_family(DecoderFamily(
    model_type="qwen3_moe", pretrained=qwen3.Qwen3MoePreTrainedModel, decoder_layer=qwen3.Qwen3MoeDecoderLayer,
    moe_block=qwen3.Qwen3MoeSparseMoeBlock, router=qwen3.Qwen3MoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=qwen3.Qwen3MoeRMSNorm, attention=qwen3.Qwen3MoeAttention,
    dense_mlp=qwen3.Qwen3MoeMLP))

QWEN2_MOE = register_decoder_family(DecoderFamily(
    model_type="qwen2_moe", pretrained=qwen2.Qwen2MoePreTrainedModel, decoder_layer=qwen2.Qwen2MoeDecoderLayer,
    moe_block=qwen2.Qwen2MoeSparseMoeBlock, router=qwen2.Qwen2MoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=qwen2.Qwen2MoeRMSNorm, attention=qwen2.Qwen2MoeAttention,
    dense_mlp=qwen2.Qwen2MoeMLP))

OLMOE = register_decoder_family(DecoderFamily(
    model_type="olmoe", pretrained=olmoe.OlmoePreTrainedModel, decoder_layer=olmoe.OlmoeDecoderLayer,
    moe_block=olmoe.OlmoeSparseMoeBlock, router=olmoe.OlmoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=olmoe.OlmoeRMSNorm, attention=olmoe.OlmoeAttention))

QWEN3_NEXT = register_decoder_family(DecoderFamily(
    model_type="qwen3_next", pretrained=qwen3_next.Qwen3NextPreTrainedModel,
    decoder_layer=qwen3_next.Qwen3NextDecoderLayer, moe_block=qwen3_next.Qwen3NextSparseMoeBlock,
    router=qwen3_next.Qwen3NextTopKRouter, router_forward=softmax_topk_router_forward, norm=None,
    dense_mlp=qwen3_next.Qwen3NextMLP))

# The text causal LM ("qwen3_5_moe_text"), and the same class under the multimodal checkpoints' model_type, which
# AutoModelForCausalLM loads as the text model; the multimodal model's language layers are the same classes.
QWEN3_5_MOE = [register_decoder_family(DecoderFamily(
    model_type=model_type, pretrained=qwen3_5.Qwen3_5MoePreTrainedModel, decoder_layer=qwen3_5.Qwen3_5MoeDecoderLayer,
    moe_block=qwen3_5.Qwen3_5MoeSparseMoeBlock, router=qwen3_5.Qwen3_5MoeTopKRouter,
    router_forward=renormalized_softmax_topk_router_forward, norm=None, dense_mlp=qwen3_5.Qwen3_5MoeMLP))
    for model_type in ("qwen3_5_moe_text", "qwen3_5_moe")]
