"""The patched ``BertModel.forward`` for inference: pack, run the packed runtime, hand back HF's outputs.

``last_hidden_state`` comes back padded ([B, S, H]), ``pooler_output`` as [B, H]. Padded positions hold
zeros where vanilla BERT computes them (each attends over its row's real tokens at every layer: the padded
work packing skips), the one difference from vanilla, which ``patch_report`` states. Small batches (at most
``PADDED_ROWS_LIMIT`` positions) run row for row instead of packed, so no call waits for its mask on the host;
their padded positions come back as zeros too, so outputs do not depend on the batch's size. Callers that
want the packed rows use :func:`packed_outputs` (or :class:`~hf_scatter.turbo.encoder.Encoder` for lists of
requests).
"""

from __future__ import annotations

import torch
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from .packing import (PackedBatch, check_padded, key_mask_of, mask_layout, pack_padded, pack_with_layout,
                      unpack_padded_rows, unpack_rows)
from .runtime import PADDED_ROWS_LIMIT, UnpaddedRuntime


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


def _parameter_blocker(runtime: UnpaddedRuntime) -> str | None:
    wrapped = runtime.check_modules()
    if wrapped is not None:
        return f"a layer that is not plain ({wrapped}: an adapter or a quantized layer)"
    runtime.check_params()  # the dtypes are worked out once per set of parameters
    if torch.is_grad_enabled() and any(p.requires_grad for p in runtime.params):
        return "gradients enabled (use torch.no_grad() or torch.inference_mode())"
    if runtime.mixed_dtypes:
        return "parameters of several dtypes"
    return None


def packed_bert_forward(model, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds=None):
    """HF outputs of an inference call, or None where the padded forward must answer instead: gradients
    wanted, layers that are not plain (PEFT's adapters, quantized layers), mixed parameter dtypes,
    ``inputs_embeds`` of another dtype, an empty batch, or (for packed batches) a row whose first column is
    padding while the model pools (vanilla pools that padded position, which packing never computes; a batch
    run row for row computes it). A batch of at most
    ``PADDED_ROWS_LIMIT`` positions runs row for row; larger ones of token ids with CUDA graphs are packed
    straight into the graph's inputs (``run_padded``)."""
    runtime = runtime_of(model)
    if _parameter_blocker(runtime) is not None:
        return None
    if inputs_embeds is not None and inputs_embeds.dtype != runtime.params[0].dtype:
        return None
    B, S = check_padded(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
    if B * S == 0:
        return None
    if B * S <= PADDED_ROWS_LIMIT:
        hidden, pooled = runtime.run_padded_rows(input_ids, attention_mask, token_type_ids, position_ids,
                                                 inputs_embeds, check=False)
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=unpack_padded_rows(hidden, key_mask_of(attention_mask), (B, S)),
            pooler_output=None if pooled is None else pooled.clone())
    layout = mask_layout(attention_mask, (B, S))
    if layout.num_tokens == 0 or (layout.first_column_padded and model.pooler is not None):
        return None
    if inputs_embeds is None and runtime.graphs_enabled() and input_ids.device == runtime.device:
        hidden, pooled, index = runtime.run_padded(input_ids, layout, token_type_ids, position_ids, check=False)
        last = unpack_rows(hidden, index, layout.shape)
    else:
        batch = pack_with_layout(layout, input_ids, token_type_ids, position_ids, inputs_embeds)
        hidden, pooled = runtime.run(batch)
        last = batch.unpack(hidden)
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=last, pooler_output=None if pooled is None else pooled.clone())
