"""Families hf-scatter can patch, keyed by ``config.model_type``, and the options a user can turn off."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class PatchOptions:
    """What :func:`hf_scatter.patch_model` replaces; every piece is on unless turned off, except
    ``moe_graphs`` (opt-in: its captured graphs hold a training step's MoE activations in their own pool)."""

    moe: bool = True  # experts on the ScatterMoE kernels
    norms: bool = True  # residual add + LayerNorm / RMSNorm in one fused kernel
    router: bool = True  # router softmax + top-k + renormalisation in one fused kernel
    unpadded: bool = True  # BERT inference on packed tokens (varlen attention, planned memory)
    cuda_graphs: bool = True  # BERT packed inference replays one CUDA graph per length bucket (CUDA only)
    fast_gelu: bool = True  # BERT packed half-precision inference: bias + GELU in the GEMM epilogue (tanh form)
    moe_graphs: bool = False  # MoE blocks of training steps replayed as CUDA graphs (CUDA only; fixed shapes)

    @classmethod
    def from_kwargs(cls, caller: str, **options) -> "PatchOptions":
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"{caller}: unknown option(s) {', '.join(unknown)}; the options are {', '.join(known)}")
        for name, value in options.items():
            if not isinstance(value, bool):
                raise TypeError(f"{caller}: option {name} must be True or False, got {value!r}")
        if options.get("moe_graphs") and not options.get("moe", True):
            raise ValueError(f"{caller}: moe_graphs=True replays the ScatterMoE experts' graphs; it needs moe=True")
        return cls(**options)


@dataclass(frozen=True)
class Family:
    """How to patch one model family.

    ``patch(model, options, class_default)`` makes a live model match ``options`` (idempotent; pieces turned
    off are restored to vanilla). ``class_default`` is True when called from a model's own construction under
    ``patch_transformers``: choices the user made explicitly at load time are then respected.
    ``pretrained_class`` (``"module:Class"``) is the family's ``PreTrainedModel`` base, hooked by
    ``patch_transformers``; ``class_hooks(options)`` returns extra class attributes to set while it is active.
    """

    model_type: str
    patch: Callable[[nn.Module, PatchOptions, bool], None]
    pretrained_class: str
    class_hooks: Callable[[PatchOptions], dict[str, object]] = lambda options: {}


FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family
