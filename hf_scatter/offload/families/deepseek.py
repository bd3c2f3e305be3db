"""DeepSeek-V3 and DeepSeek-V2 under offloading: shapes with multi-head latent attention (MLA), and the split.

Offloaded generation runs MLA in its absorbed form: the key half of ``kv_b_proj`` is applied to each query head
on the GPU, so the CPU cache holds one normalised latent plus the rotary key per token (576 values for V2-Lite
and V3, against 5,120 for the expanded keys and values of V2-Lite's 16 heads), which serves as the single key
head and as the value; the value half of ``kv_b_proj`` takes each head's attended latent to its values before
the output projection. The shared experts and the first dense layers' MLPs are dense tensors of the layer,
resident or streamed with the rest of it; the router chooses on float32 logits with the family's selection.
Over several GPUs each rank takes its query heads (their rows of the query projection and of ``kv_b_proj``) and
computes and caches the whole latent, which all heads read (``sharding``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from ...kernels.router_select import (Selection, deepseek_v2_group_limited, deepseek_v2_selection,
                                      deepseek_v3_selection, router_select)
from .adapter import LayerAttention, dense_mlp, linear_weight, mlp_tensors
from .llama_style import LlamaStyleConstants, LlamaStylePipelineAdapter
from .registry import OffloadFamily
from .spec import ModelSpec


def deepseek_spec(config, label: str, dtype_bytes: int) -> ModelSpec:
    """Shapes of a DeepSeek-V2/V3 config, MLA priced in the absorbed form the offloaded runtime runs."""
    return ModelSpec(
        name=label, family=config.model_type, hidden=config.hidden_size, layers=config.num_hidden_layers,
        heads=config.num_attention_heads, kv_heads=1, head_dim=config.kv_lora_rank + config.qk_rope_head_dim,
        intermediate=config.moe_intermediate_size, experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
        vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        dtype_bytes=dtype_bytes, shared_intermediate=config.moe_intermediate_size * (config.n_shared_experts or 0),
        dense_layers=min(config.first_k_dense_replace or 0, config.num_hidden_layers),
        dense_intermediate=config.intermediate_size, q_lora_rank=config.q_lora_rank or 0,
        kv_lora_rank=config.kv_lora_rank, qk_nope_dim=config.qk_nope_head_dim, qk_rope_dim=config.qk_rope_head_dim,
        v_head_dim=config.v_head_dim)


@dataclass(frozen=True)
class DeepseekConstants(LlamaStyleConstants):
    """The Llama-style constants plus MLA's head widths, its low-rank norms' epsilons (their modules' own: the
    config does not set them), the router's selection and the rotary embedding of the version."""

    nope: int  # qk_nope_head_dim: the part of a query / key head without rotary embedding
    rope_dim: int  # qk_rope_head_dim
    latent: int  # kv_lora_rank
    v: int  # v_head_dim
    q_a_norm_eps: float | None  # None: a full-rank query projection
    kv_a_norm_eps: float
    selection: Selection | None  # None: every layer holds a dense MLP
    rope: Callable  # (q [T, H, rope], k [T, 1, rope], cos, sin) -> both rotated

    @classmethod
    def of(cls, model: nn.Module, selection: Callable[..., Selection], rope: Callable, **fields):
        """``selection(config)``: the version's router choice, read where some layer holds experts."""
        c, a = model.config, model.model.layers[0].self_attn
        routed = any(hasattr(layer.mlp, "experts") for layer in model.model.layers)
        return super().of(
            model, attention=(LayerAttention(scale=float(a.scaling)),) * c.num_hidden_layers,
            nope=c.qk_nope_head_dim, rope_dim=c.qk_rope_head_dim, latent=c.kv_lora_rank, v=c.v_head_dim,
            q_a_norm_eps=a.q_a_layernorm.variance_epsilon if a.q_a_layernorm is not None else None,
            kv_a_norm_eps=a.kv_a_layernorm.variance_epsilon, selection=selection(c) if routed else None, rope=rope,
            **fields)


class ComplexRotary(nn.Module):
    """DeepSeek-V2's rotary module returns one complex ``freqs_cis``; the pipeline carries (cos, sin) pairs, here
    its real and imaginary parts, which :func:`complex_rope` joins again."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = self.rotary(x, position_ids)  # [B, T, rope / 2] complex
        return freqs.real, freqs.imag


def complex_rope(q, k, cos, sin):
    """V2's own complex rotation; it wants [B, heads, T, rope] and [B, T, rope / 2] frequencies."""
    q_rot, k_rot = v2.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       torch.complex(cos, sin)[None])
    return q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1)


def _v3_selection(c) -> Selection:
    return deepseek_v3_selection(c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)


def _v2_selection(c) -> Selection:
    return deepseek_v2_selection(c.n_group, c.topk_group, deepseek_v2_group_limited(c.topk_method),
                                 c.routed_scaling_factor)


class DeepseekPipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of DeepSeek-V2/V3: MLA absorbed (see the module docstring), the router on float32
    logits with the family's selection, the shared experts added to the routed ones, and the first layers'
    dense MLPs in place of experts."""

    # ----- weights -----
    def layers(self):
        return list(self.model.model.layers)

    def _kv_b(self, layer) -> torch.Tensor:
        """``kv_b_proj`` as [heads, nope + v, latent]: each head's key rows, then its value rows."""
        k = self.constants
        weight = linear_weight(layer.self_attn.kv_b_proj, self.float_dtype)
        return weight.view(self.full_dims.heads, k.nope + k.v, k.latent)

    def pre_tensors(self, layer):
        a = layer.self_attn
        t = {"norm": layer.input_layernorm.weight}
        if a.q_lora_rank is None:
            t["q"] = linear_weight(a.q_proj, self.float_dtype)
        else:
            t.update(q_a=linear_weight(a.q_a_proj, self.float_dtype), q_a_norm=a.q_a_layernorm.weight,
                     q_b=linear_weight(a.q_b_proj, self.float_dtype))
            if a.q_a_proj.bias is not None:
                t["q_a_bias"] = a.q_a_proj.bias
        t.update(kv_a=linear_weight(a.kv_a_proj_with_mqa, self.float_dtype), kv_a_norm=a.kv_a_layernorm.weight,
                 w_uk=self._kv_b(layer)[:, :self.constants.nope])  # [heads, nope, latent]
        if a.kv_a_proj_with_mqa.bias is not None:
            t["kv_a_bias"] = a.kv_a_proj_with_mqa.bias
        return t

    def post_tensors(self, layer):
        a, mlp = layer.self_attn, layer.mlp
        t = {"w_uv": self._kv_b(layer)[:, self.constants.nope:],  # [heads, v, latent]
             "o": linear_weight(a.o_proj, self.float_dtype)}
        if a.o_proj.bias is not None:
            t["o_bias"] = a.o_proj.bias
        t["post_norm"] = layer.post_attention_layernorm.weight
        if hasattr(mlp, "experts"):
            t["router"] = mlp.gate.weight
            bias = getattr(mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                t["score_bias"] = bias
            t.update(mlp_tensors("shared", mlp.shared_experts, self.float_dtype))
        else:
            t.update(mlp_tensors("dense", mlp, self.float_dtype))
        return t

    def expert_tensors(self, layer):
        return super().expert_tensors(layer) if hasattr(layer.mlp, "experts") else {}

    # ----- maths -----
    def qkv(self, w, x, cos, sin):
        """[T, heads * (latent + rope) + latent + rope]: each head's query in the latent space (its no-rotary
        part through the key half of ``kv_b_proj``) with its rotary part, then the token's latent and rotary
        key, the single KV head."""
        k = self.constants
        T, H = x.shape[0], self.dims.heads
        n, r, c = k.nope, k.rope_dim, k.latent
        h = self._norm(x, None, w["norm"])
        if "q" in w:
            q = F.linear(h, w["q"])
        else:
            q_a = F.linear(h, w["q_a"], w.get("q_a_bias"))
            q = F.linear(self._norm(q_a, None, w["q_a_norm"], k.q_a_norm_eps), w["q_b"])
        q = q.view(T, H, n + r)  # [T, H, nope + rope]
        kv = F.linear(h, w["kv_a"], w.get("kv_a_bias"))  # [T, latent + rope]
        latent = self._norm(kv[:, :c].contiguous(), None, w["kv_a_norm"], k.kv_a_norm_eps)
        q_rot, k_rot = k.rope(q[..., n:], kv[:, None, c:], cos, sin)  # [T, H, rope], [T, 1, rope]
        out = torch.empty(T, self.dims.qkv_dim, dtype=x.dtype, device=x.device)
        q_out = out[:, :self.dims.q_dim].view(T, H, c + r)
        q_out[..., :c] = torch.bmm(q[..., :n].transpose(0, 1), w["w_uk"]).transpose(0, 1)  # [T, H, latent]
        q_out[..., c:] = q_rot
        out[:, self.dims.q_dim:self.dims.q_dim + c] = latent
        out[:, self.dims.q_dim + c:] = k_rot[:, 0]
        return out

    def _attention_output(self, w, attn):
        """Each head's attended latent [T, H, latent] through the value half of ``kv_b_proj``, then ``o``."""
        k = self.constants
        T, H = attn.shape[0], self.dims.heads
        latent = attn.view(T, H, k.latent + k.rope_dim)[..., :k.latent]
        values = torch.bmm(latent.transpose(0, 1), w["w_uv"].transpose(1, 2))  # [H, T, v]
        return F.linear(values.transpose(0, 1).reshape(T, H * k.v), w["o"], w.get("o_bias"))

    def _mlp(self, w, expert_parts, normed, fetch=None):
        glu = self.constants.glu  # the shared and dense MLPs' act(gate) * up, as the experts'
        if "dense_gate_up" in w:  # one of the first dense layers
            return dense_mlp(w, "dense", normed, glu)
        return super()._mlp(w, expert_parts, normed, fetch) + dense_mlp(w, "shared", normed, glu)

    def _route(self, w, normed):
        logits = F.linear(normed.float(), w["router"].float())  # [T, E], as the router computes them
        return router_select(logits, self.dims.top_k, self.constants.selection, bias=w.get("score_bias"))


class DeepseekV3PipelineAdapter(DeepseekPipelineAdapter):
    model_type = "deepseek_v3"

    def read_constants(self, model):
        rotate = (v3.apply_rotary_pos_emb_interleave if model.config.rope_interleave
                  else v3.apply_rotary_pos_emb)
        return DeepseekConstants.of(model, selection=_v3_selection, rope=functools.partial(rotate, unsqueeze_dim=1))


class DeepseekV2PipelineAdapter(DeepseekPipelineAdapter):
    model_type = "deepseek_v2"

    def read_constants(self, model):
        return DeepseekConstants.of(model, selection=_v2_selection, rope=complex_rope)

    def _rotary_module(self):
        return ComplexRotary(super()._rotary_module())


FAMILIES = (OffloadFamily("deepseek_v3", spec=deepseek_spec, adapter=DeepseekV3PipelineAdapter),
            OffloadFamily("deepseek_v2", spec=deepseek_spec, adapter=DeepseekV2PipelineAdapter))
