"""Device and host memory of a CGOPipe run, checked against the budgets before anything is allocated.

The planner reserves the activations by the same model (:mod:`..plan.activations`), but the runtime knows the
real model's tensors, its cuBLAS workspace and its CUDA graphs, so it re-checks: if the resident weight
fraction the policy chose leaves too little device memory for the pipeline's activations, it keeps a little
less of every layer resident (never more), and a request whose prompt or KV cache cannot fit at all is refused
with its index and the numbers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ...common.units import format_bytes
from ..families.adapter import PipelineAdapter
from ..plan.activations import (MIN_CHUNK_TOKENS, chunk_tokens, decode_bytes, graph_bytes, prefill_bytes, row_bytes,
                                workspace_bytes)
from ..plan.policy import PlanError
from .paging import Layout


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
        chunk = chunk_tokens(d, batch, available, b)
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
