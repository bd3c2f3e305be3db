"""Mixtral: experts on the ``"scattermoe"`` backend, fused norms and router (the shared decoder-family pieces of
``decoder_moe``), the planner's shapes and the offloaded runtime's layer split.

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
from torch import nn
from transformers.models.mixtral.modeling_mixtral import (MixtralAttention, MixtralDecoderLayer, MixtralPreTrainedModel,
                                                          MixtralRMSNorm, MixtralSparseMoeBlock, MixtralTopKRouter)

from ..kernels.norms import fused_add_rms_norm
from ..kernels.router import router_topk
from ..moe.mlp import expert_mlp, glu_activation
from .decoder_moe import DecoderFamily, register_decoder_family
from .pipeline_adapter import Dims, PipelineAdapter, Rows
from .spec import llama_style_spec


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


class MixtralPipelineAdapter(PipelineAdapter):
    """Offloaded generation of Mixtral: its layer in pieces, the experts in column layout."""

   
    model_type = "mixtral"
    column_dims = {"gate_up": 2, "down": 2}  # gate_up as [E, 2, I, H] ([gate; up]), down [E, H, I]

    def _dims(self, c) -> Dims:
        return Dims.of(c, getattr(c, "max_position_embeddings", None), getattr(c, "sliding_window", None))

    def layers(self):
        return list(self.model.model.layers)

    def pre_tensors(self, layer):
        a = layer.self_attn
        return {"norm": layer.input_layernorm.weight, "qkv": Rows(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)}

    def post_tensors(self, layer):
        return {"o": layer.self_attn.o_proj.weight, "post_norm": layer.post_attention_layernorm.weight,
                "router": layer.mlp.gate.weight}

    def expert_tensors(self, layer):
        experts = layer.mlp.experts
        flags = {f: getattr(experts, f, d) for f, d in (("has_gate", True), ("has_bias", False),
                                                         ("is_concatenated", True))}
        if flags != {"has_gate": True, "has_bias": False, "is_concatenated": True}:
            raise NotImplementedError(f"offloading supports Mixtral experts with a concatenated [gate; up] projection "
                                      f"and no bias; this model's experts have {flags}")
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] / [E, I, H]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        E, two_i, H = gate_up.shape
        self._act_fn = experts.act_fn
        return {"gate_up": gate_up.reshape(E, 2, two_i // 2, H), "down": down}

    def other_tensors(self):
        base = self.model.model
        self._eps = (self.model.model.layers[0].input_layernorm.variance_epsilon,
                     self.model.model.layers[0].post_attention_layernorm.variance_epsilon, base.norm.variance_epsilon)
        return {"embed": base.embed_tokens.weight, "final_norm": base.norm.weight,
                "lm_head": self.model.lm_head.weight}

    def _rotary_module(self):
        return self.model.model.rotary_emb

    def _project_qkv(self, w, x):
        return F.linear(fused_add_rms_norm(x, None, w["norm"], eps=self._eps[0], validate=False), w["qkv"])

    def _post_norm(self, w, o, x):
        return fused_add_rms_norm(o, x, w["post_norm"], eps=self._eps[1], return_sum=True, validate=False)

    def _route(self, logits):
        return router_topk(logits, self.dims.top_k, normalize="sum", softmax_dtype=torch.float32)

    def _experts(self, part, x, experts, gates):
        E, _, c, H = part["gate_up"].shape
        w_in = part["gate_up"].view(E, 2 * c, H).transpose(1, 2)
        return expert_mlp(x, (w_in,), part["down"].transpose(1, 2), experts, gates, glu_activation(self._act_fn),
                          validate=False)

    def _final_norm(self, other, x):
        return fused_add_rms_norm(x, None, other["final_norm"], eps=self._eps[2], validate=False)


MIXTRAL = register_decoder_family(
    MIXTRAL_LAYERS, pipeline_adapter=MixtralPipelineAdapter,
    spec=lambda config, name, dtype_bytes: llama_style_spec(config, name, dtype_bytes, family="mixtral"))
