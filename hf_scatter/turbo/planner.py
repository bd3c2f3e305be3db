"""Sequence-length-aware memory planner (TurboTransformers, Algorithms 1-2).

Variable-length serving makes a caching allocator fragment: every new batch shape asks for new block
sizes. TurboTransformers instead plans all intermediates of a forward at once, per input length:

1. *Usage records* ``{first_op, last_op, size}`` of every intermediate, taken from the real computation:
   the forward runs once with a recording allocator under a ``TorchDispatchMode`` that sees every op
   (kernel calls included, through :class:`~hf_scatter.kernels.custom_ops.dispatch_ops`) and which planned
   buffers it touches. Nothing about lifetimes is written by hand. The recording runs on fake tensors
   (shapes, dtypes and devices without memory or arithmetic), so planning never needs the memory that
   planning is there to save.
2. *Greedy by size, best fit* (Algorithm 2): records sorted by size, largest first; each goes to the
   smallest gap, among the tensors of a chunk whose lifetimes overlap its own, that holds it; when no
   chunk has one, a new chunk of ``max(2 MB, 1.2 x size)``.
3. Chunks are shared by every cached plan (one forward runs at a time) and kept as long as some plan uses
   them; chunks no plan uses are released.

Intermediates are then views into the chunks (:class:`PlannedAllocator`). A plan is keyed by the batch's
length bucket and serves any batch of that bucket (smaller tensors use the start of their slot).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..common.units import align_up
from ..kernels.custom_ops import dispatch_ops

MiB = 1 << 20
ALIGN = 512  # bytes, as torch's allocator aligns blocks (keeps every planned view 16-byte aligned for kernels)


@dataclass(frozen=True)
class UsageRecord:
    """One intermediate of one forward: allocated ``index``-th, touched by ops ``first_op..last_op``."""

    index: int
    name: str
    first_op: int
    last_op: int
    size: int  # bytes, rounded up to ALIGN
    nbytes: int = 0  # bytes the buffer asked for

    def scaled(self, factor: float) -> "UsageRecord":
        """The same buffer in a forward over ``factor`` times the tokens (every shape is linear in them)."""
        nbytes = int(round(self.nbytes * factor))
        return UsageRecord(self.index, self.name, self.first_op, self.last_op, _aligned(nbytes), nbytes)

    def overlaps(self, other: "UsageRecord") -> bool:
        return self.first_op <= other.last_op and other.first_op <= self.last_op


@dataclass(frozen=True)
class Placement:
    chunk: int
    offset: int


def _aligned(nbytes: int) -> int:
    return max(ALIGN, align_up(nbytes, ALIGN))


# ------------------------------------------------------------------------------------ usage records
def _storage_key(t: torch.Tensor):
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # tensor subclasses without storage
        return None


class _Recorder(TorchDispatchMode):
    """Counts ops and notes, for each recorded buffer, the first and last op that reads or writes it."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.by_storage: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                index = self.by_storage.get(_storage_key(t))
                if index is not None:
                    self.first.setdefault(index, self.ops)
                    self.last[index] = self.ops
        self.ops += 1
        return out


def record_usage(forward: Callable, keep_alive: Callable[[object], list] = lambda result: [],
                 fake: bool = True) -> tuple[list[UsageRecord], object]:
    """Run ``forward(alloc)`` once, recording every buffer it takes from ``alloc`` and the ops that touch it.

    Buffers in ``keep_alive(result)`` (the outputs) live to the end. ``fake``: on fake tensors (real inputs
    and weights are read as fakes; nothing is computed or allocated). Returns ``(records, result)``; with
    ``fake`` the result is made of fake tensors.
    """
    recorder = _Recorder()
    names: list[str] = []
    sizes: list[int] = []  # bytes asked for
    buffers: list[torch.Tensor] = []  # keeps storages alive so their keys stay unique

    def alloc(name, shape, dtype, device):
        t = torch.zeros(shape, dtype=dtype, device=device)  # (real runs: rows nobody writes stay finite)
        recorder.by_storage[_storage_key(t)] = len(names)
        names.append(name)
        sizes.append(t.numel() * t.element_size())
        buffers.append(t)
        return t

    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext(), dispatch_ops(), recorder:
        result = forward(alloc)
    end = recorder.ops
    for t in keep_alive(result):
        index = recorder.by_storage.get(_storage_key(t))
        if index is not None:
            recorder.last[index] = end
            recorder.first.setdefault(index, end)
    records = []
    for i, (name, size) in enumerate(zip(names, sizes)):
        if i not in recorder.first:
            raise RuntimeError(f"memory planner: buffer {i} ({name!r}) was allocated but no op touched it")
        records.append(UsageRecord(i, name, recorder.first[i], recorder.last[i], _aligned(size), size))
    return records, result


# ------------------------------------------------------------------------------------------ planning
def plan_records(records: list[UsageRecord], chunks: dict[int, int], chunk_bytes: int = 2 * MiB,
                 growth: float = 1.2) -> tuple[dict[int, Placement], dict[int, int]]:
    """Algorithm 2: place every record; returns ``(placements by record index, chunk sizes incl. new ones)``.

    ``chunks``: existing chunk id -> bytes, tried first in id order (so chunks persist across plans).
    """
    chunks = dict(chunks)
    placed: dict[int, list[tuple[int, UsageRecord]]] = {cid: [] for cid in chunks}  # chunk -> (offset, record)
    placements: dict[int, Placement] = {}
    for rec in sorted(records, key=lambda r: (-r.size, r.index)):
        for cid in sorted(chunks):
            offset = _best_fit(rec, placed[cid], chunks[cid])
            if offset is not None:
                break
        else:
            cid = max(chunks, default=-1) + 1
            chunks[cid] = _aligned(max(chunk_bytes, int(growth * rec.size)))
            placed[cid] = []
            offset = 0
        placed[cid].append((offset, rec))
        placements[rec.index] = Placement(cid, offset)
    return placements, chunks


def _best_fit(rec: UsageRecord, in_chunk: list[tuple[int, UsageRecord]], chunk_size: int) -> int | None:
    """Offset of the smallest gap that holds ``rec`` between the chunk's lifetime-overlapping tensors."""
    best, best_gap, prev_end = None, None, 0
    for offset, other in sorted(in_chunk, key=lambda p: p[0]):
        if not rec.overlaps(other):
            continue
        gap = offset - prev_end
        if gap >= rec.size and (best_gap is None or gap < best_gap):
            best, best_gap = prev_end, gap
        prev_end = max(prev_end, offset + other.size)
    tail = chunk_size - prev_end
    if tail >= rec.size and (best_gap is None or tail < best_gap):
        best = prev_end
    return best


# ------------------------------------------------------------------------------------ plans in use
@dataclass
class Plan:
    records: list[UsageRecord]
    placements: dict[int, Placement]
    planning_ms: float

    @property
    def naive_bytes(self) -> int:
        """What the same buffers take without reuse."""
        return sum(r.size for r in self.records)

    def used_bytes(self) -> int:
        """Bytes spanned by this plan's placements (per chunk, the end of its last tensor)."""
        ends: dict[int, int] = {}
        for rec in self.records:
            p = self.placements[rec.index]
            ends[p.chunk] = max(ends.get(p.chunk, 0), p.offset + rec.size)
        return sum(ends.values())

    def chunk_ids(self) -> set[int]:
        return {p.chunk for p in self.placements.values()}


class PlannedAllocator:
    """Hands out the plan's slots in allocation order, as views of the planner's chunks."""

    def __init__(self, plan: Plan, chunks: dict[int, torch.Tensor]):
        self.plan = plan
        self.chunks = chunks
        self.next = 0

    def reset(self) -> "PlannedAllocator":
        self.next = 0
        return self

    def __call__(self, name, shape, dtype, device) -> torch.Tensor:
        records = self.plan.records
        if self.next >= len(records) or records[self.next].name != name:
            expected = records[self.next].name if self.next < len(records) else "no more buffers"
            raise RuntimeError(f"memory planner: buffer {self.next} is {name!r} but the plan expects {expected!r}; "
                               "the computation changed since it was planned (clear the planner)")
        rec = records[self.next]
        numel = 1
        for n in shape:
            numel *= n
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if nbytes > rec.size:
            raise RuntimeError(f"memory planner: {name!r} needs {nbytes} bytes but its slot holds {rec.size}; "
                               "the batch is larger than the plan's bucket")
        p = self.plan.placements[rec.index]
        self.next += 1
        return self.chunks[p.chunk][p.offset:p.offset + nbytes].view(dtype).view(shape)


class MemoryPlanner:
    """Plans per key (a length bucket) over one shared pool of chunks on ``device``.

    ``plan(key, forward)`` records ``forward`` (see :func:`record_usage`) the first time a key is seen and
    returns an allocator over the pool; at most ``max_plans`` plans are kept (least recently used first
    out), and chunks no kept plan uses are released.
    """

    def __init__(self, device: torch.device | str, chunk_bytes: int = 2 * MiB, growth: float = 1.2,
                 max_plans: int = 64):
        if chunk_bytes <= 0 or growth < 1.0 or max_plans < 1:
            raise ValueError("MemoryPlanner: chunk_bytes must be > 0, growth >= 1 and max_plans >= 1")
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes
        self.growth = growth
        self.max_plans = max_plans
        self.chunks: dict[int, torch.Tensor] = {}
        self.plans: OrderedDict = OrderedDict()
        self.planning_ms_total = 0.0

    @property
    def footprint_bytes(self) -> int:
        """Bytes the planner holds on its device (all chunks)."""
        return sum(c.numel() for c in self.chunks.values())

    def cached(self, key) -> Plan | None:
        plan = self.plans.get(key)
        if plan is not None:
            self.plans.move_to_end(key)
        return plan

    def plan(self, key, forward: Callable | None = None, keep_alive: Callable = lambda result: []) -> PlannedAllocator:
        """An allocator for ``key``, planned from a (fake) recording of ``forward`` the first time."""
        if self.cached(key) is None:
            start = time.perf_counter()
            records, _ = record_usage(forward, keep_alive)
            return self.plan_records(key, records, start)
        return PlannedAllocator(self.plans[key], self.chunks)

    def plan_records(self, key, records: list[UsageRecord], start: float | None = None) -> PlannedAllocator:
        """An allocator for ``key`` from usage records recorded elsewhere (e.g. scaled from another size)."""
        plan = self.cached(key)
        if plan is None:
            start = time.perf_counter() if start is None else start
            placements, sizes = plan_records(records, {cid: c.numel() for cid, c in self.chunks.items()},
                                             self.chunk_bytes, self.growth)
            for cid, size in sizes.items():
                if cid not in self.chunks:
                    # zeroed once: rows a bucket pads with then only ever hold finite values
                    self.chunks[cid] = torch.zeros(size, dtype=torch.uint8, device=self.device)
            plan = Plan(records, placements, (time.perf_counter() - start) * 1e3)
            self.planning_ms_total += plan.planning_ms
            self.plans[key] = plan
            while len(self.plans) > self.max_plans:
                self.plans.popitem(last=False)
            self._release_unused()
        return PlannedAllocator(plan, self.chunks)

    def _release_unused(self) -> None:
        used = set().union(*(p.chunk_ids() for p in self.plans.values())) if self.plans else set()
        for cid in [c for c in self.chunks if c not in used]:
            del self.chunks[cid]

    def clear(self) -> None:
        self.plans.clear()
        self.chunks.clear()

    def stats(self) -> dict:
        return {"plans": len(self.plans), "chunks": len(self.chunks), "footprint_bytes": self.footprint_bytes,
                "planning_ms_total": round(self.planning_ms_total, 3),
                "naive_bytes_largest_plan": max((p.naive_bytes for p in self.plans.values()), default=0)}
