"""The families offloading plans and runs, keyed by ``config.model_type``: one module of this package each.

A family module lists its :class:`OffloadFamily` entries in its ``FAMILIES`` tuple; adding a family is adding
its module and its name in :data:`FAMILY_MODULES`. The modules import on first use of :func:`families`, so
importing the planner does not load every family's code.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Callable

FAMILY_MODULES = ("mixtral", "dbrx", "qwen_moe", "deepseek", "gpt_oss", "granite_moe")


@dataclass(frozen=True)
class OffloadFamily:
    """What offloading knows of one family: ``spec(config, name, dtype_bytes)`` reads the shapes the planner
    prices (a :class:`~.spec.ModelSpec`); ``adapter`` is the :class:`~.adapter.PipelineAdapter` subclass that
    runs its decoder layers in pieces."""

    model_type: str
    spec: Callable
    adapter: type


@functools.lru_cache(maxsize=None)
def families() -> dict[str, OffloadFamily]:
    """Every offloaded family by ``model_type`` (importing the family modules the first time)."""
    return {family.model_type: family for name in FAMILY_MODULES
            for family in importlib.import_module(f"{__package__}.{name}").FAMILIES}


def offloaded_model_types() -> list[str]:
    """The families offloaded generation runs."""
    return sorted(families())


def adapter_for(model, shard=None):
    """The split of ``model`` (a causal LM of a family in :func:`offloaded_model_types`; patched or not), a
    :class:`~.adapter.PipelineAdapter`; ``shard``: this process's :class:`~.sharding.Shard` of a
    tensor-parallel group (default: the whole model)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    offloadable = offloaded_model_types()
    if model_type not in offloadable:
        raise ValueError(f"offloading supports {', '.join(offloadable)} causal LMs; got model_type "
                         f"{model_type!r} ({type(model).__name__})")
    if not hasattr(model, "lm_head"):
        raise ValueError(f"offloading needs the causal-LM model (with lm_head), got {type(model).__name__}: load it "
                         "with AutoModelForCausalLM")
    adapter = families()[model_type].adapter
    return adapter(model) if shard is None else adapter(model, shard)
