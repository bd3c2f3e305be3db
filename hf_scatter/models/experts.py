"""The ``"scattermoe"`` backend of transformers' ``ExpertsInterface``.

Any experts class decorated with ``use_experts_implementation`` (Mixtral, and other families with the
same contract) dispatches here when ``config._experts_implementation == "scattermoe"``. The decorator's
flags describe the layout (gate or not, bias, transposed storage, post-expert norm, custom gating) and
are honoured, so the result is the one the family's eager forward gives.
"""

from __future__ import annotations

import torch

from .. import SCATTERMOE
from ..moe.mlp import expert_mlp, glu_activation


def _uses_default_gate(experts: torch.nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    return getattr(type(experts), "_apply_gate", _default_apply_gate) is _default_apply_gate


def scattermoe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    if getattr(self, "_is_expert_parallel", False):
        raise NotImplementedError(
            f"experts_implementation='{SCATTERMOE}' does not run expert-parallel (sharded) experts yet; "
            "use experts_implementation='grouped_mm' for expert parallelism")

    def kernel_layout(w: torch.Tensor) -> torch.Tensor:  # [E, d_in, d_out], a view either way
        return w if self.is_transposed else w.transpose(1, 2)

    has_bias = getattr(self, "has_bias", False)
    if getattr(self, "has_gate", True):
        w_in, b_in = self.gate_up_proj, (self.gate_up_proj_bias if has_bias else None)
        if getattr(self, "is_concatenated", True) and _uses_default_gate(self):
            activation = glu_activation(self.act_fn)
        else:
            activation = self._apply_gate  # interleaved [g0, u0, ...] or a family-specific gate (clamps, alpha)
    else:
        w_in, b_in = self.up_proj, (self.up_proj_bias if has_bias else None)
        activation = self.act_fn
    post_norm = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    # Router top-k ids are in range by construction: skip the validating host sync on the hot path.
    out = expert_mlp(x, (kernel_layout(w_in),), kernel_layout(self.down_proj), top_k_index.reshape(x.shape[0], -1),
                     top_k_weights.reshape(x.shape[0], -1), activation, b_in=(b_in,),
                     b_out=self.down_proj_bias if has_bias else None, post_norm=post_norm, validate=False)
    return out.to(hidden_states.dtype).view(hidden_states.shape)
