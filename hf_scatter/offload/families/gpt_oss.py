"""GPT-OSS under offloading: Llama-style shapes and split, plus its biases (q/k/v, o, router and both expert
projections), its attention sinks and sliding-window layers (``layer_types``), its half-width rotary tables
and its clamped SwiGLU experts."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels.mxfp4 import GROUP, Mxfp4Weight
from ...kernels.router_select import gpt_oss_selection, router_select
from ...kernels.swiglu import GateForm, gpt_oss_gate
from ...models.mxfp4_experts import Mxfp4GptOssExperts
from ...moe.mlp import FusedSwiGLU, expert_mlp
from .adapter import LayerAttention, layer_windows
from .llama_style import LlamaStyleConstants, LlamaStylePipelineAdapter
from .registry import OffloadFamily
from .spec import llama_style_spec


@dataclass(frozen=True)
class GptOssConstants(LlamaStyleConstants):
    """The Llama-style constants plus each layer's attention sinks and the experts' clamped gate over [gate; up]
    columns (read from the experts: transformers before 5.19 fixes alpha and limit there, not in the config)."""

    gate: GateForm

    @classmethod
    def of(cls, model: nn.Module, **fields):
        layers = model.model.layers
        attention = tuple(LayerAttention(window=window, sinks=layer.self_attn.sinks.detach().float().cpu().clone())
                          for window, layer in zip(layer_windows(model.config), layers))
        experts = layers[0].mlp.experts
        gate = gpt_oss_gate(float(experts.alpha), float(experts.limit))._replace(interleaved=False)
        return super().of(model, attention=attention, gate=gate, **fields)


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
    and the clamped gate runs fused over it; the output projection's bias is added once, outside the parts.

    Experts loaded as shipped (:class:`~hf_scatter.models.mxfp4_experts.Mxfp4GptOssExperts`) stay MXFP4: their
    blocks and scales get the same column layout (the [gate; up] projection's rows are its columns; the down
    projection's columns are its groups of 32), are stored and streamed as bytes, and the expert kernels decode
    each part in registers."""

    model_type = "gpt_oss"
    column_dims = {"gate_up": 2, "gate_up_bias": 2, "down": 2,  # [E, 2, I, H], [E, 2, I], [E, H, I]
                   # MXFP4: [E, 2, I, H/32, 16], [E, 2, I, H/32], [E, H, I/32, 16], [E, H, I/32]
                   "gate_up_blocks": 2, "gate_up_scales": 2, "down_blocks": 2, "down_scales": 2}
    column_units = {"down_blocks": GROUP, "down_scales": GROUP}
    norm_casting = "gpt_oss"

    def read_expert_format(self, model) -> str:
        return "mxfp4" if isinstance(model.model.layers[0].mlp.experts, Mxfp4GptOssExperts) else ""

    def read_constants(self, model) -> GptOssConstants:
        return GptOssConstants.of(model)

    def _rotary_module(self):
        return FullWidthRotary(super()._rotary_module())

    def post_tensors(self, layer):
        mlp = layer.mlp
        return {**self._attention_out_tensors(layer), "router": mlp.router.weight, "router_bias": mlp.router.bias,
                "down_bias": mlp.experts.down_proj_bias}

    def expert_tensors(self, layer):
        experts = layer.mlp.experts
        if (self.full_dims.expert_format == "mxfp4") != isinstance(experts, Mxfp4GptOssExperts):
            raise NotImplementedError("offloading needs every layer's experts in one format; this model mixes "
                                      "MXFP4 and float experts")
        bias = experts.gate_up_proj_bias  # [E, 2I], interleaved
        E, two_i = bias.shape
        gate_up_bias = bias.view(E, two_i // 2, 2).transpose(1, 2)  # [E, 2, I]
        if isinstance(experts, Mxfp4GptOssExperts):
            blocks, scales = experts.gate_up_proj_blocks, experts.gate_up_proj_scales  # [E, 2I, H/32, 16], [.., H/32]
            return {"gate_up_blocks": blocks.unflatten(1, (-1, 2)).transpose(1, 2),  # [E, 2, I, H/32, 16]
                    "gate_up_scales": scales.unflatten(1, (-1, 2)).transpose(1, 2),  # [E, 2, I, H/32]
                    "gate_up_bias": gate_up_bias,
                    "down_blocks": experts.down_proj_blocks,  # [E, H, I/32, 16]
                    "down_scales": experts.down_proj_scales}  # [E, H, I/32]
        gate_up = experts.gate_up_proj  # [E, H, 2I]
        return {"gate_up": gate_up.view(E, -1, two_i // 2, 2).permute(0, 3, 2, 1),  # [E, 2, I, H]
                "gate_up_bias": gate_up_bias,
                "down": experts.down_proj.transpose(1, 2)}  # [E, H, I]

    def _select(self, logits):
        return router_select(logits, self.dims.top_k, gpt_oss_selection())

    def _experts(self, part, x, experts, gates, routing):
        if "gate_up_blocks" in part:  # MXFP4, in the kernels' [E, d_in, d_out] reading
            E, _, c = part["gate_up_blocks"].shape[:3]
            w_in = Mxfp4Weight(part["gate_up_blocks"].flatten(1, 2), part["gate_up_scales"].flatten(1, 2))  # [E, H, 2c]
            w_out = Mxfp4Weight(part["down_blocks"], part["down_scales"])  # [E, c, H]
        else:
            E, _, c, H = part["gate_up"].shape
            w_in = part["gate_up"].view(E, 2 * c, H).transpose(1, 2)  # [E, H, 2c]: [gate; up] columns
            w_out = part["down"].transpose(1, 2)  # [E, c, H]
        return expert_mlp(x, (w_in,), w_out, experts, gates, FusedSwiGLU(self.constants.gate),
                          b_in=(part["gate_up_bias"].reshape(E, 2 * c),), validate=False, routing=routing)


FAMILIES = (OffloadFamily("gpt_oss", spec=functools.partial(llama_style_spec, family="gpt_oss"),
                          adapter=GptOssPipelineAdapter),)
