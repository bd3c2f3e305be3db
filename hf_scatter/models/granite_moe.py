"""Granite-MoE: top-k of the router logits (float32), a softmax over the kept, weights in the activations'
dtype (the selection kernel); Llama-style RMSNorm; both residual branches scaled by ``residual_multiplier``;
experts on the ``"scattermoe"`` backend.

Its router returned ``(index, weights, logits)`` before transformers reordered it to ``(logits, weights,
index)`` (between 5.17 and 5.23): the fused router answers in the order of the installed version.

Offloaded generation splits its layer like Mixtral's, plus its four scalars: the embedding multiplied by
``embedding_multiplier``, the softmax scale ``attention_multiplier`` (not ``head_dim ** -0.5``), both residual
branches by ``residual_multiplier``, and the logits divided by ``logits_scaling``; its MoE block is
``block_sparse_moe``.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from transformers.models.granitemoe import modeling_granitemoe as granite

from ..kernels.router_select import gpt_oss_selection, router_select
from .decoder_moe import DecoderFamily, register_decoder_family
from .pipeline_adapter import LayerAttention, LlamaStylePipelineAdapter
from .spec import llama_style_spec

_LOGITS_FIRST = "return router_logits" in inspect.getsource(granite.GraniteMoeTopKRouter.forward)


def granite_router_forward(self, hidden_states: torch.Tensor):
    router_logits = F.linear(hidden_states, self.weight).float()  # [T, E]
    weights, indices = router_select(router_logits, self.top_k, gpt_oss_selection(), out_dtype=hidden_states.dtype)
    return (router_logits, weights, indices) if _LOGITS_FIRST else (indices, weights, router_logits)


class GraniteMoePipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Granite-MoE: Mixtral's split under the names of its ``block_sparse_moe``, with
    its multipliers where vanilla applies them (same rounding: each scales a tensor in the activations' dtype)."""

    model_type = "granitemoe"

    def layers(self):
        return list(self.model.model.layers)  # every Granite-MoE layer holds experts

    def layer_attention(self):
        return [LayerAttention(scale=self.model.config.attention_multiplier)] * self.dims.layers

    def post_tensors(self, layer):
        return {**self._attention_out_tensors(layer), "router": layer.block_sparse_moe.router.weight}

    def expert_tensors(self, layer):
        experts = layer.block_sparse_moe.experts  # [E, 2I, H] ([gate; up]) and [E, H, I]
        E, two_i, H = experts.gate_up_proj.shape
        self._act_fn = experts.act_fn
        return {"gate_up": experts.gate_up_proj.view(E, 2, two_i // 2, H), "down": experts.down_proj}

    def embed(self, other, ids):
        return super().embed(other, ids) * self.model.config.embedding_multiplier

    def _attention_output(self, w, attn):
        return super()._attention_output(w, attn) * self.model.config.residual_multiplier

    def _mlp(self, w, expert_parts, normed, fetch=None):
        return super()._mlp(w, expert_parts, normed, fetch) * self.model.config.residual_multiplier

    def _select(self, logits):
        """Top-k of the float32 logits, a softmax over the kept, weights in the activations' dtype."""
        return router_select(logits.float(), self.dims.top_k, gpt_oss_selection(), out_dtype=logits.dtype)

    def logits(self, other, x):
        """Divided by ``logits_scaling`` in the activations' dtype, as vanilla rounds, before the float32 cast."""
        return (F.linear(self._final_norm(other, x), other["lm_head"]) / self.model.config.logits_scaling).float()


GRANITE_MOE = register_decoder_family(DecoderFamily(
    model_type="granitemoe", pretrained=granite.GraniteMoePreTrainedModel,
    decoder_layer=granite.GraniteMoeDecoderLayer, moe_block=granite.GraniteMoeMoE, router=granite.GraniteMoeTopKRouter,
    router_forward=granite_router_forward, norm=granite.GraniteMoeRMSNorm, mlp="block_sparse_moe",
    scaled_residual=True, attention=granite.GraniteMoeAttention),
    pipeline_adapter=GraniteMoePipelineAdapter, spec=functools.partial(llama_style_spec, family="granitemoe"))
