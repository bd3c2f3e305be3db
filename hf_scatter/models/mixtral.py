"""Mixtral: experts on the ``"scattermoe"`` backend, fused norms and router (the shared decoder-family pieces of
``decoder_moe``).

Experts: no class is touched on a live model (:func:`~.experts.patch_interface_experts`), and under
``patch_transformers`` the family's default (what ``experts_implementation=None`` resolves to) becomes
``"scattermoe"``, so an explicit ``experts_implementation=...`` at load time still wins.

Norms and router: ``MixtralRMSNorm`` carries transformers' hub kernel-layer tag, but using it needs the
``kernels`` package and the hub, so the norm, the decoder layer (its post-attention residual add joins the
RMSNorm) and the router are swapped in place for subclasses. Router jitter keeps a block out of ``moe_graphs``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.mixtral.modeling_mixtral import (MixtralAttention, MixtralDecoderLayer, MixtralPreTrainedModel,
                                                          MixtralRMSNorm, MixtralSparseMoeBlock, MixtralTopKRouter)

from ..kernels.router import router_topk
from .decoder_moe import DecoderFamily, register_decoder_family


def mixtral_router_forward(self, hidden_states: torch.Tensor):
    """float32 softmax, top-k and renormalisation in one kernel (float32 weights, as Mixtral's own)."""
    router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)  # [T, E]
    scores, indices = router_topk(router_logits, self.top_k, normalize="sum", softmax_dtype=torch.float32)
    return router_logits, scores, indices


def _jitters(block: MixtralSparseMoeBlock) -> bool:
    """Router jitter draws random numbers: such a block stays out of ``moe_graphs``."""
    return block.jitter_noise > 0


MIXTRAL_LAYERS = DecoderFamily(
    model_type="mixtral", pretrained=MixtralPreTrainedModel, decoder_layer=MixtralDecoderLayer,
    moe_block=MixtralSparseMoeBlock, router=MixtralTopKRouter, router_forward=mixtral_router_forward,
    norm=MixtralRMSNorm, uses_rng=_jitters, attention=MixtralAttention)


MIXTRAL = register_decoder_family(MIXTRAL_LAYERS)
