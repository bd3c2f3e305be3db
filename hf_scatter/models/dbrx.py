"""DBRX: its experts have no ``ExpertsInterface`` switch, so the two expert classes are swapped in place.

``DbrxExperts`` keeps routing through ``self.mlp(...)`` (so PEFT's parameter wrappers around the expert
tensors still apply their deltas) and ``DbrxExpertGLU`` runs all experts at once on ParallelLinear, reading
its [E*I, H] ``w1`` / ``v1`` / ``w2`` through strided [E, ., .] views: no copy, no change to parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.dbrx.modeling_dbrx import DbrxBlock, DbrxExpertGLU, DbrxExperts, DbrxFFN, DbrxNormAttentionNorm

from ..kernels.router import router_topk
from ..moe.mlp import expert_mlp, glu_pair_activation
from .class_patch import apply_swaps
from .experts import SCATTERMOE
from .fused_loss import set_fused_loss
from .fused_norms import FUSED_ADD_NORM, add_layer_norm
from .training_graphs import set_moe_graphs
from .registry import Family, PatchOptions, register_family


class ScatterMoEDbrxExpertGLU(DbrxExpertGLU):
    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *vanilla_args) -> torch.Tensor:
        if top_k_index.is_floating_point():  # the vanilla per-expert call (x, w1_e, v1_e, w2_e)
            return super().forward(x, top_k_index, top_k_weights, *vanilla_args)
        E, I, H = self.moe_num_experts, self.ffn_hidden_size, self.hidden_size
        w1 = self.w1.view(E, I, H).transpose(1, 2)  # [E, H, I]: x @ w1_e.T
        v1 = self.v1.view(E, I, H).transpose(1, 2)
        w2 = self.w2.view(E, I, H)  # DBRX applies w2 untransposed: h @ w2_e
        return expert_mlp(x, (w1, v1), w2, top_k_index, top_k_weights, glu_pair_activation(self.activation_fn),
                          validate=False)

    def extra_repr(self) -> str:
        return f"experts_implementation={SCATTERMOE}"


class ScatterMoEDbrxExperts(DbrxExperts):
    hf_scatter_impl = SCATTERMOE

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        batch_size = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        out = self.mlp(x, top_k_index, top_k_weights)  # through any PEFT wrapper around self.mlp
        return out.to(hidden_states.dtype).view(batch_size, -1, self.hidden_size)


class FusedDbrxNormAttentionNorm(DbrxNormAttentionNorm):
    """norm_1 -> attention -> dropout -> (+ residual, norm_2) with the add and norm_2 in one kernel."""

    hf_scatter_impl = FUSED_ADD_NORM

    # The KV cache travels in ``kwargs`` under whichever name the caller used (``past_key_values`` up to
    # transformers 5.23, ``cache`` from 5.24), so the attention gets it as vanilla's block passes it.
    def forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs):
        residual = hidden_states
        hidden_states = add_layer_norm(hidden_states, None, self.norm_1)[0].to(hidden_states.dtype)
        hidden_states, _ = self.attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                     position_embeddings=position_embeddings, **kwargs)
        hidden_states = nn.functional.dropout(hidden_states, p=self.resid_pdrop, training=self.training)
        normed, residual = add_layer_norm(hidden_states, residual, self.norm_2)
        return residual, normed.to(residual.dtype)


class FusedRouterDbrxFFN(DbrxFFN):
    """Softmax in the logits' dtype, top-k and the p-norm of ``moe_normalize_expert_weights`` in one kernel;
    the router module is still called, so its logits are recorded."""

    hf_scatter_impl = "router_topk"

    def route_tokens_to_experts(self, router_logits: torch.Tensor):
        return router_topk(router_logits, self.top_k, normalize=self.moe_normalize_expert_weights,
                           softmax_dtype=router_logits.dtype)


def _jitters(ffn: DbrxFFN) -> bool:
    return ffn.router.moe_jitter_eps is not None


def patch_dbrx(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    if options.layer_graphs:
        raise ValueError("layer_graphs is not available for dbrx (its blocks take the attention mask and cache "
                         "positionally); patch with moe_graphs=True to replay its MoE blocks as graphs")
    apply_swaps(model, [(DbrxExperts, ScatterMoEDbrxExperts, options.moe),
                        (DbrxExpertGLU, ScatterMoEDbrxExpertGLU, options.moe),
                        (DbrxNormAttentionNorm, FusedDbrxNormAttentionNorm, options.norms),
                        (DbrxFFN, FusedRouterDbrxFFN, options.router)])
    set_fused_loss(model, options.loss)
    layers = [m for m in model.modules() if isinstance(m, DbrxBlock)]
    set_moe_graphs([layer.ffn for layer in layers], layers, options.moe_graphs,
                   uses_rng=_jitters, model=model)


DBRX = register_family(Family(
    model_type="dbrx",
    patch=patch_dbrx,
    pretrained_class="transformers.models.dbrx.modeling_dbrx:DbrxPreTrainedModel",
))
