"""The ``"scattermoe"`` backend of transformers' ``ExpertsInterface``, its name, and the patch that selects it.

Any experts class decorated with ``use_experts_implementation`` (Mixtral, and other families with the
same contract) dispatches here when ``config._experts_implementation == "scattermoe"``. The decorator's
flags describe the layout (gate or not, bias, transposed storage, post-expert norm, custom gating) and
are honoured, so the result is the one the family's eager forward gives. ``import hf_scatter`` registers
the backend (:func:`register_experts_backend`), so ``from_pretrained(..., experts_implementation=
"scattermoe")`` works without any other call; the kernels load on the first forward.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from .class_patch import set_instance_method

SCATTERMOE = "scattermoe"  # the experts_implementation name


_VANILLA_CHOICE = "_hf_scatter_vanilla_experts"


def is_interface_experts(module: nn.Module) -> bool:
    """An experts module built by ``use_experts_implementation`` (dispatches on its config)."""
    return all(hasattr(module, a) for a in ("config", "has_gate", "is_transposed", "is_concatenated"))


def _experts_extra_repr(self) -> str:
    return f"experts_implementation={self.config._experts_implementation}"


def _vanilla_default(model: nn.Module) -> str:
    from transformers import PreTrainedModel

    return PreTrainedModel.get_correct_experts_implementation(model, None)


def _show_choice_in_repr(experts: list[nn.Module], show: bool) -> None:
    for m in experts:
        if show:
            set_instance_method(m, "extra_repr", _experts_extra_repr)
        else:
            m.__dict__.pop("extra_repr", None)


def patch_interface_experts(model: nn.Module, options, class_default: bool = False) -> None:
    """Any family whose experts use transformers' ``ExpertsInterface``: select ``"scattermoe"`` with
    ``set_experts_implementation`` (``options.moe``), or give the family's own choice back."""
    experts = [m for m in model.modules() if is_interface_experts(m)]
    if not experts:
        return
    if any(type(m).__name__ == "FP8Experts" for m in experts):  # transformers' FP8 experts have a table of their own
        register_fp8_experts_backend()
    current = model.config._experts_implementation
    if class_default:  # the class-level default already applied; what the user chose at load time stands
        _show_choice_in_repr(experts, current == SCATTERMOE)
        return
    if options.moe and current != SCATTERMOE:
        model.__dict__[_VANILLA_CHOICE] = current
        model.set_experts_implementation(SCATTERMOE)
    elif not options.moe and current == SCATTERMOE:
        model.set_experts_implementation(model.__dict__.pop(_VANILLA_CHOICE, None) or _vanilla_default(model))
    _show_choice_in_repr(experts, options.moe)


def register_experts_backend() -> None:
    """``experts_implementation="scattermoe"`` for every model. transformers' MoE integration imports torch._dynamo,
    which writes inductor's default cache directory into the environment: undone when the user had not set it, so
    that importing hf-scatter leaves the environment as it was (torch derives the same default when it compiles)."""
    inductor_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if inductor_cache is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    ALL_EXPERTS_FUNCTIONS.register(SCATTERMOE, scattermoe_experts_forward)


def register_fp8_experts_backend() -> None:
    """transformers' FP8 experts (``FP8Experts``, their own ``ExpertsInterface`` table) dispatch
    ``experts_implementation="scattermoe"`` to the same forward, which reads their FP8 weights in place. Added
    when such experts are first built or patched: the table's module costs 0.6 s to import."""
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

    ALL_FP8_EXPERTS_FUNCTIONS.register(SCATTERMOE, scattermoe_experts_forward)


def fp8_expert_weight(experts: nn.Module, name: str):
    """``experts.<name>`` as stored by transformers' ``FP8Experts`` ([E, out, in] FP8 beside ``<name>_scale_inv``),
    or None when that projection is not block-scaled FP8."""
    weight, scale = getattr(experts, name, None), getattr(experts, f"{name}_scale_inv", None)
    if weight is None or scale is None:
        return None
    from ..kernels.fp8_blocks import FP8_DTYPE, Fp8BlockWeight

    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"hf_scatter: {type(experts).__name__}.{name} is stored as {weight.dtype} (FP4-packed "
                         "experts); hf-scatter reads block-scaled FP8 experts only: load the checkpoint with "
                         "quantization_config=FineGrainedFP8Config(dequantize=True) to get bf16 weights")
    if scale.dtype != torch.float32:
        scale = scale.to(torch.float32)  # power-of-two (ue8m0) scales hold exact float32 values
    stored = Fp8BlockWeight(weight, scale)  # the block derived from the shapes, as transformers dequantizes
    check_fp8_blocks(f"{type(experts).__name__}.{name}", stored, getattr(experts, "block_size", None),
                     fused_halves=name == "gate_up_proj")
    return stored


def check_fp8_blocks(where: str, stored, block, fused_halves: bool = False) -> None:
    """Refuses FP8 experts whose blocks the shapes do not give: a dimension of several blocks that ends in a
    partial one (its derived block differs from the config's). One block along a dimension, or one per half
    of a fused [gate; up] projection (transformers' grid for halves narrower than a block), reads right."""
    if not block:
        return
    (_, K, N), (SN, SK) = stored.shape, stored.scale_inv.shape[-2:]
    bn, bk = stored.block
    if not (bn == block[0] or SN == 1 or (fused_halves and SN == 2)) or not (bk == block[1] or SK == 1):
        raise NotImplementedError(f"hf_scatter: {where} is [{N}, {K}] in {tuple(block)} blocks and ends in a partial "
                                  "block, which the expert kernels do not read; load the checkpoint with "
                                  "quantization_config=FineGrainedFP8Config(dequantize=True)")


def _uses_default_gate(experts: torch.nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    if getattr(type(experts), "_apply_gate", _default_apply_gate) is _default_apply_gate:
        return True
    # transformers' FP8Experts carries a gate of its own, the default one unless its config clamps or softcaps
    return type(experts).__name__ == "FP8Experts" and all(
        getattr(experts, name, None) is None for name in ("swiglu_alpha", "limit", "gate_softcap", "up_softcap"))


def _fused_gate_form(experts: torch.nn.Module):
    """The fused kernel's form of a family's own gate, where it has one (GPT-OSS's clamped, interleaved gate);
    None for the default gate (handled by ``glu_activation``) and gates the kernel does not know."""
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is None or getattr(experts, "is_concatenated", True):
        return None
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return None
    if gate is GptOssExperts._apply_gate:
        from ..kernels.swiglu import gpt_oss_gate

        return gpt_oss_gate(float(experts.alpha), float(experts.limit))
    return None


def _maybe_expert_parallel(experts: nn.Module) -> bool:
    """Whether ``experts`` may be a shard of an expert-parallel layer. Recent transformers flag one
    (``_is_expert_parallel``); earlier 5.x releases only shrink ``num_experts`` to the local count and let the
    router mark other ranks' routes, so any run with a process group may be one (the masking then costs two
    elementwise ops on the [T, k] routing tensors)."""
    return getattr(experts, "_is_expert_parallel", False) or (
        torch.distributed.is_available() and torch.distributed.is_initialized())


def _routes_may_leave_this_rank(experts: nn.Module, top_k_index: torch.Tensor) -> bool:
    """Whether some of these routes may name another rank's expert: transformers' all-reduce dispatch hands every
    rank the whole batch, k routes per token (inference on a shared batch in releases with ``ep_size``, which
    flag an expert-parallel module ``_is_expert_parallel``; training and inference on the tensor-parallel group
    in earlier ones, asked for with ``DistributedConfig(enable_expert_parallel=True)``). Its all-to-all dispatch
    hands one local route per row. FSDP, DDP and ZeRO hold every expert: no route leaves."""
    if top_k_index.shape[-1] < 2:
        return False
    if getattr(experts, "_is_expert_parallel", False):
        return True
    distributed = getattr(getattr(experts, "config", None), "distributed_config", None)
    return bool(getattr(distributed, "enable_expert_parallel", False))


def _skipping_other_ranks(num_local: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                          ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """(routing, gates) for a rank whose routes to other ranks' experts carry id ``num_local``: the sort puts them
    in a bin of their own past the local experts, which the kernels skip (zeros, no product), so a rank holding
    1/N of the experts computes its share of the routes, not all of them; their gates are zeroed, which also
    zeroes their gradients."""
    from ..moe.routing import flatten_sort_count  # the kernels load on first use

    routing = flatten_sort_count(top_k_index.reshape(top_k_index.shape[0], -1), num_local + 1, validate=False)
    return routing, top_k_weights.masked_fill(top_k_index >= num_local, 0.0)


def _local_routes(num_local: int, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """A process group where no route is expected to leave this rank (transformers' all-to-all dispatch hands
    local ids only; FSDP or DDP hold every expert): a stray id ``num_local`` would run on the last local expert
    with weight 0, adding nothing to the output nor to any gradient, for two elementwise ops where there is
    none (:func:`_skipping_other_ranks` is for routes that do leave)."""
    off_rank = top_k_index >= num_local  # [T, k]
    return top_k_index.clamp(max=num_local - 1), top_k_weights.masked_fill(off_rank, 0.0)


def scattermoe_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    from ..moe.mlp import FusedSwiGLU, expert_mlp, glu_activation  # the kernels load on first use

    routing = None
    if _routes_may_leave_this_rank(self, top_k_index):
        routing, top_k_weights = _skipping_other_ranks(self.num_experts, top_k_index, top_k_weights)
    elif _maybe_expert_parallel(self):
        top_k_index, top_k_weights = _local_routes(self.num_experts, top_k_index, top_k_weights)

    def kernel_layout(name: str):  # [E, d_in, d_out]: a view, or FP8 weights read as stored
        quantized = fp8_expert_weight(self, name)
        if quantized is not None:
            return quantized
        w = getattr(self, name)
        return w if self.is_transposed else w.transpose(1, 2)

    has_bias = getattr(self, "has_bias", False)
    if getattr(self, "has_gate", True):
        w_in, b_in = kernel_layout("gate_up_proj"), (self.gate_up_proj_bias if has_bias else None)
        fused_form = _fused_gate_form(self)
        if fused_form is not None:
            activation = FusedSwiGLU(fused_form)
        elif getattr(self, "is_concatenated", True) and _uses_default_gate(self):
            activation = glu_activation(self.act_fn)
        else:
            activation = self._apply_gate  # interleaved [g0, u0, ...] or a family-specific gate (clamps, alpha)
    else:
        w_in, b_in = kernel_layout("up_proj"), (self.up_proj_bias if has_bias else None)
        activation = self.act_fn
    w_out = kernel_layout("down_proj")  # quantized weights: decoded by expert_mlp where its fused path cannot run
    post_norm = self.post_expert_norm if getattr(self, "has_post_expert_norm", False) else None
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    # Router top-k ids are in range by construction: skip the validating host sync on the hot path.
    out = expert_mlp(x, (w_in,), w_out, top_k_index.reshape(x.shape[0], -1),
                     top_k_weights.reshape(x.shape[0], -1), activation, b_in=(b_in,),
                     b_out=self.down_proj_bias if has_bias else None, post_norm=post_norm, validate=False,
                     routing=routing)
    return out.to(hidden_states.dtype).view(hidden_states.shape)
