"""The one registry of model families, keyed by ``config.model_type``, and the options a user can turn off.

Each family is one module of this package (:data:`FAMILY_MODULES`) that registers a :class:`Family`: how to
patch it for training and inference (what offloading knows of a family lives in ``hf_scatter.offload.families``).
Adding a family is adding its module and its name here. The modules import on first use of :func:`families`,
so ``import hf_scatter`` does not load every family's transformers code.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Callable

from torch import nn


@dataclass(frozen=True)
class PatchOptions:
    """What :func:`hf_scatter.patch_model` replaces; every piece is on unless turned off, except
    ``moe_graphs`` and ``layer_graphs`` (opt-in: their captured graphs hold a training step's activations in
    their own pool)."""

    moe: bool = True  # experts on the ScatterMoE kernels
    norms: bool = True  # residual add + LayerNorm / RMSNorm in one fused kernel
    router: bool = True  # router softmax + top-k + renormalisation in one fused kernel
    unpadded: bool = True  # BERT inference on packed tokens (varlen attention, planned memory)
    cuda_graphs: bool = True  # BERT packed inference replays one CUDA graph per length bucket (CUDA only)
    fast_gelu: bool = True  # BERT packed half-precision inference: bias + GELU in the GEMM epilogue (tanh form)
    moe_graphs: bool = False  # MoE blocks of training steps replayed as CUDA graphs (CUDA only; fixed shapes)
    layer_graphs: bool = False  # whole decoder layers of training steps replayed as CUDA graphs (same terms)
    loss: bool = True  # causal LMs in training: LM head + cross-entropy fused, no [tokens, vocab] logits
    rope: bool = True  # rotary embeddings of q and k in one kernel each way (Liger-Kernel's)
    swiglu: bool = True  # dense gated MLPs (shared experts, dense layers): silu(gate) * up fused, not stored

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
        if options.get("moe_graphs") and options.get("layer_graphs"):
            raise ValueError(f"{caller}: layer_graphs=True already replays each MoE block inside its layer's graph; "
                             "pass one of moe_graphs=True or layer_graphs=True")
        return cls(**options)


@dataclass(frozen=True)
class Family:
    """How hf-scatter handles one model family.

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


FAMILY_MODULES = ("mixtral", "dbrx", "bert", "qwen_moe", "deepseek", "gpt_oss", "granite_moe")
_FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    _FAMILIES[family.model_type] = family
    return family


def families() -> dict[str, Family]:
    """Every registered family by ``model_type`` (importing the family modules the first time)."""
    for name in FAMILY_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return _FAMILIES
