"""Interval arithmetic over (start, end) pairs: how long a set of possibly overlapping activities covers, and
how much of it another set covers too. The offload trace and the training bench's communication split read
busy and overlapped time this way."""

from __future__ import annotations


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The sorted, disjoint intervals covering exactly what ``intervals`` cover."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists (each a :func:`union`)."""
    i = j = 0
    shared = 0.0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


__all__ = ["length", "overlap", "union"]
