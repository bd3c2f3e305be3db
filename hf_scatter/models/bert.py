"""BERT: fused residual add + LayerNorm in every layer, and packed (unpadded) inference.

transformers has no kernel-layer tag on these classes, so they are swapped in place:
- ``BertSelfOutput`` and ``BertOutput`` (``dense -> dropout -> LayerNorm(h + input)``) run the add and the
  LayerNorm in one kernel; the dense layers, dropout and attention are transformers' own. This is the
  training path.
- ``BertModel`` runs inference calls on packed tokens (``hf_scatter.turbo``: no padding, variable-length
  attention, planned memory, a CUDA graph per length bucket) and returns HF's padded outputs, so every head
  (sequence / token classification, masked LM, ...) works unchanged; ``input_ids`` and ``inputs_embeds``
  alike. Calls the packed path cannot serve exactly (training, gradients, autocast, attention or hidden-state
  outputs, caches, left padding with a pooler in batches too large to run row for row) and inputs vanilla
  rejects take transformers' own forward.

The one visible difference from vanilla, so ``patch_report`` says it: packed calls return zeros as the hidden
states of padded positions (``attention_mask == 0``; a head sees zero rows there). Vanilla's values there come
from those positions attending over the real tokens at every layer: each padded position costs all of a real
token's work but its key and value projections (10 of 12 parts of the linear layers), which is the padded
work packing exists to skip (docs/bert.md has the measured cost).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertModel, BertOutput, BertSelfOutput

from .class_patch import apply_swaps, restore_class, swap_class
from .fused_norms import FUSED_ADD_NORM, add_layer_norm
from .registry import Family, PatchOptions, register_family

UNPADDED = ("unpadded (packed tokens, varlen attention, planned memory, CUDA graphs; inference returns zero hidden "
            "states at padded positions, attention_mask == 0, where vanilla computes values)")


def _dense_dropout_add_norm(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    hidden_states = self.dropout(self.dense(hidden_states))
    return add_layer_norm(hidden_states, input_tensor, self.LayerNorm, return_sum=False)[0]


class FusedBertSelfOutput(BertSelfOutput):
    hf_scatter_impl = FUSED_ADD_NORM
    forward = _dense_dropout_add_norm


class FusedBertOutput(BertOutput):
    hf_scatter_impl = FUSED_ADD_NORM
    forward = _dense_dropout_add_norm


def _packed_call_blocker(model, input_ids, attention_mask, position_ids, inputs_embeds, encoder_hidden_states,
                         cache, use_cache, kwargs) -> str | None:
    """Why this call must take transformers' padded forward, as far as the arguments tell (the packed path
    itself declines the rest: see ``turbo.hf_forward.packed_bert_forward``). Inputs vanilla rejects go there
    too, so they fail with vanilla's own error before any packed work."""
    if model.training:
        return "training mode (dropout)"
    if (input_ids is None) == (inputs_embeds is None):
        return "neither or both of input_ids and inputs_embeds"
    if (input_ids is not None and input_ids.dim() != 2) or (inputs_embeds is not None and inputs_embeds.dim() != 3):
        return "input_ids not [batch, seq] / inputs_embeds not [batch, seq, hidden]"
    tokens = input_ids if input_ids is not None else inputs_embeds
    if position_ids is None and tokens.shape[1] > model.config.max_position_embeddings:
        return "more positions than max_position_embeddings"
    if encoder_hidden_states is not None or cache is not None or use_cache:
        return "cross-attention or a KV cache"
    if model.config.output_attentions or model.config.output_hidden_states:
        return "attention weights / hidden states requested"
    unread = sorted(k for k, v in kwargs.items() if k != "return_dict" and v is not None and v is not False)
    if unread:
        return f"arguments the packed path does not read: {', '.join(unread)}"
    if torch.is_autocast_enabled(tokens.device.type):
        return "autocast"
    if attention_mask is not None and attention_mask.dim() != 2:
        return "a 3-D/4-D attention mask"
    return None


class UnpaddedBertModel(BertModel):
    """BertModel whose inference calls run packed; see the module docstring for when it falls back."""

    hf_scatter_impl = UNPADDED

    # Vanilla's signature and docs (inspect follows __wrapped__): transformers and its tests read what a model
    # supports from it, e.g. output_attentions from the ``**kwargs: Unpack[TransformersKwargs]`` annotation.
    @functools.wraps(BertModel.forward, assigned=("__doc__",), updated=())
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, encoder_hidden_states=None, encoder_attention_mask=None, past_key_values=None,
                use_cache=None, **kwargs):
        # The KV cache is ``past_key_values`` up to transformers 5.23 and ``cache`` from 5.24 (the old name
        # deprecated). Either reaches vanilla under the name the caller used, so vanilla's own renaming
        # and warnings apply; a None is not passed on, so no call warns that the caller did not make.
        if past_key_values is not None:
            kwargs["past_key_values"] = past_key_values
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        reason = _packed_call_blocker(self, input_ids, attention_mask, position_ids, inputs_embeds,
                                      encoder_hidden_states, cache, use_cache,
                                      {k: v for k, v in kwargs.items() if k not in ("past_key_values", "cache")})
        if reason is None:
            from ..turbo.hf_forward import packed_bert_forward

            out = packed_bert_forward(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
            if out is not None:
                return out.to_tuple() if kwargs.get("return_dict", self.config.return_dict) is False else out
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                               position_ids=position_ids, inputs_embeds=inputs_embeds,
                               encoder_hidden_states=encoder_hidden_states,
                               encoder_attention_mask=encoder_attention_mask, use_cache=use_cache, **kwargs)


def _share_output_capture(ours: type, vanilla: type) -> None:
    """transformers looks up which outputs (hidden states, attentions) a model records by the name of its
    class (a registry filled in ``PreTrainedModel.__init__``); a swapped class needs the vanilla entry."""
    try:
        from transformers.modeling_utils import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    # Stored under str(class) in every 5.x release (newer ones key by model in __setitem__: bypass it).
    dict.__setitem__(_CAN_RECORD_REGISTRY, str(ours), getattr(vanilla, "_can_record_outputs", None))


_share_output_capture(UnpaddedBertModel, BertModel)


def _patch_unpadded(model: nn.Module, options: PatchOptions) -> None:
    """Swap every BertModel whose architecture packs exactly (encoders with absolute positions)."""
    from ..turbo.unpadded import unsupported_architecture

    for module in model.modules():
        if isinstance(module, BertModel):
            module.__dict__.pop("_hf_scatter_runtime", None)  # options may have changed: plan and capture afresh
            if options.unpadded and unsupported_architecture(module.config) is None:
                swap_class(module, UnpaddedBertModel)
                module.__dict__["_hf_scatter_cuda_graphs"] = options.cuda_graphs
                module.__dict__["_hf_scatter_fast_gelu"] = options.fast_gelu
            else:
                restore_class(module, BertModel)


def patch_bert(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    apply_swaps(model, [(BertSelfOutput, FusedBertSelfOutput, options.norms),
                        (BertOutput, FusedBertOutput, options.norms)])
    _patch_unpadded(model, options)


BERT = register_family(Family(
    model_type="bert",
    patch=patch_bert,
    pretrained_class="transformers.models.bert.modeling_bert:BertPreTrainedModel",
))
