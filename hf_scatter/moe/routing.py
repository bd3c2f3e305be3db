"""Routing bookkeeping: turn per-token expert choices into the expert-sorted order the kernels read."""

from __future__ import annotations

import torch

from ..kernels.custom_ops import profiled
from ..kernels.sort_slots import sort_slots


@profiled("hf_scatter::flatten_sort_count")
def flatten_sort_count(expert_idxs: torch.Tensor, num_experts: int, validate: bool = True
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the T*k (token, choice) slots by expert.

    Returns ``(sorted_expert_idxs, sorted_scattered_idxs, expert_offsets)``: the expert of each sorted slot,
    the flat slot index ``t*k + j`` it came from (stable within an expert), and the end offset of each
    expert's rows. ``validate`` checks expert ids are in range (one host sync; routers that produce ids
    with ``topk`` over ``num_experts`` logits may pass False). Small batches (decode) are sorted by one
    kernel that also makes the expert GEMMs' tile table (``kernels/sort_slots.py``).
    """
    if not isinstance(expert_idxs, torch.Tensor) or expert_idxs.dtype not in (torch.int32, torch.int64):
        got = expert_idxs.dtype if isinstance(expert_idxs, torch.Tensor) else type(expert_idxs).__name__
        raise ValueError(f"flatten_sort_count: expert_idxs must be an integer tensor [T, k], got {got}")
    if num_experts < 1:
        raise ValueError(f"flatten_sort_count: num_experts must be >= 1, got {num_experts}")
    flat = expert_idxs.reshape(-1)
    if validate and flat.numel() and not torch.compiler.is_compiling():
        lo, hi = flat.aminmax()
        lo, hi = int(lo), int(hi)
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"flatten_sort_count: expert ids must lie in [0, {num_experts}), got values in "
                             f"[{lo}, {hi}]; check num_experts against the router's output size")
    return sort_slots(flat, num_experts)


def skips_routes(expert_offsets: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the routing sorted into one bin more than ``weight`` has experts: that last bin holds routes to
    another rank's experts (expert parallelism's all-reduce dispatch), which the kernels skip and write as
    zeros. The library grouped GEMM knows no such bin, so our kernels run those products."""
    return expert_offsets.numel() > weight.shape[0]


def slot_positions(sorted_scattered_idxs: torch.Tensor) -> torch.Tensor:
    """The row of each slot ``t*k + j`` in expert order ([T*k], the inverse of the sort's permutation): how a
    per-token mix reads outputs that a GEMM wrote in expert order."""
    positions = torch.empty_like(sorted_scattered_idxs)
    return positions.index_copy_(0, sorted_scattered_idxs, torch.arange(
        sorted_scattered_idxs.numel(), device=sorted_scattered_idxs.device, dtype=sorted_scattered_idxs.dtype))


def slot_experts(sorted_expert_idxs: torch.Tensor, sorted_scattered_idxs: torch.Tensor) -> torch.Tensor:
    """The expert of each slot ``t*k + j`` ([T*k], slot order): the sort's expert ids put back in place."""
    return torch.empty_like(sorted_expert_idxs).index_copy_(0, sorted_scattered_idxs, sorted_expert_idxs)
