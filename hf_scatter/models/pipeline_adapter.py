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
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.norms import fused_add_rms_norm
from ..kernels.router import router_topk
from ..moe.mlp import expert_mlp, glu_activation
from ..moe.routing import flatten_sort_count
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
        """Width of the pre-attention output: queries, keys, and values unless the keys are the values (MLA)."""
        return self.q_dim + self.kv_width


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

    def layer_attention(self) -> list[LayerAttention]:
        """Each layer's window and sinks; by default the config's ``sliding_window`` (None: full) on every
        layer, as Mixtral and the Qwen-MoE configs apply it."""
        return [LayerAttention(window=self.dims.sliding_window)] * self.dims.layers

    # ----- math -----
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

    def post(self, w: dict, expert_parts: list[dict], x: torch.Tensor, attn: torch.Tensor,
             fetch: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Post-attention: the layer's output hidden state (the next residual). ``fetch``: called with the
        chosen experts [T, k] before any expert part is read (routed streaming brings them in then)."""
        o = self._attention_output(w, attn)
        normed, summed = self._post_norm(w, o, x)
        return summed + self._mlp(w, expert_parts, normed, fetch)

    def _attention_output(self, w: dict, attn: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention ``attn`` [T, q] (optional bias ``o_bias``)."""
        return F.linear(attn, w["o"], w.get("o_bias"))

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

    def logits(self, other: dict, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._final_norm(other, x), other["lm_head"]).float()

    # ----- per family -----
    def _dims(self, config) -> Dims:
        raise NotImplementedError

    def _rotary_module(self) -> nn.Module:
        raise NotImplementedError

    def _project_qkv(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _normalize_qk(self, w: dict, qkv: torch.Tensor) -> None:
        """Norms (and clamps) of q and k before the rotary embedding, in place in ``qkv`` [T, q + 2 kv]."""

    def _post_norm(self, w: dict, o: torch.Tensor, x: torch.Tensor):
        raise NotImplementedError

    def _route(self, w: dict, normed: torch.Tensor):
        """(gates [T, k], experts [T, k]) of the router ``router`` (optional ``router_bias``)."""
        return self._select(F.linear(normed, w["router"], w.get("router_bias")))

    def _select(self, logits: torch.Tensor):
        raise NotImplementedError

    def _experts(self, part: dict, x: torch.Tensor, experts: torch.Tensor, gates: torch.Tensor,
                 routing: tuple) -> torch.Tensor:
        """One column part of every expert (``routing``: the shared sort of ``experts``)."""
        raise NotImplementedError

    def _final_norm(self, other: dict, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def mlp_tensors(prefix: str, mlp: nn.Module) -> dict:
    """A gated MLP's weights as ``<prefix>_gate_up`` [2I, H] ([gate; up]) and ``<prefix>_down`` [H, I], with
    their biases where it has them."""
    t = {f"{prefix}_gate_up": Rows(mlp.gate_proj.weight, mlp.up_proj.weight), f"{prefix}_down": mlp.down_proj.weight}
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


def offloaded_model_types() -> list[str]:
    """The families offloaded generation runs: those whose registry entry names a pipeline adapter."""
    from .registry import families

    return sorted(name for name, f in families().items() if f.pipeline_adapter is not None)


def adapter_for(model: nn.Module) -> PipelineAdapter:
    """The split of ``model`` (a causal LM of a family in :func:`offloaded_model_types`; patched or not)."""
    from .registry import families

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    offloadable = offloaded_model_types()
    if model_type not in offloadable:
        raise ValueError(f"offloading supports {', '.join(offloadable)} causal LMs; got model_type "
                         f"{model_type!r} ({type(model).__name__})")
    if not hasattr(model, "lm_head"):
        raise ValueError(f"offloading needs the causal-LM model (with lm_head), got {type(model).__name__}: load it "
                         "with AutoModelForCausalLM")
    adapter = families()[model_type].pipeline_adapter(model)
    adapter.other_tensors()  # reads the norms' eps
    layers = adapter.layers()
    if layers:
        adapter.expert_tensors(layers[0])  # reads the activation and the router's normalisation
    return adapter


class LlamaStylePipelineAdapter(PipelineAdapter):
    """The Llama-style MoE layer (Mixtral, Qwen3-MoE, OLMoE): RMSNorm, separate q/k/v projections, a linear
    router at ``mlp.gate``, SwiGLU experts with a concatenated [gate; up] projection. Subclasses name the
    family and add its q/k norms or routing; every layer must hold an MoE block."""

    gates_in_logits_dtype = False
    column_dims = {"gate_up": 2, "down": 2}  # gate_up as [E, 2, I, H] ([gate; up]), down [E, H, I]
    norm_casting = "llama"  # its RMSNorm's rounding (kernels.norms.fused_add_rms_norm)

    def _dims(self, c) -> Dims:
        return Dims.of(c, getattr(c, "max_position_embeddings", None), getattr(c, "sliding_window", None))

    def layers(self):
        layers = list(self.model.model.layers)
        dense = [i for i, layer in enumerate(layers) if not hasattr(layer.mlp, "experts")]
        if dense:
            raise NotImplementedError(f"offloading runs decoder layers that all hold experts; layers {dense} of this "
                                      f"{self.model_type} model hold a dense MLP (mlp_only_layers / decoder_sparse_step)")
        return layers

    def pre_tensors(self, layer):
        a = layer.self_attn
        tensors = {"norm": layer.input_layernorm.weight, "qkv": Rows(a.q_proj.weight, a.k_proj.weight, a.v_proj.weight)}
        if a.q_proj.bias is not None:  # attention_bias (Qwen2-MoE and GPT-OSS always; the others by config)
            tensors["qkv_bias"] = Rows(a.q_proj.bias, a.k_proj.bias, a.v_proj.bias)
        return tensors

    def post_tensors(self, layer):
        return {**self._attention_out_tensors(layer), "router": layer.mlp.gate.weight}

    def _attention_out_tensors(self, layer) -> dict:
        """The attention's output projection (with its bias where it has one) and the post-attention norm."""
        o = layer.self_attn.o_proj
        tensors = {"o": o.weight, "post_norm": layer.post_attention_layernorm.weight}
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
        self._act_fn = experts.act_fn
        return {"gate_up": gate_up.reshape(E, 2, two_i // 2, H), "down": down}

    def other_tensors(self):
        base = self.model.model
        self._eps = (self.model.model.layers[0].input_layernorm.variance_epsilon,
                     self.model.model.layers[0].post_attention_layernorm.variance_epsilon, base.norm.variance_epsilon)
        return {"embed": base.embed_tokens.weight, "final_norm": base.norm.weight,
                "lm_head": self.model.lm_head.weight}

    def _rotary_module(self):
        return self.model.model.rotary_emb

    def _project_qkv(self, w, x):
        return F.linear(self._norm(x, None, w["norm"], self._eps[0]), w["qkv"], w.get("qkv_bias"))

    def _post_norm(self, w, o, x):
        return self._norm(o, x, w["post_norm"], self._eps[1], return_sum=True)

    def _norm(self, x, residual, weight, eps, return_sum=False):
        """The family's RMSNorm of ``x + residual`` (with the sum when ``return_sum``), in its casting."""
        return fused_add_rms_norm(x, residual, weight, eps=eps, return_sum=return_sum, validate=False,
                                  casting=self.norm_casting)

    def _select(self, logits):
        """float32 softmax, top-k, renormalised to sum 1 (Mixtral: float32 gates; Qwen-style routers renormalise
        where ``norm_topk_prob`` says and hand the gates on in the logits' dtype)."""
        normalize = "sum" if getattr(self.model.config, "norm_topk_prob", True) else None
        gates, experts = router_topk(logits, self.dims.top_k, normalize=normalize, softmax_dtype=torch.float32)
        return (gates.to(logits.dtype) if self.gates_in_logits_dtype else gates), experts

    def _experts(self, part, x, experts, gates, routing):
        E, _, c, H = part["gate_up"].shape
        w_in = part["gate_up"].view(E, 2 * c, H).transpose(1, 2)
        return expert_mlp(x, (w_in,), part["down"].transpose(1, 2), experts, gates, glu_activation(self._act_fn),
                          validate=False, routing=routing)

    def _final_norm(self, other, x):
        return self._norm(x, None, other["final_norm"], self._eps[2])
