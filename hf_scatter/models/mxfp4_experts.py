"""GPT-OSS experts as their checkpoints ship them: MXFP4, loaded and run without a bf16 copy.

Without its hub kernels (the ``kernels`` package and OpenAI's triton_kernels) transformers dequantizes a GPT-OSS
MXFP4 checkpoint while loading it, on the CPU and on any GPU: GPT-OSS-120B's 61 GiB of experts become 218 GiB
of bf16. :class:`Mxfp4GptOssExperts` keeps the checkpoint's own tensors under their own names (``*_blocks``,
``*_scales`` as uint8, the biases in the model's dtype), so every key loads by name with no conversion, and runs
them on the expert GEMMs that decode MXFP4 in registers (``kernels/mxfp4.py``; their torch reference where the
kernels do not run). ``save_pretrained`` writes the same keys back.

transformers picks a checkpoint's quantizer by its ``quant_method`` from one table and offers no other way to
load MXFP4 without dequantizing (a ``quantization_config`` argument only toggles ``dequantize``, which the stock
quantizer turns back on without the hub kernels). :data:`AS_SHIPPED` points that table's
``"mxfp4"`` entry at :class:`Mxfp4AsShippedQuantizer`, which builds these modules in place of ``GptOssExperts``
before the weights load, as transformers' own quantizers replace modules; ``Mxfp4Config(dequantize=True)``
still gets the stock quantizer. ``hf_scatter.patch_transformers()`` and ``hf_scatter.from_pretrained`` switch
it on.

The experts are frozen: their weights get no gradient (training stays bf16), while inputs and everything around
them train, so LoRA on attention works through them (the backward decodes one layer's experts at a time).
"""

from __future__ import annotations

import json
import os

import torch
from torch import nn
from transformers.quantizers.base import HfQuantizer

from ..kernels.mxfp4 import GROUP, Mxfp4Weight
from .quantizer_switch import QuantizerSwitch

QUANT_METHOD = "mxfp4"


class Mxfp4GptOssExperts(nn.Module):
    """GPT-OSS's experts with the checkpoint's MXFP4 tensors: ``gate_up_proj_blocks`` [E, 2I, H/32, 16] and
    ``_scales`` [E, 2I, H/32] (gate and up interleaved along 2I), ``down_proj_blocks`` [E, H, I/32, 16] and
    ``_scales`` [E, H, I/32], biases [E, 2I] and [E, H]. Called as ``GptOssExperts`` is."""

    hf_scatter_impl = "scattermoe (MXFP4 weights as shipped)"

    def __init__(self, config):
        super().__init__()
        E, H, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        if H % GROUP or inter % GROUP:
            raise ValueError(f"hf_scatter: MXFP4 experts need hidden_size and intermediate_size multiples of "
                             f"{GROUP}, got {H} and {inter}")
        self.num_experts, self.hidden_size = E, H
        # transformers 5.17's GPT-OSS config has no swiglu_alpha (its experts use 1.702)
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        packed = dict(dtype=torch.uint8)
        frozen = dict(requires_grad=False)
        self.gate_up_proj_blocks = nn.Parameter(torch.empty(E, 2 * inter, H // GROUP, GROUP // 2, **packed), **frozen)
        self.gate_up_proj_scales = nn.Parameter(torch.empty(E, 2 * inter, H // GROUP, **packed), **frozen)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * inter))
        self.down_proj_blocks = nn.Parameter(torch.empty(E, H, inter // GROUP, GROUP // 2, **packed), **frozen)
        self.down_proj_scales = nn.Parameter(torch.empty(E, H, inter // GROUP, **packed), **frozen)
        self.down_proj_bias = nn.Parameter(torch.empty(E, H))

    def weights(self) -> tuple[Mxfp4Weight, Mxfp4Weight]:
        """The two projections in the kernels' layout: [E, H, 2I] and [E, I, H]."""
        return (Mxfp4Weight(self.gate_up_proj_blocks, self.gate_up_proj_scales),
                Mxfp4Weight(self.down_proj_blocks, self.down_proj_scales))

    def forward(self, hidden_states: torch.Tensor, router_indices: torch.Tensor,
                routing_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, self.hidden_size)  # [T, H]
        out = gpt_oss_mxfp4_experts(x, *self.weights(), self.gate_up_proj_bias, self.down_proj_bias, self.alpha,
                                    self.limit, router_indices.reshape(x.shape[0], -1),
                                    routing_weights.reshape(x.shape[0], -1).to(x.dtype))  # [T, H]
        return out.view(hidden_states.shape)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, weights=MXFP4"


def gpt_oss_mxfp4_experts(x: torch.Tensor, w_in: Mxfp4Weight, w_out: Mxfp4Weight, b_in: torch.Tensor,
                          b_out: torch.Tensor, alpha: float, limit: float, experts: torch.Tensor,
                          gates: torch.Tensor) -> torch.Tensor:
    """GPT-OSS's experts (interleaved, clamped gate; biases) on MXFP4 weights for ``x`` [T, H] routed to
    ``experts`` with ``gates`` [T, k]: the fused SwiGLU experts, the weights read as stored."""
    from ..kernels.swiglu import gpt_oss_gate
    from ..moe.mlp import FusedSwiGLU, expert_mlp  # the kernels load on first use

    return expert_mlp(x, (w_in,), w_out, experts, gates, FusedSwiGLU(gpt_oss_gate(alpha, limit)),
                      b_in=(b_in.to(x.dtype),), b_out=b_out.to(x.dtype), validate=False)


class Mxfp4AsShippedQuantizer(HfQuantizer):
    """transformers' quantizer interface for MXFP4 checkpoints, kept as shipped: no environment to demand, the
    GPT-OSS experts replaced by :class:`Mxfp4GptOssExperts` before loading, no conversion of any key."""

    requires_calibration = False

    def validate_environment(self, *args, **kwargs) -> None:
        return None  # runs on any device: the kernels' torch reference where Triton does not

    def _process_model_before_weight_loading(self, model, **kwargs):
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

        config = model.config.get_text_config()
        replaced = [name for name, module in model.named_modules() if isinstance(module, GptOssExperts)]
        if not replaced:
            raise ValueError(f"hf_scatter: this checkpoint's MXFP4 weights are loaded as shipped for GPT-OSS only, "
                             f"and {type(model).__name__} has no GPT-OSS experts; load it with "
                             "quantization_config=Mxfp4Config(dequantize=True) to get bf16 weights")
        for name in replaced:
            with torch.device("meta"):
                model.set_submodule(name, Mxfp4GptOssExperts(config))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return model

    def is_serializable(self, *args, **kwargs) -> bool:
        return True  # the same keys as the checkpoint

    @property
    def is_trainable(self) -> bool:
        return True  # with adapters: the experts stay frozen, gradients flow through them


def _choose_quantizer(config, **kwargs):
    """The stock quantizer when the user asks to dequantize, ours otherwise (transformers calls the table's
    entry with the checkpoint's merged config)."""
    if getattr(config, "dequantize", False):
        from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

        return Mxfp4HfQuantizer(config, **kwargs)
    return Mxfp4AsShippedQuantizer(config, **kwargs)


AS_SHIPPED = QuantizerSwitch(QUANT_METHOD, _choose_quantizer)  # switched on by hf_scatter's loaders


def quantize_gpt_oss_experts(model: nn.Module) -> nn.Module:
    """``model`` with every ``GptOssExperts`` (float weights) replaced by an :class:`Mxfp4GptOssExperts` holding
    them quantized exactly as :func:`save_mxfp4_checkpoint` writes them, as if loaded back as shipped: for
    benchmarks and tests of the MXFP4 paths without a checkpoint on disk. In place, one layer at a time."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from ..kernels.mxfp4 import quantize_experts

    names = [name for name, module in model.named_modules() if isinstance(module, GptOssExperts)]
    if not names:
        raise ValueError(f"hf_scatter.quantize_gpt_oss_experts: {type(model).__name__} has no GPT-OSS experts with "
                         "float weights to quantize")
    config = model.config.get_text_config()
    for name in names:
        floats = model.get_submodule(name)
        with torch.device("meta"):
            packed = Mxfp4GptOssExperts(config)
        for leaf in ("gate_up_proj", "down_proj"):
            weight = quantize_experts(getattr(floats, leaf))  # [E, in, out] as GPT-OSS stores it
            setattr(packed, f"{leaf}_blocks", nn.Parameter(weight.blocks, requires_grad=False))
            setattr(packed, f"{leaf}_scales", nn.Parameter(weight.scales, requires_grad=False))
            setattr(packed, f"{leaf}_bias", nn.Parameter(getattr(floats, f"{leaf}_bias").detach().clone()))
        model.set_submodule(name, packed)
    return model


# GPT-OSS's own list: attention, routers, embeddings and head stay in the model's dtype
_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def save_mxfp4_checkpoint(model: nn.Module, path) -> None:
    """Save a GPT-OSS model whose experts hold float weights (a bf16 fine-tune, a tiny random model) as an MXFP4
    checkpoint laid out as GPT-OSS ships: each expert's [out, in] matrix quantized along ``in`` (OCP rounding,
    ``kernels.mxfp4.quantize_mxfp4``) into ``*_blocks`` / ``*_scales``, every other tensor as it is, and the
    config's ``quantization_config``. One expert at a time, so the host holds one expert's temporaries."""
    from safetensors.torch import save_file
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from ..common.atomic_files import atomic_path
    from ..kernels.mxfp4 import quantize_experts

    experts = {name for name, module in model.named_modules() if isinstance(module, GptOssExperts)}
    if not experts:
        raise ValueError(f"hf_scatter.save_mxfp4_checkpoint: {type(model).__name__} has no GPT-OSS experts with float "
                         "weights to quantize")
    state = {}
    for key, tensor in model.state_dict().items():
        owner, _, leaf = key.rpartition(".")
        if owner in experts and leaf in ("gate_up_proj", "down_proj"):
            packed = quantize_experts(tensor)  # [E, in, out] as GPT-OSS stores it
            state[f"{key}_blocks"], state[f"{key}_scales"] = packed.blocks, packed.scales  # [E, out, in/32, (16)]
        else:
            state[key] = tensor.detach().contiguous().clone()
    os.makedirs(path, exist_ok=True)
    with atomic_path(os.path.join(path, "model.safetensors")) as tmp:
        save_file(state, tmp, metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "modules_to_not_convert": _NOT_CONVERTED}
    with atomic_path(os.path.join(path, "config.json")) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)
