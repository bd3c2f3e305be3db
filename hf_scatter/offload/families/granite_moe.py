"""Granite-MoE under offloading: Llama-style shapes, and Mixtral's split under the names of its
``block_sparse_moe`` with its four scalars where vanilla applies them: the embedding multiplied by
``embedding_multiplier``, the softmax scale ``attention_multiplier`` (not ``head_dim ** -0.5``), both residual
branches by ``residual_multiplier``, and the logits divided by ``logits_scaling``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from ...kernels.router_select import gpt_oss_selection, router_select
from .adapter import LayerAttention
from .llama_style import LlamaStyleConstants, LlamaStylePipelineAdapter
from .registry import OffloadFamily
from .spec import llama_style_spec


@dataclass(frozen=True)
class GraniteMoeConstants(LlamaStyleConstants):
    """The Llama-style constants plus Granite's multipliers (the attention's is each layer's softmax scale)."""

    embedding_multiplier: float
    residual_multiplier: float
    logits_scaling: float

    @classmethod
    def of(cls, model: nn.Module, **fields):
        c = model.config
        return super().of(model, attention=(LayerAttention(scale=c.attention_multiplier),) * c.num_hidden_layers,
                          embedding_multiplier=c.embedding_multiplier, residual_multiplier=c.residual_multiplier,
                          logits_scaling=c.logits_scaling, **fields)


class GraniteMoePipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Granite-MoE: Mixtral's split under the names of its ``block_sparse_moe``, with
    its multipliers where vanilla applies them (same rounding: each scales a tensor in the activations' dtype)."""

    model_type = "granitemoe"

    def read_constants(self, model) -> GraniteMoeConstants:
        return GraniteMoeConstants.of(model)

    def layers(self):
        return list(self.model.model.layers)  # every Granite-MoE layer holds experts

    def post_tensors(self, layer):
        return {**self._attention_out_tensors(layer), "router": layer.block_sparse_moe.router.weight}

    def expert_tensors(self, layer):
        experts = layer.block_sparse_moe.experts  # [E, 2I, H] ([gate; up]) and [E, H, I]
        E, two_i, H = experts.gate_up_proj.shape
        return {"gate_up": experts.gate_up_proj.view(E, 2, two_i // 2, H), "down": experts.down_proj}

    def embed(self, other, ids):
        return super().embed(other, ids) * self.constants.embedding_multiplier

    def _attention_output(self, w, attn):
        return super()._attention_output(w, attn) * self.constants.residual_multiplier

    def _mlp(self, w, expert_parts, normed, fetch=None):
        return super()._mlp(w, expert_parts, normed, fetch) * self.constants.residual_multiplier

    def _select(self, logits):
        """Top-k of the float32 logits, a softmax over the kept, weights in the activations' dtype."""
        return router_select(logits.float(), self.dims.top_k, gpt_oss_selection(), out_dtype=logits.dtype)

    def logits(self, other, x):
        """Divided by ``logits_scaling`` in the activations' dtype, as vanilla rounds, before the float32 cast."""
        return (F.linear(self._final_norm(other, x), other["lm_head"]) / self.constants.logits_scaling).float()


FAMILIES = (OffloadFamily("granitemoe", spec=functools.partial(llama_style_spec, family="granitemoe"),
                          adapter=GraniteMoePipelineAdapter),)
