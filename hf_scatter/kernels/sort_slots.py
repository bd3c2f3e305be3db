"""``sort_slots``: the routing bookkeeping of a small batch in one launch.

The T*k (token, choice) slots sorted by expert (stable), each expert's end offset, and the GEMMs' tile
table (``scatter2scatter.expert_tiles``). The torch form is a radix sort, a searchsorted, three casts and the
tile kernel: six launches, about as much host time per MoE layer at decode sizes as the expert GEMMs take on
the GPU. Here one program counts slots per expert, then ranks each slot within its expert by a prefix sum over
a [chunk of slots, experts] one-hot, and writes every output: a counting sort, for batches of up to
``MAX_SLOTS`` slots (``fits_one_program``). Larger batches keep the torch sort.
"""

from __future__ import annotations

import torch

from .backend import kernels_enabled, next_power_of_2, triton_interpreted, use_triton
from .custom_ops import mutating_op, run_op
from .scatter2scatter import expert_tiles_reference, num_tile_programs, remember_expert_tiles, tile_rows

MAX_SLOTS = 4096  # slots one program sorts (a decode step's or a short prompt's; larger batches: torch's sort)
CHUNK_ELEMENTS = 8192  # one-hot elements (slots x experts) per step of the program's loop

if kernels_enabled():
    import triton
    import triton.language as tl

    from .scatter2scatter import store_expert_tiles

    @triton.jit
    def _sort_slots_kernel(ids_ptr, sorted_expert_ptr, sorted_slot_ptr, ends_ptr, tile_expert_ptr, tile_row_ptr,
                           S, E, NUM_PROGRAMS, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr,
                           BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr):
        # Slots go through in chunks of BLOCK_C: a prefix sum over a [chunk, experts] one-hot is staged in
        # shared memory, and the whole batch's would not fit there.
        e = tl.arange(0, BLOCK_E)
        counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
        for c0 in range(0, S, BLOCK_C):
            s = c0 + tl.arange(0, BLOCK_C)
            ids = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
            counts += tl.sum(((ids[:, None] == e[None, :]) & (s < S)[:, None]).to(tl.int32), 0)
        ends = tl.cumsum(counts, 0)
        starts = ends - counts
        tl.store(ends_ptr + e, ends.to(tl.int64), mask=e < E)
        placed = starts  # next free sorted row of each expert
        for c0 in range(0, S, BLOCK_C):
            s = c0 + tl.arange(0, BLOCK_C)
            ids = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
            valid = (s < S) & (ids >= 0) & (ids < E)
            one_hot = ((ids[:, None] == e[None, :]) & valid[:, None]).to(tl.int32)  # [C, E]
            # after the expert's earlier slots: stable, like the torch path's sort
            pos = tl.sum(one_hot * (placed[None, :] + tl.cumsum(one_hot, 0) - 1), 1)
            tl.store(sorted_slot_ptr + pos, s.to(tl.int64), mask=valid)
            tl.store(sorted_expert_ptr + pos, ids.to(sorted_expert_ptr.dtype.element_ty), mask=valid)
            placed += tl.sum(one_hot, 0)
        for p0 in range(0, NUM_PROGRAMS, BLOCK_P):
            store_expert_tiles(starts, counts, e, E, p0 + tl.arange(0, BLOCK_P), NUM_PROGRAMS, tile_expert_ptr,
                               tile_row_ptr, BLOCK_M)


def fits_one_program(num_slots: int, num_experts: int) -> bool:
    """Whether one program sorts this batch: at most ``MAX_SLOTS`` slots, and few enough experts that a one-hot
    chunk of ``CHUNK_ELEMENTS`` still covers 16 slots."""
    return num_slots <= MAX_SLOTS and num_experts <= CHUNK_ELEMENTS // 16


def sort_slots_reference(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted expert ids, the slot each sorted row came from, end offset per expert) by torch's sort."""
    # Sort the ids in the narrowest integer type that holds them: a stable radix sort makes one pass per key
    # byte, so 8-bit ids take one pass instead of eight (and far fewer launches, for the host as well).
    narrow = torch.uint8 if num_experts <= 256 else torch.int16 if num_experts <= 32767 else flat.dtype
    sorted_narrow, sorted_scattered_idxs = torch.sort(flat.to(narrow), stable=True)
    sorted_expert_idxs = sorted_narrow.to(flat.dtype)
    # End offset of expert e = number of slots with id <= e; a static [E] shape keeps torch.compile graphs whole.
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_expert_idxs.dtype)
    expert_offsets = torch.searchsorted(sorted_expert_idxs, experts, right=True)
    return sorted_expert_idxs, sorted_scattered_idxs, expert_offsets


def _sort_slots_impl(flat: torch.Tensor, sorted_expert: torch.Tensor, sorted_slot: torch.Tensor, ends: torch.Tensor,
                     tile_expert: torch.Tensor, tile_row: torch.Tensor, block_m: int) -> None:
    S, E, programs = flat.numel(), ends.numel(), tile_expert.numel()
    if not use_triton(flat, "sort_slots"):
        for out, value in zip((sorted_expert, sorted_slot, ends), sort_slots_reference(flat, E)):
            out.copy_(value)
        for out, value in zip((tile_expert, tile_row), expert_tiles_reference(ends, block_m, S)):
            out.copy_(value)
        return
    block_e = max(16, next_power_of_2(E))
    block_c = min(next_power_of_2(max(1, S)), CHUNK_ELEMENTS // block_e)
    _sort_slots_kernel[(1,)](flat, sorted_expert, sorted_slot, ends, tile_expert, tile_row, S, E, programs,
                             BLOCK_C=block_c, BLOCK_E=block_e, BLOCK_P=min(64, next_power_of_2(programs)),
                             BLOCK_M=block_m, num_warps=1 if triton_interpreted() else 8)


_sort_slots_op = mutating_op("sort_slots", "sorted_expert", "sorted_slot", "ends", "tile_expert",
                             "tile_row")(_sort_slots_impl)


def sort_slots(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flat`` [S] expert ids (in range) -> (sorted expert ids in ``flat``'s dtype, sorted slots, end offsets).

    One kernel where the batch fits one program on a Triton device; the tile table the expert GEMMs will ask
    for is made in the same launch and handed to them. Otherwise, and under ``torch.compile``, torch's sort.
    """
    S = flat.numel()
    if torch.compiler.is_compiling() or S == 0 or not fits_one_program(S, num_experts) \
            or not use_triton(flat, "sort_slots"):
        return sort_slots_reference(flat, num_experts)
    block_m = tile_rows(S, num_experts)
    sorted_expert = torch.empty_like(flat)
    sorted_slot = flat.new_empty(S, dtype=torch.int64)
    ends = flat.new_empty(num_experts, dtype=torch.int64)
    tile_expert = flat.new_empty(num_tile_programs(S, num_experts, block_m), dtype=torch.int32)
    tile_row = torch.empty_like(tile_expert)
    run_op(_sort_slots_op, _sort_slots_impl, flat, sorted_expert, sorted_slot, ends, tile_expert, tile_row, block_m)
    remember_expert_tiles(ends, block_m, S, (tile_expert, tile_row))
    return sorted_expert, sorted_slot, ends
