"""The pipeline's streams and events, with a CPU stand-in, so one code path runs on both devices.

On CUDA each role (compute, hidden-state uploads, QKV downloads, weight pages, routed experts) has its own
stream and work is ordered across them with events. On the CPU every operation completes before the call
returns, so a stream is a no-op context and an event is already complete: the schedule, the buffer reuse
rules and the page table run unchanged, which is what makes the CPU tests meaningful.
"""

from __future__ import annotations

import contextlib

import torch

ROLES = ("compute", "h2d", "d2h", "weights", "experts")


class DoneEvent:
    """A CPU event: the work it marks finished when it was recorded."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


DONE = DoneEvent()


class Streams:
    """One stream per role (``compute``, ``h2d``, ``d2h``, ``weights``, ``experts``) on ``device``."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            with torch.cuda.device(self.device):
                self._streams = {role: torch.cuda.Stream() for role in ROLES}

    def stream(self, role: str):
        return self._streams[role] if self.cuda else None

    def on(self, role: str):
        """Context: work issued inside runs on ``role``'s stream."""
        return torch.cuda.stream(self._streams[role]) if self.cuda else contextlib.nullcontext()

    def record(self, role: str, timing: bool = False):
        """An event marking everything issued so far on ``role``'s stream."""
        if not self.cuda:
            return DONE
        # blocking: a host thread waiting on it sleeps instead of spinning a core the CPU attention needs
        event = torch.cuda.Event(enable_timing=timing, blocking=True)
        event.record(self._streams[role])
        return event

    def wait(self, role: str, event) -> None:
        """``role``'s stream waits (on the device, not the host) until ``event`` has completed."""
        if self.cuda and event is not None and event is not DONE:
            self._streams[role].wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, role: str) -> None:
        """``tensor`` (allocated on another stream) is read on ``role``: the caching allocator must not hand
        its memory out again before that work has finished."""
        if self.cuda:
            tensor.record_stream(self._streams[role])

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
