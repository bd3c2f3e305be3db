"""BERT: the two ``dense -> dropout -> LayerNorm(h + input)`` blocks with the add and LayerNorm in one kernel.

transformers has no kernel-layer tag on these classes, so ``BertSelfOutput`` and ``BertOutput`` are swapped in
place; the dense layers, dropout and attention (SDPA or eager) are transformers' own.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.bert.modeling_bert import BertOutput, BertSelfOutput

from .class_patch import apply_swaps
from .fused_norms import FUSED_ADD_NORM, add_layer_norm
from .registry import Family, PatchOptions, register_family


def _dense_dropout_add_norm(self, hidden_states: torch.Tensor, input_tensor: torch.Tensor) -> torch.Tensor:
    hidden_states = self.dropout(self.dense(hidden_states))
    return add_layer_norm(hidden_states, input_tensor, self.LayerNorm, return_sum=False)[0]


class FusedBertSelfOutput(BertSelfOutput):
    hf_scatter_impl = FUSED_ADD_NORM
    forward = _dense_dropout_add_norm


class FusedBertOutput(BertOutput):
    hf_scatter_impl = FUSED_ADD_NORM
    forward = _dense_dropout_add_norm


def patch_bert(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    apply_swaps(model, [(BertSelfOutput, FusedBertSelfOutput, options.norms),
                        (BertOutput, FusedBertOutput, options.norms)])


BERT = register_family(Family(
    model_type="bert",
    patch=patch_bert,
    pretrained_class="transformers.models.bert.modeling_bert:BertPreTrainedModel",
))
