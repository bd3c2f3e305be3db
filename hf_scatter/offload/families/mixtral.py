"""Mixtral under offloading: the Llama-style split as it stands, and Llama-style shapes."""

from __future__ import annotations

import functools

from .llama_style import LlamaStylePipelineAdapter
from .registry import OffloadFamily
from .spec import llama_style_spec


class MixtralPipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of Mixtral: its layer in pieces, the experts in column layout."""

    model_type = "mixtral"


FAMILIES = (OffloadFamily("mixtral", spec=functools.partial(llama_style_spec, family="mixtral"),
                          adapter=MixtralPipelineAdapter),)
