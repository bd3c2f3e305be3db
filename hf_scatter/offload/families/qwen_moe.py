"""Qwen3-MoE, OLMoE and Qwen2-MoE under offloading: Llama-style shapes (Qwen2-MoE's shared expert included) and
Mixtral's split, plus Qwen3's and OLMoE's q/k norms, or Qwen2-MoE's biases, shared expert and sliding windows."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.norms import fused_add_rms_norm
from .adapter import LayerAttention, dense_mlp, layer_windows, linear_weight, mlp_tensors
from .llama_style import LlamaStyleConstants, LlamaStylePipelineAdapter
from .registry import OffloadFamily
from .spec import llama_style_spec


@dataclass(frozen=True)
class QwenStyleConstants(LlamaStyleConstants):
    """The Llama-style constants plus OLMoE's clamp after the q/k norms (None: none, as Qwen3-MoE)."""

    clip_qkv: float | None

    @classmethod
    def of(cls, model: nn.Module, **fields):
        return super().of(model, clip_qkv=getattr(model.config, "clip_qkv", None), **fields)


class QwenStylePipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Qwen3-MoE and OLMoE: Mixtral's split plus their q/k RMSNorms before the rotary
    embedding (Qwen3: per head, over ``head_dim``; OLMoE: over the whole projection, then ``clip_qkv``)."""

    gates_in_logits_dtype = True
    qk_norms_span_heads = False  # Qwen3: per head; OLMoE: over the whole projection

    def read_constants(self, model) -> QwenStyleConstants:
        return QwenStyleConstants.of(model)

    def pre_tensors(self, layer):
        a = layer.self_attn
        return {**super().pre_tensors(layer), "q_norm": a.q_norm.weight, "k_norm": a.k_norm.weight}

    def _normalize_qk(self, w, qkv):
        d, k = self.dims, self.constants
        parts = ((slice(0, d.q_dim), w["q_norm"]), (slice(d.q_dim, d.q_dim + d.kv_dim), w["k_norm"]))
        if self.shard.whole or not self.qk_norms_span_heads:
            for part, norm in parts:
                states = qkv[:, part]
                rows = states.reshape(-1, norm.shape[0])  # [T * heads, head_dim] (Qwen3) or [T, heads * head_dim]
                states.copy_(fused_add_rms_norm(rows, None, norm, eps=k.norm_eps, validate=False).view(states.shape))
        else:
            self._normalize_qk_over_group(qkv, parts)
        if k.clip_qkv is not None:
            qkv.clamp_(min=-k.clip_qkv, max=k.clip_qkv)

    def _normalize_qk_over_group(self, qkv, parts):
        """OLMoE's q/k norms span every head, and this rank holds only its heads' columns: each projection's sum
        of squares over the group (one small all-reduce of [T, 2]), then the norm of the rank's columns, rounded
        as the whole norm rounds (``weight * (x.float() * rstd).to(x.dtype)``)."""
        squares = torch.stack([qkv[:, part].float().square().sum(-1) for part, _ in parts], dim=1)  # [T, 2]
        self.shard.reduce(squares)
        for i, ((part, norm), width) in enumerate(zip(parts, (self.full_dims.q_dim, self.full_dims.kv_dim))):
            rstd = torch.rsqrt(squares[:, i:i + 1] / width + self.constants.norm_eps)  # [T, 1]
            states = qkv[:, part]
            states.copy_(norm * (states.float() * rstd).to(states.dtype))


class Qwen3MoePipelineAdapter(QwenStylePipelineAdapter):
    model_type = "qwen3_moe"


class OlmoePipelineAdapter(QwenStylePipelineAdapter):
    model_type = "olmoe"
    qk_norms_span_heads = True


class Qwen2MoePipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Qwen2-MoE: Mixtral's split with q/k/v biases, the shared expert (scaled by its
    sigmoid gate) added to the routed experts as dense tensors of the layer, and sliding windows on the layers
    ``layer_types`` names."""

    model_type = "qwen2_moe"
    gates_in_logits_dtype = True

    def read_constants(self, model) -> LlamaStyleConstants:
        windows = layer_windows(model.config)
        return LlamaStyleConstants.of(model, attention=tuple(LayerAttention(window=window) for window in windows))

    def post_tensors(self, layer):
        mlp = layer.mlp
        return {**super().post_tensors(layer), **mlp_tensors("shared", mlp.shared_expert, self.float_dtype),
                "shared_gate": linear_weight(mlp.shared_expert_gate, self.float_dtype)}  # [1, H]

    def _mlp(self, w, expert_parts, normed, fetch=None):
        shared = torch.sigmoid(F.linear(normed, w["shared_gate"])) * dense_mlp(w, "shared", normed, self.constants.glu)
        return super()._mlp(w, expert_parts, normed, fetch) + shared


FAMILIES = tuple(OffloadFamily(model_type, spec=functools.partial(llama_style_spec, family=model_type), adapter=adapter)
                 for model_type, adapter in (("qwen3_moe", Qwen3MoePipelineAdapter),
                                             ("qwen2_moe", Qwen2MoePipelineAdapter), ("olmoe", OlmoePipelineAdapter)))
