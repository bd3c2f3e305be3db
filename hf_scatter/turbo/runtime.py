"""Packed BERT inference with planned memory and, on CUDA, one captured graph per length bucket.

A small BERT batch is host-bound: ~25 launches per layer cost more host time than the GPU needs for them
(ANCHORS.md: B=1, S=40 takes 8.6 ms). Packing makes the work proportional to real tokens; replaying a
captured CUDA graph makes the host cost one launch. Graphs need fixed shapes and fixed addresses, which
the memory planner already gives: every intermediate of a bucket's plan sits at a fixed place in its chunks.

Buckets: total tokens rounded up to a geometric series (ratio 1.125, multiples of 64: at most ~12% padded
rows, ~6% on average) and sequences to a power of two. Rows past the real tokens hold stale data nobody
reads: each attention block only covers real rows of one sequence (the block table), and every other op
is row-wise.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..kernels.varlen_attention import block_m_for, block_table, max_blocks
from .packing import PackedBatch, first_token_rows
from .planner import MemoryPlanner, MiB
from .unpadded import encode, fresh

TOKEN_QUANTUM = 64
BUCKET_RATIO = 1.125


def token_bucket(num_tokens: int) -> int:
    """Smallest bucket >= ``num_tokens``: multiples of 64 growing by at most 12.5% a step."""
    size = TOKEN_QUANTUM
    while size < num_tokens:
        size = max(size + TOKEN_QUANTUM, int(math.ceil(size * BUCKET_RATIO / TOKEN_QUANTUM)) * TOKEN_QUANTUM)
    return size


def sequence_bucket(num_sequences: int) -> int:
    return 1 << max(0, num_sequences - 1).bit_length()


@dataclass
class _Captured:
    """A bucket's graph with its static inputs (written before each replay) and outputs (arena views)."""

    graph: "torch.cuda.CUDAGraph"
    batch: PackedBatch
    blocks: torch.Tensor
    first: torch.Tensor
    hidden: torch.Tensor
    pooled: torch.Tensor | None


class UnpaddedRuntime:
    """Runs one ``BertModel`` on packed batches (:meth:`run`).

    ``planner``: intermediates in planned chunks (TurboTransformers' allocator) instead of torch's caching
    allocator. ``cuda_graphs``: replay a captured graph per bucket (CUDA only; needs the planner). The
    runtime notices when the model's parameters move (another device or dtype, new tensors) and re-plans.
    """

    def __init__(self, model: nn.Module, *, planner: bool = True, cuda_graphs: bool | None = None,
                 max_graphs: int = 48, chunk_bytes: int = 2 * MiB):
        self.model = model
        self.use_planner = planner
        self.cuda_graphs = cuda_graphs
        self.max_graphs = max_graphs
        self.chunk_bytes = chunk_bytes
        self.params = list(model.parameters())  # .to()/.half() swap their data in place: watched per call
        self._signature = None
        self._reset()

    def _reset(self) -> None:
        device = self.params[0].device
        self.device = device
        self.planner = MemoryPlanner(device, chunk_bytes=self.chunk_bytes, max_plans=self.max_graphs)
        self.graphs: OrderedDict = OrderedDict()
        self._pool = None
        self.captures = 0

    def _params_signature(self):
        return [(p.data_ptr(), p.dtype) for p in self.params]

    def graphs_enabled(self) -> bool:
        wanted = self.device.type == "cuda" if self.cuda_graphs is None else self.cuda_graphs
        return bool(wanted and self.use_planner and self.device.type == "cuda")

    # -------------------------------------------------------------------------------------- running
    def run(self, batch: PackedBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden [T, H], pooled [N, H] or None)`` for a packed batch on the model's device.

        With the planner the results are views of planned memory, valid until the next call: copy what
        you keep (``PackedBatch.unpack`` / ``split`` + ``clone`` do).
        """
        signature = self._params_signature()
        if signature != self._signature:
            self._reset()
            self._signature = signature
        if batch.device != self.device:
            raise ValueError(f"UnpaddedRuntime: the batch is on {batch.device} but the model is on {self.device}; "
                             "pack it on the model's device")
        if batch.num_tokens == 0:
            raise ValueError("UnpaddedRuntime: the batch has no tokens (every sequence is empty)")
        if not self.use_planner:
            h, pooled = encode(self.model, batch, fresh)
            return h, pooled
        key = (token_bucket(batch.num_tokens), sequence_bucket(batch.num_sequences))
        if self.graphs_enabled():
            return self._replay(key, batch)
        return self._planned(key, batch)

    def _planned(self, key, batch: PackedBatch):
        """Eager, with the bucket's plan: the batch is padded to the bucket's token count so that one plan
        (recorded at that size) serves every batch of the bucket."""
        padded = _pad_to_bucket(batch, *key)
        first = padded.first_token_index()
        forward = lambda alloc: encode(self.model, padded, alloc, first_token=first)  # noqa: E731
        hidden, pooled = forward(self.planner.plan(key, forward, keep_alive=_outputs))
        return hidden[:batch.num_tokens], None if pooled is None else pooled[:batch.num_sequences]

    # ---------------------------------------------------------------------------------------- graphs
    def _static_inputs(self, key) -> tuple[PackedBatch, torch.Tensor, torch.Tensor]:
        tokens, sequences = key
        dev = self.device
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        head_dim = self.model.encoder.layer[0].attention.self.attention_head_size
        blocks = torch.zeros((max_blocks(tokens, sequences, block_m_for(head_dim)), 3), dtype=torch.int32,
                             device=dev)
        return PackedBatch(zeros(tokens), zeros(tokens), zeros(tokens), [tokens]), blocks, zeros(sequences)

    def _fill(self, captured: _Captured, batch: PackedBatch) -> None:
        static = captured.batch
        T = batch.num_tokens
        static.input_ids[:T].copy_(batch.input_ids)
        static.position_ids[:T].copy_(batch.position_ids)
        if batch.token_type_ids is None:
            static.token_type_ids[:T].zero_()
        else:
            static.token_type_ids[:T].copy_(batch.token_type_ids)
        head_dim = self.model.encoder.layer[0].attention.self.attention_head_size
        table = block_table(batch.lengths, block_m_for(head_dim), capacity=captured.blocks.shape[0])
        first = np.zeros(captured.first.shape[0], dtype=np.int64)
        first[:batch.num_sequences] = first_token_rows(batch.lengths)
        captured.blocks.copy_(torch.from_numpy(table))
        captured.first.copy_(torch.from_numpy(first))
        static.lengths = list(batch.lengths)

    def _replay(self, key, batch: PackedBatch):
        captured = self.graphs.get(key)
        if captured is None:
            captured = self._capture(key, batch)
        self.graphs.move_to_end(key)
        self._fill(captured, batch)
        captured.graph.replay()
        N = batch.num_sequences
        return captured.hidden, None if captured.pooled is None else captured.pooled[:N]

    def _capture(self, key, batch: PackedBatch) -> _Captured:
        static, blocks, first = self._static_inputs(key)
        placeholder = _Captured(None, static, blocks, first, None, None)
        self._fill(placeholder, batch)
        forward = lambda alloc: encode(self.model, static, alloc, blocks, first)  # noqa: E731
        allocator = self.planner.plan(key, forward, keep_alive=_outputs)
        for stale in [k for k in self.graphs if k not in self.planner.plans]:
            del self.graphs[stale]  # its plan (and maybe its chunks) are gone
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up (compiles the kernels) on a side stream, as capture wants
            forward(allocator.reset())
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, pooled = forward(allocator.reset())
        captured = _Captured(graph, static, blocks, first, hidden, pooled)
        self.graphs[key] = captured
        self.captures += 1
        while len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return captured

    def stats(self) -> dict:
        return {"graphs": len(self.graphs), "captures": self.captures, **self.planner.stats()}


def _pad_to_bucket(batch: PackedBatch, tokens: int, sequences: int) -> PackedBatch:
    """The same sequences, plus empty ones up to ``sequences``, in ``tokens`` rows; the extra rows (token 0,
    position 0) belong to no sequence, so nothing reads what they compute."""
    extra = tokens - batch.num_tokens
    lengths = batch.lengths + [0] * (sequences - batch.num_sequences)
    if extra == 0 and len(lengths) == batch.num_sequences:
        return batch
    pad = lambda t: None if t is None else torch.cat([t, t.new_zeros(extra)])  # noqa: E731
    return PackedBatch(pad(batch.input_ids), pad(batch.position_ids), pad(batch.token_type_ids), lengths)


def _outputs(result) -> list[torch.Tensor]:
    hidden, pooled = result
    return [t for t in (hidden, pooled) if t is not None]
