"""The Llama-style MoE layer the offloaded runtime splits for most families (Mixtral, Qwen-MoE, OLMoE, GPT-OSS,
Granite-MoE, DeepSeek): RMSNorm, separate q/k/v projections, a linear router, SwiGLU experts with a
concatenated [gate; up] projection. A family's module subclasses it with what differs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from ...kernels.fp8_blocks import Fp8BlockWeight
from ...kernels.norms import fused_add_rms_norm
from ...kernels.router import router_topk
from ...models.experts import fp8_expert_weight
from ...moe.mlp import expert_mlp, glu_activation
from .adapter import Dims, LayerAttention, PipelineAdapter, linear_weight
from .rows import Rows


@dataclass(frozen=True)
class LlamaStyleConstants:
    """What the Llama-style maths reads from the config."""

    attention: tuple[LayerAttention, ...]  # each layer's window, sinks and scale
    norm_eps: float  # every RMSNorm's of the layer stack: input, post-attention, final
    glu: Callable[[torch.Tensor], torch.Tensor]  # act(gate) * up over [gate; up] columns (experts, dense MLPs)
    normalize: str | None  # "sum": the top-k gates renormalised (norm_topk_prob; Mixtral always)

    @classmethod
    def of(cls, model: nn.Module, attention: tuple[LayerAttention, ...] | None = None, **fields):
        """``attention`` by default: the config's ``sliding_window`` (None: full) on every layer, as Mixtral and
        the Qwen-MoE configs apply it; ``fields``: a subclass's own."""
        c = model.config
        if attention is None:
            attention = (LayerAttention(window=getattr(c, "sliding_window", None)),) * c.num_hidden_layers
        return cls(attention=attention, norm_eps=c.rms_norm_eps, glu=glu_activation(ACT2FN[c.hidden_act]),
                   normalize="sum" if getattr(c, "norm_topk_prob", True) else None, **fields)


class LlamaStylePipelineAdapter(PipelineAdapter):
    """The Llama-style MoE layer with its router at ``mlp.gate`` (Mixtral, Qwen3-MoE, OLMoE). Subclasses name the
    family and add its q/k norms or routing; every layer must hold an MoE block."""

    gates_in_logits_dtype = False
    # gate_up as [E, 2, I, H] ([gate; up]), down [E, H, I]; FP8 experts' scales as [E, 2, I / bn, H / bk] and
    # [E, H / bn, I / bk], a column range of them in whole blocks
    column_dims = {"gate_up": 2, "down": 2, "gate_up_scale": 2, "down_scale": 2}
    norm_casting = "llama"  # its RMSNorm's rounding (kernels.norms.fused_add_rms_norm)

    # ----- reading -----
    def read_dims(self, c) -> Dims:
        return Dims.of(c, getattr(c, "max_position_embeddings", None), getattr(c, "sliding_window", None))

    def read_constants(self, model) -> LlamaStyleConstants:
        return LlamaStyleConstants.of(model)

    # ----- weights -----
    def layers(self):
        layers = list(self.model.model.layers)
        dense = [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "experts")]
        if dense:
            raise NotImplementedError(f"offloading runs decoder layers that all hold experts; layers {dense} of this "
                                      f"{self.model_type} model hold a dense MLP (mlp_only_layers / decoder_sparse_step)")
        return layers

    def pre_tensors(self, layer):
        a = layer.self_attn
        q, k, v = (linear_weight(p, self.float_dtype) for p in (a.q_proj, a.k_proj, a.v_proj))
        tensors = {"norm": layer.input_layernorm.weight, "qkv": Rows(q, k, v)}
        if a.q_proj.bias is not None:  # attention_bias (Qwen2-MoE and GPT-OSS always; the others by config)
            tensors["qkv_bias"] = Rows(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
        return tensors

    def post_tensors(self, layer):
        return {**self._attention_out_tensors(layer), "router": layer.mlp.gate.weight}

    def _attention_out_tensors(self, layer) -> dict:
        """The attention's output projection (with its bias where it has one) and the post-attention norm."""
        o = layer.self_attn.o_proj
        tensors = {"o": linear_weight(o, self.float_dtype), "post_norm": layer.post_attention_layernorm.weight}
        if o.bias is not None:
            tensors["o_bias"] = o.bias
        return tensors

    def expert_tensors(self, layer):
        experts = layer.mlp.experts
        flags = {f: getattr(experts, f, d) for f, d in (("has_gate", True), ("has_bias", False),
                                                         ("is_concatenated", True))}
        if flags != {"has_gate": True, "has_bias": False, "is_concatenated": True}:
            raise NotImplementedError(f"offloading supports experts with a concatenated [gate; up] projection "
                                      f"and no bias; this model's experts have {flags}")
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if getattr(experts, "is_transposed", False):  # stored [E, H, 2I] / [E, I, H]
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        E, two_i, H = gate_up.shape
        tensors = {"gate_up": gate_up.reshape(E, 2, two_i // 2, H), "down": down}
        if self.full_dims.expert_format == "fp8":  # as shipped: the bytes and their scales, split in whole blocks
            gate_up_scale, down_scale = experts.gate_up_proj_scale_inv, experts.down_proj_scale_inv
            tensors.update(gate_up_scale=gate_up_scale.reshape(E, 2, -1, gate_up_scale.shape[-1]),
                           down_scale=down_scale)
        return tensors

    def read_expert_format(self, model) -> str:
        # transformers' FP8Experts (a block-scaled checkpoint loaded as shipped) hold their weights' scales
        experts = next((m for m in model.modules() if getattr(m, "down_proj_scale_inv", None) is not None), None)
        if experts is None:
            return ""
        if not self.shard.whole:
            raise NotImplementedError("offloading FP8 experts over several GPUs is not built; offload them on one "
                                      "GPU, or load the checkpoint with FineGrainedFP8Config(dequantize=True)")
        gate_rows, down_cols = experts.gate_up_proj_scale_inv.shape[1], experts.down_proj_scale_inv.shape[2]
        inter = experts.down_proj.shape[2]
        if gate_rows % 2 or inter % (gate_rows // 2) or inter % down_cols:
            raise NotImplementedError(f"offloading FP8 experts needs each of gate and up to hold whole scale blocks; "
                                      f"this model's {inter} intermediate columns have {gate_rows} scale rows")
        for name in ("gate_up_proj", "down_proj"):  # a partial last block: refused as the patched model does
            fp8_expert_weight(experts, name)
        # a column range holds whole blocks of both projections' scales
        self.column_units = {**self.column_units, "gate_up_scale": inter // (gate_rows // 2),
                             "down_scale": inter // down_cols}
        return "fp8"

    def other_tensors(self):
        base = self.model.model
        return {"embed": base.embed_tokens.weight, "final_norm": base.norm.weight,
                "lm_head": self.model.lm_head.weight}

    def _rotary_module(self):
        return self.model.model.rotary_emb

    # ----- maths -----
    def _project_qkv(self, w, x):
        return F.linear(self._norm(x, None, w["norm"]), w["qkv"], w.get("qkv_bias"))

    def _post_norm(self, w, o, x):
        return self._norm(o, x, w["post_norm"], return_sum=True)

    def _norm(self, x, residual, weight, eps=None, return_sum=False):
        """The family's RMSNorm of ``x + residual`` (with the sum when ``return_sum``), in its casting; ``eps``:
        the layer stack's unless given."""
        return fused_add_rms_norm(x, residual, weight, eps=self.constants.norm_eps if eps is None else eps,
                                  return_sum=return_sum, validate=False, casting=self.norm_casting)

    def _select(self, logits):
        """float32 softmax, top-k, renormalised to sum 1 (Mixtral: float32 gates; Qwen-style routers renormalise
        where ``norm_topk_prob`` says and hand the gates on in the logits' dtype)."""
        gates, experts = router_topk(logits, self.dims.top_k, normalize=self.constants.normalize,
                                     softmax_dtype=torch.float32)
        return (gates.to(logits.dtype) if self.gates_in_logits_dtype else gates), experts

    def _experts(self, part, x, experts, gates, routing):
        E, _, c, H = part["gate_up"].shape
        if "gate_up_scale" in part:  # FP8 as shipped, read by the kernels as [E, d_in, d_out]
            w_in = Fp8BlockWeight(part["gate_up"].view(E, 2 * c, H), part["gate_up_scale"].flatten(1, 2))
            w_out = Fp8BlockWeight(part["down"], part["down_scale"])
        else:
            w_in, w_out = part["gate_up"].view(E, 2 * c, H).transpose(1, 2), part["down"].transpose(1, 2)
        return expert_mlp(x, (w_in,), w_out, experts, gates, self.constants.glu, validate=False, routing=routing)

    def _final_norm(self, other, x):
        return self._norm(x, None, other["final_norm"])
