"""DeepSeek-V3 and DeepSeek-V2: their routers on the selection kernel, Llama-style RMSNorm (the attention's
low-rank q/kv norms included), experts on the ``"scattermoe"`` backend. The shared experts and the first
``first_k_dense_replace`` dense layers run as transformers has them, their SwiGLU fused.

V3 routes on sigmoid scores plus ``e_score_correction_bias``, limited to the ``topk_group`` best of ``n_group``
expert groups; V2 on softmax scores, greedy or ``group_limited_greedy``. The choice is exact, ties included
(see ``kernels/router_select``); the weights are float32, as transformers' are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from ..kernels.router_select import (Selection, deepseek_v2_group_limited, deepseek_v2_selection,
                                     deepseek_v3_selection, router_select)
from .decoder_moe import DecoderFamily, register_decoder_family


def _float32_logits(router, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden_states.view(-1, router.hidden_dim).float(), router.weight.float())  # [T, E]


def v3_selection(router) -> Selection:
    return deepseek_v3_selection(router.num_group, router.topk_group, router.norm_topk_prob,
                                 router.routed_scaling_factor)


def v2_selection(router) -> Selection:
    return deepseek_v2_selection(router.num_group, router.topk_group, deepseek_v2_group_limited(router.topk_method),
                                 router.routed_scaling_factor)


def v3_router_forward(self, hidden_states: torch.Tensor):
    selection = v3_selection(self)
    router_logits = _float32_logits(self, hidden_states)
    weights, indices = router_select(router_logits, self.top_k, selection, bias=self.e_score_correction_bias)
    return router_logits, weights, indices


def v2_router_forward(self, hidden_states: torch.Tensor):
    selection = v2_selection(self)
    router_logits = _float32_logits(self, hidden_states)
    weights, indices = router_select(router_logits, self.top_k, selection)
    return router_logits, weights, indices


DEEPSEEK_V3 = register_decoder_family(DecoderFamily(
    model_type="deepseek_v3", pretrained=v3.DeepseekV3PreTrainedModel, decoder_layer=v3.DeepseekV3DecoderLayer,
    moe_block=v3.DeepseekV3MoE, router=v3.DeepseekV3TopkRouter, router_forward=v3_router_forward,
    norm=v3.DeepseekV3RMSNorm, dense_mlp=v3.DeepseekV3MLP))

DEEPSEEK_V2 = register_decoder_family(DecoderFamily(
    model_type="deepseek_v2", pretrained=v2.DeepseekV2PreTrainedModel, decoder_layer=v2.DeepseekV2DecoderLayer,
    moe_block=v2.DeepseekV2Moe, router=v2.DeepseekV2TopkRouter, router_forward=v2_router_forward,
    norm=v2.DeepseekV2RMSNorm, dense_mlp=v2.DeepseekV2MLP))
