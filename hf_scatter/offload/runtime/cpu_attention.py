"""Decode attention on the CPU over a CPU-resident KV cache, run by a worker thread beside the GPU.

The KV cache of a batch lives in CPU memory in the model's dtype (bf16 for a bf16 model). Within a
micro-batch, requests (longest first, as :mod:`batching` orders them) are grouped into *length buckets*;
each bucket is one ``[requests, kv_heads, capacity, head_dim]`` tensor per layer, so a decode step is one
fused SDPA call per bucket (:func:`~.attention.decode_attention`): grouped-query attention reads each KV head once for
all the query heads that share it (expanding K/V per query head was 10-25x slower on the H100 host).
The buckets trade the two costs of a call: a fixed one (the handoff to the worker and its thread team; about 0.3 ms on
the 16-core H100 host) and the padded rows it reads. :func:`~hf_scatter.offload.plan.attention_buckets.length_buckets`
picks them with the partition DP, never padding a bucket beyond ``1 + slack`` of its real tokens (which bounds
the cache's memory).

:class:`AttentionWorker` is a single thread, so tasks run in the order the pipeline submits them, whose
intra-op thread count comes from the hardware profile (cores are left to the threads driving the GPU and the pager:
:func:`~hf_scatter.offload.plan.tensor_parallel.attention_threads`).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..families.adapter import LayerAttention
from ..plan.attention_buckets import BucketCosts
from ..plan.tensor_parallel import attention_threads as threads_per_rank
from .attention import decode_attention, visible_keys, window_start

@dataclass
class _Bucket:
    start: int
    end: int
    capacity: int
    k: torch.Tensor  # [layers, n, kv_heads, capacity, head_dim]
    v: torch.Tensor
    rows: torch.Tensor  # arange(n)
    max_prompt: int
    min_prompt: int


class KVCache:
    """KV cache of one batch. ``micro_batches[j]`` lists ``(prompt_len, capacity)`` of its rows, longest
    first; capacity = prompt + the new tokens whose keys will be stored (max_new_tokens - 1). ``attention``:
    each layer's window, sinks and scale (default: plain causal attention). ``values_are_keys``: the cache
    holds keys only and attends with them as the values too (MLA's latent), at half the memory."""

    def __init__(self, micro_batches: Sequence[Sequence[tuple[int, int]]], layers: int, kv_heads: int,
                 head_dim: int, q_heads: int, dtype: torch.dtype, costs: BucketCosts = BucketCosts(),
                 attention: Sequence[LayerAttention] | None = None, values_are_keys: bool = False):
        self.layers, self.kv_heads, self.head_dim, self.q_heads = layers, kv_heads, head_dim, q_heads
        self.dtype = dtype
        self.values_are_keys = values_are_keys
        self.attention = list(attention) if attention is not None else [LayerAttention()] * layers
        if len(self.attention) != layers:
            raise ValueError(f"KVCache: {len(self.attention)} layers' attention settings for {layers} layers")
        row_token_bytes = self._row_token_bytes(kv_heads, head_dim, dtype.itemsize, values_are_keys)
        self.prompt_lens = []
        # the current decode step's positions and masks, by micro-batch (and bucket and window): every layer of the
        # step reads the same ones, so each is made once a step, not once a layer (each op is a parallel region
        # of the attention threads)
        self._step = None
        self._step_tensors: dict = {}
        self.buckets: list[list[_Bucket]] = []
        self.row_bucket: list[list[tuple[int, int]]] = []
        for rows in micro_batches:
            lens = torch.tensor([p for p, _ in rows], dtype=torch.long)
            self.prompt_lens.append(lens)
            buckets, where = [], []
            for b, (start, end, cap) in enumerate(costs.buckets([c for _, c in rows], row_token_bytes)):
                n = end - start
                shape = (layers, n, kv_heads, cap, head_dim)
                # zeros, not empty: masked keys get zero weight, but 0 x NaN garbage in V would still be NaN
                k = torch.zeros(shape, dtype=dtype)
                v = k if values_are_keys else torch.zeros(shape, dtype=dtype)
                buckets.append(_Bucket(start, end, cap, k, v, torch.arange(n), int(lens[start:end].max()),
                                       int(lens[start:end].min())))
                where += [(b, i) for i in range(n)]
            self.buckets.append(buckets)
            self.row_bucket.append(where)

    @staticmethod
    def planned_bytes(micro_batches: Sequence[Sequence[tuple[int, int]]], layers: int, kv_heads: int, head_dim: int,
                      dtype_bytes: int, costs: BucketCosts = BucketCosts(), values_are_keys: bool = False) -> int:
        """Bytes the cache would take, without allocating it."""
        row_token_bytes = KVCache._row_token_bytes(kv_heads, head_dim, dtype_bytes, values_are_keys)
        return sum((end - start) * cap * layers * row_token_bytes for rows in micro_batches
                   for start, end, cap in costs.buckets([c for _, c in rows], row_token_bytes))

    @staticmethod
    def _row_token_bytes(kv_heads: int, head_dim: int, dtype_bytes: int, values_are_keys: bool) -> int:
        """One row's cache of one token in one layer: keys and values, or the keys alone when they are both."""
        return (1 if values_are_keys else 2) * kv_heads * head_dim * dtype_bytes

    @property
    def nbytes(self) -> int:
        return sum(b.k.nbytes + (0 if b.v is b.k else b.v.nbytes) for mb in self.buckets for b in mb)

    def write_prompts(self, layer: int, mb: int, rows: Sequence[tuple[int, int, int]], kv: torch.Tensor) -> None:
        """Prompt keys/values of layer ``layer``: ``rows`` = (row in the micro-batch, first token, end token)
        into ``kv`` [tokens, 2 * kv_heads * head_dim] (keys, then values; the keys alone when they are the
        values)."""
        kv_dim, Hkv, d = self.kv_heads * self.head_dim, self.kv_heads, self.head_dim
        # one copy per run of prompts of one length that sit side by side in ``kv`` and in one bucket (prompts come
        # longest first, so a chunk has few runs): a copy per prompt, each a parallel region of every attention
        # thread, made the CPU's prompt stores most of the prefill (3.1 of 4.5 s, 8 layers on the H100 host)
        for bucket, i, a, g, p in self._runs(mb, rows):
            cache, src = self.buckets[mb][bucket], kv[a:a + g * p]
            cache.k[layer, i:i + g, :, :p].copy_(src[:, :kv_dim].view(g, p, Hkv, d).transpose(1, 2))
            if not self.values_are_keys:
                cache.v[layer, i:i + g, :, :p].copy_(src[:, kv_dim:].view(g, p, Hkv, d).transpose(1, 2))

    def _runs(self, mb: int, rows: Sequence[tuple[int, int, int]]) -> list[tuple[int, int, int, int, int]]:
        """``rows`` as runs (bucket, first row in it, first token, prompts, length): consecutive prompts of one
        length, adjacent in the token buffer and in one bucket."""
        runs: list[list[int]] = []
        for row, a, b in rows:
            bucket, i = self.row_bucket[mb][row]
            last = runs[-1] if runs else None
            if last and last[0] == bucket and last[1] + last[3] == i and last[2] + last[3] * last[4] == a \
                    and last[4] == b - a:
                last[3] += 1
            else:
                runs.append([bucket, i, a, 1, b - a])
        return [tuple(r) for r in runs]

    def attend(self, layer: int, mb: int, step: int, qkv: torch.Tensor, out: torch.Tensor) -> None:
        """Decode step ``step`` (0 = the first token after the prompt) of every row of micro-batch ``mb``:
        store its new key/value at position prompt + step, attend over positions 0..prompt + step.
        ``qkv`` [rows, q + 2 kv] (rotary applied; [rows, q + kv] when the keys are the values), ``out`` [rows, q]."""
        H, Hkv, d = self.q_heads, self.kv_heads, self.head_dim
        qd, kvd = H * d, Hkv * d
        setting = self.attention[layer]
        window, sinks = setting.window, setting.sinks
        for i, b in enumerate(self.buckets[mb]):
            a, e, n = b.start, b.end, b.end - b.start
            k_cache, v_cache = b.k[layer], b.v[layer]
            pos = self._this_step(step, ("positions", mb, i), lambda: self.prompt_lens[mb][a:e] + step)
            k_cache[b.rows, :, pos] = qkv[a:e, qd:qd + kvd].view(n, Hkv, d)
            if not self.values_are_keys:
                v_cache[b.rows, :, pos] = qkv[a:e, qd + kvd:].view(n, Hkv, d)
            length = b.max_prompt + step + 1
            first = window_start(b.min_prompt + step, window)  # no row of the bucket sees keys before it
            # rows of different lengths: hide each shorter row's unused tail, and the keys before its window
            # (rows of one length see exactly keys [first, length))
            mask = self._this_step(step, ("mask", mb, i, window), lambda: visible_keys(pos, first, length, window)) \
                if b.min_prompt != b.max_prompt else None
            decode_attention(qkv[a:e, :qd].view(n, H, d), k_cache[:, :, first:length], v_cache[:, :, first:length],
                             mask, sinks, setting.scale, out=out[a:e].view(n, H, d))

    def _this_step(self, step: int, key: tuple, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, made once for decode step ``step`` (the tensors of earlier steps are dropped: every micro-batch
        finishes a step's layers before the next step starts)."""
        if step != self._step:
            self._step, self._step_tensors = step, {}
        if key not in self._step_tensors:
            self._step_tensors[key] = make()
        return self._step_tensors[key]


def attention_threads(profile=None, ranks: int = 1) -> int:
    """Intra-op threads for CPU attention in one of ``ranks`` processes sharing the profile's cores (else this
    machine's): :func:`~hf_scatter.offload.plan.tensor_parallel.attention_threads`."""
    cores = getattr(profile, "cpu_cores", None) or os.cpu_count() or 1
    return threads_per_rank(cores, ranks)


def _init_worker(threads: int) -> None:
    torch.set_num_threads(threads)


@contextlib.contextmanager
def intra_op_threads(threads: int):
    """Run this thread's torch ops on at most ``threads`` threads meanwhile. For small copies: a region of every
    attention thread costs more in its start and its wait for the slowest member than the copy itself (a prompt's
    KV store of 2 MiB took 4.4 ms with 63 threads while the GPU thread was busy, H100 x4 host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, min(threads, before)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


class AttentionWorker:
    """One thread running CPU-side tasks in submission order (grad mode off)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-scatter-cpu-attention",
                                        initializer=_init_worker, initargs=(threads,))

    def submit(self, fn: Callable, *args) -> Future:
        return self._pool.submit(_no_grad, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _no_grad(fn, *args):
    with torch.no_grad():
        return fn(*args)
