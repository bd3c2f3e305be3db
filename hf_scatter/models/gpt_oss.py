"""GPT-OSS: top-k of the router logits, then a softmax over the kept (the selection kernel), experts on the
``"scattermoe"`` backend (its biased, interleaved, clamped experts run fused). Attention sinks are untouched.

Its RMSNorm multiplies by its weight before rounding to the activations' dtype (Llama-style norms round
first): its norms, and the post-attention add + norm of its decoder layers, run the fused kernel in that
casting (``norm_casting="gpt_oss"``). Its MoE block returns the router scores with the hidden states, so it
is not graphed (``moe_graphs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.gpt_oss import modeling_gpt_oss as gpt_oss

from ..kernels.router_select import gpt_oss_selection, router_select
from .decoder_moe import DecoderFamily, register_decoder_family


def gpt_oss_router_forward(self, hidden_states: torch.Tensor):
    router_logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
    weights, indices = router_select(router_logits, self.top_k, gpt_oss_selection())
    return router_logits, weights, indices


GPT_OSS = register_decoder_family(DecoderFamily(
    model_type="gpt_oss", pretrained=gpt_oss.GptOssPreTrainedModel, decoder_layer=gpt_oss.GptOssDecoderLayer,
    moe_block=gpt_oss.GptOssMLP, router=gpt_oss.GptOssTopKRouter, router_forward=gpt_oss_router_forward,
    norm=gpt_oss.GptOssRMSNorm, norm_casting="gpt_oss", graphs=False, attention=gpt_oss.GptOssAttention,
    rope_full_head=True))
