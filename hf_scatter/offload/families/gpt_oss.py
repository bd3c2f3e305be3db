"""GPT-OSS under offloading: Llama-style shapes and split, plus its biases (q/k/v, o, router and both expert
projections), its attention sinks and sliding-window layers (``layer_types``), its half-width rotary tables
and its clamped SwiGLU experts."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from ...kernels.router_select import gpt_oss_selection, router_select
from ...kernels.swiglu import GateForm, gpt_oss_gate
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
    and the clamped gate runs fused over it; the output projection's bias is added once, outside the parts."""

    model_type = "gpt_oss"
    column_dims = {"gate_up": 2, "gate_up_bias": 2, "down": 2}  # [E, 2, I, H], [E, 2, I], [E, H, I]
    norm_casting = "gpt_oss"

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
        return expert_mlp(x, (w_in,), part["down"].transpose(1, 2), experts, gates, FusedSwiGLU(self.constants.gate),
                          b_in=(part["gate_up_bias"].reshape(E, 2 * c),), validate=False, routing=routing)


FAMILIES = (OffloadFamily("gpt_oss", spec=functools.partial(llama_style_spec, family="gpt_oss"),
                          adapter=GptOssPipelineAdapter),)
