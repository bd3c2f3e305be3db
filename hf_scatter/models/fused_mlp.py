"""Dense gated MLPs (shared experts, the dense layers of MoE stacks) on the fused SwiGLU kernel.

transformers computes ``down(act(gate(x)) * up(x))`` as separate ops, so autograd keeps four [tokens, I]
tensors per MLP for the backward: the gate, its activation, the up projection and their product. The fused
kernel computes ``silu(gate) * up`` in one pass and recomputes the activation in its backward, so the
activation is never stored: one [tokens, I] tensor less per MLP. DeepSeek's two shared experts in every layer
make that the largest activation a patched DeepSeek model kept beyond Liger-Kernel's (which fuses the same
way). Activations other than SiLU run the vanilla forward.
"""

from __future__ import annotations

import torch
from torch.nn.modules.module import _global_forward_hooks

from ..kernels.swiglu import swiglu_pair
from ..moe.mlp import is_silu
from .class_patch import vanilla_class

FUSED_SWIGLU = "fused_swiglu"


def swiglu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The Llama-style gated MLP (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``) with the fused SwiGLU.
    The projections' outputs are this forward's own intermediates, so the backward writes their gradients into
    them, unless a forward hook on a projection may have kept its output."""
    if not is_silu(self.act_fn):
        return vanilla_class(type(self)).forward(self, x)
    gate, up = self.gate_proj(x), self.up_proj(x)  # [..., I] each
    shape = gate.shape
    reuse = not (self.gate_proj._forward_hooks or self.up_proj._forward_hooks or _global_forward_hooks)
    hidden = swiglu_pair(gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1]), reuse_input_buffers=reuse)  # [T, I]
    return self.down_proj(hidden.view(shape))
