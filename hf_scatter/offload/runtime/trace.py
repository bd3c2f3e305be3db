"""Chrome trace of a pipelined run: one lane per stream and one for CPU attention, so overlap can be seen.

Device work is timed with CUDA events recorded on its stream around each span and resolved once the run
has finished (no synchronisation while it runs); host work (CPU attention, and everything on the CPU
device) with the wall clock. Both share one time origin. Open the JSON in ``chrome://tracing`` or
https://ui.perfetto.dev.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time

from ...common.atomic_files import write_json
from ...common.intervals import length, overlap, union

# "Driver": the host thread issuing the pipeline's work, where it waits and how long issuing each piece takes (a
# stall there with every other lane idle is the host, not the hardware)
LANES = ("GPU compute", "CPU attention", "H2D hidden", "D2H qkv", "H2D weights", "H2D routed experts", "Driver")
ROLE_LANES = {"compute": "GPU compute", "h2d": "H2D hidden", "d2h": "D2H qkv", "weights": "H2D weights",
              "experts": "H2D routed experts"}


class NullTracer:
    """Tracing off: spans cost nothing."""

    enabled = False

    def device_span(self, role: str, name: str):
        return contextlib.nullcontext()

    def host_span(self, lane: str, name: str):
        return contextlib.nullcontext()


class Tracer:
    """Collects spans; :meth:`events` resolves them after the streams have been synchronised."""

    enabled = True

    def __init__(self, streams):
        self.streams = streams
        self._lock = threading.Lock()
        self._host: list[tuple[str, str, float, float]] = []
        self._device: list[tuple[str, str, object, object]] = []
        self.streams.synchronize()
        self._origin_event = streams.record("compute", timing=True)
        self._origin = time.perf_counter()

    @contextlib.contextmanager
    def device_span(self, role: str, name: str):
        """Work issued inside runs on ``role``'s stream."""
        if not self.streams.cuda:  # the CPU device: the work runs now
            with self.host_span(ROLE_LANES[role], name):
                yield
            return
        start = self.streams.record(role, timing=True)
        yield
        end = self.streams.record(role, timing=True)
        with self._lock:  # the pager thread records too
            self._device.append((ROLE_LANES[role], name, start, end))

    @contextlib.contextmanager
    def host_span(self, lane: str, name: str):
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        with self._lock:
            self._host.append((lane, name, start - self._origin, end - self._origin))

    def spans(self) -> list[tuple[str, str, float, float]]:
        """(lane, name, start s, end s), every span; synchronises the device."""
        self.streams.synchronize()
        out = list(self._host)
        for lane, name, start, end in self._device:
            out.append((lane, name, self._origin_event.elapsed_time(start) / 1e3,
                        self._origin_event.elapsed_time(end) / 1e3))
        return sorted(out, key=lambda s: s[2])

    def events(self) -> list[dict]:
        spans = self.spans()
        used = {lane for lane, *_ in spans}  # the routed-experts lane only where decode streamed that way
        lanes = {lane: i for i, lane in enumerate(LANES) if lane in used or lane != "H2D routed experts"}
        meta = [{"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": lane}}
                for lane, i in lanes.items()]
        return meta + [{"name": name, "ph": "X", "pid": 0, "tid": lanes[lane], "ts": start * 1e6,
                        "dur": max(end - start, 0.0) * 1e6} for lane, name, start, end in spans]

    def save(self, path: str) -> str:
        return write_json(path, {"traceEvents": self.events(), "displayTimeUnit": "ms"}, indent=None)

    def summary(self) -> dict:
        """Busy seconds per lane, how much of the weight transfer ran while the GPU or the CPU computed, and
        how much of that compute ran under a transfer (in a link-bound run the second is the telling one:
        the link cannot be hidden behind less compute than it takes, but the compute can hide under it); and
        each lane's busy seconds within the prefill (a prefill whose lanes idle most of it is bound by the host
        issuing its work); the driver's median time to issue one micro-batch's decode stage, its
        pre-attention and post-attention work apart (what the planner's per-kernel launch cost stands for), and
        its total time issuing the prefill's stages (against the GPU's busy time there: how host-bound it is)."""
        spans = self.spans()
        busy = {lane: union([(s, e) for la, _, s, e in spans if la == lane]) for lane in LANES}
        weights = union(busy["H2D weights"] + busy["H2D routed experts"])
        compute = union(busy["GPU compute"] + busy["CPU attention"])
        hidden = overlap(weights, compute)
        total, computing = length(weights), length(compute)
        # the prefill ends with the last span it labels (its stages and its prompts' KV stores)
        prefill_end = max((e for _, name, _, e in spans if name.startswith("prefill") or "prompt" in name),
                          default=0.0)
        start = min((s for _, _, s, _ in spans), default=0.0)
        prefill = [(start, prefill_end)] if prefill_end > start else []
        return {"busy_s": {lane: length(iv) for lane, iv in busy.items()},
                "prefill_s": length(prefill),
                "prefill_busy_s": {lane: overlap(iv, prefill) for lane, iv in busy.items()},
                "weight_transfer_s": total, "weight_transfer_overlapped_s": hidden,
                "weight_transfer_overlap": hidden / total if total else None,
                "compute_s": computing, "compute_under_transfer": hidden / computing if computing else None,
                "driver_issue_s": _issue_medians(spans),
                "prefill_issue_s": sum(e - s for lane, name, s, e in spans
                                       if lane == "Driver" and name.startswith("issue prefill")),
                "span_s": (max(e for *_, e in spans) - min(s for _, _, s, _ in spans)) if spans else 0.0}


def _issue_medians(spans) -> dict:
    """Median seconds of the Driver's "issue pre" and "issue post" spans (one each per micro-batch and stage of
    decode), and how many of each there were."""
    kinds = {"pre": [], "post": []}
    for lane, name, start, end in spans:
        words = name.split()
        if lane == "Driver" and words[0] == "issue" and words[1] in kinds:
            kinds[words[1]].append(end - start)
    out = {kind: statistics.median(times) if times else None for kind, times in kinds.items()}
    out["stages"] = {kind: len(times) for kind, times in kinds.items()}
    return out
