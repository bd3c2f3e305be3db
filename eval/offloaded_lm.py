"""The ``hf-scatter-offloaded`` lm-eval model: lm-eval's Hugging Face model class whose forward passes and
generation run through :func:`hf_scatter.offload` (CGOPipe: layers streamed from host memory, attention on
the CPU during generation), so a checkpoint larger than the GPU can be evaluated, and the offloaded runtime
can be checked against transformers request by request.

``model_args``: what lm-eval's ``hf`` model takes (``pretrained=DIR``, ``dtype``, ``batch_size``, ...), plus
``gpu_memory`` (default 16GiB) and ``profile`` (a hardware profile name or JSON for the policy search;
default this machine's saved one). ``device`` is where the offloaded runtime runs (``cuda``, or ``cpu`` for
the same pipeline on the CPU); the checkpoint itself loads into host memory.
"""

from __future__ import annotations

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

import hf_scatter


@register_model("hf-scatter-offloaded")
class OffloadedLM(HFLM):
    def __init__(self, pretrained, device: str = "cuda", gpu_memory: str = "16GiB", profile: str | None = None,
                 **kwargs):
        super().__init__(pretrained, device="cpu", **kwargs)  # host memory; the layers move into the store
        self.offloaded = hf_scatter.offload_model(self._model, gpu_memory=gpu_memory, device=device, profile=profile,
                                                  progress=False)
        self.patch_report = {"model": f"offloaded: {self.offloaded!r}"}

    def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
        if attn_mask is not None or labels is not None:
            raise NotImplementedError("hf-scatter-offloaded runs causal LMs only (no encoder-decoder scoring)")
        return self.offloaded.logits(inps)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs):
        """As lm-eval's HF model: temperature 0 means greedy; the task's other generation keywords go to
        OffloadedModel.generate as they would to model.generate (it names any it does not support)."""
        mask = generation_kwargs.pop("attention_mask", None)
        generation_kwargs.pop("use_cache", None)  # the offloaded runtime always keeps a KV cache
        temperature = generation_kwargs.pop("temperature", 0.0) or 0.0
        do_sample = bool(generation_kwargs.pop("do_sample", None) or temperature > 0)
        if do_sample:
            generation_kwargs["temperature"] = temperature or 1.0
        new_tokens = max(1, max_length - context.shape[1])
        return self.offloaded.generate(context, attention_mask=mask, max_new_tokens=new_tokens, do_sample=do_sample,
                                       stop_strings=stop, tokenizer=self.tokenizer,
                                       pad_token_id=self.tokenizer.pad_token_id, progress=False, **generation_kwargs)
