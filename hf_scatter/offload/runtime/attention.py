"""The attention math of the offloaded pipeline: prompts on the device, one new token per row on the CPU.

Plain causal attention runs as one fused SDPA call (grouped-query heads folded into query rows, so each K/V
head is read once). A layer's :class:`~hf_scatter.offload.families.adapter.LayerAttention` adds what some
families need: a sliding window (a boolean mask; decode also skips the keys before every row's window) and
attention sinks (GPT-OSS), which SDPA has no argument for. Sinks run as explicit float32 softmax over the
scores and the sink logit, the sink's column dropped afterwards, as transformers' eager GPT-OSS attention
does; prompts do so a block of queries at a time so the [heads, queries, keys] scores stay bounded. On the CPU,
where SDPA's fused kernel returns each query's log-sum-exp, decode and unwindowed prompts run fused instead and
rescale by the sink (:func:`_with_sinks`). On the GPU (half precision), a chunk's prompts go through
FlashAttention's variable-length kernel in one call (PyTorch's own build of it): no padding, the window as the
kernel's own argument, and its log-sum-exp rescaled by the sink the same way.
Multi-head latent attention (DeepSeek) arrives here already absorbed: one latent KV head that is both key and
value, and a softmax scale of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..families.adapter import Dims, LayerAttention
from ..plan.attention_buckets import SLACK, length_buckets


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                   sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Softmax attention whose denominator also holds ``exp(sink)`` of each query head.

    ``q`` [B, Hkv, G, T, d] (the G query heads sharing a KV head), ``k``/``v`` [B, Hkv, S, d], ``allowed``
    bool broadcastable to [B, 1, 1, T, S] (True: attend; None: every key), ``sinks`` [Hkv * G] (head h reads
    KV head h // G), ``scale`` (None: ``d ** -0.5``). Returns [B, Hkv, G, T, d] in ``v``'s dtype."""
    B, Hkv, G, T, d = q.shape
    scores = torch.matmul(q.reshape(B, Hkv, G * T, d), k.transpose(-1, -2)).float()  # [B, Hkv, G*T, S]
    scores = scores.view(B, Hkv, G, T, -1) * (d ** -0.5 if scale is None else scale)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(device=scores.device, dtype=torch.float32).view(1, Hkv, G, 1, 1).expand(B, Hkv, G, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]  # [B, Hkv, G, T, S]
    out = torch.matmul(probs.to(v.dtype).reshape(B, Hkv, G * T, -1), v)  # [B, Hkv, G*T, d]
    return out.view(B, Hkv, G, T, d)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                     sinks: torch.Tensor | None = None, scale: float | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped-query attention of one new token per row: ``q`` [n, heads, d] over ``k``/``v``
    [n, kv_heads, S, d], ``mask`` [n, S] (True: attend), ``sinks`` [heads] or None, ``scale`` (None:
    ``d ** -0.5``); written into ``out`` [n, heads, d] where given. The heads // kv_heads
    query heads that share a KV head become that head's query rows, so each K/V head is read once and no copy
    is expanded; this form also stays on SDPA's fused CPU kernel in bf16, where ``enable_gqa=True`` fell back
    to the unfused path on the CPU build we measured (torch 2.13, 10x slower)."""
    n, H, d = q.shape
    Hkv = k.shape[1]
    if sinks is not None and _fuses_lse(q):
        dest = None if out is None else out.view(n, Hkv, H // Hkv, d)
        return _fused_sink_decode(q.view(n, Hkv, H // Hkv, d), k, v, mask, sinks, scale, dest).reshape(n, H, d)
    if sinks is not None:
        allowed = None if mask is None else mask.view(n, 1, 1, 1, -1)
        o = sink_attention(q.view(n, Hkv, H // Hkv, 1, d), k, v, allowed, sinks, scale)
    else:
        o = F.scaled_dot_product_attention(q.reshape(n, Hkv, H // Hkv, d), k, v,
                                           attn_mask=None if mask is None else mask.view(n, 1, 1, -1), scale=scale)
    return o.reshape(n, H, d) if out is None else out.copy_(o.reshape(n, H, d))


# SDPA's fused CPU kernel, which also returns each query's log-sum-exp of its scores (torch >= 2.3; private, so
# looked up once and the unfused reference used where a build lacks it)
_FUSED_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fuses_lse(t: torch.Tensor) -> bool:
    """Whether attention on ``t``'s device can run fused with its log-sum-exp (the sinks' rescaling needs it)."""
    return _FUSED_WITH_LSE is not None and t.device.type == "cpu"


def _fused_sink_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       sinks: torch.Tensor, scale: float | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`sink_attention` for one query per row, in one fused pass over the cache: attention without the sink,
    then each head rescaled by ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``, which is what the sink
    adds to the softmax's denominator. The unfused form copies every K/V slice for its matmuls and runs five
    thread-team regions per call, which dominated decode on hosts of many cores. ``q`` [n, Hkv, G, d], ``k``/``v``
    [n, Hkv, S, d] (strided slices of the cache are fine), ``mask`` [n, S] bool or None; returns [n, Hkv, G, d]
    (``out`` where given)."""
    n, Hkv, G, _ = q.shape
    bias = None  # the kernel takes an additive mask of the query's dtype
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")).view(n, 1, 1, -1)
    o, lse = _FUSED_WITH_LSE(q, k, v, attn_mask=bias, scale=scale)  # [n, Hkv, G, d], lse [n, Hkv, G]
    return _with_sinks(o, lse, sinks.view(1, Hkv, G), out)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
                dest: torch.Tensor | None = None) -> torch.Tensor:
    """Attention ``out`` [..., d] without the sink, given each query's log-sum-exp ``lse`` [...] of its scores and
    its head's sink logit (``sinks`` broadcast to ``lse``), as attention with the sink in the softmax's
    denominator: scaled by ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``, in float32, rounded once
    to ``out``'s dtype (into ``dest`` where given). One float32 copy scaled in place and one store: with a
    product and a cast each in a new tensor, the rescaling took 3.8 of a 7.2 ms bf16 decode call on the H200
    host's CPU (512 rows of GPT-OSS-120B's heads), against 0.6 ms this way."""
    acc = torch.promote_types(out.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(acc) - sinks.to(acc)).unsqueeze(-1)
    scaled = out.to(acc, copy=True).mul_(keep)
    return scaled.to(out.dtype) if dest is None else dest.copy_(scaled)


def window_start(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees (transformers: keys at positions > i - window)."""
    return 0 if window is None else max(0, position - window + 1)


@dataclass(frozen=True)
class PromptCall:
    """``count`` adjacent prompts of a chunk (its tokens ``start`` .. ``end``) in one attention call, each
    right-padded to ``length``: ``gather`` [count * length] picks the padded rows out of the chunk's tokens
    (a padded position repeats its prompt's last token), ``scatter`` [end - start] picks each real token's output
    back out of them; both None where every prompt has ``length`` tokens (the call reads the chunk in place).
    Right padding needs no mask of its own: under the causal mask a real query never sees a later position."""

    start: int
    end: int
    count: int
    length: int
    gather: torch.Tensor | None = None
    scatter: torch.Tensor | None = None


def prompt_calls(rows: list[tuple[int, int, int]], device=None, slack: float = SLACK) -> list[PromptCall]:
    """The attention calls of a chunk's prompts ``rows`` = (row, first token, end token), adjacent in the
    chunk: prompts longest first go in the fewest calls whose padding stays within ``1 + slack`` of their real
    tokens (one call per prompt length, as many as the chunk has lengths, left the prefill bound by the host:
    GPT-OSS's sink path launches about a dozen kernels a call); otherwise one call per run of equal lengths."""
    lens = [b - a for _, a, b in rows]
    if all(x >= y for x, y in zip(lens, lens[1:])):
        spans = [(s, e) for s, e, _ in length_buckets(lens, slack)]
    else:
        spans, i = [], 0
        while i < len(rows):
            j = i + 1
            while j < len(rows) and lens[j] == lens[i]:
                j += 1
            spans.append((i, j))
            i = j
    calls = []
    for s, e in spans:
        start, end, length = rows[s][1], rows[e - 1][2], max(lens[s:e])
        if all(p == length for p in lens[s:e]):
            calls.append(PromptCall(start, end, e - s, length))
            continue
        t = torch.arange(length)
        gather = torch.cat([a + t.clamp(max=b - a - 1) for _, a, b in rows[s:e]])  # [count * length]
        scatter = torch.cat([j * length + torch.arange(b - a) for j, (_, a, b) in enumerate(rows[s:e])])
        calls.append(PromptCall(start, end, e - s, length, gather.to(device), scatter.to(device)))
    return calls


@dataclass(frozen=True)
class PackedPrompts:
    """A chunk's adjacent prompts as FlashAttention's variable-length kernel takes them: ``starts`` [n + 1] int32
    (each prompt's first token, then the chunk's end) and the longest prompt's length."""

    starts: torch.Tensor
    longest: int


def packed_prompts(rows: list[tuple[int, int, int]], device=None) -> PackedPrompts:
    """:class:`PackedPrompts` of a chunk's prompts ``rows`` = (row, first token, end token), adjacent in the chunk."""
    starts = [a for _, a, _ in rows] + [rows[-1][2]]
    return PackedPrompts(torch.tensor(starts, dtype=torch.int32).to(device), max(b - a for _, a, b in rows))


def flash_varlen_runs(device: torch.device, dtype: torch.dtype, d: Dims) -> bool:
    """Whether a chunk's prompts in ``dtype`` on ``device`` go through FlashAttention's variable-length kernel: a
    CUDA build with it (Ampere or newer), half precision, a head size it takes, keys and values of their own
    (MLA's latent head is 576 wide)."""
    return (device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and not d.values_are_keys
            and d.head_dim % 8 == 0 and d.head_dim <= 256 and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device)[0] >= 8)


def _flash_varlen_attention(qkv: torch.Tensor, d: Dims, layer: LayerAttention, sinks: torch.Tensor | None,
                            packed: PackedPrompts) -> torch.Tensor:
    """Causal attention within each packed prompt in one kernel call; returns [T, q]. The window is the kernel's
    (transformers' window w keeps keys after i - w: w - 1 to the left); sinks rescale by the log-sum-exp."""
    T = qkv.shape[0]
    q = qkv[:, :d.q_dim].unflatten(1, (d.heads, d.head_dim))  # [T, H, d], a view
    k = qkv[:, d.q_dim:d.q_dim + d.kv_dim].unflatten(1, (d.kv_heads, d.head_dim))  # [T, Hkv, d]
    v = qkv[:, d.q_dim + d.kv_dim:].unflatten(1, (d.kv_heads, d.head_dim))  # [T, Hkv, d]
    window = {}
    if layer.window is not None and layer.window < packed.longest:  # else no prompt reaches past it
        window = {"window_size_left": layer.window - 1, "window_size_right": 0}
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, packed.starts, packed.starts, packed.longest, packed.longest, 0.0, True, False,
        scale=layer.scale, **window)[:2]  # [T, H, d], [H, T] float32
    if sinks is not None:
        out = _with_sinks(out, lse.t(), sinks.view(1, d.heads))
    return out.reshape(T, d.q_dim)


def prompt_attention(qkv: torch.Tensor, rows: list[tuple[int, int, int]], d: Dims,
                     layer: LayerAttention = LayerAttention(), sinks: torch.Tensor | None = None,
                     max_score_bytes: int = 1 << 28, calls: list[PromptCall] | None = None,
                     packed: PackedPrompts | None = None) -> torch.Tensor:
    """Causal attention within each prompt of a chunk: ``qkv`` [T, q + 2 kv] (rotary applied; [T, q + kv]
    when the keys are the values), ``rows`` =
    (row, first token, end token) per prompt; returns [T, q]. ``packed`` / ``calls``: :func:`packed_prompts` /
    :func:`prompt_calls` of ``rows`` on ``qkv``'s device (a chunk passes through every layer, so the pipeline
    decides once, with :func:`flash_varlen_runs`, and builds one of them once): ``packed`` runs the FlashAttention
    call, ``calls`` the padded ones; given neither, this call decides.
    ``sinks``: ``layer.sinks`` on ``qkv``'s device; with sinks, queries go in blocks whose float32 scores
    take at most ``max_score_bytes``."""
    if packed is None and calls is None and flash_varlen_runs(qkv.device, qkv.dtype, d):
        packed = packed_prompts(rows, qkv.device)
    if packed is not None:
        return _flash_varlen_attention(qkv, d, layer, sinks, packed)
    return _padded_prompt_attention(qkv, rows, d, layer, sinks, max_score_bytes, calls)


def _padded_prompt_attention(qkv: torch.Tensor, rows: list[tuple[int, int, int]], d: Dims, layer: LayerAttention,
                             sinks: torch.Tensor | None, max_score_bytes: int,
                             calls: list[PromptCall] | None) -> torch.Tensor:
    """:func:`prompt_attention` in calls of prompts padded to one length (SDPA, or the sinks' explicit softmax)."""
    out = torch.empty(qkv.shape[0], d.q_dim, dtype=qkv.dtype, device=qkv.device)
    G = d.heads // d.kv_heads
    for call in prompt_calls(rows, qkv.device) if calls is None else calls:
        g, p = call.count, call.length
        rows_qkv = qkv[call.start:call.end] if call.gather is None else qkv.index_select(0, call.gather)
        q = rows_qkv[:, :d.q_dim].view(g, p, d.heads, d.head_dim).transpose(1, 2)  # [g, H, p, d], a view
        k = rows_qkv[:, d.q_dim:d.q_dim + d.kv_dim].view(g, p, d.kv_heads, d.head_dim).transpose(1, 2)  # [g, Hkv, p, d]
        v = k if d.values_are_keys else rows_qkv[:, d.q_dim + d.kv_dim:].view(g, p, d.kv_heads,
                                                                              d.head_dim).transpose(1, 2)
        if sinks is None and layer.window is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=layer.scale)
            o = o.transpose(1, 2)  # [g, p, H, d]
        elif sinks is None:
            allowed = visible_keys(torch.arange(p, device=qkv.device), 0, p, layer.window)  # [p, p]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, enable_gqa=True, scale=layer.scale)
            o = o.transpose(1, 2)
        elif _fuses_lse(qkv) and (layer.window or p) >= p:
            # one fused pass where no window cuts a prompt: causal attention and its log-sum-exp, rescaled
            o, lse = _FUSED_WITH_LSE(q, k, v, is_causal=True, scale=layer.scale)  # [g, H, p, d], [g, H, p]
            o = _with_sinks(o, lse, sinks.view(1, d.heads, 1)).transpose(1, 2)
        else:
            o = torch.empty(g, p, d.heads, d.head_dim, dtype=qkv.dtype, device=qkv.device)  # [g, p, H, d]
            block = max(1, max_score_bytes // (4 * d.heads * p * g))
            qg = q.unflatten(1, (d.kv_heads, G))  # [g, Hkv, G, p, d], a view: each block copies only its queries
            for s in range(0, p, block):
                e = min(p, s + block)
                first = window_start(s, layer.window)  # keys before it are outside every query's window
                allowed = visible_keys(torch.arange(s, e, device=qkv.device), first, e, layer.window)
                o[:, s:e] = sink_attention(qg[:, :, :, s:e], k[:, :, first:e], v[:, :, first:e], allowed, sinks,
                                           layer.scale).reshape(g, d.heads, e - s, d.head_dim).transpose(1, 2)
        dst = out[call.start:call.end]  # [tokens, q]
        if call.scatter is None:
            dst.view(g, p, d.heads, d.head_dim).copy_(o)
        else:
            torch.index_select(o.reshape(g * p, d.q_dim), 0, call.scatter, out=dst)
    return out


def visible_keys(positions: torch.Tensor, first: int, end: int, window: int | None) -> torch.Tensor:
    """[len(positions), end - first] bool: key position j in [first, end) is visible from a query at position i
    (j <= i, and within the window)."""
    j = torch.arange(first, end, device=positions.device)
    allowed = j <= positions[:, None]
    if window is not None:
        allowed &= j > positions[:, None] - window
    return allowed
