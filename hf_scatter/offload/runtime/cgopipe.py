"""CGOPipe (MoE-Lightning, section 4 and Fig. 6): one batch through prefill and decode, GPU, CPU and link
overlapped.

Decode, per step, per stage s = 0..L (stage s = post-attention of layer s-1 + pre-attention of layer s,
see :mod:`paging`), per micro-batch j::

    driver  : wait CPU attention (s-1, j) -> issue H2D of its output -> issue GPU work (s, j) -> issue D2H
              of QKV (s, j) -> hand attention (s, j) to the CPU worker
    GPU     : post-attention of layer s-1 and pre-attention of layer s for j   (while the CPU runs j-1 / j+1)
    CPU     : attention of layer s for j, on the CPU KV cache                (while the GPU runs j+1)
    link    : hidden states up and QKV down on their own streams; stage s+1's weights page by page
              (at least one page per micro-batch, at most two queued: see paging.Pager)

so with two or more micro-batches the GPU and CPU work side by side, and the next stage's weights arrive
during the whole stage without ever holding up the small transfers. At the turn of a step each micro-batch starts
its next step as soon as its token is chosen, where the first stage's weights stay resident (else the CPU would
wait there for every micro-batch's last layer). Prefill runs the same stages on the GPU
(attention included) over chunks of whole prompts, writing each layer's keys and values to the CPU cache
through the worker.

Buffer reuse, each enforced by an event or by program order: a weight slot is refilled only after the
compute stream has passed the last stage that read it; the pinned QKV buffer of a micro-batch is
overwritten only after the attention that read it has returned; its pinned attention-output buffer only
after the upload that read it has completed; its GPU landing buffer only after the post-attention that
read it; tensors made on the compute stream and read by a copy stream are kept alive for that stream.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable

import torch

from ..families.adapter import PipelineAdapter
from ..plan.activations import HEAD_ROWS
from ..plan.attention_buckets import BucketCosts
from .attention import PackedPrompts, PromptCall, flash_varlen_runs, packed_prompts, prompt_attention, prompt_calls
from .batching import Batch
from .cpu_attention import AttentionWorker, KVCache, intra_op_threads
from .paging import WeightStreamer
from .sampling import History, Sampling
from .stage_graphs import StageBuffers, StageGraphs
from .stopping import Stopping
from .streams import DONE, Streams
from .trace import NullTracer

STORE_THREADS = 4  # threads of a prompt's KV store: a strided copy of a few MiB, bound by its region's start and wait


@dataclass
class _MicroBatch:
    index: int
    requests: tuple[int, ...]
    offset: int  # first row in the batch
    prompt_lens: list[int]
    positions: torch.Tensor  # [m] prompt lengths on the device
    tokens: torch.Tensor  # [m] the token each row feeds next
    attn_in: torch.Tensor  # [m, q] attention output landing buffer
    qkv_host: torch.Tensor  # [m, q + 2 kv] pinned
    out_host: torch.Tensor  # [m, q] pinned
    history: History | None = None  # each row's tokens so far, only while a processor reads them
    x: torch.Tensor | None = None  # [m, H] residual stream
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    pending: object = None  # Future of the CPU attention in flight
    out_free: object = DONE  # the upload that last read out_host
    post_done: object = DONE  # the post-attention that last read attn_in
    buffers: StageBuffers | None = None  # where its decode stages read and write, when they run as CUDA graphs
    started: int = -1  # the decode step whose first stage was issued ahead, at the end of the step before

    @property
    def rows(self) -> int:
        return len(self.requests)


@dataclass
class _Chunk:
    """Whole prompts of one micro-batch, prefilled together."""

    mb: int
    rows: list[tuple[int, int, int]]  # (row in the micro-batch, first token, end token)
    ids: torch.Tensor
    positions: torch.Tensor
    last: torch.Tensor  # index of each prompt's last token
    row_index: torch.Tensor  # rows of the micro-batch, on the device
    calls: list[PromptCall] | None = None  # its prompts' attention calls, the same in every layer ...
    packed: PackedPrompts | None = None  # ... or, on the GPU, its prompts packed for one FlashAttention call
    x: torch.Tensor | None = None
    attn: torch.Tensor | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.rows[-1][2]


@dataclass
class BatchResult:
    tokens: dict[int, list[int]]  # request -> new tokens (the finishing one included)
    first_token_s: dict[int, float] = field(default_factory=dict)  # seconds since the run started
    finish_s: dict[int, float] = field(default_factory=dict)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    routed: bool = False  # decode fetched only the chosen experts' streamed columns
    fetched_experts: int = 0  # expert blocks those fetches copied, over every stage and step
    graph_replays: int = 0  # decode stage halves (post- or pre-attention of a micro-batch) run as CUDA graphs


class StagingBuffers:
    """Pinned host buffers of the pipeline, allocated once for the largest batch seen and reused."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for s in shape:
            numel *= s
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            buf = torch.empty(numel, dtype=dtype, pin_memory=self.pin)
            self._buffers[name] = buf
        return buf[:numel].view(shape)


class CGOPipe:
    """Runs batches on ``adapter``'s model whose layer weights ``streamer`` pages through the device."""

    def __init__(self, adapter: PipelineAdapter, streamer: WeightStreamer, other: dict, rotary, streams: Streams,
                 worker: AttentionWorker, staging: StagingBuffers, chunk_tokens: int, group_tokens: int,
                 bucket_costs: BucketCosts = BucketCosts(), graphs: bool = False):
        self.adapter, self.streamer, self.other, self.rotary = adapter, streamer, other, rotary
        self.bucket_costs = bucket_costs
        self.streams, self.worker, self.staging = streams, worker, staging
        self.dims = adapter.dims
        self.chunk_tokens, self.group_tokens = chunk_tokens, group_tokens
        self.device = streams.device
        self.dtype = other["embed"].dtype
        self.num_stages = self.dims.layers + 1
        self.attention = adapter.layer_attention()  # each layer's window and sinks
        self.device_sinks = [None if a.sinks is None else a.sinks.to(self.device) for a in self.attention]
        self.flash_prompts = flash_varlen_runs(self.device, self.dtype, self.dims)  # prompt attention in one call
        self.graphs = StageGraphs(graphs)  # decode stages as CUDA graphs (see stage_graphs.graphs_wanted)

    # ------------------------------------------------------------------ one batch
    def run(self, batch: Batch, prompts: list[torch.Tensor], max_new_tokens: int, sampling: Sampling,
            generator, stopping: Stopping, tracer, on_step: Callable[[], None] | None = None,
            clock_origin: float | None = None, routed: bool = False) -> BatchResult:
        """New tokens of every request of ``batch`` (``prompts`` is indexed by request). ``routed``: decode
        streams only the experts the rows choose (the prefill streams every expert: its chunks choose them all)."""
        self.tracer = tracer
        self.streamer.tracer = tracer
        self.streamer.set_pages(len(batch.micro_batches))
        self.streamer.set_routed(False)
        origin = clock_origin if clock_origin is not None else time.perf_counter()
        with torch.no_grad(), self.streams.on("compute"):  # every device tensor of the run belongs to it
            return self._run(batch, prompts, max_new_tokens, sampling, generator, stopping, on_step, origin, routed)

    def _run(self, batch, prompts, max_new_tokens, sampling, generator, stopping, on_step, origin,
             routed) -> BatchResult:
        d = self.dims
        n = batch.size
        qkv_host = self.staging.get("qkv", (n, d.qkv_dim), self.dtype)
        out_host = self.staging.get("out", (n, d.q_dim), self.dtype)
        token_host = self.staging.get("tokens", (max_new_tokens, n), torch.long)
        graphed = self.graphs.enabled and not routed  # routed decode picks the experts to fetch on the host
        mbs, offset = [], 0
        for j, micro in enumerate(batch.micro_batches):
            m = len(micro)
            lens = [len(prompts[r]) for r in micro.requests]
            buffers = self.graphs.buffers(j, m, lambda: self._stage_buffers(m)) if graphed else None
            mbs.append(_MicroBatch(
                index=j, requests=micro.requests, offset=offset, prompt_lens=lens,
                positions=torch.tensor(lens, dtype=torch.long).to(self.device),
                tokens=torch.empty(m, dtype=torch.long, device=self.device),
                attn_in=buffers.attn_in if buffers else torch.empty(m, d.q_dim, dtype=self.dtype, device=self.device),
                qkv_host=qkv_host[offset:offset + m], out_host=out_host[offset:offset + m], buffers=buffers))
            self.streams.keep_alive(mbs[-1].attn_in, "h2d")  # also written by the upload stream
            if sampling.uses_history:
                mbs[-1].history = History.of([prompts[r] for r in micro.requests], max_new_tokens, self.device)
            offset += m
        kv = KVCache([[(p, p + max_new_tokens - 1) for p in mb.prompt_lens] for mb in mbs], d.layers, d.kv_heads,
                     d.head_dim, d.heads, self.dtype, self.bucket_costs, self.attention, d.values_are_keys)
        result = BatchResult(tokens={r: [] for r in batch.requests})
        finished: set[int] = set()
        token_events: list[list] = [[] for _ in range(max_new_tokens)]

        def collect(row: int) -> None:
            """Hand the tokens of generation row ``row`` to the requests still running."""
            for ev in token_events[row]:
                ev.synchronize()
            now = time.perf_counter() - origin
            values = token_host[row].tolist()
            for mb in mbs:
                for i, r in enumerate(mb.requests):
                    if r in finished:
                        continue
                    toks = result.tokens[r]
                    toks.append(values[mb.offset + i])
                    if row == 0:
                        result.first_token_s[r] = now
                    if stopping.done(toks) or len(toks) == max_new_tokens:
                        finished.add(r)
                        result.finish_s[r] = now

        start = time.perf_counter()
        self._prefill(mbs, kv, prompts, sampling, generator, token_host, token_events)
        collect(0)  # waits for the prefill: its time and every first token are then known
        result.prefill_s = time.perf_counter() - start
        if on_step:
            on_step()
        self.streamer.set_routed(routed)
        fetched, partial = self.streamer.fetched_experts, self.streamer.partial_loads
        replays = self.graphs.replays
        start = time.perf_counter()
        produced = collected = 1
        for t in range(max_new_tokens - 1):
            if len(finished) == n:
                break
            self._decode_step(t, mbs, kv, sampling, generator, token_host, token_events,
                              last=t + 2 >= max_new_tokens)
            produced += 1
            result.steps += 1
            if produced - collected > 1:  # read the tokens one step behind, so the device never drains
                collect(collected)
                collected += 1
            if on_step:
                on_step()
        for mb in mbs:  # a step issued ahead of a stop: its layer-0 attention still writes this batch's cache
            if mb.pending is not None:
                mb.pending.result()
                mb.pending = None
        while collected < produced and len(finished) < n:
            collect(collected)
            collected += 1
        result.decode_s = time.perf_counter() - start
        # routed only where some stage loaded without its experts (a one-layer model keeps its prefill's stages)
        result.routed = routed and self.streamer.partial_loads > partial
        result.fetched_experts = self.streamer.fetched_experts - fetched
        result.graph_replays = self.graphs.replays - replays
        return result

    # ------------------------------------------------------------------ scoring
    def logits(self, batch: Batch, prompts: list[torch.Tensor]) -> dict[int, torch.Tensor]:
        """fp32 logits ``[len, vocab]`` on the CPU for every position of every request of ``batch``: the
        prefill's stages (GPU attention within each prompt, weights streamed once per group of chunks) with
        the LM head on every token and no KV cache, as a log-likelihood needs."""
        self.tracer = self.streamer.tracer = NullTracer()  # not a traced generate's leftover
        self.streamer.set_pages(len(batch.micro_batches))
        self.streamer.set_routed(False)
        mbs = [SimpleNamespace(index=j, requests=micro.requests, prompt_lens=[len(prompts[r]) for r in micro.requests])
               for j, micro in enumerate(batch.micro_batches)]
        out: dict[int, torch.Tensor] = {}
        adapter = self.adapter
        with torch.no_grad(), self.streams.on("compute"):
            for group in self._groups(self._chunks(mbs, prompts)):
                for s in range(self.num_stages):
                    w = self.streamer.enter(s)
                    for c in group:
                        if self._prompt_stage(c, s, w) is None:  # past the last layer: every token's logits
                            rows = torch.cat([adapter.logits(self.other, c.x[i:i + HEAD_ROWS]).cpu()
                                              for i in range(0, c.tokens, HEAD_ROWS)])
                            for row, a, b in c.rows:
                                out[mbs[c.mb].requests[row]] = rows[a:b]
                    self.streamer.leave()
                for c in group:
                    c.x = c.attn = c.cos = c.sin = None
        return out

    # ------------------------------------------------------------------ decode
    def _decode_step(self, t: int, mbs: list[_MicroBatch], kv: KVCache, sampling: Sampling, generator,
                     token_host: torch.Tensor, token_events: list, last: bool = True) -> None:
        """Feed token t of every row (position prompt + t), produce token t + 1. Unless ``last``, a micro-batch's
        first stage of step t + 1 is issued right after its token is chosen, where that stage's weights are all
        resident: its layer-0 attention then runs on the CPU while the GPU finishes the other micro-batches'
        last layer (issued in stage order, the CPU idled at every step's turn: about 11 ms of a 162 ms step,
        GPT-OSS-120B's shapes on one H200)."""
        streams, tracer, L = self.streams, self.tracer, self.dims.layers
        first_stage = None if last else self.streamer.resident(0)
        for s in range(self.num_stages):
            w = self.streamer.enter(s)
            for mb in mbs:
                label = f"step {t} stage {s} mb {mb.index}"
                if s == 0:
                    if mb.started != t:  # else issued at the end of the previous step
                        self._first_stage(w, mb, t, kv)
                    continue
                self._upload_attention(mb, label)
                with tracer.host_span("Driver", f"issue post {label}"), \
                        tracer.device_span("compute", f"post L{s - 1} {label}"):
                    self._post(s, w, mb)
                mb.post_done = streams.record("compute")
                if s < L:
                    self._issue_pre(s, w, mb, t, kv, label)
                    continue
                with tracer.device_span("compute", f"head {label}"):
                    history = mb.history and mb.history.view(slice(None), t + 1)
                    mb.tokens = self._next_tokens(mb.x, sampling, generator, history)
                    if history is not None:
                        mb.history.record(slice(None), t + 1, mb.tokens)
                token_events[t + 1].append(
                    self._download(mb.tokens, token_host[t + 1, mb.offset:mb.offset + mb.rows], f"tokens {label}"))
                if first_stage is not None:
                    self._first_stage(first_stage, mb, t + 1, kv)
                    mb.started = t + 1
            self.streamer.leave()

    def _first_stage(self, w, mb: _MicroBatch, t: int, kv: KVCache) -> None:
        """Stage 0 of ``mb`` at step t: the embedding of the tokens it feeds, then layer 0's pre-attention."""
        label = f"step {t} stage 0 mb {mb.index}"
        with self.tracer.device_span("compute", f"embed {label}"):
            self._embed(mb, t)
        self._issue_pre(0, w, mb, t, kv, label)

    def _issue_pre(self, s: int, w, mb: _MicroBatch, t: int, kv: KVCache, label: str) -> None:
        """Layer s's pre-attention of ``mb`` at step t on the GPU, its QKV down, its attention to the CPU worker."""
        with self.tracer.host_span("Driver", f"issue pre {label}"):
            with self.tracer.device_span("compute", f"pre L{s} {label}"):
                qkv = self._pre(s, w, mb)
            done = self._download(qkv, mb.qkv_host, f"qkv {label}")
            mb.pending = self.worker.submit(self._attend, kv, s, mb, t, done, mb.out_free)

    def _stage_buffers(self, rows: int) -> StageBuffers:
        d, dev = self.dims, self.device
        return StageBuffers(x=torch.zeros(rows, d.hidden, dtype=self.dtype, device=dev),
                            attn_in=torch.zeros(rows, d.q_dim, dtype=self.dtype, device=dev),
                            qkv=torch.zeros(rows, d.qkv_dim, dtype=self.dtype, device=dev))

    def _embed(self, mb: _MicroBatch, t: int) -> None:
        """Stage 0's start, on the host's side of the graphs (the positions move every step): the embedding of
        the tokens fed at step ``t`` and their rotary tables."""
        x = self.adapter.embed(self.other, mb.tokens)
        cos, sin = self.rotary(x, (mb.positions + t).unsqueeze(0))
        b = mb.buffers
        if b is None:
            mb.x, mb.cos, mb.sin = x, cos[0], sin[0]
            return
        if b.cos is None:
            b.cos, b.sin = torch.empty_like(cos[0]), torch.empty_like(sin[0])
        b.x.copy_(x)
        b.cos.copy_(cos[0])
        b.sin.copy_(sin[0])
        mb.x, mb.cos, mb.sin = b.x, b.cos, b.sin

    def _post(self, s: int, w, mb: _MicroBatch) -> None:
        """Layer s-1's post-attention of ``mb``: its next residual stream into ``mb.x``."""
        adapter, b = self.adapter, mb.buffers
        if b is None:
            mb.x = adapter.post(w.post, w.experts, mb.x, mb.attn_in, self.streamer.fetch_experts)
            return
        # w: the same tensors whenever stage s sits in this slot (the store caches them), so they key the graph
        self.graphs.run(("post", s, mb.index, mb.rows), id(w),
                        lambda: b.x.copy_(adapter.post(w.post, w.experts, b.x, b.attn_in)))

    def _pre(self, s: int, w, mb: _MicroBatch) -> torch.Tensor:
        """Layer s's pre-attention of ``mb``: [m, q + 2 kv] with the rotary embedding applied."""
        adapter, b = self.adapter, mb.buffers
        if b is None:
            return adapter.qkv(w.pre, mb.x, mb.cos, mb.sin)
        self.graphs.run(("pre", s, mb.index, mb.rows), id(w),
                        lambda: b.qkv.copy_(adapter.qkv(w.pre, b.x, b.cos, b.sin)))
        return b.qkv

    def _next_tokens(self, x: torch.Tensor, sampling: Sampling, generator,
                     history: History | None = None) -> torch.Tensor:
        """Final norm, LM head and the token choice, HEAD_ROWS rows at a time (bounded [rows, vocab]
        temporaries); ``history``: these rows' tokens, where a logits processor reads them."""
        return torch.cat([sampling.choose(self.adapter.logits(self.other, x[i:i + HEAD_ROWS]), generator,
                                          history and history.view(slice(i, i + HEAD_ROWS)))
                          for i in range(0, x.shape[0], HEAD_ROWS)])

    def _upload_attention(self, mb: _MicroBatch, label: str) -> None:
        """Wait for the CPU attention of the previous stage and bring its output to the device."""
        with self.tracer.host_span("Driver", f"wait attention {label}"):
            mb.pending.result()
        streams = self.streams
        streams.wait("h2d", mb.post_done)  # attn_in's last reader has finished
        with streams.on("h2d"), self.tracer.device_span("h2d", f"attn out {label}"):
            mb.attn_in.copy_(mb.out_host, non_blocking=True)
        mb.out_free = streams.record("h2d")
        self.streamer.make_way(mb.out_free)  # its wait, post_done, has passed: the attention read the QKV after it
        streams.wait("compute", mb.out_free)

    def _download(self, src: torch.Tensor, dst: torch.Tensor, label: str):
        """Copy a tensor made on the compute stream into pinned ``dst`` on the D2H stream; returns the event
        marking its arrival."""
        streams = self.streams
        streams.wait("d2h", streams.record("compute"))
        with streams.on("d2h"), self.tracer.device_span("d2h", label):
            dst.copy_(src, non_blocking=True)
            streams.keep_alive(src, "d2h")
        return streams.record("d2h")

    def _attend(self, kv: KVCache, layer: int, mb: _MicroBatch, step: int, qkv_ready, out_free) -> None:
        qkv_ready.synchronize()
        out_free.synchronize()  # the upload of the previous output from out_host has completed
        with self.tracer.host_span("CPU attention", f"step {step} L{layer} mb {mb.index}"):
            kv.attend(layer, mb.index, step, mb.qkv_host, mb.out_host)

    # ------------------------------------------------------------------ prefill
    def _prefill(self, mbs: list[_MicroBatch], kv: KVCache, prompts: list[torch.Tensor], sampling: Sampling,
                 generator, token_host: torch.Tensor, token_events: list) -> None:
        tracer, d = self.tracer, self.dims
        chunks = self._chunks(mbs, prompts)
        kv_dim = d.kv_width
        biggest = max(c.tokens for c in chunks)
        staging = [self.staging.get(f"prompt_kv{i}", (biggest, kv_dim), self.dtype) for i in range(2)]
        in_use = [None, None]  # Future of the cache write still reading each staging buffer
        downloads = 0
        for group in self._groups(chunks):
            for s in range(self.num_stages):
                w = self.streamer.enter(s)
                for c in group:
                    mb = mbs[c.mb]
                    label = f"prefill stage {s} mb {c.mb} rows {c.rows[0][0]}-{c.rows[-1][0]}"
                    with tracer.host_span("Driver", f"issue {label}"), tracer.device_span("compute", label):
                        qkv = self._prompt_stage(c, s, w)
                        if qkv is not None:
                            keys_values = qkv[:, d.q_dim:].contiguous()
                        else:
                            history = mb.history and mb.history.view(c.row_index, 0)
                            first = self._next_tokens(c.x[c.last], sampling, generator, history)
                            mb.tokens.index_copy_(0, c.row_index, first)
                            if history is not None:
                                mb.history.record(c.row_index, 0, first)
                    if s < d.layers:
                        i = downloads % 2
                        downloads += 1
                        if in_use[i] is not None:
                            with tracer.host_span("Driver", f"wait prompt kv store {label}"):
                                in_use[i].result()
                        buf = staging[i][:c.tokens]
                        done = self._download(keys_values, buf, f"prompt kv {label}")
                        in_use[i] = self.worker.submit(self._store_prompt, kv, s, c, buf, done)
                self.streamer.leave()
            for c in group:  # free the group's activations before the next one
                c.x = c.attn = c.cos = c.sin = None
        for fut in in_use:
            if fut is not None:
                fut.result()
        for mb in mbs:
            token_events[0].append(self._download(mb.tokens, token_host[0, mb.offset:mb.offset + mb.rows],
                                                  f"tokens prefill mb {mb.index}"))

    def _prompt_stage(self, c: _Chunk, s: int, w) -> torch.Tensor | None:
        """Stage ``s`` of a chunk of whole prompts on the GPU: the embedding (s = 0) or layer s-1's
        post-attention, then layer s's QKV and attention within each prompt; returns the QKV (None past
        the last layer)."""
        adapter = self.adapter
        if s == 0:
            c.x = adapter.embed(self.other, c.ids)
            cos, sin = self.rotary(c.x, c.positions.unsqueeze(0))
            c.cos, c.sin = cos[0], sin[0]
        else:
            c.x = adapter.post(w.post, w.experts, c.x, c.attn)
        if s == self.dims.layers:
            c.attn = None
            return None
        qkv = adapter.qkv(w.pre, c.x, c.cos, c.sin)
        # the scores of a block of queries (sinks) within what the chunk's workspace was sized for
        c.attn = prompt_attention(qkv, c.rows, self.dims, self.attention[s], self.device_sinks[s], calls=c.calls,
                                  packed=c.packed,
                                  max_score_bytes=self.chunk_tokens * self.dims.q_dim * self.dtype.itemsize)
        return qkv

    def _store_prompt(self, kv: KVCache, layer: int, c: _Chunk, buf: torch.Tensor, ready) -> None:
        ready.synchronize()
        with self.tracer.host_span("CPU attention", f"store prompt kv L{layer} mb {c.mb}"), \
                intra_op_threads(STORE_THREADS):
            kv.write_prompts(layer, c.mb, c.rows, buf)

    def _chunks(self, mbs: list[_MicroBatch], prompts: list[torch.Tensor]) -> list[_Chunk]:
        chunks = []
        for mb in mbs:
            current: list[int] = []
            tokens = 0
            for i, p in enumerate(mb.prompt_lens):
                if current and tokens + p > self.chunk_tokens:
                    chunks.append(self._chunk(mb, current, prompts))
                    current, tokens = [], 0
                current.append(i)
                tokens += p
            if current:
                chunks.append(self._chunk(mb, current, prompts))
        return chunks

    def _chunk(self, mb: _MicroBatch, rows: list[int], prompts: list[torch.Tensor]) -> _Chunk:
        spans, a = [], 0
        for i in rows:
            spans.append((i, a, a + mb.prompt_lens[i]))
            a += mb.prompt_lens[i]
        ids = torch.cat([prompts[mb.requests[i]] for i in rows])
        positions = torch.cat([torch.arange(mb.prompt_lens[i]) for i in rows])
        last = torch.tensor([b - 1 for _, _, b in spans])
        dev, flash = self.device, self.flash_prompts
        return _Chunk(mb.index, spans, ids.to(dev), positions.to(dev), last.to(dev),
                      torch.tensor(rows, dtype=torch.long).to(dev), None if flash else prompt_calls(spans, dev),
                      packed_prompts(spans, dev) if flash else None)

    def _groups(self, chunks: list[_Chunk]) -> list[list[_Chunk]]:
        """Consecutive chunks whose activations fit on the device together (each group streams the
        weights once)."""
        groups, tokens = [], 0
        for c in chunks:
            if groups and tokens + c.tokens <= self.group_tokens:
                groups[-1].append(c)
                tokens += c.tokens
            else:
                groups.append([c])
                tokens = c.tokens
        return groups
