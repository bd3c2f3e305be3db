"""Decode stages issued as CUDA graphs, so the host is left to the CPU attention.

Issuing one decode stage of an MXFP4 GPT-OSS layer from Python (output projection, norm, router, sort, the
expert kernels, QKV, rotary) takes the driver thread 2-3 ms per micro-batch, mostly Triton's launcher, and
on the hosts measured that time adds to the CPU attention's instead of hiding behind it. A CUDA graph of the
stage, captured once per stage, micro-batch and weight slot and replayed on every later step, is one
launch.

A graph reads and writes fixed addresses, so a graphed stage takes its inputs from and leaves its outputs in
:class:`StageBuffers` (one set per micro-batch, kept with the graphs), and the weights it reads are the slot
views :meth:`WeightStore.stage_weights` caches per (stage, slot): the same tensors every time the stage is in
that slot. The pipeline's events order everything around a replay as they ordered the eager calls.

Graphs are used on CUDA only, where decode streams whole stages (routed streaming decides on the host which
experts to fetch, mid-stage). A tensor-parallel rank's stage captures its NCCL all-reduces with it (its first run
is eager, so the communicator exists before any capture); a rank whose capture fails runs that stage eagerly,
which issues the same collectives in the same order, so the ranks still meet.
``HF_SCATTER_OFFLOAD_GRAPHS=0`` turns them off. A stage whose capture fails runs eagerly from then on, with
one warning naming the reason.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from ...kernels.backend import env_switch


def graphs_wanted(device: torch.device) -> bool:
    """Whether decode's stages run as CUDA graphs on ``device``."""
    return device.type == "cuda" and env_switch("HF_SCATTER_OFFLOAD_GRAPHS") is not False


@dataclass
class StageBuffers:
    """The fixed addresses a micro-batch's graphed stages read and write."""

    x: torch.Tensor  # [m, H] residual stream
    attn_in: torch.Tensor  # [m, q] the CPU attention's output, uploaded
    qkv: torch.Tensor  # [m, q + 2 kv] the stage's QKV, downloaded for the CPU attention
    cos: torch.Tensor | None = None  # [m, rotary width], once the first embedding has shown the width
    sin: torch.Tensor | None = None


class StageGraphs:
    """CUDA graphs of decode stages by key, sharing one memory pool (a stage's intermediates are dead by the
    end of its capture, and stages replay one at a time on one stream)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled  # (graphs_wanted) and no capture has failed
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._warm: set[Hashable] = set()  # work run once eagerly (kernels compiled and tuned at its shapes)
        self._buffers: dict[tuple[int, int], StageBuffers] = {}
        self._pool = None
        self.replays = 0  # graphed stage runs, the capturing ones included

    def buffers(self, index: int, rows: int, make: Callable[[], StageBuffers]) -> StageBuffers:
        """Micro-batch ``index``'s buffers for ``rows`` rows (the same ones for every batch of that shape)."""
        key = (index, rows)
        if key not in self._buffers:
            self._buffers[key] = make()
        return self._buffers[key]

    def run(self, work: Hashable, weights: Hashable, stage: Callable[[], None]) -> None:
        """Run ``stage`` (which writes its results into buffers of ours) as a graph: ``work`` names what it computes
        at which shapes, ``weights`` the tensors it reads. Eagerly the first time ``work`` comes (a kernel's first
        call at new shapes compiles or tunes it, which a capture cannot hold), then captured once per weights and
        replayed; eagerly whenever graphs are off."""
        if not self.enabled or work not in self._warm:
            self._warm.add(work)
            stage()
            return
        key = (work, weights)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(stage)
            if graph is None:
                stage()
                return
            self._graphs[key] = graph
        graph.replay()
        self.replays += 1

    def _capture(self, stage: Callable[[], None]) -> torch.cuda.CUDAGraph | None:
        # not torch.cuda.graph(): it synchronizes the device and empties the allocator's cache on entry, and the
        # driver thread must not wait for the device here. thread_local: the pager and the attention threads go on
        # with their own CUDA calls during the capture.
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        failure = None
        try:
            graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
        except RuntimeError as error:
            failure = error
        else:
            try:
                stage()
            except RuntimeError as error:  # a host sync or a pageable copy inside the stage
                failure = error
            finally:
                try:
                    graph.capture_end()
                except RuntimeError as error:
                    failure = failure or error
        if failure is not None:
            self.enabled = False
            self._graphs.clear()
            warnings.warn(f"hf_scatter: offloaded decode runs its stages eagerly: capturing one as a CUDA graph "
                          f"failed ({str(failure).splitlines()[0]}); HF_SCATTER_OFFLOAD_GRAPHS=0 skips the attempt",
                          RuntimeWarning, stacklevel=3)
            return None
        return graph

    def clear(self) -> None:
        """Drop every graph and buffer (their memory returns to the allocator)."""
        self._graphs.clear()
        self._warm.clear()
        self._buffers.clear()
        self._pool = None
