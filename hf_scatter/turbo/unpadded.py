"""BERT encoder on packed tokens: embeddings, layers and pooler of a live ``BertModel``, no padding anywhere.

Between the GEMMs run the fused kernels: residual add + LayerNorm in one pass, and variable-length
attention straight from the Q/K/V projections (no score matrix, no [B, S, S] mask). Q, K and V come from
one GEMM over the three weights as one tensor (:class:`QkvWeights`: the parameters become views of it): a
small batch's GEMMs are bound by their launch, not their size, so one GEMM for three saves two per layer.
Every intermediate comes from an *allocator* ``alloc(name, shape, dtype, device)`` and every op writes into
it (``out=``), so the memory planner can place all of them in one arena and a CUDA graph can replay the
whole encoder.

Inference only (eval mode, no autograd): training keeps transformers' padded path with the fused norms.
The arithmetic and its rounding follow transformers' BertModel op for op (bias inside the GEMM, the
residual add rounded before the norm), so outputs at real positions match the padded model's.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..kernels.norms import fused_add_layer_norm
from ..kernels.skinny_linear import SkinnyWorkspace, runs_skinny, skinny_linear
from ..kernels.varlen_attention import varlen_attention
from .packing import PackedBatch

Alloc = Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]

# The FFN runs in row chunks of at most this many tokens: GEMMs of thousands of rows still run at full
# speed, and the [rows, intermediate] buffer (the largest of a layer, 4x the hidden size) stops growing with
# the batch.
FFN_CHUNK_ROWS = 5120


def fresh(name: str, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The unplanned allocator: a new tensor from torch's caching allocator."""
    return torch.empty(shape, dtype=dtype, device=device)


_INPLACE_ACTIVATIONS = {
    "gelu": lambda t: torch.ops.aten.gelu_(t),
    "gelu_pytorch_tanh": lambda t: torch.ops.aten.gelu_(t, approximate="tanh"),
    "relu": torch.relu_,
    "silu": lambda t: torch.ops.aten.silu_(t),
    "swish": lambda t: torch.ops.aten.silu_(t),
}
_SKINNY_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}  # hidden_act -> the kernel's epilogue


def unsupported_architecture(config) -> str | None:
    """Why a BERT of this config cannot run packed, or None (encoders with absolute positions can)."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        return "decoder / cross-attention BERT (causal or encoder-decoder attention is not packed)"
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type={config.position_embedding_type!r} (only absolute positions are packed)"
    return None


# What the packed encoder reads weights from directly. An adapter's wrapper (PEFT's LoRA layers) or a quantized
# layer is another class, whose weight alone does not say what it computes: such a model is not run packed.
PLAIN_MODULES = (nn.Linear, nn.LayerNorm, nn.Embedding)


def modules_read(model: nn.Module) -> list[tuple[dict, str, nn.Module | None]]:
    """``(parent's _modules, name, module)`` of every layer whose weights the packed encoder reads: comparing
    ``_modules[name] is module`` tells, for a few dictionary lookups, whether any of them has been replaced."""
    found = []
    for parent, names in ((model.embeddings, ("word_embeddings", "position_embeddings", "token_type_embeddings",
                                              "LayerNorm")),
                          *((part, names) for layer in model.encoder.layer
                            for part, names in ((layer.attention.self, ("query", "key", "value")),
                                                (layer.attention.output, ("dense", "LayerNorm")),
                                                (layer.intermediate, ("dense",)),
                                                (layer.output, ("dense", "LayerNorm")))),
                          *(((model.pooler, ("dense",)),) if model.pooler is not None else ())):
        found.extend((parent._modules, name, parent._modules.get(name)) for name in names)
    return found


def wrapped_module(found: list[tuple[dict, str, nn.Module | None]]) -> str | None:
    """``"name: Class"`` of the first module read that is not a plain Linear, LayerNorm or Embedding, or None."""
    for _, name, module in found:
        if type(module) not in PLAIN_MODULES:
            return f"{name}: {type(module).__name__}"
    return None


class QkvWeights:
    """Each layer's query, key and value weights (and biases) as one [3 * all_head_size, hidden] tensor, for one
    GEMM instead of three.

    Where the three share dtype, device and width, their parameters become views of that tensor: no copy is
    kept, and every later write to them (``load_state_dict``, an optimizer step, a LoRA merge through ``.data``,
    which moves no version counter) lands in the tensor the GEMM reads. The parameters stay the same objects
    with the same names and values; a checkpoint saves them as before (disjoint views of one storage). A swap of
    their data (``.to()``, ``.half()``) gives them new addresses, which the runtime notices and fuses afresh.
    Otherwise (mixed dtypes, or ``share=False``) each call concatenates them anew."""

    def __init__(self, model: nn.Module, share: bool = True):
        self.layers = [(attn.query, attn.key, attn.value) for attn in
                       (layer.attention.self for layer in model.encoder.layer)]
        self.shared = [self._share(projs) if share else None for projs in self.layers]

    @staticmethod
    def _share(projs) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        params = [p for lin in projs for p in (lin.weight, lin.bias) if p is not None]
        same = len({(p.dtype, p.device) for p in params}) == 1 and len({lin.weight.shape[1] for lin in projs}) == 1
        if not same or any(type(p.data) is not torch.Tensor or p.device.type == "meta" for p in params) \
                or len({lin.bias is None for lin in projs}) != 1:
            return None
        with torch.inference_mode(False), torch.no_grad():  # plain tensors: the parameters may train later
            weight = torch.cat([lin.weight for lin in projs])  # [3 * width, H]
            bias = None if projs[0].bias is None else torch.cat([lin.bias for lin in projs])  # [3 * width]
            start = 0
            for lin in projs:
                rows = slice(start, start + lin.weight.shape[0])
                lin.weight.data = weight[rows]
                if bias is not None:
                    lin.bias.data = bias[rows]
                start = rows.stop
        return weight, bias

    def of_layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer ``i``'s (weight [3 * width, H], bias [3 * width] or None)."""
        if self.shared[i] is not None:
            return self.shared[i]
        projs = self.layers[i]
        weight = torch.cat([lin.weight for lin in projs])
        if all(lin.bias is None for lin in projs):
            return weight, None
        return weight, torch.cat([weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias.to(weight.dtype)
                                  for lin in projs])


def _skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, skinny: SkinnyWorkspace | None) -> bool:
    """Whether this projection runs on the few-rows kernel: a caller that keeps a workspace (the graphed runtime,
    where the GPU time is what is left), at most 64 half-precision rows, weights of the same dtype."""
    return (skinny is not None and runs_skinny(x) and weight.dtype == x.dtype
            and (bias is None or bias.dtype == x.dtype))


def _linear(x: torch.Tensor, linear: nn.Linear, out: torch.Tensor, skinny: SkinnyWorkspace | None = None
            ) -> torch.Tensor:
    if _skinny(x, linear.weight, linear.bias, skinny):
        return skinny_linear(x, linear.weight, linear.bias, out=out, workspace=skinny)
    if linear.bias is None:
        return torch.mm(x, linear.weight.t(), out=out)
    return torch.addmm(linear.bias, x, linear.weight.t(), out=out)


def _activation_(hidden_act, intermediate: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The FFN activation in place: the known ones by name, anything else through the module (a copy)."""
    inplace = _INPLACE_ACTIVATIONS.get(hidden_act) if isinstance(hidden_act, str) else None
    if inplace is not None:
        return inplace(x)
    return x.copy_(intermediate.intermediate_act_fn(x))


def embed(embeddings: nn.Module, batch: PackedBatch, alloc: Alloc) -> torch.Tensor:
    """LayerNorm(word + token type + position) per packed token, rounded like BertEmbeddings; the word
    embeddings are the caller's ``inputs_embeds`` where the batch has them (one op either way, so one plan
    serves both)."""
    word = embeddings.word_embeddings.weight
    T, H, dev = batch.num_tokens, word.shape[1], word.device
    summed = alloc("embed.word_type", (T, H), word.dtype, dev)
    if batch.inputs_embeds is None:
        torch.index_select(word, 0, batch.input_ids, out=summed)
    else:
        summed.copy_(batch.inputs_embeds)
    types = embeddings.token_type_embeddings.weight
    if batch.token_type_ids is None:
        summed.add_(types[0])
    else:
        summed.add_(torch.index_select(types, 0, batch.token_type_ids,
                                       out=alloc("embed.type", (T, H), word.dtype, dev)))
    positions = torch.index_select(embeddings.position_embeddings.weight, 0, batch.position_ids,
                                   out=alloc("embed.position", (T, H), word.dtype, dev))
    norm = embeddings.LayerNorm
    return fused_add_layer_norm(summed, positions, norm.weight, norm.bias, eps=norm.eps, validate=False,
                                out=alloc("embed.out", (T, H), word.dtype, dev))


def layer_forward(layer: nn.Module, h: torch.Tensor, batch: PackedBatch, alloc: Alloc,
                  qkv_weights: tuple[torch.Tensor, torch.Tensor | None], blocks: torch.Tensor | None,
                  hidden_act="gelu", fast_gelu: bool = False, skinny: SkinnyWorkspace | None = None) -> torch.Tensor:
    """One BertLayer on packed rows [T, H]: Q/K/V in one GEMM (``qkv_weights``: the layer's entry of
    :class:`QkvWeights`), varlen attention, out-proj + add&norm, FFN + add&norm. ``skinny``: at most 64 rows
    run the projections on :func:`skinny_linear` (the FFN's GELU, either form, in its epilogue)."""
    T, H = h.shape
    dtype, dev = h.dtype, h.device
    attn = layer.attention.self
    heads, head_dim = attn.num_attention_heads, attn.attention_head_size
    width = heads * head_dim
    qkv = alloc("attention.qkv", (T, 3 * width), dtype, dev)  # [T, q | k | v]
    weight, bias = qkv_weights  # [3 * width, H], [3 * width]
    if _skinny(h, weight, bias, skinny):
        skinny_linear(h, weight, bias, out=qkv, workspace=skinny)
    elif bias is None:
        torch.mm(h, weight.t(), out=qkv)
    else:
        torch.addmm(bias, h, weight.t(), out=qkv)
    q, k, v = (qkv[:, i * width:(i + 1) * width].view(T, heads, head_dim) for i in range(3))  # [T, heads, d]
    context = alloc("attention.context", (T, width), dtype, dev)
    varlen_attention(q, k, v, batch.lengths, attn.scaling, out=context.view(T, heads, head_dim), blocks=blocks,
                     key_mask=batch.key_mask)

    out = layer.attention.output
    projected = _linear(context, out.dense, alloc("attention.dense", (T, H), dtype, dev), skinny)
    h1 = fused_add_layer_norm(projected, h, out.LayerNorm.weight, out.LayerNorm.bias, eps=out.LayerNorm.eps,
                              validate=False, out=alloc("attention.norm", (T, H), dtype, dev))

    inner, ffn = layer.intermediate.dense, layer.output
    rows = min(T, FFN_CHUNK_ROWS)  # the [T, 4H] intermediate is the largest buffer: bound it (monotone in T,
    # so the arena planned for a large bucket holds every smaller one)
    intermediate = alloc("ffn.intermediate", (rows, inner.out_features), dtype, dev)
    projected = alloc("ffn.dense", (T, H), dtype, dev)
    for r0 in range(0, T, rows):
        r1 = min(T, r0 + rows)
        inter = intermediate[:r1 - r0]
        fused = _SKINNY_ACTIVATIONS.get(hidden_act) if isinstance(hidden_act, str) else None
        if fused and _skinny(h1[r0:r1], inner.weight, inner.bias, skinny):  # GELU exactly as named, one rounding
            skinny_linear(h1[r0:r1], inner.weight, inner.bias, fused, out=inter, workspace=skinny)
        elif fast_gelu and hidden_act == "gelu" and inner.bias is not None:  # bias + GELU in the GEMM's epilogue
            torch._addmm_activation(inner.bias, h1[r0:r1], inner.weight.t(), use_gelu=True, out=inter)
        else:
            _activation_(hidden_act, layer.intermediate, _linear(h1[r0:r1], inner, inter, skinny))
        _linear(inter, ffn.dense, projected[r0:r1], skinny)
    return fused_add_layer_norm(projected, h1, ffn.LayerNorm.weight, ffn.LayerNorm.bias, eps=ffn.LayerNorm.eps,
                                validate=False, out=alloc("ffn.norm", (T, H), dtype, dev))


def pool(pooler: nn.Module, h: torch.Tensor, first_token: torch.Tensor, alloc: Alloc,
         skinny: SkinnyWorkspace | None = None) -> torch.Tensor:
    """BertPooler on each sequence's first token: tanh(dense(h[CLS]))."""
    N = first_token.shape[0]
    cls = torch.index_select(h, 0, first_token, out=alloc("pooler.cls", (N, h.shape[1]), h.dtype, h.device))
    pooled = _linear(cls, pooler.dense, alloc("pooler.out", (N, pooler.dense.out_features), h.dtype, h.device),
                     skinny)
    if isinstance(pooler.activation, nn.Tanh):
        return pooled.tanh_()
    return pooled.copy_(pooler.activation(pooled))


def encode(model: nn.Module, batch: PackedBatch, alloc: Alloc = fresh, blocks: torch.Tensor | None = None,
           first_token: torch.Tensor | None = None, fast_gelu: bool = False,
           qkv: QkvWeights | None = None, skinny: SkinnyWorkspace | None = None
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(last hidden state [T, H], pooled output [N, H] or None)`` of a BertModel on a packed batch.

    ``blocks``/``first_token``: prebuilt device tables (the CUDA-graph runtime passes fixed-size ones).
    ``fast_gelu``: the FFN's bias + GELU inside the GEMM (``torch._addmm_activation``; on CUDA that is
    cuBLASLt's epilogue, GELU's tanh form), for half precision. ``qkv``: the layers' Q/K/V weights as one
    tensor each (the runtime keeps one; without it each call concatenates them). ``skinny``: a workspace for
    :func:`skinny_linear`, which then runs every projection of at most 64 half-precision rows (the graphed
    runtime passes one: in a graph the GPU's time is what is left, and cuBLAS spends 4-8 us on each).
    """
    qkv = QkvWeights(model, share=False) if qkv is None else qkv  # (a caller's model is not regrouped)
    h = embed(model.embeddings, batch, alloc)
    for i, layer in enumerate(model.encoder.layer):
        h = layer_forward(layer, h, batch, alloc, qkv.of_layer(i), blocks, model.config.hidden_act, fast_gelu, skinny)
    pooled = None
    if model.pooler is not None:
        pooled = pool(model.pooler, h, batch.first_token_index() if first_token is None else first_token, alloc,
                      skinny)
    return h, pooled
