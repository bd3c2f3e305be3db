"""Granite-MoE: top-k of the router logits (float32), a softmax over the kept, weights in the activations'
dtype (the selection kernel); Llama-style RMSNorm; both residual branches scaled by ``residual_multiplier``;
experts on the ``"scattermoe"`` backend.

Its router returned ``(index, weights, logits)`` before transformers reordered it to ``(logits, weights,
index)`` (between 5.17 and 5.23): the fused router answers in the order of the installed version.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers.models.granitemoe import modeling_granitemoe as granite

from ..kernels.router_select import gpt_oss_selection, router_select
from .decoder_moe import DecoderFamily, register_decoder_family

_LOGITS_FIRST = "return router_logits" in inspect.getsource(granite.GraniteMoeTopKRouter.forward)


def granite_router_forward(self, hidden_states: torch.Tensor):
    router_logits = F.linear(hidden_states, self.weight).float()  # [T, E]
    weights, indices = router_select(router_logits, self.top_k, gpt_oss_selection(), out_dtype=hidden_states.dtype)
    return (router_logits, weights, indices) if _LOGITS_FIRST else (indices, weights, router_logits)


GRANITE_MOE = register_decoder_family(DecoderFamily(
    model_type="granitemoe", pretrained=granite.GraniteMoePreTrainedModel,
    decoder_layer=granite.GraniteMoeDecoderLayer, moe_block=granite.GraniteMoeMoE, router=granite.GraniteMoeTopKRouter,
    router_forward=granite_router_forward, norm=granite.GraniteMoeRMSNorm, mlp="block_sparse_moe",
    scaled_residual=True, attention=granite.GraniteMoeAttention))
