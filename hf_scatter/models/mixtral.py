"""Mixtral: experts on the ``"scattermoe"`` backend, fused norms and router, the planner's shapes and the
offloaded runtime's layer split.

Experts: no class is touched on a live model (:func:`~.experts.patch_interface_experts`), and under
``patch_transformers`` the family's default (what ``experts_implementation=None`` resolves to) becomes
``"scattermoe"``, so an explicit ``experts_implementation=...`` at load time still wins.

Norms and router (Mixtral only): ``MixtralRMSNorm`` carries transformers' hub kernel-layer tag, but using
it needs the ``kernels`` package and the hub, so the norm, the decoder layer (its post-attention residual
add joins the RMSNorm) and the router are swapped in place for subclasses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mixtral.modeling_mixtral import (MixtralDecoderLayer, MixtralRMSNorm, MixtralSparseMoeBlock,
                                                          MixtralTopKRouter)

from ..kernels.norms import fused_add_rms_norm
from ..kernels.router import router_topk
from ..moe.mlp import expert_mlp, glu_activation
from .class_patch import apply_swaps
from .experts import SCATTERMOE, patch_interface_experts
from .fused_loss import set_fused_loss
from .fused_norms import FUSED_ADD_NORM, add_rms_norm, rms_norm
from .pipeline_adapter import Dims, PipelineAdapter, Rows
from .moe_graphs import set_moe_graphs
from .registry import Family, PatchOptions, register_family
from .spec import llama_style_spec


class FusedMixtralRMSNorm(MixtralRMSNorm):
    hf_scatter_impl = FUSED_ADD_NORM

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, None, self.weight, self.variance_epsilon)[0]


class FusedMixtralDecoderLayer(MixtralDecoderLayer):
    """The post-attention residual add and RMSNorm in one kernel; the rest as transformers has it."""

    hf_scatter_impl = FUSED_ADD_NORM

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                position_ids=None, past_key_values=None, **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, position_embeddings=position_embeddings,
                                          attention_mask=attention_mask, position_ids=position_ids,
                                          past_key_values=past_key_values, **kwargs)
        hidden_states, residual = add_rms_norm(hidden_states, residual, self.post_attention_layernorm)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class FusedMixtralTopKRouter(MixtralTopKRouter):
    """float32 softmax, top-k and renormalisation in one kernel."""

    hf_scatter_impl = "router_topk"

    def forward(self, hidden_states: torch.Tensor):
        router_logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        scores, indices = router_topk(router_logits, self.top_k, normalize="sum", softmax_dtype=torch.float32)
        return router_logits, scores, indices


def _jitters(block: MixtralSparseMoeBlock) -> bool:
    return block.jitter_noise > 0


def patch_mixtral(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    patch_interface_experts(model, options, class_default)
    apply_swaps(model, [(MixtralRMSNorm, FusedMixtralRMSNorm, options.norms),
                        (MixtralDecoderLayer, FusedMixtralDecoderLayer, options.norms),
                        (MixtralTopKRouter, FusedMixtralTopKRouter, options.router)])
    set_fused_loss(model, options.loss)
    layers = [m for m in model.modules() if isinstance(m, MixtralDecoderLayer)
              and isinstance(getattr(m, "mlp", None), MixtralSparseMoeBlock)]
    set_moe_graphs([layer.mlp for layer in layers], layers, options.moe_graphs,
                   uses_rng=_jitters)


def _default_to_scattermoe(self, requested_experts):
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(self, SCATTERMOE if requested_experts is None
                                                              else requested_experts)


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


MIXTRAL = register_family(Family(
    model_type="mixtral",
    patch=patch_mixtral,
    spec=lambda config, name, dtype_bytes: llama_style_spec(config, name, dtype_bytes, family="mixtral"),
    pipeline_adapter=MixtralPipelineAdapter,
    pretrained_class="transformers.models.mixtral.modeling_mixtral:MixtralPreTrainedModel",
    class_hooks=lambda options: {"get_correct_experts_implementation": _default_to_scattermoe} if options.moe else {},
))
