"""Mixtral (and any family whose experts use transformers' ``ExpertsInterface``): select ``"scattermoe"``.

Experts: no class is touched on a live model: ``set_experts_implementation`` switches the registered
backend, and under ``patch_transformers`` the family's default (what ``experts_implementation=None``
resolves to) becomes ``"scattermoe"``, so an explicit ``experts_implementation=...`` at load time still wins.

Norms and router (Mixtral only): ``MixtralRMSNorm`` carries transformers' hub kernel-layer tag, but using
it needs the ``kernels`` package and the hub, so the norm, the decoder layer (its post-attention residual
add joins the RMSNorm) and the router are swapped in place for subclasses.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.mixtral.modeling_mixtral import (MixtralDecoderLayer, MixtralRMSNorm, MixtralSparseMoeBlock,
                                                          MixtralTopKRouter)

from ..kernels.fused_ops import router_topk
from .class_patch import apply_swaps
from .experts import SCATTERMOE
from .fused_norms import FUSED_ADD_NORM, add_rms_norm, rms_norm
from .moe_graphs import set_moe_graphs
from .registry import Family, PatchOptions, register_family

_VANILLA_CHOICE = "_hf_scatter_vanilla_experts"


def is_interface_experts(module: nn.Module) -> bool:
    """An experts module built by ``use_experts_implementation`` (dispatches on its config)."""
    return all(hasattr(module, a) for a in ("config", "has_gate", "is_transposed", "is_concatenated"))


def _experts_extra_repr(self) -> str:
    return f"experts_implementation={self.config._experts_implementation}"


def _vanilla_default(model: nn.Module) -> str:
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(model, None)


def _show_choice_in_repr(experts: list[nn.Module], show: bool) -> None:
    for m in experts:
        if show:
            m.extra_repr = types.MethodType(_experts_extra_repr, m)
        else:
            m.__dict__.pop("extra_repr", None)


def patch_interface_experts(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    experts = [m for m in model.modules() if is_interface_experts(m)]
    if not experts:
        return
    current = model.config._experts_implementation
    if class_default:  # the class-level default already applied; what the user chose at load time stands
        _show_choice_in_repr(experts, current == SCATTERMOE)
        return
    if options.moe and current != SCATTERMOE:
        model.__dict__[_VANILLA_CHOICE] = current
        model.set_experts_implementation(SCATTERMOE)
    elif not options.moe and current == SCATTERMOE:
        model.set_experts_implementation(model.__dict__.pop(_VANILLA_CHOICE, None) or _vanilla_default(model))
    _show_choice_in_repr(experts, options.moe)


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
    layers = [m for m in model.modules() if isinstance(m, MixtralDecoderLayer)
              and isinstance(getattr(m, "mlp", None), MixtralSparseMoeBlock)]
    set_moe_graphs([layer.mlp for layer in layers], layers, options.moe_graphs,
                   uses_rng=_jitters)


def _default_to_scattermoe(self, requested_experts):
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(self, SCATTERMOE if requested_experts is None
                                                              else requested_experts)


MIXTRAL = register_family(Family(
    model_type="mixtral",
    patch=patch_mixtral,
    pretrained_class="transformers.models.mixtral.modeling_mixtral:MixtralPreTrainedModel",
    class_hooks=lambda options: {"get_correct_experts_implementation": _default_to_scattermoe} if options.moe else {},
))
