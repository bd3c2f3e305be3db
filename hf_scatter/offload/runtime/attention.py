"""The attention math of the offloaded pipeline: prompts on the device, one new token per row on the CPU.

Plain causal attention runs as one fused SDPA call (grouped-query heads folded into query rows, so each K/V
head is read once). A layer's :class:`~hf_scatter.offload.families.adapter.LayerAttention` adds what some
families need: a sliding window (a boolean mask; decode also skips the keys before every row's window) and
attention sinks (GPT-OSS), which SDPA has no argument for. Sinks run as explicit float32 softmax over the
scores and the sink logit, the sink's column dropped afterwards, as transformers' eager GPT-OSS attention
does; prompts do so a block of queries at a time so the [heads, queries, keys] scores stay bounded.
Multi-head latent attention (DeepSeek) arrives here already absorbed: one latent KV head that is both key and
value, and a softmax scale of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..families.adapter import Dims, LayerAttention


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
                     sinks: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """Grouped-query attention of one new token per row: ``q`` [n, heads, d] over ``k``/``v``
    [n, kv_heads, S, d], ``mask`` [n, S] (True: attend), ``sinks`` [heads] or None, ``scale`` (None:
    ``d ** -0.5``). The heads // kv_heads
    query heads that share a KV head become that head's query rows, so each K/V head is read once and no copy
    is expanded; this form also stays on SDPA's fused CPU kernel in bf16, where ``enable_gqa=True`` fell back
    to the unfused path on the CPU build we measured (torch 2.13, 10x slower)."""
    n, H, d = q.shape
    Hkv = k.shape[1]
    if sinks is not None:
        if _FUSED_WITH_LSE is None or q.device.type != "cpu":
            allowed = None if mask is None else mask.view(n, 1, 1, 1, -1)
            return sink_attention(q.view(n, Hkv, H // Hkv, 1, d), k, v, allowed, sinks, scale).reshape(n, H, d)
        return _fused_sink_decode(q.view(n, Hkv, H // Hkv, d), k, v, mask, sinks, scale).reshape(n, H, d)
    out = F.scaled_dot_product_attention(q.reshape(n, Hkv, H // Hkv, d), k, v,
                                         attn_mask=None if mask is None else mask.view(n, 1, 1, -1), scale=scale)
    return out.reshape(n, H, d)


# SDPA's fused CPU kernel, which also returns each query's log-sum-exp of its scores (torch >= 2.3; private, so
# looked up once and the unfused reference used where a build lacks it)
_FUSED_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _fused_sink_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       sinks: torch.Tensor, scale: float | None) -> torch.Tensor:
    """:func:`sink_attention` for one query per row, in one fused pass over the cache: attention without the sink,
    then each head rescaled by ``exp(lse) / (exp(lse) + exp(sink)) = sigmoid(lse - sink)``, which is what the sink
    adds to the softmax's denominator. The unfused form copies every K/V slice for its matmuls and runs five
    thread-team regions per call, which dominated decode on hosts of many cores. ``q`` [n, Hkv, G, d], ``k``/``v``
    [n, Hkv, S, d] (strided slices of the cache are fine), ``mask`` [n, S] bool or None; returns [n, Hkv, G, d]."""
    n, Hkv, G, _ = q.shape
    bias = None  # the kernel takes an additive mask of the query's dtype
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf")).view(n, 1, 1, -1)
    out, lse = _FUSED_WITH_LSE(q, k, v, attn_mask=bias, scale=scale)  # [n, Hkv, G, d], lse [n, Hkv, G]
    acc = torch.promote_types(q.dtype, torch.float32)
    keep = torch.sigmoid(lse.to(acc) - sinks.to(acc).view(1, Hkv, G))  # [n, Hkv, G]
    return (out.to(acc) * keep.unsqueeze(-1)).to(v.dtype)


def window_start(position: int, window: int | None) -> int:
    """The first key position a query at ``position`` sees (transformers: keys at positions > i - window)."""
    return 0 if window is None else max(0, position - window + 1)


def prompt_attention(qkv: torch.Tensor, rows: list[tuple[int, int, int]], d: Dims,
                     layer: LayerAttention = LayerAttention(), sinks: torch.Tensor | None = None,
                     max_score_bytes: int = 1 << 28) -> torch.Tensor:
    """Causal attention within each prompt of a chunk: ``qkv`` [T, q + 2 kv] (rotary applied; [T, q + kv]
    when the keys are the values), ``rows`` =
    (row, first token, end token) per prompt; returns [T, q]. Prompts of equal length share one call.
    ``sinks``: ``layer.sinks`` on ``qkv``'s device; with sinks, queries go in blocks whose float32 scores
    take at most ``max_score_bytes``."""
    T = qkv.shape[0]
    q = qkv[:, :d.q_dim].view(T, d.heads, d.head_dim)  # [T, H, d]
    k = qkv[:, d.q_dim:d.q_dim + d.kv_dim].view(T, d.kv_heads, d.head_dim)  # [T, Hkv, d]
    v = k if d.values_are_keys else qkv[:, d.q_dim + d.kv_dim:].view(T, d.kv_heads, d.head_dim)
    out = torch.empty(T, d.q_dim, dtype=qkv.dtype, device=qkv.device)
    G = d.heads // d.kv_heads
    i = 0
    while i < len(rows):
        p = rows[i][2] - rows[i][1]
        j = i
        while j < len(rows) and rows[j][2] - rows[j][1] == p:
            j += 1
        a, b, g = rows[i][1], rows[j - 1][2], j - i
        qs = q[a:b].view(g, p, d.heads, d.head_dim).transpose(1, 2)  # [g, H, p, d]
        ks = k[a:b].view(g, p, d.kv_heads, d.head_dim).transpose(1, 2)  # [g, Hkv, p, d]
        vs = v[a:b].view(g, p, d.kv_heads, d.head_dim).transpose(1, 2)
        dst = out[a:b].view(g, p, d.heads, d.head_dim)
        if sinks is None and layer.window is None:
            dst.copy_(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True,
                                                     scale=layer.scale).transpose(1, 2))
        elif sinks is None:
            allowed = visible_keys(torch.arange(p, device=qkv.device), 0, p, layer.window)  # [p, p]
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, enable_gqa=True, scale=layer.scale)
            dst.copy_(o.transpose(1, 2))
        else:
            block = max(1, max_score_bytes // (4 * d.heads * p * g))
            qg = qs.reshape(g, d.kv_heads, G, p, d.head_dim)  # [g, Hkv, G, p, d]
            for s in range(0, p, block):
                e = min(p, s + block)
                first = window_start(s, layer.window)  # keys before it are outside every query's window
                allowed = visible_keys(torch.arange(s, e, device=qkv.device), first, e, layer.window)
                o = sink_attention(qg[:, :, :, s:e], ks[:, :, first:e], vs[:, :, first:e], allowed, sinks,
                                   layer.scale)
                dst[:, s:e].copy_(o.reshape(g, d.heads, e - s, d.head_dim).transpose(1, 2))
        i = j
    return out


def visible_keys(positions: torch.Tensor, first: int, end: int, window: int | None) -> torch.Tensor:
    """[len(positions), end - first] bool: key position j in [first, end) is visible from a query at position i
    (j <= i, and within the window)."""
    j = torch.arange(first, end, device=positions.device)
    allowed = j <= positions[:, None]
    if window is not None:
        allowed &= j > positions[:, None] - window
    return allowed
