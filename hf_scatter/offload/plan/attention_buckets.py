"""How the CPU attention of a decode step is grouped into length buckets, and what each bucket costs.

Requests of a micro-batch are bucketed by KV capacity (longest first), each bucket one SDPA call over
padded rows: a call costs a fixed ``call_s`` plus ``byte_s`` per byte of K/V it reads. The runtime's KV
cache buckets its rows with :func:`length_buckets`, and the planner prices CPU attention with the very
same bucketing, so both agree on what a step does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...common.partition import dp_schedule

SLACK = 0.25  # a bucket's largest capacity is at most 1.25x its smallest

# Bucketing costs where no hardware profile gives them (the profile's fit replaces both): per SDPA call,
# and per byte of cached K/V read.
CALL_S = 250e-6
BYTE_S = 1 / 50e9


@dataclass(frozen=True)
class BucketCosts:
    """What a CPU attention call costs: ``call_s`` fixed, ``byte_s`` per byte of K/V it reads."""

    call_s: float = CALL_S
    byte_s: float = BYTE_S
    slack: float = SLACK

    @classmethod
    def from_profile(cls, profile, context: float = 512.0) -> "BucketCosts":
        """The profile's fitted CPU attention (rate at ``context``, per-call overhead); defaults without one."""
        if profile is None or not getattr(profile, "cpu_attention", None):
            return cls()
        from ..plan.hrm import HierarchicalRoofline

        rate, overhead = HierarchicalRoofline(profile).cpu_attention_rate(context)
        return cls(call_s=overhead, byte_s=1.0 / rate)

    def buckets(self, capacities: Sequence[int], row_token_bytes: int) -> list[tuple[int, int, int]]:
        return length_buckets(capacities, self.slack, self.call_s, self.byte_s * row_token_bytes)


def length_buckets(capacities: Sequence[int], slack: float = SLACK, call_s: float = CALL_S,
                   token_s: float = 0.0) -> list[tuple[int, int, int]]:
    """``(start, end, capacity)`` row ranges over ``capacities`` (non-increasing) minimising
    ``calls * call_s + padded row-tokens * token_s``, each range padded to at most ``1 + slack`` times its
    real tokens. ``token_s`` 0: the fewest buckets."""
    caps = [int(c) for c in capacities]
    if any(a < b for a, b in zip(caps, caps[1:])):
        raise ValueError("capacities must be sorted longest first")
    if not caps:
        return []
    n = len(caps)

    def group_costs(sizes, totals, longest):
        padded = sizes * longest
        return np.where(padded <= (1 + slack) * totals + 1e-9, call_s + token_s * padded, np.inf)

    # reversed, the capacities ascend, so the DP's runs are contiguous ranges of rows
    out = []
    for group in dp_schedule(caps[::-1], group_costs):
        start, end = n - 1 - max(group), n - min(group)
        out.append((start, end, caps[start]))
    return sorted(out)
