"""Mixture-of-Attention (ScatterMoE paper, Algorithm 4).

Each expert owns a query and an output projection; keys and values are shared. Q is a scattered ->
scattered ParallelLinear, so the k expert queries of a token stay at that token's time position and act as
k extra heads over the shared K/V; O maps each expert's attention output back and mixes with the gates: its
input is already one row per slot (k=1), and its gates [T, k] mix each token's k slots (Algorithm 1's gate
width is independent of the input fan-out), so no [T*k, H] per-slot output is made.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .parallel_linear import parallel_linear
from .routing import flatten_sort_count


class MixtureOfAttention(nn.Module):
    """``forward(x [B, S, H], attention_mask=None, is_causal=True) -> [B, S, H]``.

    Parameters: ``router`` (Linear H -> E), ``q_proj`` [E, heads*head_dim, H], ``o_proj`` [E, H, heads*head_dim],
    ``kv_proj`` (Linear H -> 2*kv_heads*head_dim, shared by all experts). Routing is softmax -> top-k -> renormalise.
    ``attention_mask`` is an optional boolean [B, S] key-padding mask (True = attend).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, num_heads: int, head_dim: int,
                 num_kv_heads: int | None = None, device=None, dtype=None):
        super().__init__()
        num_kv_heads = num_kv_heads or num_heads
        if (top_k * num_heads) % num_kv_heads:
            raise ValueError(f"MixtureOfAttention: top_k*num_heads={top_k * num_heads} query heads must be a "
                             f"multiple of num_kv_heads={num_kv_heads}")
        factory = {"device": device, "dtype": dtype}
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, num_kv_heads
        self.router = nn.Linear(hidden_size, num_experts, bias=False, **factory)
        self.q_proj = nn.Parameter(torch.empty(num_experts, num_heads * head_dim, hidden_size, **factory))
        self.o_proj = nn.Parameter(torch.empty(num_experts, hidden_size, num_heads * head_dim, **factory))
        self.kv_proj = nn.Linear(hidden_size, 2 * num_kv_heads * head_dim, bias=False, **factory)
        nn.init.normal_(self.q_proj, std=1 / math.sqrt(hidden_size))
        nn.init.normal_(self.o_proj, std=1 / math.sqrt(num_heads * head_dim))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(x).float(), dim=-1)
        gates, expert_idxs = probs.topk(self.top_k, dim=-1)
        return gates / gates.sum(-1, keepdim=True), expert_idxs

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None, is_causal: bool = True):
        B, S, H = x.shape
        k, h, d = self.top_k, self.num_heads, self.head_dim
        flat = x.reshape(B * S, H)
        gates, expert_idxs = self.route(flat)
        routing = flatten_sort_count(expert_idxs, self.num_experts, validate=False)
        q = parallel_linear(flat, self.q_proj.transpose(1, 2), k, *routing)  # [T*k, h*d], token-major slots
        # Heads ordered (head, expert choice) so grouped-query attention maps expert head h to shared KV head h.
        q = q.view(B, S, k, h, d).transpose(2, 3).reshape(B, S, h * k, d).transpose(1, 2)
        kv = self.kv_proj(x).view(B, S, 2, self.num_kv_heads, d)
        key, value = kv.unbind(2)
        mask = None
        if attention_mask is not None:
            mask = attention_mask[:, None, None, :].to(torch.bool)
            if is_causal:
                mask = mask & torch.ones(S, S, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(q, key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask,
                                             is_causal=is_causal and mask is None,
                                             enable_gqa=self.num_kv_heads != k * h)
        out = out.transpose(1, 2).reshape(B, S, h, k, d).transpose(2, 3).reshape(B * S * k, h * d)  # slot order
        y = parallel_linear(out, self.o_proj.transpose(1, 2), 1, *routing, gates=gates)  # [T, H]
        return y.view(B, S, H)
