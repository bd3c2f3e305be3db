"""The user-facing switches: patch a live model, or every model transformers builds from now on.

Patching changes compute only: parameter names, shapes, dtypes and ``state_dict`` stay as transformers
made them, so checkpoints move freely between patched and vanilla models.
"""

from __future__ import annotations

import contextlib
import importlib

from torch import nn

from .models import SCATTERMOE, PatchOptions, families, is_interface_experts, patch_interface_experts
from .models.fused_loss import fused_loss_impl
from .models.training_graphs import IMPL as GRAPHS_IMPL
from .models.training_graphs import graphs_of
from .models.sharding import FSDP2, sharded_by
from .models.registry import Family

_GENERIC = "any other model whose experts use transformers' ExpertsInterface (experts_implementation switch)"


def _pretrained_root(model: nn.Module) -> nn.Module:
    """The transformers model inside ``model`` (itself, or the base model of a PEFT or other wrapper)."""
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return model
    if not isinstance(model, nn.Module):
        hint = " (a checkpoint path: use hf_scatter.from_pretrained(path))" if isinstance(model, str) else ""
        raise TypeError(f"hf_scatter: the model argument must be a transformers PreTrainedModel (or a wrapper of "
                        f"one, e.g. PEFT), got {type(model).__name__}{hint}")
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            return module
    raise TypeError(f"hf_scatter: expected a transformers PreTrainedModel (or a wrapper of one, e.g. PEFT), "
                    f"got {type(model).__name__}")


def supported_model_types() -> list[str]:
    return sorted(families())


def _family_patch(root: nn.Module):
    model_type = getattr(root.config, "model_type", None)
    family = families().get(model_type)
    if family is not None:
        return family.patch
    if any(is_interface_experts(m) for m in root.modules()):
        return patch_interface_experts
    raise _unsupported(f"{model_type!r} ({type(root).__name__})")


def _unsupported(what: str) -> ValueError:
    return ValueError(f"hf_scatter: model_type {what} is not supported. Supported: "
                      f"{', '.join(supported_model_types())}, and {_GENERIC}.")


def check_supported(config) -> None:
    """Raise the ``ValueError`` :func:`patch_model` would raise for a model of ``config`` (a transformers
    config or a config.json dict), without loading any weight: tools call it before their long work."""
    import torch
    from transformers import AutoConfig, AutoModel

    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    if model_type in families():
        return
    try:
        if isinstance(config, dict):
            config = AutoConfig.for_model(**config)
        with torch.device("meta"):  # the modules only: whether its experts use transformers' ExpertsInterface
            root = AutoModel.from_config(config)
    except (ValueError, KeyError, TypeError):  # a model type transformers does not know either
        raise _unsupported(repr(model_type)) from None
    _family_patch(root)


def patch_model(model: nn.Module, **options) -> nn.Module:
    """Run ``model`` on hf-scatter's kernels, in place; returns ``model``.

    Works on models already on GPU, loaded with ``device_map``, or wrapped by PEFT. Options turn pieces off
    (``moe=False`` keeps the family's own experts); calling again with other options re-applies exactly
    those, and patching twice is harmless. Raises ``ValueError`` for architectures it does not support.
    """
    opts = PatchOptions.from_kwargs("patch_model", **options)
    root = _pretrained_root(model)
    _refuse_fully_sharded(root, "patch_model")
    _family_patch(root)(root, opts, False)
    return model


def _refuse_fully_sharded(root: nn.Module, caller: str) -> None:
    """FSDP2 makes every wrapped module an instance of a class of its own: patch first, then shard."""
    if sharded_by(root) == FSDP2:
        raise ValueError(f"hf_scatter.{caller}: the model is already wrapped by FSDP2's fully_shard; patch it first, "
                         "then shard it: hf_scatter.patch_model(model), then fully_shard(...) per decoder layer and "
                         "on the model (or accelerator.prepare / Trainer, which shard it for you)")


def from_pretrained(path, *args, patch: dict | None = None, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, ...)`` patched with ``patch_model(**patch)``: loads HF
    checkpoints and ``hf-scatter convert`` output alike (the latter with no per-expert stacking); GPT-OSS's MXFP4
    experts stay MXFP4 and block-scaled FP8 checkpoints stay FP8 (:func:`load_as_shipped`)."""
    from transformers import AutoModelForCausalLM

    with load_as_shipped():
        model = AutoModelForCausalLM.from_pretrained(path, *args, **kwargs)
    return patch_model(model, **(patch or {}))


@contextlib.contextmanager
def load_as_shipped():
    """A context manager: inside it, ``from_pretrained`` of any loader keeps GPT-OSS's MXFP4 experts
    (``models/mxfp4_experts.py``) and block-scaled FP8 weights (``models/fp8_experts.py``) as shipped, as
    :func:`from_pretrained` and :func:`patch_transformers` do."""
    with contextlib.ExitStack() as stack:
        for switch in _as_shipped_switches():
            stack.enter_context(switch.enabled())
        yield


def _as_shipped_switches():
    """The quantized formats hf-scatter keeps as shipped, each one entry of transformers' quantizer table."""
    from .models import fp8_experts, mxfp4_experts

    return (mxfp4_experts.AS_SHIPPED, fp8_experts.AS_SHIPPED)


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo :func:`patch_model`: every piece back to the family's own implementation."""
    off = PatchOptions(**{name: False for name in PatchOptions.__dataclass_fields__})
    root = _pretrained_root(model)
    _refuse_fully_sharded(root, "unpatch_model")
    _family_patch(root)(root, off, False)
    return model


def patch_report(model: nn.Module) -> dict[str, str]:
    """Module path -> hf-scatter implementation, for every module hf-scatter currently computes."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"hf_scatter.patch_report: the model argument must be a torch module, got {type(model).__name__}")
    report = {}
    for name, module in model.named_modules():
        impl = getattr(type(module), "hf_scatter_impl", None) or fused_loss_impl(module)
        graphs = graphs_of(module)
        if graphs is not None:
            impl = GRAPHS_IMPL[graphs.kind] if impl is None else f"{impl}, {GRAPHS_IMPL[graphs.kind]}"
        if impl is None and is_interface_experts(module) and module.config._experts_implementation == SCATTERMOE:
            stored = ", FP8 block-scaled weights as shipped" if hasattr(module, "down_proj_scale_inv") else ""
            impl = f"{SCATTERMOE} (ExpertsInterface{stored})"
        if impl is not None:
            report[name] = impl
    return report


# ----------------------------------------------------------------------------------------- class level
_CLASS_PATCHES: list[tuple[type, str, object]] = []  # (class, attribute, saved value or _ABSENT)
_ABSENT = object()


def _family_base(family: Family) -> type:
    module_name, class_name = family.pretrained_class.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def _patching_post_init(options: PatchOptions, family: Family, original_post_init):
    def post_init(self, *args, **kwargs):
        original_post_init(self, *args, **kwargs)
        family.patch(self, options, True)

    post_init.__hf_scatter__ = True
    return post_init


def patch_transformers(**options) -> None:
    """Class level: every model of a supported family that transformers builds from now on (``from_pretrained``,
    ``from_config``, a constructor) comes out patched with ``options``, and MXFP4 and block-scaled FP8
    checkpoints load as shipped (:func:`load_as_shipped`). An explicit ``experts_implementation=...`` at load time still
    wins. Undo with :func:`unpatch_transformers`."""
    opts = PatchOptions.from_kwargs("patch_transformers", **options)
    unpatch_transformers()
    for switch in _as_shipped_switches():
        switch.enable(True, pin=True)
    for family in families().values():
        cls = _family_base(family)
        attrs = {"post_init": _patching_post_init(opts, family, cls.post_init), **family.class_hooks(opts)}
        for attr, value in attrs.items():
            _CLASS_PATCHES.append((cls, attr, cls.__dict__.get(attr, _ABSENT)))
            setattr(cls, attr, value)


def unpatch_transformers() -> None:
    """Restore every class :func:`patch_transformers` touched; models built while it was on stay patched
    (use :func:`unpatch_model` on those)."""
    for switch in _as_shipped_switches():
        switch.enable(False, pin=False)
    while _CLASS_PATCHES:
        cls, attr, saved = _CLASS_PATCHES.pop()
        if saved is _ABSENT:
            delattr(cls, attr)
        else:
            setattr(cls, attr, saved)


def transformers_patched() -> bool:
    return bool(_CLASS_PATCHES)
