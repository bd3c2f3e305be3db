"""Training steps without [tokens, vocab] logits: the causal LM's loss through the fused linear cross-entropy.

transformers has no hook between the LM head and the loss, so the model instance gets its own ``forward``
(the class, and so ``save_pretrained``'s ``architectures``, stay transformers'). It runs the family's own
forward with ``labels=None`` and no logit positions kept (``logits_to_keep`` an empty index: the LM head sees
[batch, 0, hidden]), takes the final hidden states from the base model's output, and computes transformers'
``ForCausalLMLoss`` (shift, ignore_index, ``num_items_in_batch``) with
:func:`~hf_scatter.kernels.linear_cross_entropy.linear_cross_entropy`, plus the family's router aux loss
(``router_aux_loss_coef``) where the forward computed one. The output's ``logits`` are None then.

It applies only where nothing else depends on the logits: training mode, gradients on, ``labels`` given,
``logits_to_keep=0``, a ``ModelOutput`` asked for (not ``return_dict=False``), transformers' own causal-LM
loss, a plain bias-free ``nn.Linear`` head without accelerate hooks, no final logit soft-capping, and not
inside ``torch.compile``. Anything else runs the vanilla forward unchanged.
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..common.made_names import module_getattr
from ..kernels.linear_cross_entropy import linear_cross_entropy
from .class_patch import set_instance_method

FUSED_LOSS = "fused_linear_cross_entropy"


def _base_model(model: nn.Module) -> nn.Module | None:
    return getattr(model, getattr(model, "base_model_prefix", "model"), None)


def _fusable(model: nn.Module, labels, logits_to_keep, return_dict) -> bool:
    from transformers.loss.loss_utils import ForCausalLMLoss

    head = getattr(model, "lm_head", None)
    return (labels is not None and model.training and torch.is_grad_enabled()
            and (return_dict if return_dict is not None else getattr(model.config, "return_dict", True))
            and not torch.compiler.is_compiling() and isinstance(logits_to_keep, int) and logits_to_keep == 0
            and type(head) is nn.Linear and head.bias is None and not hasattr(head, "_hf_hook")
            and getattr(model.config, "final_logit_softcapping", None) is None
            and model.loss_function is ForCausalLMLoss and _base_model(model) is not None)


def fused_loss_forward(self, *args, labels=None, logits_to_keep=0, **kwargs):
    vanilla = type(self).forward
    if not _fusable(self, labels, logits_to_keep, kwargs.get("return_dict")):
        return vanilla(self, *args, labels=labels, logits_to_keep=logits_to_keep, **kwargs)
    outputs = []
    handle = _base_model(self).register_forward_hook(lambda module, inputs, output: outputs.append(output))
    try:
        no_positions = torch.empty(0, dtype=torch.long, device=self.lm_head.weight.device)
        out = vanilla(self, *args, labels=None, logits_to_keep=no_positions, **kwargs)
    finally:
        handle.remove()
    hidden = outputs[-1][0]  # [B, S, H] after the final norm
    ignore_index = kwargs.get("ignore_index", -100)
    shift_labels = kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    loss = linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.lm_head.weight,
                                shift_labels.reshape(-1).to(hidden.device), ignore_index=ignore_index,
                                num_items_in_batch=kwargs.get("num_items_in_batch"),
                                scale=1.0 / getattr(self.config, "logits_scaling", 1.0))
    aux_loss = getattr(out, "aux_loss", None)
    if aux_loss is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    # A new output without logits: a ModelOutput keeps a field in its dict once set, even if set to None.
    return type(out)(loss=loss, **{k: v for k, v in out.items() if k not in ("loss", "logits")})


# Every forward _forward_for made, by name. Pickle finds a patched model's forward as an attribute of this
# module (its __module__ and __qualname__): the module's __getattr__ below looks it up here.
FORWARDS: dict[str, Callable] = {}


__getattr__ = module_getattr(FORWARDS, __name__)


def _forward_for(cls: type):
    """:func:`fused_loss_forward` for ``cls``, showing ``cls.forward``'s signature (the Trainer keeps the
    dataset columns that the forward's signature names). Made once per class and kept in :data:`FORWARDS` by
    name, so patched models pickle."""
    name = f"fused_loss_forward_{cls.__name__}"
    made = FORWARDS.get(name)
    if made is None:
        def made(self, *args, **kwargs):
            return fused_loss_forward(self, *args, **kwargs)

        made.__name__ = made.__qualname__ = name
        made.__module__ = __name__
        made.__doc__ = cls.forward.__doc__
        made.__signature__ = inspect.signature(cls.forward)
        made.hf_scatter_impl = FUSED_LOSS
        FORWARDS[name] = made
    return made


def fused_loss_impl(module: nn.Module) -> str | None:
    """``FUSED_LOSS`` where ``module`` runs the fused-loss forward (for the patch report)."""
    return getattr(getattr(module.__dict__.get("forward"), "__func__", None), "hf_scatter_impl", None)


def set_fused_loss(model: nn.Module, on: bool) -> None:
    """Give a causal LM the fused-loss forward (``on``), or its class's own back."""
    ours = fused_loss_impl(model) == FUSED_LOSS
    if on and not ours and getattr(model, "lm_head", None) is not None and _base_model(model) is not None:
        if "forward" in model.__dict__:  # someone else's wrapper (accelerate hooks): leave it alone
            return
        set_instance_method(model, "forward", _forward_for(type(model)))
    elif not on and ours:
        del model.__dict__["forward"]
