"""The ``hf-scatter`` lm-eval model: lm-eval's own Hugging Face model class with hf-scatter's patch applied.

Everything lm-eval's ``hf`` model accepts works here too (``pretrained=DIR``, ``dtype``, ``device``,
``batch_size``, ``peft``, ...); the loaded model is then run through :func:`hf_scatter.patch_model`, so
the only difference from ``--model hf`` is the kernels (and a quantized checkpoint's experts, which ``hf``
dequantizes and this model keeps as shipped). Patch options ride along in ``model_args``
(``moe=False``, ``norms=False``, ``router=False``: :class:`hf_scatter.models.PatchOptions`).
"""

from __future__ import annotations

import dataclasses

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hf_scatter
from hf_scatter.models import PatchOptions

PATCH_OPTION_NAMES = tuple(f.name for f in dataclasses.fields(PatchOptions))


@register_model("hf-scatter")
class HFScatterLM(HFLM):
    def __init__(self, pretrained, **kwargs):
        options = {name: kwargs.pop(name) for name in PATCH_OPTION_NAMES if name in kwargs}
        PatchOptions.from_kwargs("hf-scatter model_args", **options)  # fail before the model loads
        with hf_scatter.load_as_shipped():  # a quantized checkpoint's experts as it ships them (GPT-OSS: MXFP4)
            super().__init__(pretrained, **kwargs)
        hf_scatter.patch_model(self._model, **options)
        self.patch_report = hf_scatter.patch_report(self._model)
