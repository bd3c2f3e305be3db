"""Qwen3-MoE, Qwen2-MoE, OLMoE, Qwen3-Next and Qwen3.5-MoE: softmax -> top-k -> optional renormalisation
(``norm_topk_prob``; Qwen3.5-MoE always renormalises), Llama-style RMSNorm (Qwen3's and OLMoE's q/k norms included),
experts on the ``"scattermoe"`` backend. The shared expert and its sigmoid gate (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)
run as transformers has them (the SwiGLU fused, as in dense layers), inside the (optionally graphed) MoE block;
offloaded Qwen2-MoE adds them to the routed experts itself. Qwen3-Next and Qwen3.5-MoE keep their own norms (``(1 + weight)`` scaling, rounded after
the weight), attention and linear attention; their routers and experts are fused."""

from __future__ import annotations

import functools

from transformers.models.olmoe import modeling_olmoe as olmoe
from transformers.models.qwen2_moe import modeling_qwen2_moe as qwen2
from transformers.models.qwen3_moe import modeling_qwen3_moe as qwen3
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as qwen3_5
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..kernels.norms import fused_add_rms_norm
from ..moe.mlp import glu_activation
from .decoder_moe import (DecoderFamily, register_decoder_family, renormalized_softmax_topk_router_forward,
                          softmax_topk_router_forward)
from .pipeline_adapter import LayerAttention, LlamaStylePipelineAdapter, dense_mlp, layer_windows, mlp_tensors
from .spec import llama_style_spec


class QwenStylePipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Qwen3-MoE and OLMoE: Mixtral's split plus their q/k RMSNorms before the rotary
    embedding (Qwen3: per head, over ``head_dim``; OLMoE: over the whole projection, then ``clip_qkv``)."""

    gates_in_logits_dtype = True

    def pre_tensors(self, layer):
        a = layer.self_attn
        return {**super().pre_tensors(layer), "q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight}

    def _normalize_qk(self, w, qkv):
        d, eps = self.dims, self.model.config.rms_norm_eps
        for part, norm in ((slice(0, d.q_dim), w["q_norm"]), (slice(d.q_dim, d.q_dim + d.kv_dim), w["k_norm"])):
            states = qkv[:, part]
            rows = states.reshape(-1, norm.shape[0])  # [T * heads, head_dim] (Qwen3) or [T, heads * head_dim]
            states.copy_(fused_add_rms_norm(rows, None, norm, eps=eps, validate=False).view(states.shape))
        clip = getattr(self.model.config, "clip_qkv", None)
        if clip is not None:
            qkv.clamp_(min=-clip, max=clip)


class Qwen3MoePipelineAdapter(QwenStylePipelineAdapter):
    model_type = "qwen3_moe"


class OlmoePipelineAdapter(QwenStylePipelineAdapter):
    model_type = "olmoe"


class Qwen2MoePipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Qwen2-MoE: Mixtral's split with q/k/v biases, the shared expert (scaled by its
    sigmoid gate) added to the routed experts as dense tensors of the layer, and sliding windows on the layers
    ``layer_types`` names."""

    model_type = "qwen2_moe"
    gates_in_logits_dtype = True

    def __init__(self, model):
        super().__init__(model)
        self._glu = glu_activation(ACT2FN[model.config.hidden_act])  # the shared expert's act(gate) * up

    def layer_attention(self):
        return [LayerAttention(window=window) for window in layer_windows(self.model.config)]

    def post_tensors(self, layer):
        mlp = layer.mlp
        return {**super().post_tensors(layer), **mlp_tensors("shared", mlp.shared_expert),
                "shared_gate": mlp.shared_expert_gate.weight}  # [1, H]

    def _mlp(self, w, expert_parts, normed, fetch=None):
        shared = torch.sigmoid(F.linear(normed, w["shared_gate"])) * dense_mlp(w, "shared", normed, self._glu)
        return super()._mlp(w, expert_parts, normed, fetch) + shared


QWEN3_MOE = register_decoder_family(DecoderFamily(
    model_type="qwen3_moe", pretrained=qwen3.Qwen3MoePreTrainedModel, decoder_layer=qwen3.Qwen3MoeDecoderLayer,
    moe_block=qwen3.Qwen3MoeSparseMoeBlock, router=qwen3.Qwen3MoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=qwen3.Qwen3MoeRMSNorm, attention=qwen3.Qwen3MoeAttention,
    dense_mlp=qwen3.Qwen3MoeMLP),
    pipeline_adapter=Qwen3MoePipelineAdapter, spec=functools.partial(llama_style_spec, family="qwen3_moe"))

QWEN2_MOE = register_decoder_family(DecoderFamily(
    model_type="qwen2_moe", pretrained=qwen2.Qwen2MoePreTrainedModel, decoder_layer=qwen2.Qwen2MoeDecoderLayer,
    moe_block=qwen2.Qwen2MoeSparseMoeBlock, router=qwen2.Qwen2MoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=qwen2.Qwen2MoeRMSNorm, attention=qwen2.Qwen2MoeAttention,
    dense_mlp=qwen2.Qwen2MoeMLP),
    pipeline_adapter=Qwen2MoePipelineAdapter, spec=functools.partial(llama_style_spec, family="qwen2_moe"))

OLMOE = register_decoder_family(DecoderFamily(
    model_type="olmoe", pretrained=olmoe.OlmoePreTrainedModel, decoder_layer=olmoe.OlmoeDecoderLayer,
    moe_block=olmoe.OlmoeSparseMoeBlock, router=olmoe.OlmoeTopKRouter,
    router_forward=softmax_topk_router_forward, norm=olmoe.OlmoeRMSNorm, attention=olmoe.OlmoeAttention),
    pipeline_adapter=OlmoePipelineAdapter, spec=functools.partial(llama_style_spec, family="olmoe"))

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
