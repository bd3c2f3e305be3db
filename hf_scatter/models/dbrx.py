"""DBRX: its experts have no ``ExpertsInterface`` switch, so the two expert classes are swapped in place.

``DbrxExperts`` keeps routing through ``self.mlp(...)`` (so PEFT's parameter wrappers around the expert
tensors still apply their deltas) and ``DbrxExpertGLU`` runs all experts at once on ParallelLinear, reading
its [E*I, H] ``w1`` / ``v1`` / ``w2`` through strided [E, ., .] views: no copy, no change to parameters.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.dbrx.modeling_dbrx import DbrxExpertGLU, DbrxExperts

from ..kernels.ops import swiglu_pair
from ..moe.mlp import expert_mlp, is_silu
from .class_patch import restore_class, swap_class
from .experts import SCATTERMOE
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
        if is_silu(self.activation_fn):
            # Both grouped projections are expert_mlp's own intermediates: the backward may overwrite them.
            activation = lambda gate, up: swiglu_pair(gate, up, reuse_input_buffers=True)  # noqa: E731
        else:
            activation = lambda gate, up: self.activation_fn(gate) * up  # noqa: E731
        return expert_mlp(x, (w1, v1), w2, top_k_index, top_k_weights, activation, validate=False)

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


_SWAPS = ((DbrxExperts, ScatterMoEDbrxExperts), (DbrxExpertGLU, ScatterMoEDbrxExpertGLU))


def patch_dbrx(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    for module in model.modules():
        for vanilla, ours in _SWAPS:
            if isinstance(module, vanilla):
                if options.moe:
                    swap_class(module, ours)
                else:
                    restore_class(module, vanilla)


DBRX = register_family(Family(
    model_type="dbrx",
    patch=patch_dbrx,
    pretrained_class="transformers.models.dbrx.modeling_dbrx:DbrxPreTrainedModel",
))
