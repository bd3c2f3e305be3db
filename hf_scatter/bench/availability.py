"""What every benchmark suite shares beyond the measurement helpers: saying, before measuring, why a suite
cannot run here."""

from __future__ import annotations

import torch


class BenchUnavailable(RuntimeError):
    """A suite cannot run here (no GPU) or was asked for a config it does not have: said before measuring."""


class RunStopped(RuntimeError):
    """A run that had to stop part-way (under several processes, one out of memory leaves the others waiting in
    a collective): ``report`` holds what ran before it (rank 0's; None on the others), for the caller to keep."""

    def __init__(self, report: dict | None, why: str):
        super().__init__(why)
        self.report = report


def require_cuda() -> None:
    """Every suite but ``convert`` times GPU work: one message for all of them, before anything runs."""
    if not torch.cuda.is_available():
        raise BenchUnavailable("needs a CUDA GPU (the figures are GPU timings)")


def check_names(kind: str, names, known) -> None:
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise BenchUnavailable(f"unknown {kind}(s) {', '.join(unknown)}; choose from {', '.join(known)}")
