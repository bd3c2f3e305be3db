"""Block-scaled FP8 checkpoints (DeepSeek-V3, the Qwen3 FP8 releases) loaded and run as shipped.

transformers builds such a model with its own modules (``integrations/finegrained_fp8.py``): ``FP8Experts``
(``gate_up_proj`` [E, 2I, H] and ``down_proj`` [E, H, I] as float8_e4m3fn beside their ``*_scale_inv``) for
every ``.experts`` module and ``FP8Linear`` for every other linear layer, and its loader merges the per-expert
checkpoint tensors into them. Their forwards need a kernel from the hub and a GPU of compute capability 8.9 or
more; anywhere else transformers dequantizes the whole model while loading (a 30B model's experts become
twice their bytes).

:class:`Fp8AsShippedQuantizer` keeps transformers' quantizer (its layout, key handling and conversions), with
two differences: the weights stay FP8 on any device, and each ``FP8Linear`` becomes an :class:`Fp8BlockLinear`
holding the same tensors, run on our kernels. The ``FP8Experts`` themselves stay transformers' module: their
``"scattermoe"`` entry of transformers' FP8 ``ExpertsInterface`` reads the FP8 bytes in the expert GEMMs
(``kernels/fp8_blocks.py``; ``experts.register_fp8_experts_backend`` adds it).
``FineGrainedFP8Config(dequantize=True)`` and quantizing a float checkpoint on the fly still get the stock
quantizer.

Weights stay frozen (training stays bf16): inputs and everything around them train, so LoRA on the attention
of a model whose projections are FP8 works through them (their backward decodes one weight at a time).
"""

from __future__ import annotations

import functools
import json
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.fp8_blocks import BLOCK, FP8_DTYPE, Fp8BlockWeight, dequantize_fp8_blocks, quantize_fp8_blocks
from .experts import register_fp8_experts_backend
from .quantizer_switch import QuantizerSwitch

QUANT_METHOD = "fp8"


class Fp8BlockLinear(nn.Linear):
    """A linear layer whose weight [out, in] is a checkpoint's block-scaled FP8 (``weight`` float8_e4m3fn and
    ``weight_scale_inv`` float32, the names of transformers' ``FP8Linear``), decoded in the GEMM's registers:
    the scattered-expert GEMM with one expert. Where a gradient must reach the input, the weight is decoded
    into the input's dtype for that call. An ``nn.Linear`` (as ``FP8Linear`` is), so adapters such as PEFT's
    LoRA wrap it; it allocates no float weight."""

    hf_scatter_impl = "fp8 block-scaled linear (decoded in the GEMM)"

    def __init__(self, in_features: int, out_features: int, block_size: tuple[int, int], bias: bool = False):
        nn.Module.__init__(self)  # nn.Linear's own __init__ would allocate a float weight
        self.in_features, self.out_features, self.block_size = in_features, out_features, tuple(block_size)
        scale_shape = (-(-out_features // self.block_size[0]), -(-in_features // self.block_size[1]))
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(torch.empty(*scale_shape, dtype=torch.float32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    @classmethod
    def like(cls, stock: nn.Module) -> "Fp8BlockLinear":
        """The same tensors' shapes as transformers' ``FP8Linear`` ``stock`` (on the meta device)."""
        return cls(stock.in_features, stock.out_features, stock.block_size, bias=stock.bias is not None)

    def stored(self) -> Fp8BlockWeight:
        """The weight as the GEMMs read it: [1, in, out] in kernel layout."""
        return Fp8BlockWeight(self.weight[None], self.weight_scale_inv[None], self.block_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if torch.is_grad_enabled() and (x.requires_grad or getattr(self.bias, "requires_grad", False)):
            weight = dequantize_fp8_blocks(self.weight, self.weight_scale_inv, x.dtype, block=self.block_size)
            return F.linear(x, weight, bias)
        out = fp8_linear(x.reshape(-1, self.in_features), self.stored(), bias)  # [T, out]
        return out.view(*x.shape[:-1], self.out_features)

    def reset_parameters(self) -> None:
        return None  # loaded from the checkpoint

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weights=FP8 block-scaled"


def fp8_linear(x: torch.Tensor, weight: Fp8BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [T, in] @ W.T + bias`` for one FP8 matrix ``weight`` ([1, in, out] in kernel layout): every row is
    expert 0's, grouped in and out."""
    from ..kernels.scatter2scatter import scatter2scatter

    T = x.shape[0]
    rows = torch.arange(T, device=x.device)
    return scatter2scatter(x, weight, torch.zeros_like(rows), rows, torch.full((1,), T, device=x.device),
                           x_grouped=True, y_grouped=True, bias=None if bias is None else bias[None])


@functools.cache
def _fp8_experts_class() -> type:
    """transformers' ``FP8Experts`` with its experts switch, as its quantizer decorates it (once here: the
    decorator wraps the class it is given, so every call would wrap it again)."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    return use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS,
                                      has_bias=False, has_gate=True)


def fp8_experts_module(config, block: tuple[int, int] = BLOCK) -> nn.Module:
    """transformers' FP8 experts for ``config`` (SwiGLU, no bias) in ``block`` blocks, built as its quantizer
    builds them before a load (on the current device; their tensors uninitialised)."""
    register_fp8_experts_backend()
    module = _fp8_experts_class()(config=config.get_text_config(), block_size=list(block),
                                  activation_scheme="dynamic", has_bias=False, has_gate=True)
    return module.requires_grad_(False)  # frozen, as a load as shipped leaves them


def _stock_quantizer():
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    return FineGrainedFP8HfQuantizer


class Fp8AsShippedQuantizer(_stock_quantizer()):
    """transformers' FP8 quantizer with the weights kept as shipped on any device: no GPU demanded, no
    dequantization, ``FP8Linear`` replaced by :class:`Fp8BlockLinear`; everything else is the stock one."""

    def validate_environment(self, *args, **kwargs) -> None:
        from transformers.utils import is_accelerate_available

        if not is_accelerate_available():
            raise ImportError("Loading an FP8 checkpoint needs accelerate: pip install accelerate")

    def _process_model_before_weight_loading(self, model, **kwargs):
        from transformers.integrations.finegrained_fp8 import FP8Linear

        super()._process_model_before_weight_loading(model, **kwargs)
        register_fp8_experts_backend()
        for name, module in list(model.named_modules()):
            if type(module) is FP8Linear:
                if module.block_size is None or module.activation_scheme != "dynamic":
                    raise ValueError(f"hf_scatter: {name} is per-tensor or statically scaled FP8; hf-scatter reads "
                                     "block-scaled FP8 (weight_block_size, dynamic activations) only: load with "
                                     "quantization_config=FineGrainedFP8Config(dequantize=True)")
                with torch.device("meta"):
                    model.set_submodule(name, Fp8BlockLinear.like(module))
        return model

    @property
    def is_trainable(self) -> bool:
        return True  # adapters train around the frozen FP8 weights (transformers 5.17's stock one says no)

    def _process_model_after_weight_loading(self, model, **kwargs):
        model = super()._process_model_after_weight_loading(model, **kwargs)
        for module in model.modules():
            for name, param in module.named_parameters(recurse=False):
                if name.endswith("scale_inv") and param.dtype != torch.float32:  # power-of-two (ue8m0) scales
                    param = nn.Parameter(param.data.to(torch.float32))  # as the float32 values they are, exactly
                    setattr(module, name, param)
                if param.dtype == FP8_DTYPE or name.endswith("scale_inv"):  # frozen: training stays in float
                    param.requires_grad_(False)
        return model


def _choose_quantizer(config, **kwargs):
    """Ours for a pre-quantized checkpoint kept as shipped; the stock one to dequantize or to quantize a float
    checkpoint on the fly (transformers calls the table's entry with the merged config)."""
    if getattr(config, "dequantize", False) or not kwargs.get("pre_quantized", True):
        return _stock_quantizer()(config, **kwargs)
    return Fp8AsShippedQuantizer(config, **kwargs)


AS_SHIPPED = QuantizerSwitch(QUANT_METHOD, _choose_quantizer)  # switched on by hf_scatter's loaders


def save_fp8_checkpoint(model: nn.Module, path, block: tuple[int, int] = BLOCK,
                        not_converted: tuple[str, ...] = ("lm_head",)) -> None:
    """Save a float model as a block-scaled FP8 checkpoint laid out as DeepSeek-V3 and Qwen3-FP8 ship one: the
    model's own checkpoint (per-expert tensors, as ``save_pretrained`` writes them) with every linear and
    expert weight but ``not_converted`` quantized in ``block`` blocks (transformers' arithmetic,
    :func:`quantize_fp8_blocks`) beside its ``weight_scale_inv``, and the config's ``quantization_config``.
    For tests and tools: checkpoints ship quantized already."""
    from safetensors.torch import load_file, save_file

    from ..common.atomic_files import atomic_path

    linear = {name for name, module in model.named_modules() if type(module) is nn.Linear}
    if not any(".experts" in name for name, _ in model.named_modules()):
        raise ValueError(f"hf_scatter.save_fp8_checkpoint: {type(model).__name__} has no experts to quantize")
    os.makedirs(path, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path) as float_copy:
        model.save_pretrained(float_copy, safe_serialization=True)
        state = {}
        for file in sorted(f for f in os.listdir(float_copy) if f.endswith(".safetensors")):
            state.update(load_file(os.path.join(float_copy, file)))
    shipped = {}
    for key, tensor in state.items():
        owner = key.removesuffix(".weight")
        converted = key.endswith(".weight") and tensor.dim() == 2 and (owner in linear or ".experts." in key) \
            and not any(owner == skip or owner.endswith(f".{skip}") for skip in not_converted)
        if converted:
            shipped[key], shipped[f"{owner}.weight_scale_inv"] = quantize_fp8_blocks(tensor, block)
        else:
            shipped[key] = tensor.contiguous()
    with atomic_path(os.path.join(path, "model.safetensors")) as tmp:
        save_file(shipped, tmp, metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {"quant_method": QUANT_METHOD, "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block), "modules_to_not_convert": list(not_converted)}
    with atomic_path(os.path.join(path, "config.json")) as tmp, open(tmp, "w") as f:
        json.dump(config, f, indent=2)
