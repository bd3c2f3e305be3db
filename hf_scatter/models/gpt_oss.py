"""GPT-OSS: top-k of the router logits, then a softmax over the kept (the selection kernel), experts on the
``"scattermoe"`` backend (its biased, interleaved, clamped experts run fused). Attention sinks are untouched.

Its RMSNorm multiplies by its weight before rounding to the activations' dtype (Llama-style norms round
first): its norms, and the post-attention add + norm of its decoder layers, run the fused kernel in that
casting (``norm_casting="gpt_oss"``). Its MoE block returns the router scores with the hidden states, so it
is not graphed (``moe_graphs``).

Offloaded generation splits its layer like the Llama-style families, plus its biases (q/k/v, o, router and
both expert projections), its attention sinks and sliding-window layers (``layer_types``), and its half-width
rotary tables.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

from ..kernels.router_select import gpt_oss_selection, router_select
from ..kernels.swiglu import gpt_oss_gate
from ..moe.mlp import FusedSwiGLU, expert_mlp
from .decoder_moe import DecoderFamily, register_decoder_family
from .pipeline_adapter import LayerAttention, LlamaStylePipelineAdapter, layer_windows
from .spec import llama_style_spec


def gpt_oss_router_forward(self, hidden_states: torch.Tensor):
    router_logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
    weights, indices = router_select(router_logits, self.top_k, gpt_oss_selection())
    return router_logits, weights, indices


class FullWidthRotary(nn.Module):
    """GPT-OSS's rotary module gives cos/sin over half the head ([.., d / 2], its rotation pairs the two halves
    of a head); the pipeline rotates with full-width tables, which are the half tables twice."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        cos, sin = self.rotary(x, position_ids)  # [B, T, d / 2] each
        return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


class GptOssPipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of GPT-OSS. The experts' interleaved [g0, u0, g1, u1, ...] columns are read as a
    [gate; up] view (a strided copy when packed), so a column range of every expert is a smaller GPT-OSS expert
    and the clamped gate runs fused over it; the output projection's bias is added once, outside the parts."""

    model_type = "gpt_oss"
    column_dims = {"gate_up": 2, "gate_up_bias": 2, "down": 2}  # [E, 2, I, H], [E, 2, I], [E, H, I]
    norm_casting = "gpt_oss"

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self._attention = [LayerAttention(window=window, sinks=layer.self_attn.sinks.detach().float().cpu().clone())
                           for window, layer in zip(layer_windows(model.config), model.model.layers)]

    def layer_attention(self):
        return list(self._attention)

    def rotary(self, device):
        return FullWidthRotary(super().rotary(device))

    def post_tensors(self, layer):
        mlp = layer.mlp
        return {**self._attention_out_tensors(layer), "router": mlp.router.weight, "router_bias": mlp.router.bias,
                "down_bias": mlp.experts.down_proj_bias}

    def expert_tensors(self, layer):
        experts = layer.mlp.experts
        # the columns are regrouped as [gate; up] below
        self._gate = gpt_oss_gate(float(experts.alpha), float(experts.limit))._replace(interleaved=False)
        gate_up, bias = experts.gate_up_proj, experts.gate_up_proj_bias  # [E, H, 2I], [E, 2I], interleaved
        E, H, two_i = gate_up.shape
        return {"gate_up": gate_up.view(E, H, two_i // 2, 2).permute(0, 3, 2, 1),  # [E, 2, I, H]
                "gate_up_bias": bias.view(E, two_i // 2, 2).transpose(1, 2),  # [E, 2, I]
                "down": experts.down_proj.transpose(1, 2)}  # [E, H, I]

    def _select(self, logits):
        return router_select(logits, self.dims.top_k, gpt_oss_selection())

    def _experts(self, part, x, experts, gates, routing):
        E, _, c, H = part["gate_up"].shape
        w_in = part["gate_up"].view(E, 2 * c, H).transpose(1, 2)  # [E, H, 2c]: [gate; up] columns
        return expert_mlp(x, (w_in,), part["down"].transpose(1, 2), experts, gates, FusedSwiGLU(self._gate),
                          b_in=(part["gate_up_bias"].reshape(E, 2 * c),), validate=False, routing=routing)


GPT_OSS = register_decoder_family(DecoderFamily(
    model_type="gpt_oss", pretrained=gpt_oss.GptOssPreTrainedModel, decoder_layer=gpt_oss.GptOssDecoderLayer,
    moe_block=gpt_oss.GptOssMLP, router=gpt_oss.GptOssTopKRouter, router_forward=gpt_oss_router_forward,
    norm=gpt_oss.GptOssRMSNorm, norm_casting="gpt_oss", graphs=False, attention=gpt_oss.GptOssAttention,
    rope_full_head=True),
    pipeline_adapter=GptOssPipelineAdapter, spec=functools.partial(llama_style_spec, family="gpt_oss"))
