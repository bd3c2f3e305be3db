"""How a decoder layer splits for offloaded generation (CGOPipe): pre-attention, attention, post-attention.

The pipeline needs a layer in three pieces: *pre-attention* (input norm, fused QKV projection, rotary
embedding) and *post-attention* (output projection, residual, norm, router, experts, residual) run on the
GPU, attention runs on the CPU in between. A family's :class:`PipelineAdapter` (in the family's module, named by
its registry entry) names the weights each piece reads, in the
order they should stay on the GPU when only part of a layer can (dense tensors first), and gives the
expert weights in a *column layout*: every expert tensor with the expert's intermediate dimension as one
axis, so any range of intermediate columns [a, b) of all experts is itself a smaller set of experts
(a SwiGLU MLP is a sum over its intermediate columns). That is how a fraction of every layer's experts
stays on the GPU while the rest streams, with the ScatterMoE kernels run once per part.

The math follows the vanilla transformers modules op for op (same dtypes, same order of additions), so
greedy tokens match vanilla ``generate`` in fp32.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .spec import ModelSpec


@dataclass(frozen=True)
class Dims(ModelSpec):
    """The model's shapes as the HRM reads them from its config, plus what the runtime also needs."""

    max_positions: int | None = None
    sliding_window: int | None = None

    @classmethod
    def of(cls, config, max_positions: int | None, sliding_window: int | None = None) -> "Dims":
        return cls(**dataclasses.asdict(ModelSpec.from_config(config)), max_positions=max_positions,
                   sliding_window=sliding_window)

    @property
    def qkv_dim(self) -> int:
        return self.q_dim + 2 * self.kv_dim


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, heads, d] with ``cos``/``sin`` [T, d] (halves rotated, as in Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class Rows:
    """Tensors stacked along dim 0 without building the stack (Mixtral's separate Q, K and V projections are
    stored as one [q + 2 kv, H] matrix): shape and dtype for the layout, :meth:`copy_into` for the packing."""

    def __init__(self, *parts: torch.Tensor):
        self.parts = parts
        self.shape = torch.Size((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
        self.dtype = parts[0].dtype

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.parts[0].element_size()

    def copy_into(self, dst: torch.Tensor) -> None:
        start = 0
        for p in self.parts:
            dst[start:start + p.shape[0]].copy_(p)
            start += p.shape[0]


def copy_weight(dst: torch.Tensor, src) -> None:
    src.copy_into(dst) if isinstance(src, Rows) else dst.copy_(src)


class PipelineAdapter:
    """Base of a family's split. Subclasses fill the weight lists and the per-piece math."""

    model_type = ""
    column_dims: dict[str, int] = {}  # expert tensor name -> its intermediate (column) axis

    def __init__(self, model: nn.Module):
        self.model = model
        self.dims = self._dims(model.config)

    # ----- structure -----
    def layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def pre_tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def post_tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expert_tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def other_tensors(self) -> dict[str, torch.Tensor]:
        """Embedding, final norm, LM head: always resident on the device."""
        raise NotImplementedError

    def rotary(self, device: torch.device) -> nn.Module:
        return copy.deepcopy(self._rotary_module()).to(device)

    # ----- math -----
    def embed(self, other: dict, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, other["embed"])

    def qkv(self, w: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-attention: [T, q + 2 kv] with rotary already applied to the q and k parts."""
        d = self.dims
        qkv = self._project_qkv(w, x)
        T = qkv.shape[0]
        q = qkv[:, :d.q_dim].view(T, d.heads, d.head_dim)
        k = qkv[:, d.q_dim:d.q_dim + d.kv_dim].view(T, d.kv_heads, d.head_dim)
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        q.copy_(q_rot)
        k.copy_(k_rot)
        return qkv

    def post(self, w: dict, expert_parts: list[dict], x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Post-attention: the layer's output hidden state (the next residual)."""
        o = F.linear(attn, w["o"])
        normed, summed = self._post_norm(w, o, x)
        logits = F.linear(normed, w["router"])
        gates, experts = self._route(logits)
        out = None
        for part in expert_parts:
            y = self._experts(part, normed, experts, gates).to(normed.dtype)
            out = y if out is None else out + y
        return summed + out

    def logits(self, other: dict, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._final_norm(other, x), other["lm_head"]).float()

    # ----- per family -----
    def _dims(self, config) -> Dims:
        raise NotImplementedError

    def _rotary_module(self) -> nn.Module:
        raise NotImplementedError

    def _project_qkv(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _post_norm(self, w: dict, o: torch.Tensor, x: torch.Tensor):
        raise NotImplementedError

    def _route(self, logits: torch.Tensor):
        raise NotImplementedError

    def _experts(self, part: dict, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _final_norm(self, other: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def adapter_for(model: nn.Module) -> PipelineAdapter:
    """The split of ``model`` (a causal LM of a family that offloads: Mixtral, DBRX; patched or not)."""
    from .registry import families

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    offloading = {name: f for name, f in families().items() if f.pipeline_adapter is not None}
    if model_type not in offloading:
        raise ValueError(f"offloading supports {', '.join(sorted(offloading))} causal LMs; got model_type "
                         f"{model_type!r} ({type(model).__name__})")
    if not hasattr(model, "lm_head"):
        raise ValueError(f"offloading needs the causal-LM model (with lm_head), got {type(model).__name__}: load it "
                         "with AutoModelForCausalLM")
    adapter = offloading[model_type].pipeline_adapter(model)
    adapter.other_tensors()  # reads the norms' eps
    layers = adapter.layers()
    if layers:
        adapter.expert_tensors(layers[0])  # reads the activation and the router's normalisation
    return adapter
