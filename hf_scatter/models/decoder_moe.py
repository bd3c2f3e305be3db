"""What the Llama-style MoE families share: fused RMSNorm, decoder layer and router subclasses, made per family
class on demand, and the patch that swaps them in.

transformers copies these modules from family to family (Qwen3-MoE, Qwen2-MoE, OLMoE, DeepSeek, Granite-MoE,
GPT-OSS carry the same RMSNorm and decoder layer as Mixtral, under their own names), so one fused forward
serves each piece. A family module describes itself with a :class:`DecoderFamily` (its classes, its router
forward, where the MoE block sits) and :func:`register_decoder_family` registers it.

The fused subclasses are made once per vanilla class, named ``Fused<Class>`` and kept as attributes of this
module, so they can be found by name as the hand-written classes could.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..common.made_names import module_getattr
from ..kernels.router import router_topk
from .class_patch import apply_swaps, vanilla_class
from .experts import SCATTERMOE, patch_interface_experts
from .fused_loss import set_fused_loss
from .fused_mlp import FUSED_SWIGLU, swiglu_mlp_forward
from .fused_norms import FUSED_ADD_NORM, add_rms_norm, rms_norm
from .fused_rope import FUSED_ROPE, rope_attention_forward
from .training_graphs import layer_uses_rng, set_layer_graphs, set_moe_graphs
from .registry import Family, PatchOptions, register_family

ROUTER_TOPK = "router_topk"


# Every class fused_subclass made, by name. Pickle finds a patched module's class as an attribute of this
# module (its __module__ and __qualname__): the module's __getattr__ below looks it up here.
FUSED_CLASSES: dict[str, type] = {}


def fused_subclass(vanilla: type, impl: str, forward: Callable) -> type:
    """``Fused<vanilla>``: ``vanilla`` with ``forward`` replaced and ``hf_scatter_impl = impl`` (made once)."""
    name = f"Fused{vanilla.__name__}"
    made = FUSED_CLASSES.get(name)
    if made is None or made.__bases__ != (vanilla,):
        made = type(name, (vanilla,), {"__module__": __name__, "__qualname__": name, "forward": forward,
                                       "hf_scatter_impl": impl})
        FUSED_CLASSES[name] = made
    return made


__getattr__ = module_getattr(FUSED_CLASSES, __name__)


# ------------------------------------------------------------------------------------ shared forwards
@functools.lru_cache(maxsize=None)
def rms_norm_forward(casting: str) -> Callable:
    """The family's RMSNorm on the fused kernel, in its ``casting`` (``"llama"``: ``weight * normed.to(dtype)``;
    ``"gpt_oss"``: ``(weight * normed).to(dtype)``); made once per casting."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, None, self.weight, self.variance_epsilon, casting)[0]

    return forward


@functools.lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


@functools.lru_cache(maxsize=None)
def decoder_layer_forward(mlp: str, scaled: bool, casting: str = "llama") -> Callable:
    """The decoder layer with its post-attention residual add and RMSNorm in one kernel. ``mlp``: the MoE
    block's attribute; ``scaled``: both branches are multiplied by ``residual_multiplier`` (Granite-MoE);
    ``casting``: the RMSNorm's (:func:`rms_norm_forward`). A block returning ``(hidden, router scores)``
    (GPT-OSS) has its scores dropped, as the vanilla layer does. Made once per arguments: every patch call
    asks for it."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if args:  # the vanilla layers take everything after hidden_states by keyword; bind a positional call
            bound = _signature(vanilla_class(type(self))).bind(self, hidden_states, *args, **kwargs)
            bound.arguments.pop("self")
            hidden_states = bound.arguments.pop("hidden_states")
            kwargs = {**bound.arguments.pop("kwargs", {}), **bound.arguments}
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=hidden_states, **kwargs)
        if scaled:
            hidden_states = hidden_states * self.residual_multiplier
        hidden_states, residual = add_rms_norm(hidden_states, residual, self.post_attention_layernorm, casting)
        hidden_states = getattr(self, mlp)(hidden_states)
        if isinstance(hidden_states, tuple):
            hidden_states = hidden_states[0]
        if scaled:
            hidden_states = hidden_states * self.residual_multiplier
        return residual + hidden_states

    return forward


def softmax_topk_router_forward(self, hidden_states: torch.Tensor):
    """Qwen-style router: float32 softmax, top-k, optional renormalisation (``norm_topk_prob``), weights
    in the logits' dtype."""
    return _softmax_topk(self, hidden_states, self.norm_topk_prob)


def renormalized_softmax_topk_router_forward(self, hidden_states: torch.Tensor):
    """Qwen3.5-MoE's router: Qwen-style, always renormalised (its router has no ``norm_topk_prob``)."""
    return _softmax_topk(self, hidden_states, True)


def _softmax_topk(router: nn.Module, hidden_states: torch.Tensor, renormalize: bool):
    router_logits = F.linear(hidden_states.reshape(-1, router.hidden_dim), router.weight)  # [T, E]
    weights, indices = router_topk(router_logits, router.top_k, normalize="sum" if renormalize else None,
                                   softmax_dtype=torch.float32)
    return router_logits, weights.to(router_logits.dtype), indices


# ------------------------------------------------------------------------------------------ families
def never_random(block: nn.Module) -> bool:
    """``DecoderFamily.uses_rng`` of a family whose MoE block draws no random numbers (a named function: graphed
    models pickle with it)."""
    return False


@dataclass(frozen=True)
class DecoderFamily:
    """A Llama-style MoE family: its transformers classes and how its pieces are fused.

    ``norm`` is its RMSNorm class, rounding as ``norm_casting`` says (``"llama"``, or ``"gpt_oss"``: the
    weight multiplied before the rounding); None keeps its norms and decoder layers vanilla. ``moe_block`` is
    the class of the MoE block the decoder layer holds at ``mlp`` (layers holding a dense MLP are left out of
    ``moe_graphs``); ``graphs`` is False where the block returns more than its hidden states."""

    model_type: str
    pretrained: type
    decoder_layer: type
    moe_block: type
    router: type
    router_forward: Callable
    norm: type | None
    norm_casting: str = "llama"
    mlp: str = "mlp"
    scaled_residual: bool = False
    graphs: bool = True
    uses_rng: Callable = never_random  # a block that draws random numbers (router jitter) stays eager
    attention: type | None = None  # its forward calls the module's apply_rotary_pos_emb: RoPE gets fused
    rope_full_head: bool = False  # cos/sin hold half a head (GPT-OSS): every channel of the head is rotated
    dense_mlp: type | None = None  # the gated MLP of its shared experts and dense layers: SwiGLU gets fused


def _swaps(family: DecoderFamily, options: PatchOptions) -> list:
    swaps = [(family.router, fused_subclass(family.router, ROUTER_TOPK, family.router_forward), options.router)]
    if family.norm is not None:
        layer = decoder_layer_forward(family.mlp, family.scaled_residual, family.norm_casting)
        norm = rms_norm_forward(family.norm_casting)
        swaps += [(family.norm, fused_subclass(family.norm, FUSED_ADD_NORM, norm), options.norms),
                  (family.decoder_layer, fused_subclass(family.decoder_layer, FUSED_ADD_NORM, layer), options.norms)]
    if family.dense_mlp is not None:
        swaps.append((family.dense_mlp, fused_subclass(family.dense_mlp, FUSED_SWIGLU, swiglu_mlp_forward),
                      options.swiglu))
    attention = family.attention and _rope_forward(family.attention, family.rope_full_head)
    if attention is not None:
        swaps.append((family.attention, fused_subclass(family.attention, FUSED_ROPE, attention), options.rope))
    return swaps


@functools.lru_cache(maxsize=None)
def _rope_forward(attention: type, full_head: bool) -> Callable | None:
    return rope_attention_forward(attention, full_head)


def patch_decoder_family(family: DecoderFamily, model: nn.Module, options: PatchOptions,
                         class_default: bool = False) -> None:
    if options.moe_graphs and not family.graphs:
        raise ValueError(f"moe_graphs is not available for {family.model_type}: its MoE block returns its router "
                         "scores with the hidden states; patch without moe_graphs=True")
    patch_interface_experts(model, options, class_default)
    apply_swaps(model, _swaps(family, options))
    set_fused_loss(model, options.loss)
    layers = [m for m in model.modules() if isinstance(m, family.decoder_layer)]
    if family.graphs:
        moe_layers = [m for m in layers if isinstance(getattr(m, family.mlp, None), family.moe_block)]
        set_moe_graphs([getattr(layer, family.mlp) for layer in moe_layers], moe_layers, options.moe_graphs,
                       uses_rng=family.uses_rng, model=model)
    if layers:
        base = next((m for m in model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)
                     and any(layer is layers[0] for layer in m.layers)), None)
        set_layer_graphs(layers, options.layer_graphs, model=model, base_model=base,
                         uses_rng=functools.partial(layer_uses_rng, mlp=family.mlp, moe_block=family.moe_block,
                                                    block_uses_rng=family.uses_rng))


def default_to_scattermoe(self, requested_experts):
    """Class hook under ``patch_transformers``: the family's default experts implementation becomes
    ``"scattermoe"``; an explicit ``experts_implementation=...`` at load time still wins."""
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(self, SCATTERMOE if requested_experts is None
                                                              else requested_experts)


def scattermoe_default_hooks(options: PatchOptions) -> dict[str, object]:
    return {"get_correct_experts_implementation": default_to_scattermoe} if options.moe else {}


def register_decoder_family(family: DecoderFamily) -> Family:
    return register_family(Family(
        model_type=family.model_type,
        patch=functools.partial(patch_decoder_family, family),
        pretrained_class=f"{family.pretrained.__module__}:{family.pretrained.__name__}",
        class_hooks=scattermoe_default_hooks))
