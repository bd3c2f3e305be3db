"""Request batching (MoE-Lightning, Algorithm 2): balanced micro-batches without padding across requests.

Requests are sorted by prompt length, longest first, and cut into batches of ``batch_size``; within a batch
each request goes to the micro-batch holding the fewest prompt tokens so far (longest-processing-time
first), among those not yet full. Every micro-batch then carries about the same number of tokens, so the
CPU attention and GPU work of the pipeline's stages take about the same time, and a batch holds requests of
similar length, which keeps its KV cache compact.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class MicroBatch:
    """Request indices (into the caller's list), longest prompt first, and their prompt tokens."""

    requests: tuple[int, ...]
    tokens: int

    def __len__(self) -> int:
        return len(self.requests)


@dataclass(frozen=True)
class Batch:
    micro_batches: tuple[MicroBatch, ...]

    @property
    def requests(self) -> tuple[int, ...]:
        """Every request of the batch, micro-batch by micro-batch (the order rows have on the device)."""
        return tuple(r for mb in self.micro_batches for r in mb.requests)

    @property
    def size(self) -> int:
        return sum(len(mb) for mb in self.micro_batches)

    @property
    def tokens(self) -> int:
        return sum(mb.tokens for mb in self.micro_batches)


def plan_batches(prompt_lens: Sequence[int], batch_size: int, micro_batch_size: int) -> list[Batch]:
    """Batches of at most ``batch_size`` requests, each split into ``ceil(size / micro_batch_size)``
    micro-batches of near-equal request count and balanced prompt tokens."""
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if int(micro_batch_size) != micro_batch_size or not 1 <= micro_batch_size <= batch_size:
        raise ValueError(f"micro_batch_size must be an integer in 1..batch_size ({batch_size}), got "
                         f"{micro_batch_size!r}")
    lens = [int(p) for p in prompt_lens]
    if not lens:
        raise ValueError("no requests to batch")
    if min(lens) < 1:
        raise ValueError(f"request {lens.index(min(lens))} has an empty prompt: every request needs at least one "
                         "token")
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    return [_balance(order[start:start + batch_size], lens, micro_batch_size)
            for start in range(0, len(order), batch_size)]


def _balance(requests: list[int], lens: list[int], micro_batch_size: int) -> Batch:
    count = math.ceil(len(requests) / micro_batch_size)
    cap = math.ceil(len(requests) / count)  # equal request counts, to within one
    members: list[list[int]] = [[] for _ in range(count)]
    heap = [(0, j) for j in range(count)]  # (tokens so far, micro-batch): fewest tokens on top
    for r in requests:  # longest first
        tokens, j = heapq.heappop(heap)
        members[j].append(r)
        if len(members[j]) < cap:
            heapq.heappush(heap, (tokens + lens[r], j))
    return Batch(tuple(MicroBatch(tuple(m), sum(lens[r] for r in m)) for m in members))
