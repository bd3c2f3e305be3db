"""DBRX under offloading: its shapes (``d_model``, ``attn_config``, ``ffn_config``) and its layer split, with
``w1`` / ``v1`` / ``w2`` as [E, I, H] columns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ...kernels.norms import fused_add_layer_norm
from ...kernels.router import router_topk
from ...moe.mlp import expert_mlp, glu_pair_activation
from .adapter import Dims, LayerAttention, PipelineAdapter
from .registry import OffloadFamily
from .spec import ModelSpec


def dbrx_spec(config, label: str, dtype_bytes: int) -> ModelSpec:
    """The planner's shapes from a DBRX config (``d_model``, ``attn_config``, ``ffn_config``)."""
    attn, ffn = config.attn_config, config.ffn_config
    return ModelSpec(name=label, family="dbrx", hidden=config.d_model, layers=config.n_layers, heads=config.n_heads,
                     kv_heads=attn.kv_n_heads, head_dim=config.d_model // config.n_heads,
                     intermediate=ffn.ffn_hidden_size, experts=ffn.moe_num_experts, top_k=ffn.moe_top_k,
                     vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     dtype_bytes=dtype_bytes)


@dataclass(frozen=True)
class DbrxConstants:
    """What DBRX's maths reads: from the config, but the LayerNorms' epsilons (torch's default, in the modules)."""

    attention: tuple[LayerAttention, ...]  # causal attention over the whole context on every layer
    norm_eps: tuple[float, float, float]  # norm_1 (input), norm_2 (post-attention), norm_f (final)
    clip_qkv: float | None
    glu: Callable  # act(gate) * up over the separate w1 and v1 outputs
    normalize: float | None  # moe_normalize_expert_weights: the p-norm of the top-k gates

    @classmethod
    def of(cls, model: nn.Module) -> "DbrxConstants":
        c, t = model.config, model.transformer
        nan = t.blocks[0].norm_attn_norm
        return cls(attention=(LayerAttention(),) * c.n_layers, norm_eps=(nan.norm_1.eps, nan.norm_2.eps, t.norm_f.eps),
                   clip_qkv=c.attn_config.clip_qkv,
                   glu=glu_pair_activation(ACT2FN[c.ffn_config.ffn_act_fn.get("name", "silu")]),
                   normalize=c.ffn_config.moe_normalize_expert_weights)


class DbrxPipelineAdapter(PipelineAdapter):
    """Offloaded generation of DBRX: its layer in pieces, ``w1`` / ``v1`` / ``w2`` as [E, I, H] columns."""

    model_type = "dbrx"
    column_dims = {"w1": 1, "v1": 1, "w2": 1}  # each [E, I, H]

    # ----- reading -----
    def read_dims(self, c) -> Dims:
        return Dims.of(c, getattr(c, "max_seq_len", None))

    def read_constants(self, model) -> DbrxConstants:
        return DbrxConstants.of(model)

    # ----- weights -----
    def layers(self):
        return list(self.model.transformer.blocks)

    def pre_tensors(self, layer):
        nan = layer.norm_attn_norm
        if nan.norm_1.bias is not None or nan.norm_2.bias is not None:
            raise NotImplementedError("offloading supports DBRX's bias-free LayerNorms only")
        return {"norm": nan.norm_1.weight, "qkv": nan.attn.Wqkv.weight}

    def post_tensors(self, layer):
        nan = layer.norm_attn_norm
        return {"o": nan.attn.out_proj.weight, "post_norm": nan.norm_2.weight, "router": layer.ffn.router.layer.weight}

    def expert_tensors(self, layer):
        mlp = layer.ffn.experts.mlp
        E, I, H = self.full_dims.experts, self.full_dims.intermediate, self.full_dims.hidden
        return {name: getattr(mlp, name).view(E, I, H) for name in ("w1", "v1", "w2")}

    def other_tensors(self):
        t = self.model.transformer
        if t.norm_f.bias is not None:
            raise NotImplementedError("offloading supports DBRX's bias-free LayerNorms only")
        return {"embed": t.wte.weight, "final_norm": t.norm_f.weight, "lm_head": self.model.lm_head.weight}

    def _rotary_module(self):
        return self.model.transformer.rotary_emb

    # ----- maths -----
    def _project_qkv(self, w, x):
        k = self.constants
        h = fused_add_layer_norm(x, None, w["norm"], None, eps=k.norm_eps[0], validate=False)
        qkv = F.linear(h.to(x.dtype), w["qkv"])
        if k.clip_qkv is not None:
            qkv.clamp_(min=-k.clip_qkv, max=k.clip_qkv)
        return qkv

    def _post_norm(self, w, o, x):
        normed, summed = fused_add_layer_norm(o, x, w["post_norm"], None, eps=self.constants.norm_eps[1],
                                              return_sum=True, validate=False)
        return normed.to(summed.dtype), summed

    def _select(self, logits):
        return router_topk(logits, self.dims.top_k, normalize=self.constants.normalize, softmax_dtype=logits.dtype)

    def _experts(self, part, x, experts, gates, routing):
        return expert_mlp(x, (part["w1"].transpose(1, 2), part["v1"].transpose(1, 2)), part["w2"], experts, gates,
                          self.constants.glu, validate=False, routing=routing)

    def _final_norm(self, other, x):
        return fused_add_layer_norm(x, None, other["final_norm"], None, eps=self.constants.norm_eps[2],
                                    validate=False)


FAMILIES = (OffloadFamily("dbrx", spec=dbrx_spec, adapter=DbrxPipelineAdapter),)
