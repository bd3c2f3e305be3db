"""DBRX: its experts have no ``ExpertsInterface`` switch, so the two expert classes are swapped in place.

``DbrxExperts`` keeps routing through ``self.mlp(...)`` (so PEFT's parameter wrappers around the expert
tensors still apply their deltas) and ``DbrxExpertGLU`` runs all experts at once on ParallelLinear, reading
its [E*I, H] ``w1`` / ``v1`` / ``w2`` through strided [E, ., .] views: no copy, no change to parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.dbrx.modeling_dbrx import DbrxBlock, DbrxExpertGLU, DbrxExperts, DbrxFFN, DbrxNormAttentionNorm

from ..kernels.norms import fused_add_layer_norm
from ..kernels.router import router_topk
from ..kernels.swiglu import swiglu_pair
from ..moe.mlp import expert_mlp, is_silu
from .class_patch import apply_swaps
from .experts import SCATTERMOE
from .fused_loss import set_fused_loss
from .fused_norms import FUSED_ADD_NORM, add_layer_norm
from .pipeline_adapter import Dims, PipelineAdapter
from .training_graphs import set_moe_graphs
from .registry import Family, PatchOptions, register_family
from .spec import ModelSpec


def glu_pair_activation(act_fn):
    """DBRX's GLU over its separate gate and up projections: the fused SwiGLU kernel for SiLU (both inputs
    are ``expert_mlp``'s own intermediates, so its backward may overwrite them), ``act(gate) * up`` otherwise.
    The patched experts and the offloaded runtime both run it."""
    if is_silu(act_fn):
        return lambda gate, up: swiglu_pair(gate, up, reuse_input_buffers=True)
    return lambda gate, up: act_fn(gate) * up


def dbrx_spec(config, label: str, dtype_bytes: int) -> ModelSpec:
    """The planner's shapes from a DBRX config (``d_model``, ``attn_config``, ``ffn_config``)."""
    attn, ffn = config.attn_config, config.ffn_config
    return ModelSpec(name=label, family="dbrx", hidden=config.d_model, layers=config.n_layers, heads=config.n_heads,
                     kv_heads=attn.kv_n_heads, head_dim=config.d_model // config.n_heads,
                     intermediate=ffn.ffn_hidden_size, experts=ffn.moe_num_experts, top_k=ffn.moe_top_k,
                     vocab=config.vocab_size, tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
                     dtype_bytes=dtype_bytes)


class ScatterMoEDbrxExpertGLU(DbrxExpertGLU):
    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                *vanilla_args) -> torch.Tensor:
        if top_k_index.is_floating_point():  # the vanilla per-expert call (x, w1_e, v1_e, w2_e)
            return super().forward(x, top_k_index, top_k_weights, *vanilla_args)
        E, I, H = self.moe_num_experts, self.ffn_hidden_size, self.hidden_size
        w1 = self.w1.view(E, I, H).transpose(1, 2)  # [E, H, I]: x @ w1_e.T
        v1 = self.v1.view(E, I, H).transpose(1, 2)
        w2 = self.w2.view(E, I, H)  # DBRX applies w2 untransposed: h @ w2_e
        return expert_mlp(x, (w1, v1), w2, top_k_index, top_k_weights, glu_pair_activation(self.activation_fn),
                          validate=False)

    def extra_repr(self) -> str:
        return f"experts_implementation={SCATTERMOE}"


class ScatterMoEDbrxExperts(DbrxExperts):
    hf_scatter_impl = SCATTERMOE

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        batch_size = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        out = self.mlp(x, top_k_index, top_k_weights)  # through any PEFT wrapper around self.mlp
        return out.to(hidden_states.dtype).view(batch_size, -1, self.hidden_size)


class FusedDbrxNormAttentionNorm(DbrxNormAttentionNorm):
    """norm_1 -> attention -> dropout -> (+ residual, norm_2) with the add and norm_2 in one kernel."""

    hf_scatter_impl = FUSED_ADD_NORM

    # The KV cache travels in ``kwargs`` under whichever name the caller used (``past_key_values`` up to
    # transformers 5.23, ``cache`` from 5.24), so the attention gets it as vanilla's block passes it.
    def forward(self, hidden_states: torch.Tensor, position_embeddings: torch.Tensor,
                attention_mask: torch.Tensor | None = None, **kwargs):
        residual = hidden_states
        hidden_states = add_layer_norm(hidden_states, None, self.norm_1)[0].to(hidden_states.dtype)
        hidden_states, _ = self.attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                     position_embeddings=position_embeddings, **kwargs)
        hidden_states = nn.functional.dropout(hidden_states, p=self.resid_pdrop, training=self.training)
        normed, residual = add_layer_norm(hidden_states, residual, self.norm_2)
        return residual, normed.to(residual.dtype)


class FusedRouterDbrxFFN(DbrxFFN):
    """Softmax in the logits' dtype, top-k and the p-norm of ``moe_normalize_expert_weights`` in one kernel;
    the router module is still called, so its logits are recorded."""

    hf_scatter_impl = "router_topk"

    def route_tokens_to_experts(self, router_logits: torch.Tensor):
        return router_topk(router_logits, self.top_k, normalize=self.moe_normalize_expert_weights,
                           softmax_dtype=router_logits.dtype)


def _jitters(ffn: DbrxFFN) -> bool:
    return ffn.router.moe_jitter_eps is not None


def patch_dbrx(model: nn.Module, options: PatchOptions, class_default: bool = False) -> None:
    if options.layer_graphs:
        raise ValueError("layer_graphs is not available for dbrx (its blocks take the attention mask and cache "
                         "positionally); patch with moe_graphs=True to replay its MoE blocks as graphs")
    apply_swaps(model, [(DbrxExperts, ScatterMoEDbrxExperts, options.moe),
                        (DbrxExpertGLU, ScatterMoEDbrxExpertGLU, options.moe),
                        (DbrxNormAttentionNorm, FusedDbrxNormAttentionNorm, options.norms),
                        (DbrxFFN, FusedRouterDbrxFFN, options.router)])
    set_fused_loss(model, options.loss)
    layers = [m for m in model.modules() if isinstance(m, DbrxBlock)]
    set_moe_graphs([layer.ffn for layer in layers], layers, options.moe_graphs,
                   uses_rng=_jitters, model=model)


class DbrxPipelineAdapter(PipelineAdapter):
    """Offloaded generation of DBRX: its layer in pieces, ``w1`` / ``v1`` / ``w2`` as [E, I, H] columns."""

    model_type = "dbrx"
    column_dims = {"w1": 1, "v1": 1, "w2": 1}  # each [E, I, H]

    def _dims(self, c) -> Dims:
        attn = c.attn_config
        self._clip = attn.clip_qkv
        return Dims.of(c, getattr(c, "max_seq_len", None))

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
        E, I, H = self.dims.experts, self.dims.intermediate, self.dims.hidden
        self._act_fn = mlp.activation_fn
        self._normalize = layer.ffn.moe_normalize_expert_weights
        return {name: getattr(mlp, name).view(E, I, H) for name in ("w1", "v1", "w2")}

    def other_tensors(self):
        t = self.model.transformer
        nan = t.blocks[0].norm_attn_norm
        self._eps = (nan.norm_1.eps, nan.norm_2.eps, t.norm_f.eps)
        if t.norm_f.bias is not None:
            raise NotImplementedError("offloading supports DBRX's bias-free LayerNorms only")
        return {"embed": t.wte.weight, "final_norm": t.norm_f.weight, "lm_head": self.model.lm_head.weight}

    def _rotary_module(self):
        return self.model.transformer.rotary_emb

    def _project_qkv(self, w, x):
        h = fused_add_layer_norm(x, None, w["norm"], None, eps=self._eps[0], validate=False)
        qkv = F.linear(h.to(x.dtype), w["qkv"])
        if self._clip is not None:
            qkv.clamp_(min=-self._clip, max=self._clip)
        return qkv

    def _post_norm(self, w, o, x):
        normed, summed = fused_add_layer_norm(o, x, w["post_norm"], None, eps=self._eps[1], return_sum=True,
                                              validate=False)
        return normed.to(summed.dtype), summed

    def _select(self, logits):
        return router_topk(logits, self.dims.top_k, normalize=self._normalize, softmax_dtype=logits.dtype)

    def _experts(self, part, x, experts, gates, routing):
        return expert_mlp(x, (part["w1"].transpose(1, 2), part["v1"].transpose(1, 2)), part["w2"], experts, gates,
                          glu_pair_activation(self._act_fn), validate=False, routing=routing)

    def _final_norm(self, other, x):
        return fused_add_layer_norm(x, None, other["final_norm"], None, eps=self._eps[2], validate=False)


DBRX = register_family(Family(
    model_type="dbrx",
    patch=patch_dbrx,
    spec=dbrx_spec,
    pipeline_adapter=DbrxPipelineAdapter,
    pretrained_class="transformers.models.dbrx.modeling_dbrx:DbrxPreTrainedModel",
))
