"""The best split of a sorted sequence into consecutive groups, by dynamic programming (TurboTransformers'
Algorithm 3): BERT request batching and the CPU-attention length buckets of offloaded generation both use it.

    best[0] = 0,  best[i] = min over j < i of best[j] + cost(group j..i-1)      (O(n * max_batch))
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

def dp_schedule(lengths: Sequence[int], group_costs: Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray],
                max_batch: int | None = None) -> list[list[int]]:
    """Algorithm 3: split the requests (any order) into batches minimising the summed group cost of
    consecutive runs of the length-sorted requests. ``group_costs(sizes, token_totals, longest)`` prices
    many candidate groups at once. Returns request indices per batch, shortest batch first."""
    n = len(lengths)
    if n == 0:
        return []
    if max_batch is not None and max_batch < 1:
        raise ValueError(f"dp_schedule: max_batch must be >= 1, got {max_batch}")
    order = sorted(range(n), key=lambda i: (lengths[i], i))
    sorted_lengths = np.array([lengths[i] for i in order], dtype=float)
    prefix = np.concatenate([[0.0], np.cumsum(sorted_lengths)])
    limit = n if max_batch is None else max_batch
    best = np.zeros(n + 1)
    split = [0] * (n + 1)
    for i in range(1, n + 1):
        j = np.arange(max(0, i - limit), i)  # the group j..i-1
        total = best[j] + group_costs(i - j, prefix[i] - prefix[j], np.full(len(j), sorted_lengths[i - 1]))
        k = int(np.argmin(total))  # the first minimum, like the scalar scan it replaces
        best[i], split[i] = total[k], int(j[k])
    groups, i = [], n
    while i > 0:
        groups.append(order[split[i]:i])
        i = split[i]
    return groups[::-1]


__all__ = ["dp_schedule"]
