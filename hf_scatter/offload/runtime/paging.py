"""Paged weights: a resident GPU part, a pinned CPU part, a GPU double buffer, pages and their page table.

*Stages.* CGOPipe runs the GPU's post-attention of layer l-1 and pre-attention of layer l back to back for
each micro-batch, so the unit of weight transfer is a **stage**: stage s holds layer s-1's post-attention
weights (output projection, norm, router, experts) and layer s's pre-attention weights (norm, QKV); stage
0 and stage L are half stages. While the GPU runs stage s from one slot of the double buffer, stage s+1
streams into the other in **pages** (equal byte ranges: at least one per micro-batch, as MoE-Lightning
pages them, and at most 64 MiB each). A pager thread keeps at most two pages queued on the weight stream,
and issues no further page while a hidden-state upload (or a routed experts' fetch) is pending: the copy
engine does not share itself fairly between streams, and a waiting upload would otherwise wait behind every
page of the stage.

*Residency.* The same fraction x of every layer stays on the GPU (the HRM's ``weights_gpu_fraction``):
dense tensors first (QKV, then output projection, norm, router), then the first r intermediate columns of
every expert (``offload/families/adapter.py``: a column range of all experts is itself a set of smaller
experts; r a multiple of 32 where MXFP4 groups the columns under one scale); the rest of the layer is
streamed, in the format the experts hold (MXFP4 bytes as shipped stream as they are).

*Page table.* Each stage's streamed tensors have fixed byte offsets (:class:`PageTable`), identical in the
pinned CPU buffer and in either GPU slot. A page is copied byte for byte, and once the stage's last page
has landed the expert kernels read their ``[E, d_in, d_out]`` weights as strided views of the slot at
those offsets: no gather, no reshuffle, no per-page index for the kernel to follow.

*Routed streaming.* A decode micro-batch of a few rows touches only some of a layer's experts (top-8 of 128:
8 experts for one row, about 82 for sixteen). In routed mode (:meth:`WeightStreamer.set_routed`) a stage's
pages skip the streamed expert columns; once the router has chosen, :meth:`WeightStreamer.fetch_experts`
copies the streamed columns of just the chosen experts into the slot at their page-table offsets, each
expert once per stage, and the compute stream waits for them. The experts no row chose keep whatever the
slot held before and are never read (the expert kernels only visit experts with rows).

*Pinned memory.* All streamed weights live in one CPU allocation, page-locked in place with
``cudaHostRegister`` (``pin_memory=True`` would round a 40 GB request up to 64 GB); the copies are then
true DMA at the link's pinned rate.
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from ...common.units import align_up
from ..families.adapter import PipelineAdapter
from ..families.rows import copy_weight
from .streams import DONE, Streams

ALIGN = 256  # bytes: every tensor starts on a 256-byte boundary (vectorised kernel loads)
COLUMN_ALIGN = 16  # resident expert columns come in multiples of this (16-byte aligned rows in bf16)
STREAMED = "streamed."  # page-table names of the streamed expert columns, [E, ...] each
SLOTS = 2  # GPU slots streamed stages take turns in: one computes while the next arrives


@dataclass(frozen=True)
class Entry:
    """One tensor of a page table: where it starts in the stage's bytes, its shape and dtype."""

    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class PageTable:
    """Byte layout of a set of tensors; :meth:`views` gives them from any buffer with this layout."""

    entries: dict[str, Entry] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, name: str, shape, dtype: torch.dtype) -> Entry:
        entry = Entry(self.nbytes, tuple(int(s) for s in shape), dtype)
        self.entries[name] = entry
        self.nbytes = align_up(self.nbytes + entry.nbytes, ALIGN)
        return entry

    def views(self, buffer: torch.Tensor, base: int = 0) -> dict[str, torch.Tensor]:
        return {name: buffer[base + e.offset:base + e.offset + e.nbytes].view(e.dtype).view(e.shape)
                for name, e in self.entries.items()}

    def pages(self, count: int, skip: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """``count`` near-equal byte ranges covering the table (fewer if it is small), less the byte range
        ``skip`` (a page straddling it is cut in two)."""
        if self.nbytes == 0:
            return []
        count = max(1, min(count, self.nbytes // ALIGN))
        bounds = [align_up(self.nbytes * i // count, ALIGN) for i in range(count)] + [self.nbytes]
        pages = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        if skip is None:
            return pages
        lo, hi = skip
        return [(x, y) for a, b in pages for x, y in ((a, min(b, lo)), (max(a, hi), b)) if y > x]

    def span(self, prefix: str) -> tuple[int, int] | None:
        """The byte range of the entries whose names start with ``prefix`` (None: there are none); they must
        have been added one after another."""
        names = [n for n in self.entries if n.startswith(prefix)]
        if not names:
            return None
        order = list(self.entries)
        first = order.index(names[0])
        if order[first:first + len(names)] != names:
            raise ValueError(f"page table: the {prefix!r} entries are not contiguous")
        last = self.entries[names[-1]]
        return self.entries[names[0]].offset, last.offset + last.nbytes


@dataclass(frozen=True)
class LayerSplit:
    """What of one layer stays on the GPU: the named dense tensors, and expert columns [0, columns)."""

    resident_dense: frozenset
    columns: int
    resident_bytes: int
    layer_bytes: int

    @property
    def fraction(self) -> float:
        return self.resident_bytes / self.layer_bytes if self.layer_bytes else 1.0


def split_layer(dense: dict[str, int], column_bytes: float, columns: int, fraction: float,
                align: int = COLUMN_ALIGN) -> LayerSplit:
    """Keep ``fraction`` of the layer's bytes on the GPU, never more: the longest prefix of ``dense``
    (name -> bytes, in priority order) that fits, then as many expert columns as fit, a multiple of ``align``
    (``column_bytes``: the bytes of one intermediate column of every expert; fractional for packed formats)."""
    total = sum(dense.values()) + round(column_bytes * columns)
    budget = fraction * total
    resident, used = [], 0
    for name, n in dense.items():
        if used + n > budget:
            break
        resident.append(name)
        used += n
    r = min(columns, int((budget - used) // column_bytes)) if column_bytes else columns
    if r < columns:
        r -= r % align
    return LayerSplit(frozenset(resident), r, used + round(r * column_bytes), total)


class HostBuffer:
    """One CPU byte buffer, page-locked in place when ``pin`` (unregistered again when it is dropped)."""

    def __init__(self, nbytes: int, pin: bool):
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        self.pinned = False
        self._pin = pin

    def pin(self) -> None:
        if not self._pin or self.pinned:
            return
        cudart = torch.cuda.cudart()
        ptr, size = self.tensor.data_ptr(), self.tensor.numel()
        try:
            torch.cuda.check_error(cudart.cudaHostRegister(ptr, size, 0))
        except RuntimeError as e:  # e.g. a locked-memory limit: correct, but copies at pageable speed
            warnings.warn(f"hf_scatter.offload: could not page-lock {size / 2**30:.1f} GiB of streamed weights ({e}); "
                          "weight copies will run at pageable speed (raise `ulimit -l` or free host memory)",
                          RuntimeWarning, stacklevel=2)
            return
        self.pinned = True
        weakref.finalize(self, _unregister, ptr)


def _unregister(ptr: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown: the process is going away anyway
        pass


@dataclass
class StageWeights:
    """What the GPU reads in one stage: layer s-1's post-attention weights and expert parts, layer s's
    pre-attention weights (None at the ends)."""

    post: dict | None
    experts: list[dict]
    pre: dict | None


class Layout:
    """Where every weight goes for a resident ``fraction``: a resident table per layer, a streamed table per
    stage and their offsets. Computed from shapes alone, so budgets can be checked before anything moves."""

    def __init__(self, adapter: PipelineAdapter, fraction: float):
        self.adapter = adapter
        self.requested_fraction = fraction
        layers = adapter.layers()
        self.num_layers = L = len(layers)
        self.splits = [self._split(layer, fraction) for layer in layers]
        self.resident_tables = [PageTable() for _ in range(L)]
        self.stage_tables = [PageTable() for _ in range(L + 1)]
        for s in range(L + 1):
            if s >= 1:
                self._lay_out_post(s - 1, layers[s - 1])
            if s < L:
                self._lay_out_pre(s, layers[s])
        self.stage_offsets, offset = [], 0
        for table in self.stage_tables:
            self.stage_offsets.append(offset)
            offset = align_up(offset + table.nbytes, 4096)
        self.host_bytes = offset
        self.resident_offsets, offset = [], 0
        for table in self.resident_tables:
            self.resident_offsets.append(offset)
            offset = align_up(offset + table.nbytes, ALIGN)
        self.resident_bytes = offset
        self.slot_bytes = max((t.nbytes for t in self.stage_tables), default=0)

    @property
    def fraction(self) -> float:
        """Resident share of the layers' bytes, as realised (at most the fraction asked for)."""
        total = sum(s.layer_bytes for s in self.splits)
        return sum(s.resident_bytes for s in self.splits) / total if total else 1.0

    @property
    def layer_bytes(self) -> int:
        return sum(s.layer_bytes for s in self.splits)

    @property
    def device_bytes(self) -> int:
        """Resident weights plus the two slots of the double buffer."""
        return self.resident_bytes + 2 * self.slot_bytes

    def _split(self, layer, fraction: float) -> LayerSplit:
        f = self.adapter
        dense = {f"pre.{k}": _nbytes(v) for k, v in f.shard_pre_tensors(layer).items()}
        dense.update({f"post.{k}": _nbytes(v) for k, v in f.shard_post_tensors(layer).items()})
        columns = f.dims.intermediate
        experts = f.shard_expert_tensors(layer)
        column_bytes = sum(_nbytes(t) for t in experts.values()) / columns
        align = math.lcm(COLUMN_ALIGN, *(f.column_unit(name) for name in experts))
        return split_layer(dense, column_bytes, columns, fraction, align)

    def _lay_out_pre(self, l: int, layer) -> None:
        for name, t in self.adapter.shard_pre_tensors(layer).items():
            self._place(l, l, f"pre.{name}", t.shape, t.dtype)

    def _lay_out_post(self, l: int, layer) -> None:
        for name, t in self.adapter.shard_post_tensors(layer).items():
            self._place(l, l + 1, f"post.{name}", t.shape, t.dtype)
        for key, part, resident in self.expert_parts(l, layer):
            (self.resident_tables[l] if resident else self.stage_tables[l + 1]).add(key, part.shape, part.dtype)

    def expert_parts(self, l: int, layer):
        """Layer ``l``'s expert tensors as kept: (table name, the column range as a view of the tensor, resident?),
        its first ``splits[l].columns`` intermediate columns resident and the rest streamed."""
        f = self.adapter
        r, columns = self.splits[l].columns, f.dims.intermediate
        for name, t in f.shard_expert_tensors(layer).items():
            dim, unit = f.column_dims[name], f.column_unit(name)
            if r > 0:
                yield f"resident.{name}", t.narrow(dim, 0, r // unit), True
            if r < columns:
                yield f"{STREAMED}{name}", t.narrow(dim, r // unit, (columns - r) // unit), False

    def _place(self, l: int, stage: int, name: str, shape, dtype) -> None:
        if name in self.splits[l].resident_dense:
            self.resident_tables[l].add(name, shape, dtype)
        else:
            self.stage_tables[stage].add(name, shape, dtype)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WeightStore:
    """Every decoder layer's weights placed as ``layout`` says: the resident part in one buffer on
    ``device``, the streamed part in one pinned CPU buffer laid out stage by stage, and the two GPU slots
    the stages stream into. ``release``: free each layer from the model once it is packed."""

    def __init__(self, layout: Layout, device: torch.device, release: bool = False, progress: bool = False):
        from tqdm import tqdm

        self.layout = layout
        self.device = torch.device(device)
        adapter = layout.adapter
        layers = adapter.layers()
        L = self.num_layers = layout.num_layers
        self.stage_tables, self.stage_offsets = layout.stage_tables, layout.stage_offsets
        self.host = HostBuffer(layout.host_bytes, pin=self.device.type == "cuda")
        self.resident_buffer = torch.empty(max(layout.resident_bytes, 1), dtype=torch.uint8, device=self.device)
        self.resident = [t.views(self.resident_buffer, o)
                         for t, o in zip(layout.resident_tables, layout.resident_offsets)]
        self.stage_host = [t.views(self.host.tensor, o) for t, o in zip(self.stage_tables, self.stage_offsets)]
        # fill stage by stage; a layer is released once both of its stages are packed
        for s in tqdm(range(L + 1), desc="packing weights", disable=not progress, leave=False):
            if s >= 1:
                self._fill(s - 1, layers[s - 1], "post", s)
                if release:
                    layers[s - 1].to("meta")
            if s < L:
                self._fill(s, layers[s], "pre", s)
        self.host.pin()
        self.slot_bytes = layout.slot_bytes
        self.slots = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(SLOTS)] \
            if self.slot_bytes else []
        # stages with weights to stream; no more of them than slots: each stays in its slot and none reloads
        self.streamed_stages = {s for s, t in enumerate(self.stage_tables) if t.nbytes}
        self._views: dict[tuple[int, int], StageWeights] = {}
        # each stage's streamed expert columns: their byte range, and per slot (slot view, host view) pairs
        self.expert_spans = [t.span(STREAMED) for t in self.stage_tables]
        self._expert_views: dict[tuple[int, int], list] = {}

    def _fill(self, l: int, layer, part: str, stage: int) -> None:
        f = self.layout.adapter
        tensors = f.shard_pre_tensors(layer) if part == "pre" else f.shard_post_tensors(layer)
        for name, t in tensors.items():
            key = f"{part}.{name}"
            dst = self.resident[l].get(key)
            copy_weight(dst if dst is not None else self.stage_host[stage][key], t)
        if part == "post":
            for key, columns, resident in self.layout.expert_parts(l, layer):
                (self.resident[l] if resident else self.stage_host[stage])[key].copy_(columns)

    # ----- what a stage reads -----
    def stage_weights(self, stage: int, slot: int | None) -> StageWeights:
        """Resident tensors, and the streamed ones as views of GPU slot ``slot`` (None: nothing streamed)."""
        key = (stage, -1 if slot is None else slot)
        if key not in self._views:
            streamed = self.stage_tables[stage].views(self.slots[slot]) if slot is not None else {}
            self._views[key] = self._assemble(stage, streamed)
        return self._views[key]

    def copy_experts(self, stage: int, slot: int, experts: list[int]) -> None:
        """Copy the streamed columns of ``experts`` of ``stage`` from pinned memory into GPU slot ``slot``
        (on the current stream; one copy per expert and tensor, each a contiguous block)."""
        key = (stage, slot)
        if key not in self._expert_views:
            slot_views = self.stage_tables[stage].views(self.slots[slot])
            self._expert_views[key] = [(slot_views[name], self.stage_host[stage][name])
                                       for name in slot_views if name.startswith(STREAMED)]
        for dst, src in self._expert_views[key]:
            for e in experts:
                dst[e].copy_(src[e], non_blocking=True)

    def _assemble(self, stage: int, streamed: dict) -> StageWeights:
        def named(source: dict, prefix: str) -> dict:
            return {k[len(prefix):]: v for k, v in source.items() if k.startswith(prefix)}

        post = pre = None
        experts = []
        if stage >= 1:
            resident = self.resident[stage - 1]
            post = {**named(resident, "post."), **named(streamed, "post.")}
            experts = [p for p in (named(resident, "resident."), named(streamed, STREAMED)) if p]
        if stage < self.num_layers:
            pre = {**named(self.resident[stage], "pre."), **named(streamed, "pre.")}
        return StageWeights(post, experts, pre)


PAGE_BYTES = 64 * 2**20  # a page is at most this large ...
PAGES_IN_FLIGHT = 2  # ... and at most this many are queued on the weight stream at any time


class _Load:
    """One stage on its way into a slot: ``issued`` is set once its last page has been issued, ``ready`` is
    then the event marking that page's arrival."""

    def __init__(self, stage: int, present: set | None = None):
        self.stage = stage
        self.issued = threading.Event()
        self.ready = DONE
        self.error: BaseException | None = None
        self.present = present  # routed mode: the experts whose streamed columns are in the slot (None: all)


class Pager:
    """Issues weight pages on the ``weights`` stream, pacing them so that at most PAGES_IN_FLIGHT are queued, and
    making way for the small transfers the pipeline waits for (:meth:`make_way`): the copy engine does not
    share itself fairly between streams, so while pages stay queued a hidden-state upload on another stream
    can wait for every page of the stage (120 ms, an H200 streaming GPT-OSS-120B's bf16 layers, the GPU idle
    meanwhile). On CUDA a thread of its own does the pacing (the driver thread blocks on CPU attention for long
    stretches); on the CPU the copies run at once."""

    def __init__(self, store: "WeightStore", streams: Streams):
        self.store, self.streams = store, streams
        self.tracer = None
        self._jobs: queue.Queue = queue.Queue()
        self._urgent: list = []  # events of transfers issued elsewhere that the next page must wait for
        self._urgent_lock = threading.Lock()
        self._thread = None
        if streams.cuda:
            self._thread = threading.Thread(target=self._loop, name="hf-scatter-pager", daemon=True)
            self._thread.start()

    def load(self, slot: int, stage: int, pages: list[tuple[int, int]], after, present: set | None = None) -> _Load:
        """Copy ``pages`` of ``stage`` into ``slot`` once ``after`` (an event: the slot's last reader) has passed;
        ``present``: the experts the pages hold (None: every expert)."""
        job = _Load(stage, present)
        if self._thread is None:
            self._copy(slot, job, pages, after)
        else:
            self._jobs.put((slot, job, pages, after))
        return job

    def make_way(self, event) -> None:
        """A transfer something waits for (a hidden state, routed experts) was issued on another stream, ending
        at ``event``: no page is issued after this until it has completed. It waits for nothing else on the
        device when issued, so the link pauses for the transfer itself, at most a page later."""
        if self._thread is not None and event is not DONE:
            with self._urgent_lock:  # landed ones dropped: with nothing streaming no page would collect them
                self._urgent = [e for e in self._urgent if not e.query()] + [event]

    def _let_urgent_through(self) -> None:
        with self._urgent_lock:
            urgent, self._urgent = self._urgent, []
        for event in urgent:
            event.synchronize()

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    def _loop(self) -> None:
        torch.cuda.set_device(self.streams.device)
        while True:
            item = self._jobs.get()
            if item is None:
                return
            slot, job, pages, after = item
            try:
                self._copy(slot, job, pages, after)
            except BaseException as e:  # surfaces in the driver thread at enter()
                job.error = e
                job.issued.set()

    def _copy(self, slot: int, job: _Load, pages: list[tuple[int, int]], after) -> None:
        streams, tracer = self.streams, self.tracer
        src = self.store.host.tensor
        base = self.store.stage_offsets[job.stage]
        dst = self.store.slots[slot]
        in_flight: list = []
        streams.wait("weights", after)
        with streams.on("weights"):
            for a, b in pages:
                if len(in_flight) >= PAGES_IN_FLIGHT:
                    in_flight.pop(0).synchronize()
                self._let_urgent_through()
                with tracer.device_span("weights", f"stage {job.stage} bytes {a}-{b}"):
                    dst[a:b].copy_(src[base + a:base + b], non_blocking=True)
                in_flight.append(streams.record("weights"))
        job.ready = in_flight[-1] if in_flight else DONE
        job.issued.set()


class WeightStreamer:
    """Runs the stages in order through the double buffer: :meth:`enter` a stage (the compute stream waits
    for its weights, and the next stage starts streaming into the other slot), :meth:`leave` it (the slot
    is free once the compute stream has passed this point). Stage s+1 always follows stage s, wrapping from
    the last stage to the first, so the prefill's and every decode step's stages run through one sequence.
    In routed mode (:meth:`set_routed`) stages load without their streamed expert columns, and
    :meth:`fetch_experts` brings in those of the experts a micro-batch chose."""

    def __init__(self, store: WeightStore, streams: Streams, tracer, pages: int = 1):
        self.store, self.streams = store, streams
        self.pager = Pager(store, streams)
        self.tracer = tracer
        self.pages = max(1, pages)
        self.routed = False
        self.fetched_experts = 0  # expert blocks copied by fetch_experts (summed over stages and steps)
        self.partial_loads = 0  # stages loaded without their streamed expert columns
        self.num_stages = store.num_layers + 1
        self.slot_load: list[_Load | None] = [None] * SLOTS  # the stage each slot holds or is receiving
        self.slot_free = [DONE] * SLOTS  # event: the slot's stage has no reader left
        self.rounds = 0
        self.current = None
        self._streamed = store.streamed_stages

    @property
    def tracer(self):
        return self.pager.tracer

    @tracer.setter
    def tracer(self, tracer) -> None:
        self.pager.tracer = tracer

    def set_pages(self, pages: int) -> None:
        """At least this many pages per stage (one per micro-batch); more where a page would exceed PAGE_BYTES."""
        self.pages = max(1, pages)

    def make_way(self, event) -> None:
        """See :meth:`Pager.make_way`."""
        self.pager.make_way(event)

    def set_routed(self, routed: bool) -> None:
        """Stages requested from now on load every expert (False) or only what :meth:`fetch_experts` asks for."""
        self.routed = bool(routed)

    def fetch_experts(self, experts: torch.Tensor) -> None:
        """Routed mode: copy into the current stage's slot the streamed columns of every expert in ``experts``
        (the router's choice, any shape) it does not hold yet; the compute stream waits for them. The host
        waits for the routing (a device sync). A no-op for a stage loaded whole."""
        load = self.slot_load[self.current] if self.current is not None else None
        if load is None or load.present is None:
            return
        new = [e for e in torch.unique(experts).tolist() if e not in load.present]
        if not new:
            return
        streams = self.streams
        streams.wait("experts", streams.record("compute"))  # the slot's earlier readers are behind this point
        with streams.on("experts"), self.tracer.device_span("experts", f"stage {load.stage} {len(new)} experts"):
            self.store.copy_experts(load.stage, self.current, new)
        fetched = streams.record("experts")
        self.pager.make_way(fetched)
        streams.wait("compute", fetched)
        load.present.update(new)
        self.fetched_experts += len(new)

    def enter(self, stage: int) -> StageWeights:
        if not self.store.slot_bytes:
            self.current = None
            return self.store.stage_weights(stage, None)
        k = self.rounds % 2
        ahead = self._next_streamed(stage)
        if stage not in self._streamed:
            # wholly resident (the first stage once the dense weights fit): it takes no slot, so the next stage that
            # streams is already on its way into the slot the previous one frees (a slot here idled the link
            # through the last stage of every step: 14 ms a step on 2 H100s, GPT-OSS-120B)
            self._request(k, ahead)
            self.current = None
            return self.store.stage_weights(stage, None)
        self._request(k, stage)  # normally already asked for when the previous stage was entered
        if ahead != stage:  # its slot frees once the previous stage is done
            self._request(1 - k, ahead)
        load = self.slot_load[k]
        with self.tracer.host_span("Driver", f"wait stage {stage} issued"):
            load.issued.wait()
        if load.error is not None:
            raise load.error
        self.streams.wait("compute", load.ready)
        self.current = k
        return self.store.stage_weights(stage, k)

    def resident(self, stage: int) -> StageWeights | None:
        """``stage``'s weights where none of them stream (usable outside :meth:`enter` / :meth:`leave`: they never
        move), else None."""
        if self.store.slot_bytes and stage in self._streamed:
            return None
        return self.store.stage_weights(stage, None)

    def leave(self) -> None:
        if self.current is not None:  # the slots alternate over the stages that stream
            self.slot_free[self.current] = self.streams.record("compute")
            self.rounds += len(self._streamed) > 1  # a lone streamed stage stays in its slot

    def close(self) -> None:
        self.pager.close()

    def _next_streamed(self, stage: int) -> int:
        """The first stage after ``stage`` (wrapping to the next step's) with weights to stream; ``stage`` itself
        where no other streams."""
        for i in range(1, self.num_stages + 1):
            s = (stage + i) % self.num_stages
            if s in self._streamed:
                return s
        return stage

    def _request(self, k: int, stage: int) -> None:
        held = self.slot_load[k]
        if held is not None and held.stage == stage and (self.routed or held.present is None):
            return  # still there (a one-layer model never reloads)
        table = self.store.stage_tables[stage]
        count = max(self.pages, -(-table.nbytes // PAGE_BYTES))
        skip = self.store.expert_spans[stage] if self.routed else None
        self.partial_loads += skip is not None
        self.slot_load[k] = self.pager.load(k, stage, table.pages(count, skip), self.slot_free[k],
                                            present=None if skip is None else set())
