"""Packed BERT inference with planned memory and, on CUDA, one captured graph per length bucket.

A small BERT batch is host-bound: ~25 launches per layer cost more host time than the GPU needs for them
(docs/results/anchors.json: B=1, S=40 takes 8.6 ms). Packing makes the work proportional to real tokens; replaying a
captured CUDA graph makes the host cost one launch. Graphs need fixed shapes and fixed addresses, which
the memory planner already gives: every intermediate of a bucket's plan sits at a fixed place in its chunks.
A bucket has two graphs at most: packed batches' and, for batches run row for row, one whose attention reads
a key mask.

Buckets: total tokens rounded up to multiples of 64 up to 1024, then growing by 1/16 a step (at most ~6%
padded rows, ~3% on average); a bucket of T tokens takes up to T sequences (the pooler's [T, H] slot and
the attention block table cost next to nothing), so the token count alone picks the graph. Rows past the
real tokens hold stale data nobody reads: each attention block only covers real rows of one sequence (the
block table), and every other op is row-wise.

Planning: every buffer's shape is linear in the bucket's tokens and the ops are the same for every size,
so the usage records are recorded (on fake tensors) at two small sizes, checked to agree op for op and to
scale exactly, and scaled: planning a size costs milliseconds, not a recording. One plan, made for the
largest bucket seen so far, serves every bucket (a smaller buffer takes the start of its slot), so all
graphs share one arena and the footprint is that of the largest batch; a larger batch re-plans, releases
the old chunks and re-captures graphs as they are used again (``warmup`` plans the largest size first).

Inputs: batches packed on the host (``pack_sequences``) go to the device through pinned staging buffers
with asynchronous copies, so the host packs the next batch while the GPU runs this one. A padded batch of
token ids already on the device (the patched model's call) is packed straight into a graph's inputs
(:meth:`UnpaddedRuntime.run_padded`): its layout and default positions through the same staging, its tokens
gathered on the device. Packing needs the mask on the host, a device-to-host wait that costs more than a
small batch's whole forward; a small padded batch therefore runs row for row instead
(:meth:`UnpaddedRuntime.run_padded_rows`: its mask becomes the attention's key mask on the device), and a
call then waits for nothing.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..kernels.dependent_launch import dependent_launches
from ..kernels.skinny_linear import SkinnyWorkspace
from ..kernels.varlen_attention import block_m_for, block_table, max_blocks
from .packing import (PackedBatch, PaddedLayout, check_padded, first_token_rows, key_mask_of, pack_with_layout,
                      padded_rows, positions_of)
from .planner import MemoryPlanner, MiB, UsageRecord, record_usage
from . import unpadded
from .unpadded import encode, fresh

TOKEN_QUANTUM = 64
FINE_UNTIL = 1024  # tokens; above, buckets grow by 1/16
BUCKET_RATIO = 1.0625


def token_bucket(num_tokens: int) -> int:
    """Smallest bucket >= ``num_tokens``: multiples of 64, growing by at most 6.25% a step above 1024."""
    if num_tokens <= FINE_UNTIL:
        return max(TOKEN_QUANTUM, -(-num_tokens // TOKEN_QUANTUM) * TOKEN_QUANTUM)
    size = FINE_UNTIL
    while size < num_tokens:
        size = int(math.ceil(size * BUCKET_RATIO / TOKEN_QUANTUM)) * TOKEN_QUANTUM
    return size


def buckets_up_to(num_tokens: int) -> list[int]:
    out = [token_bucket(1)]
    while out[-1] < num_tokens:
        out.append(token_bucket(out[-1] + 1))
    return out


# Rows of a graph's static int64 inputs (one device tensor, written from one pinned host tensor in one copy)
IDS, POSITIONS, TYPES, FIRST, GATHER, KEYS = range(6)

# Padded batches of at most this many positions (B * S) run row for row (run_padded_rows) rather than packed:
# up to there, computing a half-padded batch's padding cost less than the host's wait for its mask at every
# shape measured (BERT-base on an H200, docs/bert.md); a batch that is nearly all padding loses at most about
# 0.15 ms to packing there.
PADDED_ROWS_LIMIT = 1024


@dataclass
class _Captured:
    """A bucket's graph with its static inputs (written before each replay): ``inputs`` [6, tokens] int64 (rows
    IDS, POSITIONS, TYPES, FIRST: each sequence's first row, GATHER: a padded batch's flat index of each real
    token, KEYS: 0 at a padding key of a batch run row for row, else 1) and the attention block table, their
    pinned host staging and the event of the last copy out of it,
    and its outputs (arena views). ``batch`` views the first three rows."""

    graph: "torch.cuda.CUDAGraph | None"
    batch: PackedBatch
    inputs: torch.Tensor
    blocks: torch.Tensor
    staging: torch.Tensor
    staging_blocks: torch.Tensor
    copied: "torch.cuda.Event"
    device_bytes: torch.Tensor  # inputs and blocks are views of it, staging and staging_blocks of staging_bytes:
    staging_bytes: torch.Tensor  # one copy sends both
    hidden: torch.Tensor | None = None
    pooled: torch.Tensor | None = None
    staged: tuple | None = None  # what the device inputs hold from the staging, when a batch run row for row
    # sent it: the next such batch of that shape skips the host work and the copy

    @property
    def first(self) -> torch.Tensor:
        return self.inputs[FIRST]


class UnpaddedRuntime:
    """Runs one ``BertModel`` on packed batches (:meth:`run`).

    ``planner``: intermediates in planned chunks (TurboTransformers' allocator) instead of torch's caching
    allocator. ``cuda_graphs``: replay a captured graph per bucket (CUDA only; needs the planner). The
    runtime notices when the model's parameters move (another device or dtype, new tensors) and re-plans.
    ``exact_gelu``: in half precision the FFN's bias + GELU run inside the GEMM (cuBLASLt epilogue, GELU's
    tanh form: at most 4.7e-4 from the erf form, under the fp16 rounding of the same values); True keeps
    the erf form (float32 always does).
    """

    def __init__(self, model: nn.Module, *, planner: bool = True, cuda_graphs: bool | None = None,
                 max_graphs: int = 96, chunk_bytes: int = 2 * MiB, exact_gelu: bool = False):
        self.model = model
        self.use_planner = planner
        self.cuda_graphs = cuda_graphs
        self.max_graphs = max_graphs
        self.chunk_bytes = chunk_bytes
        self.exact_gelu = exact_gelu
        self.params = list(model.parameters())  # .to()/.half() swap their data in place: watched per call
        self._read = unpadded.modules_read(model)  # layers replaced later (an adapter): watched per call
        self.wrapped = unpadded.wrapped_module(self._read)
        self._signature = None
        self.qkv: unpadded.QkvWeights | None = None  # made with each set of parameters (which it regroups)
        self.mixed_dtypes = False
        self._reset()

    def _reset(self) -> None:
        device = self.params[0].device
        self.device = device
        self.planner = MemoryPlanner(device, chunk_bytes=self.chunk_bytes, max_plans=self.max_graphs)
        self.graphs: OrderedDict = OrderedDict()
        self._template: tuple[int, list[UsageRecord]] | None = None
        self._arena_tokens = 0
        self._pool = None
        # One stream for every warm-up and capture: cuBLAS keeps a workspace per stream, so a fresh stream per
        # capture would cost a workspace per graph.
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.captures = 0
        self.capture_ms_total = 0.0
        # the few-rows kernel's split-K counters and partials, shared by every graph (they replay one at a time);
        # made at a capture's warm-up, outside the capture
        self.skinny = SkinnyWorkspace()

    def _params_signature(self) -> list[int]:
        """Where every parameter's data lives: a conversion (``.to``, ``.half``) gives each a new storage while the
        old one is still alive, so any swap of a parameter's data changes its address."""
        return list(map(torch.Tensor.data_ptr, self.params))

    def check_modules(self) -> str | None:
        """Notice layers replaced since the last call (PEFT wraps its targets, quantizers swap theirs): plan
        afresh. Returns why the model cannot run packed (a layer that is not a plain Linear, LayerNorm or
        Embedding: the packed encoder reads weights, not what a wrapper computes), or None."""
        if not all(parent.get(name) is module for parent, name, module in self._read):
            self._read = unpadded.modules_read(self.model)
            self.wrapped = unpadded.wrapped_module(self._read)
            self.params = list(self.model.parameters())
            self._signature = None
        return self.wrapped

    def _check_model(self) -> None:
        """The entry points' first step: refuse a model whose layers are wrapped, then :meth:`check_params`."""
        if self.check_modules() is not None:
            raise ValueError(f"UnpaddedRuntime: {self.wrapped} is not a plain layer (an adapter's wrapper or a "
                             "quantized layer); the packed runtime reads plain weights. Merge the adapters first "
                             "(PEFT: merge_and_unload()), or call the model itself, which takes transformers' "
                             "forward for it")
        self.check_params()

    def check_params(self) -> None:
        """Notice parameters that moved (another device or dtype, new tensors): plan and capture afresh."""
        signature = self._params_signature()
        if signature != self._signature:
            self._reset()
            self.mixed_dtypes = len({p.dtype for p in self.params}) > 1
            self.qkv = unpadded.QkvWeights(self.model)
            self._signature = self._params_signature()  # Q/K/V now view one tensor per layer

    def graphs_enabled(self) -> bool:
        wanted = self.device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        return bool(wanted and self.use_planner and self.device.type == "cuda")

    def _encode(self, batch, alloc, blocks=None, first=None, skinny=None):
        fast_gelu = not self.exact_gelu and self.params[0].dtype in (torch.float16, torch.bfloat16)
        return encode(self.model, batch, alloc, blocks, first, fast_gelu=fast_gelu, qkv=self.qkv, skinny=skinny)

    # -------------------------------------------------------------------------------------- running
    def run(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden [T, H], pooled [N, H] or None)`` for a packed batch on the model's device.

        With the planner the results are views of planned memory, valid until the next call: copy what
        you keep (``PackedBatch.unpack`` / ``split`` + ``clone`` do).
        """
        self._check_model()
        if batch.device != self.device and batch.device.type != "cpu":
            raise ValueError(f"UnpaddedRuntime: the batch is on {batch.device} but the model is on {self.device}; "
                             "pack it on the host or on the model's device")
        if batch.num_tokens == 0:
            raise ValueError("UnpaddedRuntime: the batch has no tokens (every sequence is empty)")
        tokens = token_bucket(batch.num_tokens)
        if self.graphs_enabled() and batch.inputs_embeds is None:  # graphs take token ids: embeddings run eagerly
            return self._replay(tokens, batch)
        batch = batch.to(self.device)
        if not self.use_planner:
            return self._encode(batch, fresh)
        if batch.token_type_ids is None:  # planned code paths read token types always (all zeros here)
            batch = dataclasses.replace(batch, token_type_ids=torch.zeros_like(batch.position_ids), _cache={})
        return self._encode(batch, self._allocator(tokens))

    def warmup(self, max_tokens: int, progress: bool = True) -> float:
        """Plan (and capture, with graphs) every bucket up to ``max_tokens`` now rather than on first use;
        returns the seconds it took."""
        from tqdm.auto import tqdm

        self._check_model()
        start = time.perf_counter()
        sizes = buckets_up_to(max_tokens)
        if len(sizes) > self.max_graphs:
            raise ValueError(f"warmup: {len(sizes)} buckets up to {max_tokens} tokens exceed max_graphs="
                             f"{self.max_graphs}; raise max_graphs or lower max_tokens")
        with torch.inference_mode():  # parameters may require grad: out= kernels refuse autograd
            self._allocator(sizes[-1])  # the one arena, at its final size
            for tokens in tqdm(sizes, desc="planning buckets", disable=not progress):
                if self.graphs_enabled():
                    if (tokens, False) not in self.graphs:
                        self._capture(tokens, self._sample_batch(tokens))
                else:
                    self._allocator(tokens)
        return time.perf_counter() - start

    def _sample_batch(self, tokens: int) -> PackedBatch:
        """Real tokens for a warm-up run: sequences of 128 filling the bucket."""
        lengths = [128] * (tokens // 128) + ([tokens % 128] if tokens % 128 else [])
        ids = torch.full((tokens,), 1, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lengths])
        return PackedBatch(ids, positions, None, lengths)

    # -------------------------------------------------------------------------------------- planning
    def _bucket_batch(self, tokens: int) -> PackedBatch:
        """A stand-in batch of a bucket's size: ``tokens`` one-token sequences (the most a bucket holds)."""
        ids = torch.zeros(tokens, dtype=torch.int64, device=self.device)
        return PackedBatch(ids, ids, ids, [1] * tokens)

    def _record(self, tokens: int) -> list[UsageRecord]:
        batch = self._bucket_batch(tokens)
        first = torch.arange(tokens, device=self.device)
        records, _ = record_usage(lambda alloc: self._encode(batch, alloc, first=first), _outputs)
        return records

    def _records_for(self, tokens: int) -> list[UsageRecord]:
        """Usage records of a bucket, scaled from the template (recorded and checked on first use); past
        the FFN's row chunk the intermediate stops scaling, so such sizes are recorded as they are."""
        if tokens > unpadded.FFN_CHUNK_ROWS:
            return self._record(tokens)
        if self._template is None:
            a, b = self._record(TOKEN_QUANTUM), self._record(2 * TOKEN_QUANTUM)
            same_ops = [(r.name, r.first_op, r.last_op) for r in a] == [(r.name, r.first_op, r.last_op) for r in b]
            linear = all(rb.nbytes == 2 * ra.nbytes for ra, rb in zip(a, b))
            self._template = (TOKEN_QUANTUM, a) if same_ops and linear else None
            if self._template is None:  # some buffer does not scale with the tokens: record every bucket
                return self._record(tokens)
        base, records = self._template
        return [r.scaled(tokens / base) for r in records]

    def _allocator(self, tokens: int):
        """The arena's allocator, re-planned at ``tokens`` when that is larger than its current size."""
        if tokens > self._arena_tokens:
            self.planner.clear()  # the old chunks go; graphs captured on them must go too
            self.graphs.clear()
            self._arena_tokens = tokens
            return self.planner.plan_records(tokens, self._records_for(tokens), time.perf_counter())
        return self.planner.plan(self._arena_tokens)

    # ---------------------------------------------------------------------------------------- graphs
    def _static_inputs(self, tokens: int, key_masked: bool) -> _Captured:
        head_dim = self.model.encoder.layer[0].attention.self.attention_head_size
        nblocks = 1 + max_blocks(tokens, tokens, block_m_for(head_dim))  # header row + every possible block
        split = 6 * tokens * 8  # bytes of the int64 input rows; the int32 block table follows them

        def views(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return raw[:split].view(torch.int64).view(6, tokens), raw[split:].view(torch.int32).view(nblocks, 3)

        device_bytes = torch.zeros(split + nblocks * 3 * 4, dtype=torch.uint8, device=self.device)
        staging_bytes = torch.zeros(device_bytes.shape, dtype=torch.uint8, pin_memory=True)
        (inputs, blocks), (staging, staging_blocks) = views(device_bytes), views(staging_bytes)
        batch = PackedBatch(inputs[IDS], inputs[POSITIONS], inputs[TYPES], [tokens],
                            key_mask=inputs[KEYS] if key_masked else None)
        return _Captured(None, batch, inputs, blocks, staging, staging_blocks, torch.cuda.Event(), device_bytes,
                         staging_bytes)

    def _stage_tables(self, captured: _Captured, lengths: list[int]) -> np.ndarray:
        """Wait until the previous batch's copies have left the staging, write this batch's attention block table
        and first rows there; returns the staging rows (host) for the caller to fill in."""
        captured.staged = None
        captured.copied.synchronize()
        head_dim = self.model.encoder.layer[0].attention.self.attention_head_size
        block_table(lengths, block_m_for(head_dim), capacity=captured.blocks.shape[0] - 1,
                    out=captured.staging_blocks.numpy())
        rows = captured.staging.numpy()
        rows[FIRST, :len(lengths)] = first_token_rows(lengths)
        rows[FIRST, len(lengths):] = 0
        captured.batch.lengths = list(lengths)
        return rows

    def _send_staging(self, captured: _Captured) -> None:
        """The staging (input rows and block table) to the device in one asynchronous copy, then mark it in
        flight."""
        captured.device_bytes.copy_(captured.staging_bytes, non_blocking=True)
        captured.copied.record()

    def _fill(self, captured: _Captured, batch: PackedBatch) -> None:
        """Write a packed batch into a graph's static inputs: host data through the pinned staging (asynchronous),
        device data by device copies. Rows past the batch keep earlier batches' (valid) ids, read by no one."""
        T = batch.num_tokens
        rows = self._stage_tables(captured, batch.lengths)
        on_host = batch.device.type == "cpu"
        sources = ((IDS, batch.input_ids, 0), (POSITIONS, batch.position_ids, 0), (TYPES, batch.token_type_ids, 0),
                   (KEYS, batch.key_mask, 1))
        for row, src, default in sources:
            if src is None:
                rows[row, :T] = default
            elif on_host:
                rows[row, :T] = src.numpy()
        self._send_staging(captured)
        if not on_host:
            for row, src, _ in sources:
                if src is not None:
                    captured.inputs[row, :T].copy_(src)

    def _fill_padded(self, captured: _Captured, input_ids: torch.Tensor, layout: PaddedLayout,
                     token_type_ids: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor:
        """Pack a padded device batch straight into a graph's static inputs: the layout, default positions and
        types go in the host staging (one copy), then the tokens (and given positions and types) are gathered on
        the device from the padded tensors. Returns the device index of each real token in B*S."""
        T, (B, S) = layout.num_tokens, layout.shape
        rows = self._stage_tables(captured, layout.lengths)
        rows[GATHER, :T] = layout.index
        if position_ids is None:
            np.remainder(layout.index, S, out=rows[POSITIONS, :T])
        if token_type_ids is None:
            rows[TYPES, :T] = 0
        rows[KEYS, :T] = 1
        self._send_staging(captured)
        index = captured.inputs[GATHER, :T]
        for row, src in ((IDS, input_ids), (TYPES, token_type_ids),
                         (POSITIONS, None if position_ids is None else positions_of(position_ids, B, S))):
            if src is not None:
                torch.index_select(src.reshape(-1).long(), 0, index, out=captured.inputs[row, :T])
        return index

    def _graph_for(self, tokens: int, key_masked: bool, batch_for_capture) -> _Captured:
        """The graph of a bucket, with the key mask (batches run row for row) or without (packed batches: the
        mask's load cost the attention kernel a third of its time at 5k tokens on an H200)."""
        key = (tokens, key_masked)
        captured = self.graphs.get(key)
        if captured is None:
            captured = self._capture(tokens, batch_for_capture())
        self.graphs.move_to_end(key)
        return captured

    def _replay(self, tokens: int, batch: PackedBatch):
        captured = self._graph_for(tokens, batch.key_mask is not None, lambda: batch)
        self._fill(captured, batch)
        captured.graph.replay()
        N = batch.num_sequences
        return captured.hidden, None if captured.pooled is None else captured.pooled[:N]

    def run_padded(self, input_ids: torch.Tensor, layout: PaddedLayout, token_type_ids: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, check: bool = True):
        """``(hidden [T, H], pooled [N, H] or None, index [T])`` of a padded batch of token ids on the model's
        device (``layout`` from :func:`~.packing.padded_layout`), packed inside its bucket's graph inputs: a call
        costs the mask's copy to the host, two copies to the device, the gathers and one graph launch. Needs
        CUDA graphs (:meth:`graphs_enabled`); the results are views valid until the next call, as in :meth:`run`.
        ``index``: each packed row's flat position in B*S (``unpack_rows`` puts them back). ``check=False``: the
        caller ran :meth:`check_modules` and :meth:`check_params`."""
        if check:
            self._check_model()
        if layout.num_tokens == 0:
            raise ValueError("UnpaddedRuntime: the batch has no tokens (every sequence is empty)")
        tokens = token_bucket(layout.num_tokens)
        captured = self._graph_for(tokens, False,
                                   lambda: pack_with_layout(layout, input_ids, token_type_ids, position_ids))
        index = self._fill_padded(captured, input_ids, layout, token_type_ids, position_ids)
        captured.graph.replay()
        N = len(layout.lengths)
        return captured.hidden, None if captured.pooled is None else captured.pooled[:N], index

    def run_padded_rows(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                        token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                        inputs_embeds: torch.Tensor | None = None, check: bool = True):
        """``(hidden [>= B*S, H], pooled [B, H] or None)`` of a padded batch run row for row
        (:func:`~.packing.padded_rows`; ``unpack_padded_rows`` makes [B, S, H] of the rows): nothing reads the mask
        on the host, so the call never waits for the device. With CUDA graphs the host work of a shape (block
        table, first rows, default positions) is staged once and kept while that bucket serves that shape; a call
        then costs the copies of the given tensors and one graph launch. Results are views valid until the next
        call, as in :meth:`run`. ``check=False``: the caller ran :meth:`check_modules`, :meth:`check_params` and
        the input checks."""
        if check:
            self._check_model()
            check_padded(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
        tokens_of = input_ids if input_ids is not None else inputs_embeds
        B, S = tokens_of.shape[:2]
        if B * S == 0:
            raise ValueError("UnpaddedRuntime: the batch has no tokens (it is empty)")
        batch_of = lambda: padded_rows(input_ids, attention_mask, token_type_ids, position_ids,  # noqa: E731
                                       inputs_embeds)
        if inputs_embeds is not None or not self.graphs_enabled() or input_ids.device != self.device:
            return self.run(batch_of())
        captured = self._graph_for(token_bucket(B * S), attention_mask is not None, batch_of)
        T = B * S
        shape = ("rows", B, S, position_ids is None, token_type_ids is None, attention_mask is None)
        if captured.staged != shape:
            rows = self._stage_tables(captured, [S] * B)
            if position_ids is None:
                rows[POSITIONS, :T] = np.tile(np.arange(S), B)
            if token_type_ids is None:
                rows[TYPES, :T] = 0
            if attention_mask is None:
                rows[KEYS, :T] = 1
            self._send_staging(captured)
            captured.staged = shape
        keys = key_mask_of(attention_mask)
        positions = None if position_ids is None else positions_of(position_ids, B, S)
        for row, src in ((IDS, input_ids), (TYPES, token_type_ids), (POSITIONS, positions), (KEYS, keys)):
            if src is not None:
                captured.inputs[row, :T].copy_(src.reshape(-1))
        captured.graph.replay()
        return captured.hidden, None if captured.pooled is None else captured.pooled[:B]

    def _capture(self, tokens: int, batch: PackedBatch) -> _Captured:
        start = time.perf_counter()
        key_masked = batch.key_mask is not None
        captured = self._static_inputs(tokens, key_masked)
        self._fill(captured, batch)
        static, blocks, first = captured.batch, captured.blocks, captured.first
        allocator = self._allocator(tokens)
        forward = lambda: self._encode(static, allocator.reset(), blocks, first, self.skinny)  # noqa: E731
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # a graph replays a chain of kernels that each wait for the one before: their launches may overlap
        with torch.cuda.stream(stream), dependent_launches():  # warm-up (compiles, tunes) on the capture's stream
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=stream), dependent_launches():
            hidden, pooled = forward()
        captured.graph, captured.hidden, captured.pooled = graph, hidden, pooled
        self.graphs[(tokens, key_masked)] = captured
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        self.capture_ms_total += (time.perf_counter() - start) * 1e3
        return captured

    def stats(self) -> dict:
        return {"graphs": len(self.graphs), "captures": self.captures,
                "capture_ms_total": round(self.capture_ms_total, 1), **self.planner.stats()}


def _outputs(result) -> list[torch.Tensor]:
    hidden, pooled = result
    return [t for t in (hidden, pooled) if t is not None]
