"""DeepSeek-V3 and DeepSeek-V2: their routers on the selection kernel, Llama-style RMSNorm (the attention's
low-rank q/kv norms included), experts on the ``"scattermoe"`` backend. The shared experts and the first
``first_k_dense_replace`` dense layers run as transformers has them, their SwiGLU fused.

V3 routes on sigmoid scores plus ``e_score_correction_bias``, limited to the ``topk_group`` best of ``n_group``
expert groups; V2 on softmax scores, greedy or ``group_limited_greedy``. The choice is exact, ties included
(see ``kernels/router_select``); the weights are float32, as transformers' are.

Offloaded generation runs multi-head latent attention (MLA) in its absorbed form: the key half of ``kv_b_proj``
is applied to each query head on the GPU, so the CPU cache holds one normalised latent plus the rotary key per
token (576 values for V2-Lite and V3, against 5,120 for the expanded keys and values of V2-Lite's 16 heads),
which serves as the single key head and as the value; the value half of ``kv_b_proj`` takes each head's
attended latent to its values before the output projection. The shared experts and the first dense layers'
MLPs are dense tensors of the layer, resident or streamed with the rest of it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

from ..kernels.router_select import Selection, deepseek_v2_selection, deepseek_v3_selection, router_select
from ..moe.mlp import glu_activation
from .decoder_moe import DecoderFamily, register_decoder_family
from .pipeline_adapter import LayerAttention, LlamaStylePipelineAdapter, dense_mlp, mlp_tensors
from .spec import ModelSpec


def _float32_logits(router, hidden_states: torch.Tensor) -> torch.Tensor:
    return F.linear(hidden_states.view(-1, router.hidden_dim).float(), router.weight.float())  # [T, E]


def v3_selection(router) -> Selection:
    return deepseek_v3_selection(router.num_group, router.topk_group, router.norm_topk_prob,
                                 router.routed_scaling_factor)


def v2_selection(router) -> Selection:
    if router.topk_method not in ("greedy", "group_limited_greedy"):
        raise ValueError(f"DeepSeek-V2 router: topk_method {router.topk_method!r} is not one transformers defines "
                         "('greedy' or 'group_limited_greedy')")
    return deepseek_v2_selection(router.num_group, router.topk_group, router.topk_method == "group_limited_greedy",
                                 router.routed_scaling_factor)


def v3_router_forward(self, hidden_states: torch.Tensor):
    selection = v3_selection(self)
    router_logits = _float32_logits(self, hidden_states)
    weights, indices = router_select(router_logits, self.top_k, selection, bias=self.e_score_correction_bias)
    return router_logits, weights, indices


def v2_router_forward(self, hidden_states: torch.Tensor):
    selection = v2_selection(self)
    router_logits = _float32_logits(self, hidden_states)
    weights, indices = router_select(router_logits, self.top_k, selection)
    return router_logits, weights, indices


# ------------------------------------------------------------------------------------ offloaded generation
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


class ComplexRotary(nn.Module):
    """DeepSeek-V2's rotary module returns one complex ``freqs_cis``; the pipeline carries (cos, sin) pairs, here
    its real and imaginary parts, which :meth:`DeepseekV2PipelineAdapter._rope` joins again."""

    def __init__(self, rotary: nn.Module):
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor):
        freqs = self.rotary(x, position_ids)  # [B, T, rope / 2] complex
        return freqs.real, freqs.imag


class DeepseekPipelineAdapter(LlamaStylePipelineAdapter):
    """Offloaded generation of DeepSeek-V2/V3: MLA absorbed (see the module docstring), the router on float32
    logits with the family's selection, the shared experts added to the routed ones, and the first layers'
    dense MLPs in place of experts."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        c = model.config
        a = model.model.layers[0].self_attn
        self._act_fn = ACT2FN[c.hidden_act]
        self._glu = glu_activation(self._act_fn)  # act(gate) * up of the shared and dense MLPs, as the experts'
        self._nope, self._rope_dim, self._latent, self._v = (a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank,
                                                             a.v_head_dim)
        self._scale = float(a.scaling)
        self._norm_eps = {"q_a_norm": a.q_a_layernorm.variance_epsilon if a.q_a_layernorm is not None else None,
                          "kv_a_norm": a.kv_a_layernorm.variance_epsilon}
        routers = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "experts")]
        self._selection = self._selection_of(routers[0]) if routers else None

    def layers(self):
        return list(self.model.model.layers)

    def layer_attention(self):
        return [LayerAttention(scale=self._scale)] * self.dims.layers

    def _kv_b(self, layer) -> torch.Tensor:
        """``kv_b_proj`` as [heads, nope + v, latent]: each head's key rows, then its value rows."""
        return layer.self_attn.kv_b_proj.weight.view(self.dims.heads, self._nope + self._v, self._latent)

    def pre_tensors(self, layer):
        a = layer.self_attn
        t = {"norm": layer.input_layernorm.weight}
        if a.q_lora_rank is None:
            t["q"] = a.q_proj.weight
        else:
            t.update(q_a=a.q_a_proj.weight, q_a_norm=a.q_a_layernorm.weight, q_b=a.q_b_proj.weight)
            if a.q_a_proj.bias is not None:
                t["q_a_bias"] = a.q_a_proj.bias
        t.update(kv_a=a.kv_a_proj_with_mqa.weight, kv_a_norm=a.kv_a_layernorm.weight,
                 w_uk=self._kv_b(layer)[:, :self._nope])  # [heads, nope, latent]
        if a.kv_a_proj_with_mqa.bias is not None:
            t["kv_a_bias"] = a.kv_a_proj_with_mqa.bias
        return t

    def post_tensors(self, layer):
        a, mlp = layer.self_attn, layer.mlp
        t = {"w_uv": self._kv_b(layer)[:, self._nope:], "o": a.o_proj.weight}  # w_uv: [heads, v, latent]
        if a.o_proj.bias is not None:
            t["o_bias"] = a.o_proj.bias
        t["post_norm"] = layer.post_attention_layernorm.weight
        if hasattr(mlp, "experts"):
            t["router"] = mlp.gate.weight
            bias = getattr(mlp.gate, "e_score_correction_bias", None)
            if bias is not None:
                t["score_bias"] = bias
            t.update(mlp_tensors("shared", mlp.shared_experts))
        else:
            t.update(mlp_tensors("dense", mlp))
        return t

    def expert_tensors(self, layer):
        return super().expert_tensors(layer) if hasattr(layer.mlp, "experts") else {}

    def qkv(self, w, x, cos, sin):
        """[T, heads * (latent + rope) + latent + rope]: each head's query in the latent space (its no-rotary
        part through the key half of ``kv_b_proj``) with its rotary part, then the token's latent and rotary
        key, the single KV head."""
        T, H = x.shape[0], self.dims.heads
        n, r, c = self._nope, self._rope_dim, self._latent
        h = self._norm(x, None, w["norm"], self._eps[0])
        if "q" in w:
            q = F.linear(h, w["q"])
        else:
            q_a = F.linear(h, w["q_a"], w.get("q_a_bias"))
            q = F.linear(self._norm(q_a, None, w["q_a_norm"], self._norm_eps["q_a_norm"]), w["q_b"])
        q = q.view(T, H, n + r)  # [T, H, nope + rope]
        kv = F.linear(h, w["kv_a"], w.get("kv_a_bias"))  # [T, latent + rope]
        latent = self._norm(kv[:, :c].contiguous(), None, w["kv_a_norm"], self._norm_eps["kv_a_norm"])
        q_rot, k_rot = self._rope(q[..., n:], kv[:, None, c:], cos, sin)  # [T, H, rope], [T, 1, rope]
        out = torch.empty(T, self.dims.qkv_dim, dtype=x.dtype, device=x.device)
        q_out = out[:, :self.dims.q_dim].view(T, H, c + r)
        q_out[..., :c] = torch.bmm(q[..., :n].transpose(0, 1), w["w_uk"]).transpose(0, 1)  # [T, H, latent]
        q_out[..., c:] = q_rot
        out[:, self.dims.q_dim:self.dims.q_dim + c] = latent
        out[:, self.dims.q_dim + c:] = k_rot[:, 0]
        return out

    def _attention_output(self, w, attn):
        """Each head's attended latent [T, H, latent] through the value half of ``kv_b_proj``, then ``o``."""
        T, H = attn.shape[0], self.dims.heads
        latent = attn.view(T, H, self._latent + self._rope_dim)[..., :self._latent]
        values = torch.bmm(latent.transpose(0, 1), w["w_uv"].transpose(1, 2))  # [H, T, v]
        return F.linear(values.transpose(0, 1).reshape(T, H * self._v), w["o"], w.get("o_bias"))

    def _mlp(self, w, expert_parts, normed, fetch=None):
        if "dense_gate_up" in w:  # one of the first dense layers
            return dense_mlp(w, "dense", normed, self._glu)
        return super()._mlp(w, expert_parts, normed, fetch) + dense_mlp(w, "shared", normed, self._glu)

    def _route(self, w, normed):
        logits = F.linear(normed.float(), w["router"].float())  # [T, E], as the router computes them
        return router_select(logits, self.dims.top_k, self._selection, bias=w.get("score_bias"))


class DeepseekV3PipelineAdapter(DeepseekPipelineAdapter):
    model_type = "deepseek_v3"

    @staticmethod
    def _selection_of(router) -> Selection:
        return v3_selection(router)

    def _rope(self, q, k, cos, sin):
        rotate = v3.apply_rotary_pos_emb_interleave if self.model.config.rope_interleave else v3.apply_rotary_pos_emb
        return rotate(q, k, cos, sin, unsqueeze_dim=1)


class DeepseekV2PipelineAdapter(DeepseekPipelineAdapter):
    model_type = "deepseek_v2"

    @staticmethod
    def _selection_of(router) -> Selection:
        return v2_selection(router)

    def rotary(self, device):
        return ComplexRotary(super().rotary(device))

    def _rope(self, q, k, cos, sin):
        """V2's own complex rotation; it wants [B, heads, T, rope] and [B, T, rope / 2] frequencies."""
        q_rot, k_rot = v2.apply_rotary_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           torch.complex(cos, sin)[None])
        return q_rot[0].transpose(0, 1), k_rot[0].transpose(0, 1)


DEEPSEEK_V3 = register_decoder_family(DecoderFamily(
    model_type="deepseek_v3", pretrained=v3.DeepseekV3PreTrainedModel, decoder_layer=v3.DeepseekV3DecoderLayer,
    moe_block=v3.DeepseekV3MoE, router=v3.DeepseekV3TopkRouter, router_forward=v3_router_forward,
    norm=v3.DeepseekV3RMSNorm, dense_mlp=v3.DeepseekV3MLP), spec=deepseek_spec, pipeline_adapter=DeepseekV3PipelineAdapter)

DEEPSEEK_V2 = register_decoder_family(DecoderFamily(
    model_type="deepseek_v2", pretrained=v2.DeepseekV2PreTrainedModel, decoder_layer=v2.DeepseekV2DecoderLayer,
    moe_block=v2.DeepseekV2Moe, router=v2.DeepseekV2TopkRouter, router_forward=v2_router_forward,
    norm=v2.DeepseekV2RMSNorm, dense_mlp=v2.DeepseekV2MLP), spec=deepseek_spec, pipeline_adapter=DeepseekV2PipelineAdapter)
