"""How a decoder layer splits for offloaded generation (CGOPipe): pre-attention, attention, post-attention.

The pipeline needs a layer in three pieces: *pre-attention* (input norm, fused QKV projection, rotary
embedding) and *post-attention* (output projection, residual, norm, router, experts, residual) run on the
GPU, attention runs on the CPU in between. A family's :class:`PipelineAdapter` (in the family's module of this
package, named by its registry entry) names the weights each piece reads, in the
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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ...moe.routing import flatten_sort_count
from .rows import Rows
from .sharding import Shard
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


@dataclass(frozen=True)
class LayerAttention:
    """How one layer's attention departs from causal softmax attention over the whole context: a sliding
    ``window`` (a query at position i sees keys at positions > i - window, as transformers masks it),
    attention ``sinks`` (GPT-OSS: one learnt logit per query head in the softmax denominator, whose value row
    is zero), kept as a float32 CPU copy so the CPU attention reads it after the layer's weights moved, and the
    softmax ``scale`` where it is not ``head_dim ** -0.5`` (MLA: the latent head is wider than the heads the
    model scales by)."""

    window: int | None = None
    sinks: torch.Tensor | None = None  # [heads] float32, CPU
    scale: float | None = None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [T, heads, d] with ``cos``/``sin`` [T, d] (halves rotated, as in Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


class PipelineAdapter:
    """Base of a family's split. The runtime calls the weight getters below, :meth:`rotary`,
    :meth:`layer_attention`, :meth:`embed`, :meth:`qkv`, :meth:`post` and :meth:`logits`; a family overrides
    points in four groups:

    - **reading**, done once by the constructor: :meth:`read_dims` (the shapes), :meth:`read_expert_format` (how
      the loaded experts hold their weights) and :meth:`read_constants` (the family's frozen dataclass of
      everything else the maths needs: norm epsilons, activation, routing, each layer's attention; from the
      config, and from the modules for the few constants the config does not hold).
      Nothing else is read from the model later but its weights, so the getters below may run in any order.
    - **weights**, pure getters of the whole layer: :meth:`layers`, :meth:`pre_tensors`, :meth:`post_tensors`,
      :meth:`expert_tensors` (in the column layout ``column_dims`` and ``column_units`` name), :meth:`other_tensors` and
      :meth:`_rotary_module` (the runtime reads a layer through ``shard_*``: a tensor-parallel rank's share,
      split by name as :mod:`.sharding` says). They raise ``NotImplementedError`` for a layout the runtime
      cannot run; the constructor asks them once, so such a model is refused before any work.
    - **pre-attention maths**: :meth:`embed`, :meth:`_project_qkv` and :meth:`_normalize_qk` (or all of
      :meth:`qkv`, where the layout of its output differs: MLA).
    - **post-attention maths and the head**: :meth:`_attention_output`, :meth:`_post_norm`, :meth:`_route` (the router's
      logits) and :meth:`_select` (its choice), :meth:`_experts` (one column part), :meth:`_mlp` (where dense
      MLPs join the experts); the head's :meth:`_final_norm` (or all of :meth:`logits`).
    """

    model_type = ""
    column_dims: dict[str, int] = {}  # expert tensor name -> its intermediate (column) axis
    # expert tensor name -> intermediate columns per index of that axis where not one (MXFP4's down projection holds
    # its input columns in groups of 32 under one scale: a column range must start and end on a group)
    column_units: dict[str, int] = {}

    def __init__(self, model: nn.Module, shard: Shard = Shard()):
        """``shard``: this process's part of a tensor-parallel group; the getters ``shard_*`` then give its
        share of each layer, :attr:`dims` its heads and expert columns, and :meth:`post` all-reduces."""
        self.model, self.shard = model, shard
        self.float_dtype = model.get_input_embeddings().weight.dtype  # the dense maths' (FP8 linears decoded)
        self.full_dims = dataclasses.replace(self.read_dims(model.config),
                                             expert_format=self.read_expert_format(model))
        shard.check(self.full_dims, self.model_type)
        self.dims = shard.dims(self.full_dims)  # what this rank computes: the maths and the runtime read these
        self.constants = self.read_constants(model)
        layers = self.layers()  # the getters refuse what the runtime cannot run: asked once here, before any work
        other = self.other_tensors()
        if layers:
            self.shard_expert_tensors(layers[0])
            dense = {**self.shard_pre_tensors(layers[0]), **self.shard_post_tensors(layers[0]), **other}
            stored = [name for name, t in dense.items() if t.dtype == torch.float8_e4m3fn]
            if stored:
                raise NotImplementedError(f"offloading {self.model_type} reads its {', '.join(stored)} weights as "
                                          "float, and this model holds them as FP8; load the checkpoint with "
                                          "quantization_config=FineGrainedFP8Config(dequantize=True) to offload it")

    # ----- reading -----
    def read_dims(self, config) -> Dims:
        raise NotImplementedError

    def read_expert_format(self, model: nn.Module) -> str:
        """How the loaded experts hold their weights (:data:`~.spec.EXPERT_FORMATS`; "": the model's dtype), read
        from the modules: a config's ``quantization_config`` does not say whether a load kept it."""
        return ""

    def column_unit(self, name: str) -> int:
        """Intermediate columns per index along expert tensor ``name``'s column axis."""
        return self.column_units.get(name, 1)

    def read_constants(self, model: nn.Module):
        """The family's frozen dataclass of constants; it holds ``attention``, each layer's
        :class:`LayerAttention`."""
        raise NotImplementedError

    # ----- weights -----
    def layers(self) -> list[nn.Module]:
        raise NotImplementedError

    def pre_tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def post_tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def expert_tensors(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def other_tensors(self) -> dict[str, torch.Tensor]:
        """Embedding, final norm, LM head: always resident on the device (whole on every rank)."""
        raise NotImplementedError

    def shard_pre_tensors(self, layer: nn.Module) -> dict:
        """This rank's share of :meth:`pre_tensors` (all of it on one GPU): what the runtime stores."""
        return self.shard.layer_tensors(self.pre_tensors(layer), self.full_dims)

    def shard_post_tensors(self, layer: nn.Module) -> dict:
        return self.shard.layer_tensors(self.post_tensors(layer), self.full_dims)

    def shard_expert_tensors(self, layer: nn.Module) -> dict:
        return self.shard.expert_tensors(self.expert_tensors(layer), self.column_dims)

    def _rotary_module(self) -> nn.Module:
        """The module giving (cos, sin) for positions, as the pipeline rotates with them."""
        raise NotImplementedError

    def rotary(self, device: torch.device) -> nn.Module:
        return copy.deepcopy(self._rotary_module()).to(device)

    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's window, sinks (this rank's heads') and scale (:attr:`constants`)."""
        return [dataclasses.replace(a, sinks=self.shard.heads(a.sinks)) for a in self.constants.attention]

    # ----- pre-attention maths -----
    def embed(self, other: dict, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, other["embed"])

    def qkv(self, w: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Pre-attention: [T, q + 2 kv] with rotary already applied to the q and k parts."""
        d = self.dims
        qkv = self._project_qkv(w, x)
        self._normalize_qk(w, qkv)
        T = qkv.shape[0]
        q = qkv[:, :d.q_dim].view(T, d.heads, d.head_dim)
        k = qkv[:, d.q_dim:d.q_dim + d.kv_dim].view(T, d.kv_heads, d.head_dim)
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        q.copy_(q_rot)
        k.copy_(k_rot)
        return qkv

    def _project_qkv(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _normalize_qk(self, w: dict, qkv: torch.Tensor) -> None:
        """Norms (and clamps) of q and k before the rotary embedding, in place in ``qkv`` [T, q + 2 kv]."""

    # ----- post-attention maths -----
    def post(self, w: dict, expert_parts: list[dict], x: torch.Tensor, attn: torch.Tensor,
             fetch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Post-attention: the layer's output hidden state (the next residual). ``fetch``: called with the
        chosen experts [T, k] before any expert part is read (routed streaming brings them in then)."""
        o = self.shard.reduce(self._attention_output(w, attn))  # [T, H]: every rank's heads summed
        normed, summed = self._post_norm(w, o, x)
        return summed + self.shard.reduce(self._mlp(w, expert_parts, normed, fetch))  # every rank's columns

    def _attention_output(self, w: dict, attn: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention ``attn`` [T, q] (optional bias ``o_bias``)."""
        return F.linear(attn, w["o"], w.get("o_bias"))

    def _post_norm(self, w: dict, o: torch.Tensor, x: torch.Tensor):
        raise NotImplementedError

    def _mlp(self, w: dict, expert_parts: list[dict], normed: torch.Tensor, fetch=None) -> torch.Tensor:
        """The routed experts of ``normed`` [T, H], summed over their column parts; ``down_bias`` [E, H] (an
        expert's output bias) is added once however many parts the expert is split into."""
        gates, experts = self._route(w, normed)
        if fetch is not None:
            fetch(experts)
        routing = flatten_sort_count(experts, self.dims.experts, validate=False)  # one sort for every part
        out = None
        for part in expert_parts:
            y = self._experts(part, normed, experts, gates, routing).to(normed.dtype)
            out = y if out is None else out + y
        if "down_bias" in w:  # [T, k, H] biases of the chosen experts, mixed by their gates
            out = out + (w["down_bias"][experts] * gates.unsqueeze(-1).to(normed.dtype)).sum(1)
        return out

    def _route(self, w: dict, normed: torch.Tensor):
        """(gates [T, k], experts [T, k]) of the router ``router`` (optional ``router_bias``)."""
        return self._select(F.linear(normed, w["router"], w.get("router_bias")))

    def _select(self, logits: torch.Tensor):
        raise NotImplementedError

    def _experts(self, part: dict, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor,
                 routing: tuple) -> torch.Tensor:
        """One column part of every expert (``routing``: the shared sort of ``experts``)."""
        raise NotImplementedError

    # ----- the head -----
    def logits(self, other: dict, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._final_norm(other, x), other["lm_head"]).float()

    def _final_norm(self, other: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def linear_weight(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight [out, in] as the dense maths read it: a block-scaled FP8 one (``Fp8BlockLinear``,
    a checkpoint loaded as shipped) decoded into ``dtype``, the model's float dtype (dense weights are a few
    percent of an MoE layer's bytes; the experts stay FP8)."""
    scale = getattr(linear, "weight_scale_inv", None)
    if scale is None:
        return linear.weight
    from ...kernels.fp8_blocks import dequantize_fp8_blocks

    return dequantize_fp8_blocks(linear.weight, scale, dtype, block=getattr(linear, "block_size", None))


def mlp_tensors(prefix: str, mlp: nn.Module, dtype: torch.dtype) -> dict:
    """A gated MLP's weights as ``<prefix>_gate_up`` [2I, H] ([gate; up]) and ``<prefix>_down`` [H, I], with
    their biases where it has them (FP8 ones decoded into ``dtype``)."""
    t = {f"{prefix}_gate_up": Rows(linear_weight(mlp.gate_proj, dtype), linear_weight(mlp.up_proj, dtype)),
         f"{prefix}_down": linear_weight(mlp.down_proj, dtype)}
    if mlp.gate_proj.bias is not None:
        t.update({f"{prefix}_gate_up_bias": Rows(mlp.gate_proj.bias, mlp.up_proj.bias),
                  f"{prefix}_down_bias": mlp.down_proj.bias})
    return t


def dense_mlp(w: dict, prefix: str, x: torch.Tensor, glu) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` from :func:`mlp_tensors`' weights (``glu``: ``act(gate) * up`` of
    [gate; up] columns, :func:`~hf_scatter.moe.mlp.glu_activation`)."""
    gate_up = F.linear(x, w[f"{prefix}_gate_up"], w.get(f"{prefix}_gate_up_bias"))  # [T, 2I]
    return F.linear(glu(gate_up), w[f"{prefix}_down"], w.get(f"{prefix}_down_bias"))


def layer_windows(config) -> list[int | None]:
    """Each layer's attention window from the config's ``layer_types`` (GPT-OSS, Qwen2-MoE): ``sliding_window``
    on the "sliding_attention" layers, None (full attention) on the others and where the config has no types."""
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return [config.sliding_window if kind == "sliding_attention" else None for kind in types]


