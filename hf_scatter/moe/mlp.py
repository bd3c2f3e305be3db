"""SMoE GLU MLP (SwiGLU experts) on ParallelLinear, with weights in the Hugging Face layout.

First projection scattered -> grouped (the intermediate activations stay in expert order), activation,
second projection grouped -> scattered with the routing gates: in backward each does one ``group``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.swiglu import SILU, GateForm, swiglu, swiglu_pair, swiglu_reference
from ..kernels.weight_formats import is_quantized
from .parallel_linear import parallel_linear
from .routing import flatten_sort_count
from .swiglu_experts import swiglu_experts


def is_silu(act_fn) -> bool:
    return act_fn is F.silu or isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def expert_mlp(x: torch.Tensor, w_in: Sequence[torch.Tensor], w_out: torch.Tensor, expert_idxs: torch.Tensor,
               gates: torch.Tensor, activation: Callable[..., torch.Tensor],
               b_in: Sequence[torch.Tensor | None] | None = None, b_out: torch.Tensor | None = None,
               post_norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
               validate: bool = True, routing: tuple | None = None) -> torch.Tensor:
    """Two-layer experts on ParallelLinear: ``sum_j gates[t,j] * out_e(activation(*in_e(x_t)))``.

    Weights are in kernel layout ([E, d_in, d_out], transposed views welcome). ``w_in`` holds one input
    projection (a fused [gate; up] or a plain up) or several (DBRX's separate gate and up); each runs
    scattered -> grouped and ``activation`` receives their grouped outputs. The output projection runs
    grouped -> scattered and mixes the k outputs with ``gates``, unless ``post_norm`` must see each
    expert's output first (then the mix is an fp32 weighted sum). ``routing``: ``flatten_sort_count`` of
    ``expert_idxs`` when the caller has it (several column parts of the same experts share one sort).
    """
    T, k = expert_idxs.shape
    E = w_out.shape[0]
    routing = routing if routing is not None else flatten_sort_count(expert_idxs, E, validate)
    b_in = b_in if b_in is not None else (None,) * len(w_in)
    if isinstance(activation, FusedSwiGLU) and len(w_in) == 1 and post_norm is None \
            and not torch.compiler.is_compiling():  # one autograd node: lower backward peak
        return swiglu_experts(x, w_in[0], w_out, gates, routing, b_in[0], b_out, activation.form)
    # the ParallelLinear chain reads float weights: quantized ones (frozen) are decoded for this call
    w_in = [w.dequantize(x.dtype) if is_quantized(w) else w for w in w_in]
    w_out = w_out.dequantize(x.dtype) if is_quantized(w_out) else w_out
    hs = [parallel_linear(x, w, k, *routing, bias=b, grouped_out=True) for w, b in zip(w_in, b_in)]
    h = activation(*hs)
    if post_norm is None:
        return parallel_linear(h, w_out, k, *routing, bias=b_out, gates=gates, grouped_in=True)
    y = post_norm(parallel_linear(h, w_out, k, *routing, bias=b_out, grouped_in=True))
    return (y.view(T, k, -1).float() * gates.float().unsqueeze(-1)).sum(1).to(x.dtype)


def glu_experts(x: torch.Tensor, gate_up_proj: torch.Tensor, down_proj: torch.Tensor, expert_idxs: torch.Tensor,
                gates: torch.Tensor, act_fn: Callable[[torch.Tensor], torch.Tensor] = F.silu,
                gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                validate: bool = True) -> torch.Tensor:
    """``sum_j gates[t,j] * down_e(act(gate_e(x_t)) * up_e(x_t))`` for the k experts ``e = expert_idxs[t, j]``.

    ``gate_up_proj`` [E, 2I, H] holds [gate; up] (HF Mixtral order), ``down_proj`` [E, H, I]; both are read
    through transposed views, never copied. ``x`` is [T, H], ``expert_idxs`` and ``gates`` are [T, k].
    """
    if x.dim() != 2:
        raise ValueError(f"glu_experts: x must be [tokens, hidden], got {tuple(x.shape)}")
    if tuple(expert_idxs.shape) != tuple(gates.shape) or expert_idxs.dim() != 2 or expert_idxs.shape[0] != x.shape[0]:
        raise ValueError(f"glu_experts: expert_idxs {tuple(expert_idxs.shape)} and gates {tuple(gates.shape)} must "
                         f"both be [T, k] with T = {x.shape[0]}")
    E, two_i, H = gate_up_proj.shape
    if two_i % 2 or tuple(down_proj.shape) != (E, H, two_i // 2) or x.shape[1] != H:
        raise ValueError(f"glu_experts: expected gate_up_proj [E, 2I, H], down_proj [E, H, I] and x [T, H]; got "
                         f"{tuple(gate_up_proj.shape)}, {tuple(down_proj.shape)}, {tuple(x.shape)}")
    return expert_mlp(x, (gate_up_proj.transpose(1, 2),), down_proj.transpose(1, 2), expert_idxs, gates,
                      glu_activation(act_fn), b_in=(gate_up_bias,), b_out=down_bias, validate=validate)


class FusedSwiGLU:
    """A gate of the fused kernel's forms (``silu(gate) * up``, or GPT-OSS's clamped gate) over expert_mlp's
    own grouped [gate, up] rows (the backward may overwrite them); recognised by :func:`expert_mlp`, which
    then runs the whole MLP as one autograd function. Called directly (under ``torch.compile``), the SiLU
    form runs the fused kernel, other forms their torch formula."""

    def __init__(self, form: GateForm = SILU):
        self.form = form

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        if self.form == SILU:
            return swiglu(h, reuse_input_buffer=True)
        return swiglu_reference(*self.form.halves(h), *self.form.numbers)


def glu_activation(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``act(gate) * up`` over grouped [gate; up] rows: the fused kernel for SiLU, torch ops otherwise."""
    if is_silu(act_fn):
        return FusedSwiGLU()

    def act_times_up(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return act_fn(gate) * up

    return act_times_up


def glu_pair_activation(act_fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``act(gate) * up`` over separate gate and up projections (DBRX's): the fused SwiGLU kernel for SiLU (both
    inputs are ``expert_mlp``'s own intermediates, so its backward may overwrite them), torch ops otherwise. The
    patched DBRX experts and its offloaded runtime both run it."""
    if is_silu(act_fn):
        return lambda gate, up: swiglu_pair(gate, up, reuse_input_buffers=True)
    return lambda gate, up: act_fn(gate) * up


class GLUMLP(nn.Module):
    """E SwiGLU experts in HF layout (``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).

    ``forward(x, expert_idxs, gates)``: ``x`` [..., H], routing ``expert_idxs``/``gates`` [T, k] for the
    T = x.numel() // H tokens; returns the gate-weighted sum of the k experts' outputs, shaped like ``x``.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, activation: str = "silu",
                 bias: bool = False, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, **factory))
        self.gate_up_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate_size, **factory)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(num_experts, hidden_size, **factory)) if bias else None
        from transformers.activations import ACT2FN

        self.act_fn = ACT2FN[activation]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=1 / math.sqrt(self.hidden_size))
        nn.init.normal_(self.down_proj, std=1 / math.sqrt(self.intermediate_size))

    def forward(self, x: torch.Tensor, expert_idxs: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden_size)
        out = glu_experts(flat, self.gate_up_proj, self.down_proj, expert_idxs, gates, self.act_fn,
                          self.gate_up_bias, self.down_bias)
        return out.view(x.shape)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
                f"intermediate_size={self.intermediate_size}, impl=scattermoe")
