"""``sort_slots``: the routing bookkeeping of a small batch in one launch.

The T*k (token, choice) slots sorted by expert (stable), each expert's end offset, and the GEMMs' tile
table (``scatter2scatter.expert_tiles``). The torch form is a radix sort, a searchsorted, three casts and the
tile kernel: six launches, about as much host time per MoE layer at decode sizes as the expert GEMMs take on
the GPU. Here one program sorts the slots' keys (expert, slot) in registers (``tl.sort``), counts them per
expert (``tl.histogram``) and writes every output, for batches of up to ``MAX_SLOTS`` slots
(``fits_one_program``). Larger batches keep the torch sort. An earlier form of this kernel ranked slots by
prefix sums over [chunk, experts] one-hots: 36 us of a Qwen3-30B-A3B decode call's 333 on an H200, a tenth of
the call.
"""

from __future__ import annotations

import torch

from .backend import kernels_enabled, next_power_of_2, triton_interpreted, use_triton
from .custom_ops import mutating_op, run_op
from .scatter2scatter import expert_tiles_reference, num_tile_programs, remember_expert_tiles, tile_rows

MAX_SLOTS = 4096  # slots one program sorts (a decode step's or a short prompt's; larger batches: torch's sort)
MAX_EXPERTS = 512  # experts whose counts one program holds (histogram bins: the next power of two above E)
TILE_ELEMENTS = 32768  # (tile programs x bins) compared per step of the tile table's loop
# Whether Triton's interpreter runs this kernel too (its tests set it). Interpreted, tl.sort's network runs op by
# op in numpy: 0.25 s a call at 128 slots, 13 s at 4096 (the one-hot ranking it replaced: 0.02 and 0.6 s), which
# every interpreted MoE test would pay per layer; interpreted runs take torch's sort otherwise.
INTERPRET_KERNEL = False

if kernels_enabled():
    import triton
    import triton.language as tl

    from .scatter2scatter import store_expert_tiles

    @triton.jit
    def _sort_slots_kernel(ids_ptr, sorted_expert_ptr, sorted_slot_ptr, ends_ptr, tile_expert_ptr, tile_row_ptr,
                           S, E, NUM_PROGRAMS, BLOCK_S: tl.constexpr, BINS: tl.constexpr, BLOCK_P: tl.constexpr,
                           BLOCK_M: tl.constexpr):
        # Each slot's key expert * BLOCK_S + slot is unique, so one sort of the keys orders the slots by expert
        # and, within an expert, by slot (stable). Padding and out-of-range ids take expert E: they sort last
        # and are not stored.
        s = tl.arange(0, BLOCK_S)
        ids = tl.load(ids_ptr + s, mask=s < S, other=-1).to(tl.int32)
        ids = tl.where((s < S) & (ids >= 0) & (ids < E), ids, E)
        keys = tl.sort(ids * BLOCK_S + s)
        expert = keys // BLOCK_S
        stored = expert < E
        tl.store(sorted_slot_ptr + s, (keys % BLOCK_S).to(tl.int64), mask=stored)
        tl.store(sorted_expert_ptr + s, expert.to(sorted_expert_ptr.dtype.element_ty), mask=stored)
        e = tl.arange(0, BINS)  # experts, then bins nobody owns (bin E holds the padding)
        counts = tl.where(e < E, tl.histogram(ids, BINS), 0)
        ends = tl.cumsum(counts, 0)
        tl.store(ends_ptr + e, ends.to(tl.int64), mask=e < E)
        for p0 in range(0, NUM_PROGRAMS, BLOCK_P):
            store_expert_tiles(ends - counts, counts, e, E, p0 + tl.arange(0, BLOCK_P), NUM_PROGRAMS,
                               tile_expert_ptr, tile_row_ptr, BLOCK_M)


def fits_one_program(num_slots: int, num_experts: int) -> bool:
    """Whether one program sorts this batch: at most ``MAX_SLOTS`` slots and ``MAX_EXPERTS`` experts."""
    return num_slots <= MAX_SLOTS and num_experts <= MAX_EXPERTS


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
    bins = max(16, next_power_of_2(E + 1))
    _sort_slots_kernel[(1,)](flat, sorted_expert, sorted_slot, ends, tile_expert, tile_row, S, E, programs,
                             BLOCK_S=max(16, next_power_of_2(S)), BINS=bins,
                             BLOCK_P=max(1, min(64, next_power_of_2(programs), TILE_ELEMENTS // bins)),
                             BLOCK_M=block_m, num_warps=1 if triton_interpreted() else 8)


_sort_slots_op = mutating_op("sort_slots", "sorted_expert", "sorted_slot", "ends", "tile_expert",
                             "tile_row")(_sort_slots_impl)


def sort_slots(flat: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``flat`` [S] expert ids (in range) -> (sorted expert ids in ``flat``'s dtype, sorted slots, end offsets).

    One kernel where the batch fits one program on a Triton device; the tile table the expert GEMMs will ask
    for is made in the same launch and handed to them. Otherwise, under ``torch.compile`` and under Triton's
    interpreter (unless ``INTERPRET_KERNEL``), torch's sort.
    """
    S = flat.numel()
    if torch.compiler.is_compiling() or S == 0 or not fits_one_program(S, num_experts) \
            or not use_triton(flat, "sort_slots") or (triton_interpreted() and not INTERPRET_KERNEL):
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
