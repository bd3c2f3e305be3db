"""GPU measurement helpers: where a run happened, CUDA-event medians after warm-up, peak extra memory of a call."""

from __future__ import annotations

import gc
from typing import Callable

import torch


def run_header() -> dict:
    """Where and with what a benchmark ran: stored at the top of every result JSON."""
    import platform
    import time

    import transformers
    import triton

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU only ({platform.machine()})"
    return {"device": device, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "host": platform.node(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "dtype": "bfloat16"}


def git_revision(folder: str | None = None) -> str | None:
    """``git describe --always`` of ``folder`` (default: the working directory), or None outside a git checkout
    or without git. git's complaints are captured: a run outside a checkout must not print "fatal: not a git
    repository" on the user's terminal (what lm-eval's own lookup does)."""
    import subprocess

    try:
        done = subprocess.run(["git", "describe", "--always"], cwd=folder, capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def median_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200, grad_to_none=None) -> float:
    """Median time of ``fn`` in ms (CUDA events via ``triton.testing.do_bench``)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=grad_to_none, return_mode="median"))


def captured_graph(fn: Callable[[], object]) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of one ``fn()`` call, after one warm-up call on a side stream (as capture wants): replaying it
    times the GPU's work alone, with no host in between."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_replay_ms(fn: Callable[[], object], calls: int = 50) -> float:
    """Mean time of back-to-back replays of a CUDA graph of ``fn()`` in ms: a kernel's GPU time alone, its launch
    included and the L2 cache warm (a probe comparing one kernel's forms; ``median_ms`` times a whole call). Forms
    timed one after another in one process are biased by their order; :func:`alternating_replay_ms` is not."""
    return _replay_ms(captured_graph(fn), calls)


def alternating_replay_ms(forms: dict[str, Callable[[], object]], rounds: int = 5, calls: int = 20) -> dict:
    """{name: median over ``rounds`` of the mean replay time in ms} for several forms of one computation, their
    graphs replayed in turn each round (after one warm-up round), so the GPU's clocks and temperature drifting
    within the process fall on every form alike (timed one after another on an H200, the first form measured,
    the first projection as it was, took 1.61 ms; profiled inside its layer, 1.44)."""
    graphs = {name: captured_graph(fn) for name, fn in forms.items()}
    times: dict[str, list[float]] = {name: [] for name in forms}
    for round_index in range(rounds + 1):
        for name, graph in graphs.items():
            ms = _replay_ms(graph, calls)
            if round_index:
                times[name].append(ms)
    return {name: sorted(ms)[len(ms) // 2] for name, ms in times.items()}


def _replay_ms(graph: "torch.cuda.CUDAGraph", calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def peak_extra_gib(fn: Callable[[], object]) -> float:
    """Memory allocated at the peak of one ``fn()`` call beyond what was live before it, in GiB."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


__all__ = ["alternating_replay_ms", "captured_graph", "git_revision", "graph_replay_ms", "is_oom", "median_ms",
           "peak_extra_gib", "run_header"]
