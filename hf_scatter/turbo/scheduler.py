"""Batch scheduler for variable-length requests (TurboTransformers, Algorithm 3), with hungry and lazy policies.

Which requests to run together is a trade: a batch amortises per-call costs (launches, weight reads) but
a padded runtime pays for its longest member. Given requests sorted by length, the best split into
consecutive groups follows from a dynamic program over a measured cost table ``cost[length][batch]``
(the time of one batch of ``batch`` requests of ``length`` tokens):

    best[0] = 0,  best[i] = min over j < i of best[j] + cost(group j..i-1)      (O(n^2), O(n * max_batch) here)

A padded runtime's group costs ``cost[longest][size]``; the packed runtime's costs follow its tokens, so
its groups are priced at their mean length. The table is measured once per device and model (a warm-up
of a few seconds) and saved as JSON, so a restarted server reloads it.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..common.atomic_files import write_json
from ..common.partition import dp_schedule

DEFAULT_LENGTHS = (8, 16, 32, 64, 128, 192, 256, 384, 512)
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class CostTable:
    """Measured milliseconds of one batch, ``ms[i][j]`` for ``lengths[i]`` tokens x ``batches[j]`` requests.

    ``padded``: the runtime pads to the longest request (groups priced at their maximum length) rather
    than running packed (groups priced at their mean length).
    """

    lengths: list[int]
    batches: list[int]
    ms: list[list[float]]
    padded: bool = False
    key: dict = field(default_factory=dict)

    def __post_init__(self):
        table = np.asarray(self.ms, dtype=float)
        if table.shape != (len(self.lengths), len(self.batches)) or not np.isfinite(table).all() or (table <= 0).any():
            raise ValueError(f"CostTable: ms must be a {len(self.lengths)} x {len(self.batches)} table of positive "
                             f"times, got shape {table.shape}")
        if sorted(set(self.lengths)) != list(self.lengths) or sorted(set(self.batches)) != list(self.batches):
            raise ValueError("CostTable: lengths and batches must be strictly increasing")
        self._table = table

    def costs(self, lengths: np.ndarray, batches: np.ndarray) -> np.ndarray:
        """Interpolated ms of batches, vectorised (linear in length, linear in batch; beyond the table's
        largest batch, extrapolated along its last segment; lengths and smaller batches are clamped)."""
        grid_l, grid_b, table = np.asarray(self.lengths, float), np.asarray(self.batches, float), self._table
        lengths = np.clip(np.asarray(lengths, float), grid_l[0], grid_l[-1])
        batches = np.asarray(batches, float)
        if len(grid_l) == 1:
            per_batch = np.broadcast_to(table[0], (len(lengths), len(grid_b)))
        else:
            i = np.clip(np.searchsorted(grid_l, lengths, side="right") - 1, 0, len(grid_l) - 2)
            w = ((lengths - grid_l[i]) / (grid_l[i + 1] - grid_l[i]))[:, None]
            per_batch = table[i] * (1 - w) + table[i + 1] * w  # [n, len(batches)]
        rows = np.arange(len(lengths))
        if len(grid_b) == 1:
            return np.where(batches <= grid_b[0], per_batch[:, 0], per_batch[:, 0] * batches / grid_b[0])
        j = np.clip(np.searchsorted(grid_b, batches, side="right") - 1, 0, len(grid_b) - 2)
        u = np.maximum((batches - grid_b[j]) / (grid_b[j + 1] - grid_b[j]), 0.0)
        return per_batch[rows, j] * (1 - u) + per_batch[rows, j + 1] * u

    def cost(self, length: float, batch: int) -> float:
        return float(self.costs(np.array([length]), np.array([batch]))[0])

    def group_costs(self, sizes: np.ndarray, totals: np.ndarray, longest: np.ndarray) -> np.ndarray:
        """ms of groups given by their sizes, token totals and longest members (a padded runtime pays for
        its longest request, the packed one for its mean length)."""
        return self.costs(longest if self.padded else totals / sizes, sizes)

    def group_cost(self, sorted_lengths: Sequence[int]) -> float:
        return float(self.group_costs(*_stats(sorted_lengths))[0])

    # ------------------------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically."""
        write_json(path, {"lengths": self.lengths, "batches": self.batches, "ms": self.ms, "padded": self.padded,
                          "key": self.key}, make_parents=True)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CostTable":
        try:
            data = json.loads(Path(path).read_text())
            return cls(data["lengths"], data["batches"], data["ms"], data.get("padded", False), data.get("key", {}))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"CostTable: cannot read {path}: {e}") from e

    @classmethod
    def measure(cls, run: Callable[[int, int], None], lengths=DEFAULT_LENGTHS, batches=DEFAULT_BATCHES,
                max_tokens: int | None = None, padded: bool = False, key: dict | None = None,
                repeats: int = 5, sync: Callable[[], None] = lambda: None, progress: bool = True) -> "CostTable":
        """Time ``run(length, batch)`` (one batch of ``batch`` requests of ``length`` tokens) over the grid:
        median of ``repeats`` after a warm-up call. Cells above ``max_tokens`` are extrapolated from the
        largest measured batch of that length (proportional to tokens)."""
        from tqdm.auto import tqdm

        ms = np.zeros((len(lengths), len(batches)))
        cells = [(i, j) for i in range(len(lengths)) for j in range(len(batches))]
        for i, j in tqdm(cells, desc="measuring batch costs", disable=not progress):
            length, batch = lengths[i], batches[j]
            if max_tokens is not None and length * batch > max_tokens and j > 0:
                ms[i, j] = ms[i, j - 1] * batch / batches[j - 1]
                continue
            run(length, batch)
            sync()
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                run(length, batch)
                sync()
                times.append((time.perf_counter() - start) * 1e3)
            ms[i, j] = float(np.median(times))
        return cls(list(lengths), list(batches), ms.tolist(), padded, key or {})


def cost_table_path(key: dict, root: str | os.PathLike | None = None) -> Path:
    """Where a table for ``key`` (device, model, dtype...) lives: one JSON file per key."""
    root = Path(root or os.environ.get("HF_SCATTER_CACHE", Path.home() / ".cache" / "hf_scatter")) / "bert_costs"
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return root / f"{key.get('device', 'device').replace(' ', '_')}-{digest}.json"


# --------------------------------------------------------------------------------------------- the DP
def _stats(sorted_lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return np.array([len(sorted_lengths)]), np.array([sum(sorted_lengths)]), np.array([sorted_lengths[-1]])




# ------------------------------------------------------------------------------------------ policies
@dataclass
class BatchScheduler:
    """When to run what. ``policy='hungry'``: whenever the engine is free, schedule everything queued.
    ``policy='lazy'``: wait until ``max_batch`` requests are queued, the oldest has
    waited ``timeout_ms``, or waiting longer would break ``latency_budget_ms`` for the oldest (its wait so
    far plus the predicted time of a batch of everything queued)."""

    table: CostTable
    policy: str = "hungry"
    max_batch: int = 64
    max_tokens: int | None = 32768
    timeout_ms: float = 5.0
    latency_budget_ms: float | None = None

    def __post_init__(self):
        if self.policy not in ("hungry", "lazy"):
            raise ValueError(f"BatchScheduler: policy must be 'hungry' or 'lazy', got {self.policy!r}")
        if self.max_batch < 1 or self.timeout_ms < 0:
            raise ValueError("BatchScheduler: max_batch must be >= 1 and timeout_ms >= 0")

    def group_costs(self, sizes: np.ndarray, totals: np.ndarray, longest: np.ndarray) -> np.ndarray:
        costs = self.table.group_costs(sizes, totals, longest)
        if self.max_tokens is not None:  # too many tokens for one call: split
            costs = np.where((totals > self.max_tokens) & (sizes > 1), np.inf, costs)
        return costs

    def group_cost(self, sorted_lengths: Sequence[int]) -> float:
        return float(self.group_costs(*_stats(sorted_lengths))[0])

    def schedule(self, lengths: Sequence[int]) -> list[list[int]]:
        """Batches (indices into ``lengths``) for requests that run now."""
        return dp_schedule(lengths, self.group_costs, self.max_batch)

    def ready(self, queued_lengths: Sequence[int], oldest_wait_ms: float) -> bool:
        """Whether the engine (free now) should take the queue now."""
        if not queued_lengths:
            return False
        if self.policy == "hungry" or len(queued_lengths) >= self.max_batch or oldest_wait_ms >= self.timeout_ms:
            return True
        if self.latency_budget_ms is not None:
            predicted = self.table.group_cost(sorted(queued_lengths))
            return oldest_wait_ms + predicted >= self.latency_budget_ms
        return False
