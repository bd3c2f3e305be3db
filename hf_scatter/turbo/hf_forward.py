"""The patched ``BertModel.forward`` for inference: pack, run the packed runtime, hand back HF's outputs.

``last_hidden_state`` comes back padded ([B, S, H]), ``pooler_output`` as [B, H]. Padded positions hold
zeros where vanilla BERT computes them (each attends over its row's real tokens at every layer: the padded
work packing skips), the one difference from vanilla, which ``patch_report`` states. Callers that want the
packed rows use :func:`packed_outputs` (or :class:`~hf_scatter.turbo.encoder.Encoder` for lists of requests).
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from .packing import PackedBatch, pack_padded
from .runtime import UnpaddedRuntime


def runtime_of(model) -> UnpaddedRuntime:
    """The model's packed runtime (plans and graphs live as long as the model)."""
    runtime = model.__dict__.get("_hf_scatter_runtime")
    if runtime is None:
        runtime = UnpaddedRuntime(model, cuda_graphs=model.__dict__.get("_hf_scatter_cuda_graphs", True),
                                  exact_gelu=not model.__dict__.get("_hf_scatter_fast_gelu", True))
        model.__dict__["_hf_scatter_runtime"] = runtime
    return runtime


def packed_outputs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None
                   ) -> tuple[PackedBatch, torch.Tensor, torch.Tensor | None]:
    """``(batch, hidden [T, H], pooled [N, H] or None)``: the packed rows, copied out of planned memory."""
    batch = pack_padded(input_ids, attention_mask, token_type_ids, position_ids)
    hidden, pooled = runtime_of(model).run(batch)
    return batch, hidden[:batch.num_tokens].clone(), None if pooled is None else pooled.clone()


def _parameter_blocker(params) -> str | None:
    grad = torch.is_grad_enabled()
    dtype = params[0].dtype
    for p in params:
        if grad and p.requires_grad:
            return "gradients enabled (use torch.no_grad() or torch.inference_mode())"
        if p.dtype != dtype:
            return "parameters of several dtypes"
    return None


def packed_bert_forward(model, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds=None):
    """HF outputs of an inference call, or None where the padded forward must answer instead: gradients
    wanted, mixed parameter dtypes, ``inputs_embeds`` of another dtype, an empty batch, or a row whose first
    column is padding while the model pools (vanilla pools that padded position, which packing never
    computes)."""
    runtime = runtime_of(model)
    if _parameter_blocker(runtime.params) is not None:
        return None
    if inputs_embeds is not None and inputs_embeds.dtype != runtime.params[0].dtype:
        return None
    batch = pack_padded(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
    if batch.num_tokens == 0 or (batch.first_column_padded and model.pooler is not None):
        return None
    hidden, pooled = runtime.run(batch)
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=batch.unpack(hidden), pooler_output=None if pooled is None else pooled.clone())
