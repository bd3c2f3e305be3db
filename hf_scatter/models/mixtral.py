"""Mixtral (and any family whose experts use transformers' ``ExpertsInterface``): select ``"scattermoe"``.

No class is touched on a live model: ``set_experts_implementation`` switches the registered backend, and
under ``patch_transformers`` the family's default (what ``experts_implementation=None`` resolves to)
becomes ``"scattermoe"``, so an explicit ``experts_implementation=...`` at load time still wins.
"""

from __future__ import annotations

import types

from torch import nn

from .experts import SCATTERMOE
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


def _default_to_scattermoe(self, requested_experts):
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(self, SCATTERMOE if requested_experts is None
                                                              else requested_experts)


MIXTRAL = register_family(Family(
    model_type="mixtral",
    patch=patch_interface_experts,
    pretrained_class="transformers.models.mixtral.modeling_mixtral:MixtralPreTrainedModel",
    class_hooks=lambda options: {"get_correct_experts_implementation": _default_to_scattermoe} if options.moe else {},
))
