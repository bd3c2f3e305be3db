"""``hf_scatter.offload_model(model, gpu_memory="16GiB")``: batch generation with a MoE model larger than the GPU.

The model's decoder layers move into a :class:`~hf_scatter.offload.paging.WeightStore` (a resident part on
the GPU, the rest in pinned CPU memory), the policy comes from the HRM search unless given, and
:meth:`OffloadedModel.generate` runs the requests through :class:`~hf_scatter.offload.cgopipe.CGOPipe` in
batches planned by Algorithm 2. ``device="cpu"`` runs the very same pipeline with the CPU standing in for
the GPU (streams become no-ops), which is how it is tested without one. With ``group=`` every process of a
torchrun group keeps its share of every layer (:mod:`~hf_scatter.offload.families.sharding`) and runs the same
pipeline on it.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from ...common.units import format_bytes, parse_bytes
from ...kernels.backend import autotune_override
from ..families.registry import adapter_for
from ..families.sharding import Shard
from ..families.spec import ModelSpec
from ..plan.activations import decode_bytes, prefill_bytes
from ..plan.attention_buckets import SLACK, BucketCosts
from ..plan.cost_model import CostOptions, decode_layer_time
from ..plan.known_profiles import load_profile
from ..plan.policy import PlanError, Policy, Workload
from ..plan.profile import HardwareProfile, host_memory_bytes
from ..plan.search import search_policy
from .batching import plan_batches
from .cgopipe import CGOPipe, StagingBuffers
from .cpu_attention import AttentionWorker, attention_threads
from .memory import DevicePlan, cublas_workspace_bytes, plan_device
from .paging import WeightStore, WeightStreamer
from .sampling import Sampling
from .stage_graphs import graphs_wanted
from .stopping import Stopping
from .streams import Streams
from .trace import NullTracer, Tracer

# What the policy is planned for when offload_model() is not told the workload: `hf-scatter plan`'s defaults.
DEFAULT_WORKLOAD = Workload(prompt_len=512, gen_len=64)
# device="cpu" has no GPU to plan for: a small fixed policy, every weight streamed.
CPU_DEVICE_POLICY = Policy(batch_size=32, micro_batch_size=8)
CGOPIPE_PLACEMENT = (False, True)  # attention on the CPU, experts on the GPU
EXPERT_STREAMING = ("auto", "routed", "all")  # OffloadedModel.expert_streaming's values
# generate()'s keywords that a transformers GenerationConfig also carries, and their values when neither sets
# them (None: the model's own eos / pad, or off). As in model.generate, a field set in generation_config is the
# default that the keyword overrides.
GENERATION_DEFAULTS = {"max_new_tokens": 20, "min_new_tokens": 0, "do_sample": False, "temperature": 1.0,
                       "top_k": None, "top_p": None, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                       "eos_token_id": None, "pad_token_id": None, "stop_strings": None}
# GenerationConfig fields that change no token here: caching and compilation (the runtime has its own), and
# tokens a causal LM's generate does not use.
IGNORED_GENERATION_FIELDS = frozenset({
    "bos_token_id", "decoder_start_token_id", "use_cache", "cache_implementation", "cache_config", "max_cache_len",
    "compile_config", "disable_compile", "prefill_chunk_size", "low_memory", "transformers_version"})
# what to use instead, for the unimplemented fields people reach for most
GENERATION_FIELD_FIXES = {"max_length": "set max_new_tokens instead", "min_length": "set min_new_tokens instead",
                          "num_beams": "the runtime decodes greedily or samples, one sequence per request",
                          "num_return_sequences": "repeat the request instead"}


@dataclass(frozen=True)
class RequestTiming:
    """Seconds since ``generate`` started: first new token seen by the host, and the last one."""

    request: int
    batch: int
    prompt_tokens: int
    new_tokens: int
    first_token_s: float
    finish_s: float


@dataclass
class GenerationResult:
    """``sequences``: HF-style [requests, input length + new tokens] (input_ids given), pad after a request
    ends; ``tokens``: each request's new tokens (the finishing one included); ``texts``: their decoded text
    (a tokenizer given); all in input order."""

    sequences: torch.Tensor | None
    tokens: list[list[int]]
    texts: list[str] | None
    timings: list[RequestTiming]
    stats: dict = field(default_factory=dict)


@dataclass
class _BatchesRun:
    """What running a request list's batches produced: tokens and timings per request, and the clocks."""

    tokens: list[list[int]]
    timings: list[RequestTiming | None]
    prefill_s: float = 0.0
    decode_s: float = 0.0
    steps: int = 0
    wall_s: float = 0.0
    routed_batches: int = 0  # batches whose decode streamed only the chosen experts
    routed_steps: int = 0  # their decode steps
    fetched_experts: int = 0  # expert blocks those steps fetched
    graph_replays: int = 0  # decode stage halves run as CUDA graph replays


def offload_model(model, gpu_memory: int | float | str = "16GiB", cpu_memory: int | float | str | None = None,
            policy: Policy | None = None, device: str | torch.device = "cuda", *, profile=None,
            workload: Workload | None = None, release_weights: bool = True, progress: bool = True,
            group=None) -> "OffloadedModel":
    """Prepare ``model`` (a causal LM on the CPU of a family in ``offloaded_model_types()``, a checkpoint path
    loaded onto the CPU, or a function of no arguments returning such a model) for offloaded generation within
    ``gpu_memory`` of device memory and ``cpu_memory`` of host memory.

    ``policy``: a :class:`Policy`; default: the HRM's best for ``workload`` (default prompts of 512 tokens,
    64 new) on ``profile`` (a :class:`HardwareProfile`, a known name or a JSON path; default this
    machine's saved profile from ``hf-scatter profile``). ``release_weights``: move the layers' weights out
    of ``model`` (it then holds meta tensors and cannot run by itself) instead of keeping a second copy in
    host memory.

    ``group``: a ``torch.distributed`` process group of one process per GPU of this host (``torchrun
    --nproc_per_node N``, each process on its own ``torch.cuda.set_device``), which then split every layer
    (tensor parallelism: each GPU holds and streams its share of every weight, attends its heads on the CPU, and
    the hidden states are all-reduced after attention and after the FFN). Every rank calls ``offload`` and
    ``generate`` with the same arguments and gets the same tokens. ``gpu_memory`` is per GPU, ``cpu_memory`` the
    whole host's. Given a path or a loader, the ranks load one after the other, each keeping its share and freeing
    the rest, so the host holds one whole model at a time (a model object passed in is already whole in every
    process).
    """
    shard = Shard.of(group)
    if policy is not None and not isinstance(policy, Policy):
        raise TypeError(f"policy must be a hf_scatter.offload.Policy, got {type(policy).__name__}")
    if policy is not None and policy.gpus != shard.size:
        raise PlanError(f"the policy is planned for {policy.gpus} GPU(s), but this group has {shard.size}: plan "
                        f"with gpus={shard.size} (hf-scatter plan --gpus {shard.size}), or leave policy out")
    device = _device(device)
    _check_group_call(shard, device, model, {
        "gpu_memory": gpu_memory, "cpu_memory": cpu_memory, "policy": policy, "workload": workload,
        "profile": getattr(profile, "name", profile), "release_weights": release_weights})

    def build(model):
        model, chosen, plan, cpu_budget, prof = _plan(model, shard, device, gpu_memory, cpu_memory, policy, profile,
                                                      workload)
        return OffloadedModel(model, chosen, plan, device, cpu_budget, prof, release_weights, progress)

    if not isinstance(model, torch.nn.Module) and not shard.whole:
        # loaded here: one rank at a time loads the whole model, keeps its share and frees the rest, so the host
        # holds one model at a time instead of one per GPU
        built = _together(shard, lambda: build(model), in_turns=True)
        _check_same_plan(shard, built.policy, built.plan, built.cpu_budget, built)
        return built
    # in a group, a rank that fails raises on every rank (none is left in a collective waiting for it)
    model, policy, plan, cpu_budget, prof = _together(shard, lambda: _plan(
        model, shard, device, gpu_memory, cpu_memory, policy, profile, workload))
    _check_same_plan(shard, policy, plan, cpu_budget)
    return _together(shard, lambda: OffloadedModel(model, policy, plan, device, cpu_budget, prof, release_weights,
                                                   progress))


def streamed_spec(model, adapter, dtype_bytes: int) -> ModelSpec:
    """The HRM's model as the runtime streams it: the experts in the format the loaded modules hold (MXFP4 as
    shipped, or the model's dtype), whatever the config's ``quantization_config`` says."""
    spec = ModelSpec.from_config(model.config, dtype_bytes=dtype_bytes, weights="bf16")
    return dataclasses.replace(spec, expert_format=adapter.full_dims.expert_format)


def _plan(model, shard: Shard, device: torch.device, gpu_memory, cpu_memory, policy: Policy | None, profile,
          workload: Workload | None):
    """The model (loaded where a path or a loader was given), its policy and device plan, this rank's host budget
    and the profile: everything :func:`offload` decides before any weight moves."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model, dtype="auto")
    elif callable(model) and not isinstance(model, torch.nn.Module):
        loader, model = model, model()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"the model loader {loader!r} returned {type(model).__name__}, not a causal LM module")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("the model's weights are on the meta device: an earlier hf_scatter.offload_model(model) "
                         "moved them into its OffloadedModel (release_weights=True, the default), or the model was "
                         "built without weights. Reuse the first OffloadedModel, or reload the model (from_pretrained) "
                         "for a new one; pass release_weights=False to offload_model() to keep the model whole")
    adapter = adapter_for(model, shard)
    gpu_budget = parse_bytes(gpu_memory, "gpu_memory")
    prof = _profile(profile, device, required=policy is None)
    cpu_budget = parse_bytes(cpu_memory, "cpu_memory") if cpu_memory is not None else _default_cpu_budget(prof)
    dtype_bytes = adapter.other_tensors()["embed"].element_size()
    if policy is None:
        if prof is None:
            policy = dataclasses.replace(CPU_DEVICE_POLICY, gpus=shard.size)
        else:
            spec = streamed_spec(model, adapter, dtype_bytes)
            policy = search_policy(spec, prof, workload or DEFAULT_WORKLOAD, gpu_budget, cpu_budget,
                                   placements=[CGOPIPE_PLACEMENT], gpus=shard.size)
    if (policy.attention_on_gpu, policy.experts_on_gpu) != CGOPIPE_PLACEMENT:
        raise ValueError(f"the offloaded runtime runs attention on the CPU and the experts on the GPU (CGOPipe); this "
                         f"policy asks for {policy.placement()}: pass attention_on_gpu=False, experts_on_gpu=True")
    plan = plan_device(adapter, policy.weights_gpu_fraction, gpu_budget, policy.batch_size,
                       policy.micro_batch_size, dtype_bytes, reserved=cublas_workspace_bytes(device),
                       graphs=graphs_wanted(device))
    cpu_budget //= shard.size  # each rank's share of the host: its weights' share and its heads' KV cache
    if plan.layout.host_bytes > cpu_budget:
        raise PlanError(f"the streamed weights take {format_bytes(plan.layout.host_bytes)} of pinned host memory"
                        f"{' per GPU' if shard.size > 1 else ''} but cpu_memory allows "
                        f"{format_bytes(cpu_budget)}: raise cpu_memory or gpu_memory")
    return model, policy, plan, cpu_budget, prof


class OffloadedModel:
    """A model whose layers stream through the device; see :func:`offload`."""

    def __init__(self, model, policy: Policy, plan: DevicePlan, device: torch.device, cpu_budget: int,
                 profile: HardwareProfile | None, release_weights: bool, progress: bool):
        self.model, self.config, self.policy, self.plan = model, model.config, policy, plan
        self.device, self.cpu_budget, self.profile = device, cpu_budget, profile
        self.adapter = plan.layout.adapter
        self.shard = self.adapter.shard
        self.dims = self.adapter.dims
        with torch.no_grad():
            self.store = WeightStore(plan.layout, device, release=release_weights, progress=progress)
            self.other = _to_device(self.adapter.other_tensors(), device)
            self.rotary = self.adapter.rotary(device)
        if release_weights:  # the class's own .to: accelerate wraps the instance's and refuses meta
            torch.nn.Module.to(model, "meta")
        self.dtype = self.other["embed"].dtype
        self.streams = Streams(device)
        # the host's cores shared by the group's processes, each attending its own heads
        self.worker = AttentionWorker(attention_threads(profile, self.shard.size))
        self.streamer = WeightStreamer(self.store, self.streams, NullTracer())
        self.pipe = CGOPipe(self.adapter, self.streamer, self.other, self.rotary, self.streams, self.worker,
                            StagingBuffers(pin=device.type == "cuda"), plan.chunk_tokens, plan.group_tokens,
                            BucketCosts.from_profile(profile), graphs=plan.graphs > 0)
        self.generation_config = getattr(model, "generation_config", None)
        self._released = release_weights
        self._expert_streaming = "auto"
        self.spec = streamed_spec(model, self.adapter, self.dtype.itemsize)  # the HRM's view of what streams

    @property
    def expert_streaming(self) -> str:
        """How decode streams the experts' non-resident columns: ``"all"`` (every expert, paged ahead of
        each stage), ``"routed"`` (only the experts the batch's rows choose, fetched once the router has
        chosen) or ``"auto"`` (the default: the policy's choice for batches of its size; a smaller batch, such
        as a short request list, is priced both ways by the HRM where a hardware profile is known)."""
        return self._expert_streaming

    @expert_streaming.setter
    def expert_streaming(self, mode: str) -> None:
        if mode not in EXPERT_STREAMING:
            raise ValueError(f"expert_streaming must be one of {', '.join(map(repr, EXPERT_STREAMING))}, got {mode!r}")
        self._expert_streaming = mode

    def _routed(self, batch, lens: list[int], max_new_tokens: int) -> bool:
        """Whether ``batch``'s decode streams only the routed experts (see :attr:`expert_streaming`)."""
        if self._expert_streaming != "auto":
            return self._expert_streaming == "routed"
        if batch.size >= self.policy.batch_size or self.profile is None:
            return self.policy.routed_experts
        n, mu = batch.size, max(len(m) for m in batch.micro_batches)
        context = sum(lens[r] for r in batch.requests) / n + (max_new_tokens + 1) / 2
        x = self.store.layout.fraction
        seconds = {routed: decode_layer_time(Policy(n, mu, weights_gpu_fraction=x, routed_experts=routed,
                                                    gpus=self.shard.size), self.spec, self.profile, context).seconds
                   for routed in (False, True)}
        return seconds[True] < seconds[False]

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids=None, attention_mask=None, *, prompts: Sequence[str] | None = None, tokenizer=None,
                 generation_config=None, max_new_tokens: int | None = None, min_new_tokens: int | None = None,
                 do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, repetition_penalty: float | None = None,
                 no_repeat_ngram_size: int | None = None, seed: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None, pad_token_id: int | None = None,
                 stop_strings: str | Sequence[str] | None = None, return_dict: bool = False, progress: bool = True,
                 trace: str | None = None, **unsupported):
        """Generate for every request, in batches of the policy's size, and return in input order.

        Requests: ``input_ids`` [B, S] with ``attention_mask`` (left or right padding; each row's real tokens
        must be contiguous) as for ``model.generate``, or ``prompts`` with a ``tokenizer``. Returns the HF-style
        sequences tensor (``input_ids`` given) or the generated texts (``prompts``), or with ``return_dict`` a
        :class:`GenerationResult` with per-request timings. ``trace``: write a Chrome trace there.
        ``generation_config``: a transformers ``GenerationConfig`` whose set fields are the defaults the
        keywords override, as in ``model.generate``; what the runtime does not implement is refused, there or
        as a keyword, before any work.
        """
        self._check_open()

        def read_call():
            """The options and requests, checked (in a group: every rank fails alike, see _together)."""
            if unsupported:
                raise TypeError(f"OffloadedModel.generate() does not support "
                                f"{', '.join(map(repr, sorted(unsupported)))}; supported keywords: "
                                f"{', '.join(_generate_keywords())}")
            o = _generation_options(generation_config, {
                "max_new_tokens": max_new_tokens, "min_new_tokens": min_new_tokens, "do_sample": do_sample,
                "temperature": temperature, "top_k": top_k, "top_p": top_p, "repetition_penalty": repetition_penalty,
                "no_repeat_ngram_size": no_repeat_ngram_size, "eos_token_id": eos_token_id,
                "pad_token_id": pad_token_id, "stop_strings": stop_strings})
            if isinstance(o["max_new_tokens"], bool) or not isinstance(o["max_new_tokens"], int) or \
                    o["max_new_tokens"] < 1:
                raise ValueError(f"max_new_tokens must be a positive integer, got {o['max_new_tokens']!r}")
            requests, ids = self._requests(input_ids, attention_mask, prompts, tokenizer)
            self._decoding(o, seed, tokenizer)  # its checks of the options
            return o, requests, ids

        o, requests, ids = _together(self.shard, read_call)
        _check_ranks_agree(self.shard, {"requests": len(requests), "tokens": _requests_digest(requests),
                                        "options": repr(sorted(o.items())), "seed": seed},
                           "were given different generate() calls", "call generate with the same requests and "
                           "options on every rank")
        if o["do_sample"] and seed is None and not self.shard.whole:
            seed = _seed_from_rank_zero(self.shard)
        if trace and not self.shard.whole:  # one trace per rank
            root, ext = os.path.splitext(trace)
            trace = f"{root}.rank{self.shard.rank}{ext}"
        max_new_tokens = o["max_new_tokens"]
        sampling, stopping, pad = self._decoding(o, seed, tokenizer)
        lens = [len(r) for r in requests]
        batch_size, micro = self._fit(lens, max_new_tokens, sampling.uses_history)
        batches = plan_batches(lens, batch_size, micro)
        tracer = Tracer(self.streams) if trace else NullTracer()
        run = self._run_batches(batches, requests, max_new_tokens, sampling, stopping, tracer, progress)
        new_tokens, timings = run.tokens, run.timings
        generated = sum(len(t) for t in new_tokens)
        stats = {"requests": len(requests), "generated_tokens": generated, "wall_s": run.wall_s,
                 "tokens_per_s": generated / run.wall_s if run.wall_s > 0 else float("inf"),
                 "prefill_s": run.prefill_s, "decode_s": run.decode_s, "decode_steps": run.steps,
                 "batches": len(batches), "batch_size": batch_size, "micro_batch_size": micro,
                 "weights_gpu_fraction": self.store.layout.fraction, "routed_batches": run.routed_batches,
                 "routed_experts_fetched": run.fetched_experts, "graph_replays": run.graph_replays}
        streaming_layers = sum(span is not None for span in self.store.expert_spans)
        if run.routed_steps and streaming_layers:  # chosen experts brought in per layer and decode step
            stats["routed_experts_per_layer_step"] = run.fetched_experts / (run.routed_steps * streaming_layers)
        if self.device.type == "cuda":
            stats["max_memory_allocated"] = torch.cuda.max_memory_allocated(self.device)
        if trace:
            tracer.save(trace)
            stats["trace"] = {"path": trace, **tracer.summary()}
        sequences = texts = None
        if ids is not None:
            sequences = self._sequences(ids, new_tokens, pad)
        if tokenizer is not None:
            texts = tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
        if return_dict:
            return GenerationResult(sequences, new_tokens, texts, timings, stats)
        return sequences if ids is not None else texts

    def _decoding(self, o: dict, seed: int | None, tokenizer) -> tuple[Sampling, Stopping, int]:
        """How each step picks its token and when a request ends, from the resolved generation options."""
        eos = self._eos(o["eos_token_id"])
        sampling = Sampling(bool(o["do_sample"]), o["temperature"], o["top_k"], o["top_p"], seed, o["min_new_tokens"],
                            o["repetition_penalty"], o["no_repeat_ngram_size"], tuple(eos))
        pad = o["pad_token_id"] if o["pad_token_id"] is not None else self._pad(eos)
        stops = o["stop_strings"] or ()
        return sampling, Stopping(eos, [stops] if isinstance(stops, str) else stops, tokenizer), pad

    def _run_batches(self, batches, requests, max_new_tokens: int, sampling: Sampling, stopping: Stopping, tracer,
                     progress: bool) -> "_BatchesRun":
        """Every batch through CGOPipe, one after another, with the progress bar and untuned kernels."""
        from tqdm import tqdm

        run = _BatchesRun(tokens=[[] for _ in requests], timings=[None] * len(requests))
        lens = [len(r) for r in requests]
        generator = sampling.generator(self.device)
        bar = tqdm(total=len(batches) * max_new_tokens, desc="offloaded generate", unit="step",
                   disable=not progress)
        driver_threads = torch.get_num_threads()
        if self.device.type == "cpu":  # the CPU stands in for the GPU: one core drives, the rest attend
            torch.set_num_threads(1)
        start = time.perf_counter()
        with autotune_override(False):  # fixed block sizes: the tuner's 256 MB scratch would break the budget
            try:
                for b, batch in enumerate(batches):
                    bar.set_postfix_str(f"batch {b + 1}/{len(batches)} ({batch.size} requests)")
                    result = self.pipe.run(batch, requests, max_new_tokens, sampling, generator, stopping, tracer,
                                           on_step=lambda: bar.update(1), clock_origin=start,
                                           routed=self._routed(batch, lens, max_new_tokens))
                    run.prefill_s += result.prefill_s
                    run.decode_s += result.decode_s
                    run.steps += result.steps
                    run.graph_replays += result.graph_replays
                    if result.routed:
                        run.routed_batches += 1
                        run.routed_steps += result.steps
                        run.fetched_experts += result.fetched_experts
                    for r, toks in result.tokens.items():
                        run.tokens[r] = toks
                        run.timings[r] = RequestTiming(r, b, lens[r], len(toks), result.first_token_s[r],
                                                       result.finish_s[r])
                self.streams.synchronize()
            finally:
                bar.close()
                torch.set_num_threads(driver_threads)
        run.wall_s = time.perf_counter() - start
        return run

    def logits(self, input_ids, attention_mask=None, *, progress: bool = False) -> torch.Tensor:
        """fp32 logits ``[batch, length, vocab]`` on the CPU, as ``model(input_ids).logits`` gives them
        (zeros at padded positions), computed through the offloaded pipeline: what a log-likelihood
        evaluation needs. No KV cache is kept."""
        self._check_open()
        requests, ids = _together(self.shard, lambda: self._requests(input_ids, attention_mask, None, None))
        _check_ranks_agree(self.shard, {"requests": len(requests), "tokens": _requests_digest(requests)},
                           "were given different logits() calls", "call logits with the same input_ids and "
                           "attention_mask on every rank")
        lens = [len(r) for r in requests]
        batch_size, micro = self._fit(lens, 1)
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).to("cpu").bool()
        out = torch.zeros(ids.shape[0], ids.shape[1], self.dims.vocab, dtype=torch.float32)
        from tqdm import tqdm

        with autotune_override(False):
            for batch in tqdm(plan_batches(lens, batch_size, micro), desc="offloaded logits", disable=not progress):
                for r, rows in self.pipe.logits(batch, requests).items():
                    out[r, mask[r].nonzero().flatten()] = rows
            self.streams.synchronize()
        return out

    # ------------------------------------------------------------------ requests in, sequences out
    def _requests(self, input_ids, attention_mask, prompts, tokenizer):
        if (input_ids is None) == (prompts is None):
            raise ValueError("pass either input_ids (with attention_mask) or prompts with a tokenizer")
        if prompts is not None:
            if tokenizer is None:
                raise ValueError("prompts need a tokenizer: generate(prompts=[...], tokenizer=tok)")
            if isinstance(prompts, str):
                prompts = [prompts]
            encoded = [tokenizer(p)["input_ids"] for p in prompts]
            return [torch.tensor(e, dtype=torch.long) for e in encoded], None
        ids = torch.as_tensor(input_ids).to("cpu", torch.long)
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, length], got shape {tuple(ids.shape)}")
        mask = torch.ones_like(ids) if attention_mask is None else torch.as_tensor(attention_mask).to("cpu")
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask {tuple(mask.shape)} must have input_ids' shape {tuple(ids.shape)}")
        requests = []
        for i, (row, keep) in enumerate(zip(ids, mask.bool())):
            where = keep.nonzero().flatten()
            if where.numel() == 0:
                raise ValueError(f"request {i} has no tokens (its attention_mask row is all zeros)")
            if where[-1] - where[0] + 1 != where.numel():
                raise ValueError(f"request {i}: the attention_mask row has holes; each request's tokens must be "
                                 "contiguous (left or right padding)")
            requests.append(row[where[0]:where[-1] + 1].clone())
        vocab = self.dims.vocab
        for i, r in enumerate(requests):
            if int(r.min()) < 0 or int(r.max()) >= vocab:
                raise ValueError(f"request {i} has token ids outside the vocabulary [0, {vocab})")
        return requests, ids

    def _sequences(self, ids: torch.Tensor, new_tokens: list[list[int]], pad: int) -> torch.Tensor:
        grown = max(len(t) for t in new_tokens)
        out = torch.full((ids.shape[0], ids.shape[1] + grown), pad, dtype=torch.long)
        out[:, :ids.shape[1]] = ids
        for i, toks in enumerate(new_tokens):
            out[i, ids.shape[1]:ids.shape[1] + len(toks)] = torch.tensor(toks, dtype=torch.long)
        return out

    def _eos(self, eos_token_id) -> list[int]:
        if eos_token_id is None:
            eos_token_id = getattr(self.generation_config, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(self.config, "eos_token_id", None)
        if eos_token_id is None:
            return []
        return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id]

    def _pad(self, eos: list[int]) -> int:
        for source in (self.generation_config, self.config):
            pad = getattr(source, "pad_token_id", None)
            if pad is not None:
                return int(pad)
        return eos[0] if eos else 0

    # ------------------------------------------------------------------ budgets
    def _fit(self, lens: list[int], max_new_tokens: int, history: bool = False) -> tuple[int, int]:
        """Batch and micro-batch size for these requests: the policy's, or smaller where the host memory
        (KV cache) or the device memory (activations; ``history``: every row's tokens, which the repetition
        penalty, n-gram block and min_new_tokens read there) would not hold them; a request that cannot run at
        all is named."""
        d, b = self.dims, self.dtype.itemsize
        per_token = d.layers * d.kv_width * b
        host_free = self.cpu_budget - self.store.layout.host_bytes
        caps = [p + max_new_tokens - 1 for p in lens]
        for i, p in enumerate(lens):
            if caps[i] * per_token > host_free:
                raise PlanError(f"request {i} ({p} prompt tokens + {max_new_tokens} new) needs "
                                f"{format_bytes(caps[i] * per_token)} of KV cache but cpu_memory leaves "
                                f"{format_bytes(max(host_free, 0))} after the weights: raise cpu_memory or shorten it")
            if p > self.plan.chunk_tokens and prefill_bytes(d, 1, p, p, b) > self.plan.available:
                raise PlanError(f"request {i} has {p} prompt tokens; its prefill needs "
                                f"{format_bytes(prefill_bytes(d, 1, p, p, b))} of GPU memory but gpu_memory leaves "
                                f"{format_bytes(self.plan.available)} after the weights: raise gpu_memory or shorten "
                                "the prompt")
        longest_first = sorted(caps, reverse=True)
        n = min(self.policy.batch_size, len(lens))
        while n > 1:
            micro = min(self.policy.micro_batch_size, n)
            kv = sum(longest_first[:n]) * per_token * (1 + SLACK)
            staging = n * (d.qkv_dim + d.q_dim) * b + max_new_tokens * n * 8
            tokens = n * (longest_first[0] + 2) * 8 if history else 0  # [rows, prompt + new] and the starts
            if kv + staging <= host_free and decode_bytes(d, n, micro, b) + tokens <= self.plan.available and \
                    prefill_bytes(d, n, self.plan.chunk_tokens, self.plan.chunk_tokens, b) <= self.plan.available:
                break
            n = (n + 1) // 2
        return n, min(self.policy.micro_batch_size, n)

    # ------------------------------------------------------------------ reporting
    @property
    def cost_options(self) -> CostOptions:
        """The planner's cost options as this run realises them: its prefill chunk, and the prompt tokens whose
        activations fit at once (each group streams the weights again), so a prediction prices the run made."""
        return CostOptions(prefill_chunk_tokens=self.plan.chunk_tokens, prefill_group_tokens=self.plan.group_tokens)

    def memory(self) -> dict:
        """Planned device and host bytes by purpose."""
        self._check_open()
        layout = self.store.layout
        return {"device": self.plan.breakdown(), "device_budget": self.plan.budget,
                "host": {"streamed weights (pinned)": layout.host_bytes}, "host_budget": self.cpu_budget}

    def describe(self) -> str:
        """The policy table (with the HRM's prediction when it planned it) and what the runtime realised."""
        from ...common.markdown import markdown_table

        self._check_open()
        layout = self.store.layout
        parts = [self.policy.to_markdown()] if self.policy.prediction is not None else []
        rows = [["device", str(self.device)], ["layers", self.dims.layers],
                ["tensor parallel", f"rank {self.shard.rank} of {self.shard.size}" if self.shard.size > 1 else "no"],
                ["batch N / micro-batch mu", f"{self.policy.batch_size} / {self.policy.micro_batch_size}"],
                ["weights on the device (asked / realised)",
                 f"{self.policy.weights_gpu_fraction:.1%} / {layout.fraction:.1%}"],
                ["expert streaming", f"{self._expert_streaming} (the policy: "
                                     f"{'routed only' if self.policy.routed_experts else 'every expert'})"],
                ["experts' weights", f"{self.dims.expert_format.upper()}, as shipped" if self.dims.expert_format
                 else str(self.dtype).removeprefix("torch.")],
                ["streamed per decode step", format_bytes(layout.host_bytes)],
                ["prefill chunk / group (tokens)", f"{self.plan.chunk_tokens} / {self.plan.group_tokens}"],
                ["CPU attention threads", self.worker.threads]]
        rows += [[k, format_bytes(v)] for k, v in self.plan.breakdown().items()]
        parts.append(markdown_table(["runtime", "value"], rows))
        return "\n\n".join(parts)

    def __repr__(self) -> str:
        if self.pipe is None:
            return f"OffloadedModel({self.config.model_type}, closed)"
        group = f" (rank {self.shard.rank} of {self.shard.size})" if self.shard.size > 1 else ""
        return (f"OffloadedModel({self.config.model_type}, {self.dims.layers} layers on {self.device}{group}, "
                f"N={self.policy.batch_size}, mu={self.policy.micro_batch_size}, "
                f"{self.store.layout.fraction:.1%} of the weights resident, budget {format_bytes(self.plan.budget)})")

    def close(self) -> None:
        """Stop the CPU worker and free the device and pinned memory; the model cannot run afterwards."""
        if self.pipe is None:
            return
        self.worker.close()
        self.streamer.close()
        self.streams.synchronize()
        self.pipe.graphs.clear()
        self.pipe = self.streamer = self.store = self.other = None

    def _check_open(self) -> None:
        if self.pipe is None:
            again = (" from a freshly loaded model (this one's weights went into the store that close() freed)"
                     if self._released else "")
            raise RuntimeError(f"this OffloadedModel is closed: close() (or the end of its with-block) stopped its "
                               f"workers and freed its weights; make a new one with "
                               f"hf_scatter.offload_model(model, ...){again}")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _generation_options(config, explicit: dict) -> dict:
    """The keywords of GENERATION_DEFAULTS: ``explicit``'s (None: not given), else ``config``'s set fields, else the
    defaults. A field of ``config`` the runtime does not implement, set to something other than off or
    transformers' own default, is refused rather than ignored."""
    options = dict(GENERATION_DEFAULTS)
    if config is not None:
        from transformers import GenerationConfig

        if not isinstance(config, GenerationConfig):
            raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(config).__name__}")
        fresh = GenerationConfig().to_dict()
        # what model.generate uses for a field nobody set (a private helper; absent, only None counts as unset)
        implied = getattr(GenerationConfig, "_get_default_generation_params", dict)()
        refused = []
        for name, value in config.to_dict().items():
            if name in GENERATION_DEFAULTS:
                if value is not None:
                    options[name] = value
            elif not (name.startswith("_") or name in IGNORED_GENERATION_FIELDS or value is None or value is False
                      or value == fresh.get(name) or (name in implied and value == implied[name])):
                fix = GENERATION_FIELD_FIXES.get(name)
                refused.append(f"{name}={value!r}" + (f" ({fix})" if fix else ""))
        if refused:
            raise ValueError(f"generation_config sets {', '.join(refused)}, which the offloaded runtime does not "
                             f"implement; it implements {', '.join(GENERATION_DEFAULTS)}")
    options.update({k: v for k, v in explicit.items() if v is not None})
    return options


def _generate_keywords() -> list[str]:
    """OffloadedModel.generate's keywords, as its signature lists them."""
    return [p.name for p in inspect.signature(OffloadedModel.generate).parameters.values()
            if p.name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD]


def _device(device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("device='cuda' but no CUDA GPU is available: pass device='cpu' to run the same "
                               "pipeline on the CPU")
        return torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
    if device.type != "cpu":
        raise ValueError(f"device must be 'cuda' (the offloaded runtime) or 'cpu' (the same pipeline on the CPU), "
                         f"got {device}")
    return device


def _check_group_call(shard: Shard, device: torch.device, model, arguments: dict) -> None:
    """First thing ``offload`` does in a group (one small all-gather): every rank was given the same model
    config and arguments, and drives its own GPU. Past this point the ranks fail or succeed alike, so none is
    left waiting in a later collective for a rank that raised."""
    if shard.whole:
        return
    import hashlib
    import socket

    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's collectives, this one first, run on the current device
    if isinstance(model, torch.nn.Module):
        config = model.config.to_json_string()
    else:  # a checkpoint path, or a loader (its name: each process has its own function object)
        config = os.fspath(model) if isinstance(model, (str, os.PathLike)) else getattr(model, "__qualname__", "")
    mine = {"arguments": repr(sorted(arguments.items())), "model": hashlib.sha256(str(config).encode()).hexdigest(),
            "host": socket.gethostname(), "gpu": device.index if device.type == "cuda" else None}
    every = [None] * shard.size
    dist.all_gather_object(every, mine, group=shard.group)
    differ = [key for key in ("arguments", "model") if len({theirs[key] for theirs in every}) > 1]
    if differ:
        raise ValueError(f"the ranks of the tensor-parallel group were given different {' and '.join(differ)} "
                         "(offload's arguments or the model's config): call offload with the same ones on every rank")
    hosts = sorted({theirs["host"] for theirs in every})
    if len(hosts) > 1:
        raise ValueError(f"the tensor-parallel group spans {len(hosts)} hosts ({', '.join(hosts)}); offloading splits "
                         "a model over the GPUs of one host (they share its memory and CPU): use a group per host")
    gpus = [theirs["gpu"] for theirs in every]
    if device.type == "cuda" and len(set(gpus)) < len(gpus):
        raise ValueError(f"several ranks of the tensor-parallel group would run on the same GPU ({gpus}): pass each "
                         "process its own device (torch.cuda.set_device(local_rank) before offload, or device=)")


def _together(shard: Shard, build, in_turns: bool = False):
    """``build()`` on every rank of ``shard``'s group (``in_turns``: one rank after the other, rank 0 first); if it
    raised on any rank, every rank raises (that rank its own error, the others one naming it), after freeing what
    it built."""
    if shard.whole:
        return build()
    import gc

    import torch.distributed as dist

    result = error = None
    for turn in range(shard.size if in_turns else 1):
        if not in_turns or turn == shard.rank:
            try:
                result = build()
            except Exception as e:  # shared with the other ranks, then raised here unchanged
                error = e
            if in_turns:
                gc.collect()  # what the turn loaded and released, freed before the next rank loads
        if in_turns:
            dist.barrier(group=shard.group)
    every = [None] * shard.size
    dist.all_gather_object(every, None if error is None else f"{type(error).__name__}: {error}", group=shard.group)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(every) if message is not None]
    if failed:
        if isinstance(result, OffloadedModel):
            result.close()
        rank, message = failed[0]
        raise RuntimeError(f"rank {rank} of the tensor-parallel group failed, so this rank stops too: {message}")
    return result


def _seed_from_rank_zero(shard: Shard) -> int:
    """A fresh sampling seed drawn by rank 0 and used by every rank (each rank's own draw would differ, and
    with it the tokens each rank's head picks)."""
    import random

    import torch.distributed as dist

    value = [random.SystemRandom().randrange(2**63) if shard.rank == 0 else None]
    dist.broadcast_object_list(value, src=dist.get_global_rank(shard.group, 0), group=shard.group)
    return value[0]


def _check_same_plan(shard: Shard, policy: Policy, plan: DevicePlan, cpu_budget: int, built=None) -> None:
    """Every rank must run the same program (the same batches, chunks and groups, so the same all-reduces): their
    plans are compared here, before any weight moves (``built``: after, when the ranks loaded in turns; it is
    closed if they differ), rather than left to hang in a collective."""
    try:
        _check_ranks_agree(shard, {
            "batch_size": policy.batch_size, "micro_batch_size": policy.micro_batch_size,
            "routed_experts": policy.routed_experts, "weights_gpu_fraction": plan.layout.fraction,
            "chunk_tokens": plan.chunk_tokens, "group_tokens": plan.group_tokens, "available": plan.available,
            "host_bytes": plan.layout.host_bytes, "cpu_budget": cpu_budget},
            "planned differently", "pass the same model, gpu_memory, cpu_memory, policy and profile on every rank "
            "(if they were the same, this is a bug of hf-scatter)")
    except RuntimeError:
        if built is not None:
            built.close()
        raise


def _check_ranks_agree(shard: Shard, mine: dict, what: str, fix: str) -> None:
    """Raises naming each key whose value differs between the ranks of ``shard``'s group (one small all-gather),
    where a difference would leave the ranks waiting on each other's all-reduces."""
    if shard.whole:
        return
    import torch.distributed as dist

    every = [None] * shard.size
    dist.all_gather_object(every, mine, group=shard.group)
    differ = {key: [theirs[key] for theirs in every] for key in mine if len({theirs[key] for theirs in every}) > 1}
    if differ:
        raise RuntimeError(f"the ranks of the tensor-parallel group {what} ({differ}, by rank) and would wait on "
                           f"each other forever: {fix}")


def _requests_digest(requests: list[torch.Tensor]) -> str:
    """A short fingerprint of the requests' tokens, equal on every rank that was given the same requests."""
    import hashlib

    h = hashlib.sha256()
    for r in requests:
        h.update(r.numpy().tobytes())
        h.update(b"|")
    return h.hexdigest()[:16]


def _profile(profile, device: torch.device, required: bool) -> HardwareProfile | None:
    """The hardware profile; None where there is none to plan with and a policy was given (then the
    CPU budget and attention threads come from this machine)."""
    if isinstance(profile, HardwareProfile):
        return profile
    if profile is None and device.type == "cpu":
        return None
    try:
        return load_profile(profile)
    except FileNotFoundError as e:
        if profile is None and not required:
            return None
        raise FileNotFoundError(f"{e}; or give offload_model() a policy=Policy(...)") from None


def _default_cpu_budget(profile: HardwareProfile | None) -> int:
    from ..plan.cost_model import default_cpu_limit

    if profile is not None and profile.cpu_memory:
        return int(default_cpu_limit(profile, CostOptions()))
    return int(CostOptions().cpu_memory_fraction * (host_memory_bytes() or 16 * 2**30))


def _to_device(tensors: dict, device: torch.device) -> dict:
    """Copies on ``device``, a tensor shared under two names (a tied LM head) copied once."""
    moved, out = {}, {}
    for name, t in tensors.items():
        key = t.data_ptr()
        if key not in moved:
            moved[key] = t.detach().to(device)
        out[name] = moved[key]
    return out


__all__ = ["GenerationResult", "OffloadedModel", "RequestTiming", "offload"]
