"""Device and host memory of a CGOPipe run, checked against the budgets before anything is allocated.

The HRM policy search sizes its plan with a coarse activation model; the runtime knows its buffers
exactly, so it re-checks: if the resident weight fraction the policy chose leaves too little device
memory for the pipeline's activations, it keeps a little less of every layer resident (never more), and a
request whose prompt or KV cache cannot fit at all is refused with its index and the numbers.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from ...common.units import format_bytes
from ..families.adapter import Dims, PipelineAdapter
from ..plan.attention_buckets import SLACK
from ..plan.cost_model import PREFILL_CHUNK_TOKENS
from ..plan.policy import PlanError
from .paging import Layout

CHUNK_TOKENS = PREFILL_CHUNK_TOKENS  # prompt tokens per prefill chunk at most, as the planner prices them
MIN_CHUNK_TOKENS = 64
HEAD_ROWS = 64  # rows through the LM head and sampling at a time: bounds the [rows, vocab] fp32 temporaries


def other_bytes(adapter: PipelineAdapter) -> int:
    """Embedding, final norm and LM head (a tied head counted once)."""
    seen, total = set(), 0
    for t in adapter.other_tensors().values():
        key = t.data_ptr() if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def cublas_workspace_bytes(device) -> int:
    """cuBLAS's workspace for the compute stream: PyTorch allocates it through its caching allocator at the
    first GEMM on a stream (32 MiB on Hopper), so it counts against the budget like any tensor. Sized as
    PyTorch sizes it: ``CUBLAS_WORKSPACE_CONFIG`` (``:KiB:count`` pairs) or its per-architecture default."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return cublas_workspace_size(os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""),
                                 torch.cuda.get_device_capability(device)[0])


def cublas_workspace_size(config: str, major: int) -> int:
    """Bytes for a ``CUBLAS_WORKSPACE_CONFIG`` value ('' for PyTorch's default) on a GPU of compute
    capability ``major``.x."""
    pairs = re.findall(r":(\d+):(\d+)", config)
    if pairs:
        return sum(int(size) * int(count) for size, count in pairs) * 1024
    return 4096 * 8 * 1024 if major >= 9 else (4096 * 2 + 16 * 8) * 1024


def stage_bytes(d: Dims, tokens: int, b: int) -> int:
    """Transient device memory of ``tokens`` rows through one stage (upper bound: every temporary of the
    largest step counted as live at once; prompt attention's padded copies of the QKV and of its output
    at their most, 1 + SLACK times the tokens)."""
    padded = math.ceil(tokens * (1 + SLACK)) * b * (d.qkv_dim + d.q_dim)
    pre = tokens * b * (d.hidden + d.qkv_dim + 3 * (d.q_dim + d.kv_dim) + d.q_dim + 2 * d.kv_dim) + padded
    experts = tokens * (3 * d.ffn_width + d.top_k * d.hidden) * b + tokens * d.top_k * 32
    post = tokens * b * 5 * d.hidden + tokens * d.experts * 16 + experts
    return max(pre, post)


def head_bytes(d: Dims, tokens: int, b: int) -> int:
    """One slice of at most HEAD_ROWS rows through the LM head and sampling: logits, their fp32 copy, top-p's
    sorted values and indices, ..."""
    return min(tokens, HEAD_ROWS) * d.vocab * (b + 32)


def workspace_bytes(d: Dims, tokens: int, b: int) -> int:
    """Transient device memory of ``tokens`` rows through one stage, plus one slice of the LM head."""
    return stage_bytes(d, tokens, b) + head_bytes(d, tokens, b)


def row_bytes(d: Dims, b: int) -> int:
    """Device memory a row (a request in decode, a prompt token in prefill) holds across stages."""
    return (d.hidden + d.q_dim + 2 * d.head_dim) * b + 16


def decode_bytes(d: Dims, batch: int, micro: int, b: int) -> int:
    return batch * row_bytes(d, b) + workspace_bytes(d, micro, b)


def graph_bytes(d: Dims, batch: int, micro: int, b: int) -> int:
    """Device memory decode's CUDA graphs hold for the whole run (:mod:`.stage_graphs`): one stage's temporaries in
    their pool, and every row's QKV buffer."""
    return stage_bytes(d, micro, b) + batch * d.qkv_dim * b


def prefill_bytes(d: Dims, batch: int, chunk: int, group: int, b: int) -> int:
    """A group of ``group`` prompt tokens in chunks of at most ``chunk``, with the batch's decode buffers."""
    return group * row_bytes(d, b) + workspace_bytes(d, chunk, b) + batch * (d.q_dim * b + 16)


@dataclass(frozen=True)
class DevicePlan:
    layout: Layout
    budget: int
    other: int
    chunk_tokens: int
    group_tokens: int
    reserved: int = 0  # the library's own buffers (cuBLAS workspace)
    graphs: int = 0  # decode's CUDA graphs (graph_bytes), where the stages run as graphs

    @property
    def available(self) -> int:
        """Device memory left for activations after the weights."""
        return self.budget - self.other - self.reserved - self.graphs - self.layout.device_bytes

    def breakdown(self) -> dict:
        parts = {"embedding, final norm, LM head": self.other, "resident layer weights": self.layout.resident_bytes,
                 "weight double buffer": 2 * self.layout.slot_bytes, "cuBLAS workspace": self.reserved}
        if self.graphs:
            parts["decode CUDA graphs"] = self.graphs
        return {**parts, "activations (at most)": self.available}


def plan_device(adapter: PipelineAdapter, fraction: float, budget: int, batch: int, micro: int, b: int,
                reserved: int = 0, graphs: bool = False) -> DevicePlan:
    """The largest resident fraction <= ``fraction`` whose weights leave room for decoding ``batch``
    requests in micro-batches of ``micro`` and for prefill chunks of at least MIN_CHUNK_TOKENS tokens
    (``reserved``: device bytes taken besides weights and activations; ``graphs``: decode runs as CUDA graphs)."""
    d = adapter.dims
    other = other_bytes(adapter)
    graphs_bytes = graph_bytes(d, batch, micro, b) if graphs else 0
    reserved_all = reserved + graphs_bytes
    x = fraction
    while True:
        layout = Layout(adapter, x)
        available = budget - other - reserved_all - layout.device_bytes
        chunk = _chunk_tokens(d, batch, available, b)
        if chunk >= MIN_CHUNK_TOKENS and decode_bytes(d, batch, micro, b) <= available:
            per_token = row_bytes(d, b)
            group = (available - workspace_bytes(d, chunk, b) - batch * (d.q_dim * b + 16)) // per_token
            return DevicePlan(layout, budget, other, chunk, int(group), reserved, graphs_bytes)
        if x <= 0:
            need = max(decode_bytes(d, batch, micro, b), prefill_bytes(d, batch, MIN_CHUNK_TOKENS, MIN_CHUNK_TOKENS, b))
            raise PlanError(
                f"a GPU budget of {format_bytes(budget)} is too small: the embedding and LM head "
                f"({format_bytes(other)}), cuBLAS's workspace and decode's graphs ({format_bytes(reserved_all)}) and "
                f"the double buffer for one streamed stage ({format_bytes(2 * layout.slot_bytes)}) leave "
                f"{format_bytes(max(available, 0))}, but batches of "
                f"{batch} in micro-batches of {micro} need {format_bytes(need)} of activations: raise gpu_memory or "
                "pass a policy with a smaller batch_size / micro_batch_size")
        x = max(0.0, x - max(0.0025, 0.02 * x))


def _chunk_tokens(d: Dims, batch: int, available: int, b: int) -> int:
    """Prefill chunk size: the largest power of two up to CHUNK_TOKENS whose stage temporaries take at most a
    quarter of the activation memory (the rest holds the prompt tokens of a group, and every group streams
    the weights once more), else the largest that fits at all (0: none). The LM head's slice is the same for
    every chunk size, so it does not count against the quarter: with a 152k vocabulary (Qwen3) it alone
    took the quarter and left 256-token chunks, whose per-chunk host cost made the prefill 40x slower than
    the planner's 4096-token chunks (H100, 24 Qwen3-30B-A3B layers)."""
    fits = [c for c in (CHUNK_TOKENS >> i for i in range(7)) if c >= MIN_CHUNK_TOKENS and
            prefill_bytes(d, batch, c, c, b) <= available]
    roomy = [c for c in fits if stage_bytes(d, c, b) <= (available - head_bytes(d, c, b)) // 4]
    return (roomy or fits or [0])[0]
