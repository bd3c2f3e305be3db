"""Time and memory of a policy under CGOPipe (MoE-Lightning, section 4): per layer, per decode step.

CGOPipe overlaps the GPU (pre- and post-attention of the micro-batches), the CPU (decode attention on the
CPU KV cache) and the link (one weight page of the next layer per micro-batch). In steady state a layer
takes as long as its busiest resource::

    T_layer = max(T_gpu_compute, T_gpu_launch, T_cpu, T_h2d, T_d2h, T_link_duplex, T_host_memory, T_chain)

Each term is the sum over the micro-batches of that resource's work (see ``docs/offload-planning.md`` for the
formulas). ``T_chain`` is the data dependency of one micro-batch (GPU -> CPU -> GPU): with few micro-batches
the GPU and CPU cannot overlap. With routed streaming the link carries only the chosen experts' share of
the expert columns, but the GPU waits for them after each micro-batch's router (a term of its own in
``T_gpu_compute``). Given the discrete choices (N, mu, attention and FFN placement), every term
and every memory use is *affine* in the two fractions (weights on GPU ``x``, KV cache on GPU ``y``), so
:class:`Lin` carries them symbolically: evaluating at a point gives the prediction, and the policy search
minimises the same expressions exactly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass

from ..families.spec import ModelSpec
from .activations import PREFILL_CHUNK_TOKENS, decode_bytes, prefill_chunk, prefill_room
from .hrm import HierarchicalRoofline
from .policy import Policy, Workload
from .profile import HardwareProfile
from .tensor_parallel import group_model

# CPU-side torch ops per micro-batch: attention (gather, SDPA, copy out) and a CPU expert FFN (routing,
# three GEMMs, activation, combine). Each costs the profile's per-op dispatch time.
CPU_OPS = {"attention": 3, "ffn": 6}


@dataclass(frozen=True)
class CostOptions:
    """Knobs of the model that are choices, not measurements."""

    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS  # prompt tokens per prefill kernel call
    # prompt tokens whose activations the GPU holds at once: each such group streams the layer's weights once more
    # (None: the whole batch at once; a run states its own, which its memory left for activations sets)
    prefill_group_tokens: int | None = None
    decode_samples: int = 8  # context lengths at which the generation is integrated (midpoint rule)
    gpu_margin: float = 0.05  # part of the GPU budget left to allocator fragmentation
    cpu_memory_fraction: float = 0.9  # default CPU budget: this share of the profile's CPU memory


class Lin:
    """``c + x_coef * x + y_coef * y`` with x = weights on GPU, y = KV cache on GPU."""

    __slots__ = ("c", "cx", "cy")

    def __init__(self, c: float = 0.0, cx: float = 0.0, cy: float = 0.0):
        self.c, self.cx, self.cy = float(c), float(cx), float(cy)

    def __add__(self, other):
        if isinstance(other, Lin):
            return Lin(self.c + other.c, self.cx + other.cx, self.cy + other.cy)
        return Lin(self.c + other, self.cx, self.cy)

    __radd__ = __add__

    def __mul__(self, k: float):
        return Lin(self.c * k, self.cx * k, self.cy * k)

    __rmul__ = __mul__

    def __truediv__(self, k: float):
        return self * (1.0 / k)

    def at(self, x: float, y: float) -> float:
        return self.c + self.cx * x + self.cy * y

    def __repr__(self):
        return f"Lin({self.c:.4g} + {self.cx:.4g} x + {self.cy:.4g} y)"


def on_cpu_share(v: float) -> Lin:
    """``(1 - x) * v``: the part of something that stays in CPU memory."""
    return Lin(v, -v)


@dataclass(frozen=True)
class OpTime:
    """One op of one layer over the whole batch: where it runs, its work, its time alone."""

    name: str
    device: str
    flops: float
    bytes: float  # read from the memory of the level it runs on
    link_bytes: float  # moved CPU->GPU for it
    seconds: float


@dataclass(frozen=True)
class LayerTime:
    seconds: float
    terms: dict  # resource -> seconds
    bottleneck: str
    ops: dict  # name -> OpTime
    context_len: float
    link_weight_bytes: float  # weights streamed CPU->GPU for this layer

    def to_dict(self) -> dict:
        return {**asdict(self), "ops": {k: asdict(v) for k, v in self.ops.items()}}


@dataclass(frozen=True)
class Prediction:
    model: str
    hardware: str
    workload: str
    decode_layer: LayerTime  # at the mean context of the generation
    prefill_layer: LayerTime
    decode_step_s: float  # one decode step, all layers and the LM head, averaged over the generation
    prefill_s: float  # prefill of one batch
    batch_s: float  # prefill + every decode step of one batch
    tokens_per_s: float  # generated tokens per second
    gpu_memory: dict
    cpu_memory: dict
    gpu_limit: float
    gpu_usable: float  # gpu_limit less the fragmentation margin
    cpu_limit: float
    balance_batch_size: float | None
    uncalibrated: list
    notes: list
    routed_experts: float | None = None  # routed streaming: experts of a layer fetched per decode step (expected)
    experts: int = 0  # routed experts per layer
    gpus: int = 1  # tensor-parallel GPUs (gpu_memory, gpu_limit and gpu_usable are per GPU)
    prefill_chunk_tokens: int = PREFILL_CHUNK_TOKENS  # prompt tokens per prefill call (the activations leave room)

    @property
    def gpu_memory_total(self) -> float:
        return sum(self.gpu_memory.values())

    @property
    def cpu_memory_total(self) -> float:
        return sum(self.cpu_memory.values())

    @property
    def fits(self) -> bool:
        tol = 1 + 1e-9
        return self.gpu_memory_total <= self.gpu_usable * tol and self.cpu_memory_total <= self.cpu_limit * tol

    def to_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if k not in ("decode_layer", "prefill_layer")}
        out.update(decode_layer=self.decode_layer.to_dict(), prefill_layer=self.prefill_layer.to_dict(),
                   gpu_memory_total=self.gpu_memory_total, cpu_memory_total=self.cpu_memory_total, fits=self.fits)
        return out


# ----- symbolic terms -----
@dataclass
class Terms:
    """A layer's resource times (each the max of its affine pieces) and its ops, symbolic in (x, y)."""

    pieces: dict  # resource -> list[Lin]
    ops: dict  # name -> (device, flops, bytes, link bytes, seconds), each a Lin
    link_weight_bytes: list  # the max of these Lins
    context_len: float

    def all_pieces(self) -> list[Lin]:
        return [p for ps in self.pieces.values() for p in ps]

    def evaluate(self, x: float, y: float) -> LayerTime:
        terms = {name: max(p.at(x, y) for p in ps) if ps else 0.0 for name, ps in self.pieces.items()}
        bottleneck = max(terms, key=terms.get)
        ops = {name: OpTime(name, dev, flops.at(x, y), nbytes.at(x, y), link.at(x, y), secs.at(x, y))
               for name, (dev, flops, nbytes, link, secs) in self.ops.items()}
        return LayerTime(terms[bottleneck], terms, bottleneck, ops, self.context_len,
                         max(p.at(x, y) for p in self.link_weight_bytes))


def _micro_batches(policy: Policy) -> list[tuple[int, int]]:
    """(size, count): full micro-batches and the remainder."""
    full, rest = divmod(policy.batch_size, policy.micro_batch_size)
    return [(policy.micro_batch_size, full)] + ([(rest, 1)] if rest else [])


def _link_pieces(hrm: HierarchicalRoofline, ups: list, d2h: Lin, h2d_copies: float, d2h_copies: float,
                 cpu_dram: Lin) -> dict:
    """The link and host-memory terms; ``ups``: the bytes up, as Lins whose max they are."""
    return {
        "h2d": [up / hrm.roofs.link_bandwidth + h2d_copies * hrm.latency_s for up in ups],
        "d2h": [d2h / hrm.d2h_bandwidth + d2h_copies * hrm.latency_s],
        "link_duplex": [(up + d2h) / hrm.duplex_bandwidth for up in ups],
        "host_memory": [(up + d2h + cpu_dram) / hrm.host_dram_bandwidth for up in ups],
    }


def routed_share(model: ModelSpec, rows: float) -> float:
    """The share of a layer's experts ``rows`` decode rows choose between them (uniform top-k routing): what
    routed streaming fetches of the streamed expert columns at one stage."""
    return model.active_experts(rows) / model.experts


def _routed_weights(model: ModelSpec, policy: Policy) -> tuple[list, Lin]:
    """Routed streaming: (the streamed weight bytes as Lins whose max they are, the expert bytes fetched after
    routing). Residency keeps dense tensors first, so below the dense share ``D`` of a layer (``L`` bytes)
    the dense rest and the chosen experts stream (``D - xL + f X``), above it only the chosen experts' share
    of what streams (``f (1 - x) L``). The fetched bytes are ``f min(X, (1 - x) L)``; a max of affine pieces
    cannot hold a min, so they are priced as ``f (1 - x) L``, exact from the dense share up and at most
    ``f D`` (a few percent of a MoE layer) too high below it."""
    f = routed_share(model, policy.batch_size)
    layer, experts = model.layer_weight_bytes, model.ffn_weight_bytes
    experts_only = on_cpu_share(layer) * f
    return [Lin(layer - experts + f * experts, -layer), experts_only], experts_only


def attention_calls(size: int, workload: Workload | None, row_token_bytes: float, call_s: float, byte_s: float
                    ) -> tuple[tuple[float, float], ...]:
    """``(rows, longest prompt - mean prompt)`` of each CPU attention call of a micro-batch of ``size``
    requests: the runtime's own bucketing (:func:`~hf_scatter.offload.plan.attention_buckets.length_buckets`) of
    prompts spread like the workload's (uniform with its mean and variance, capped at its longest)."""
    if workload is None or workload.prompt_len_sq <= workload.prompt_len ** 2 * (1 + 1e-9) or size <= 1:
        return ((float(size), 0.0),)
    return _attention_calls(int(size), float(workload.prompt_len), float(workload.prompt_len_sq),
                            float(workload.prompt_len_max), int(workload.gen_len), float(row_token_bytes),
                            float(call_s), float(byte_s))


@functools.lru_cache(maxsize=4096)
def _attention_calls(size, mean, mean_sq, longest, gen_len, row_token_bytes, call_s, byte_s):
    from .attention_buckets import SLACK, length_buckets

    reps = min(size, 64)  # representative requests, each standing for size / reps of them
    half = math.sqrt(3 * max(mean_sq - mean * mean, 0.0))
    hi = min(mean + half, longest)
    lo = max(2 * mean - hi, 1.0)
    prompts = [hi - (hi - lo) * (i + 0.5) / reps for i in range(reps)]  # longest first
    weight = size / reps
    caps = [round(p) + gen_len - 1 for p in prompts]
    buckets = length_buckets(caps, SLACK, call_s, byte_s * row_token_bytes * weight)
    return tuple(((e - s) * weight, prompts[s] - mean) for s, e, _ in buckets)


def decode_terms(hrm: HierarchicalRoofline, model: ModelSpec, policy: Policy, context_len: float,
                 workload: Workload | None = None, per_op: bool = True) -> Terms:
    """One layer of one decode step of the whole batch, every sequence attending to ``context_len`` tokens
    (with ``workload``: its prompts spread as the workload's, ``context_len`` their mean). ``per_op``: also
    each op's share (for reports; the policy search reads only the resources' pieces and skips it)."""
    # MLA over several GPUs: every rank caches and reads the whole latent, so the KV bytes that cross host memory
    # and the links count every rank's copy; the CPU attention's own time stays the whole model's at its shape's
    # rate (each rank computes its 1/N of the heads on its share of the cores; latent attention is compute-bound:
    # 2 x H200 host, DeepSeek-V2-Lite, a decode layer 19.9 ms on one GPU, 12.9 on two)
    one, model = model, group_model(model, policy.gpus)
    b, kvb, n_seq = model.dtype_bytes, model.kv_bytes_per_token, policy.batch_size
    gpu, cpu, launches, cpu_dram = Lin(), Lin(), Lin(), Lin()
    ops: dict = {}

    def account(name, device, flops, nbytes, seconds):
        if not per_op:
            return
        prev = ops.get(name, (device, Lin(), Lin(), Lin(), Lin()))
        ops[name] = (device, prev[1] + flops, prev[2] + nbytes, prev[3], prev[4] + seconds)

    for size, count in _micro_batches(policy):
        for name, op in model.decode_ops(size, context_len).items():
            if name == "attention" and not policy.attention_on_gpu:
                rate, overhead = hrm.cpu_attention_rate(context_len, one)
                work = hrm.cpu_attention_bytes_per_token(one)
                calls = attention_calls(size, workload, work, overhead, 1.0 / rate)
                seconds = Lin(count * sum(hrm.cpu_attention_seconds(rows, context_len + spread, work, one)
                                          + CPU_OPS["attention"] * hrm.cpu_op_s for rows, spread in calls))
                cpu += seconds
                cpu_dram += count * op.kv_bytes
                account(name, "cpu", count * op.flops, count * op.kv_bytes, seconds)
            elif name == "ffn" and not policy.experts_on_gpu:
                # The CPU computes the experts' CPU-resident share (1 - x), the GPU the resident share x.
                on_cpu = on_cpu_share(count * (hrm.cpu_seconds(op) + CPU_OPS["ffn"] * hrm.cpu_op_s))
                on_gpu = Lin(0, count * hrm.gpu_seconds(op))
                cpu += on_cpu
                gpu += on_gpu
                launches += Lin(0, count * op.kernels * hrm.launch_s)
                cpu_dram += on_cpu_share(count * op.weight_bytes)
                account(name, "cpu", on_cpu_share(count * op.flops), on_cpu_share(count * op.weight_bytes), on_cpu)
                account("ffn (GPU share)", "gpu", Lin(0, count * op.flops), Lin(0, count * op.weight_bytes), on_gpu)
            else:
                seconds = Lin(count * hrm.gpu_seconds(op))
                gpu += seconds
                launches += count * op.kernels * hrm.launch_s
                account(name, "gpu", count * op.flops, count * op.bytes, seconds)

    _check_group(hrm, policy)
    for size, count in _micro_batches(policy) if hrm.gpus > 1 else ():
        # tensor parallelism: each micro-batch's hidden states summed over the GPUs after attention and the FFN
        seconds = Lin(count * _allreduces_seconds(hrm, model, size, b))
        gpu += seconds
        launches += count * _allreduces(model) * hrm.launch_s
        account("all-reduce", "gpu", Lin(), Lin(), seconds)
    n_ub = policy.num_micro_batches
    streamed = model.layer_weight_bytes - (0 if policy.experts_on_gpu else model.ffn_weight_bytes)
    weights = [on_cpu_share(streamed)]
    fetch = Lin()  # routed streaming: the compute stream waits while the chosen experts arrive
    if policy.routed_experts:
        weights, fetched = _routed_weights(model, policy)
        copies = model.expert_tensors * model.active_experts(n_seq)
        fetch = fetched / hrm.roofs.link_bandwidth + (n_ub + copies) * hrm.latency_s + n_ub * hrm.launch_s
    activations_h2d, activations_d2h, kv_stream = 0.0, 0.0, Lin()
    if policy.attention_on_gpu:
        kv_stream = Lin(n_seq * context_len * kvb, 0, -n_seq * context_len * kvb)  # CPU-resident KV to GPU
        d2h = Lin(n_seq * kvb, 0, -n_seq * kvb)  # the new token's K, V of those sequences back
        copies_d2h = n_ub
    else:
        activations_h2d += n_seq * model.q_dim * b  # attention output back
        activations_d2h += n_seq * (model.q_dim + model.kv_width) * b  # q, k, v to the CPU
        d2h = Lin()
        copies_d2h = n_ub
    if not policy.experts_on_gpu:
        activations_h2d += n_seq * model.hidden * b
        activations_d2h += n_seq * model.hidden * b
        copies_d2h += n_ub
    h2d = [w + kv_stream + activations_h2d for w in weights]
    d2h = d2h + activations_d2h
    copies_h2d = n_ub * (2 + (not policy.experts_on_gpu))  # weight page, attention output or KV, FFN output
    # Link bytes of each op, for the roofline plot: its weights' CPU share, and the streamed KV.
    for name, (dev, flops, nbytes, _, secs) in list(ops.items()):
        link = Lin()
        if name == "attention" and policy.attention_on_gpu:
            link = kv_stream
        elif dev == "gpu" and name != "ffn (GPU share)":
            link = on_cpu_share(_op_weight_bytes(model, name))
            if name == "ffn" and policy.routed_experts:
                link = link * routed_share(model, n_seq)
        ops[name] = (dev, flops, nbytes, link, secs)

    gpu, launches = gpu + fetch, launches + fetch
    pieces = {"gpu_compute": [gpu], "gpu_launch": [launches], "cpu": [cpu]}
    pieces.update(_link_pieces(hrm, h2d, d2h, copies_h2d, copies_d2h, cpu_dram))
    cpu_involved = not policy.attention_on_gpu or not policy.experts_on_gpu
    if cpu_involved:
        # One micro-batch must pass GPU -> CPU -> GPU within the layer: with n micro-batches that chain is
        # (its GPU share + its CPU share + its activation copies), which only overlaps when n > 1.
        hop = ((activations_h2d + activations_d2h) / n_ub / hrm.roofs.link_bandwidth + 2 * hrm.latency_s)
        pieces["dependency_chain"] = [(g + cpu) / n_ub + hop for g in (gpu, launches)]
    else:
        pieces["dependency_chain"] = []
    return Terms(pieces, ops, weights, context_len)


def _check_group(hrm: HierarchicalRoofline, policy: Policy) -> None:
    if hrm.gpus != policy.gpus:
        raise ValueError(f"the policy runs on {policy.gpus} GPU(s) but the roofline models {hrm.gpus}: build it "
                         f"with HierarchicalRoofline(profile, gpus={policy.gpus})")


def _allreduces(model: ModelSpec) -> int:
    """All-reduces per layer of a tensor-parallel group: the hidden states after attention and after the FFN, and
    the q/k norms' sums of squares where those norms span every head."""
    return 3 if model.qk_norms_span_heads else 2


def _allreduces_seconds(hrm: HierarchicalRoofline, model: ModelSpec, tokens: float, dtype_bytes: int) -> float:
    """One layer's all-reduces for ``tokens`` rows: two of the [tokens, hidden] states, and OLMoE's [tokens, 2]
    float32 sums of squares (latency-bound)."""
    allreduce = hrm.tensor_parallel.allreduce_seconds
    seconds = 2 * allreduce(tokens * model.hidden * dtype_bytes)
    return seconds + allreduce(tokens * 2 * 4) if model.qk_norms_span_heads else seconds


def _op_weight_bytes(model: ModelSpec, name: str) -> float:
    return {"qkv": model.qkv_weight_bytes, "o_proj": model.o_weight_bytes, "router": model.router_weight_bytes,
            "ffn": model.ffn_weight_bytes, "mlp": model.mlp_weight_bytes}.get(name, 0.0)


def prefill_terms(hrm: HierarchicalRoofline, model: ModelSpec, policy: Policy, workload: Workload,
                  options: CostOptions) -> Terms:
    """One layer of the prefill of a batch: everything on the GPU in chunks of prompt tokens, every weight
    of the layer streamed once per group of chunks, the prompt's KV written to CPU memory (its GPU share kept)."""
    tokens = policy.batch_size * workload.prompt_len
    chunk = min(options.prefill_chunk_tokens, tokens)
    groups = math.ceil(tokens / options.prefill_group_tokens) if options.prefill_group_tokens else 1
    chunks = tokens / chunk
    gpu = Lin()
    launches = 0.0
    ops = {}
    for name, op in model.prefill_ops(chunk, workload.prompt_len, workload.prompt_len_sq).items():
        seconds = Lin(chunks * hrm.gpu_seconds(op))
        gpu += seconds
        launches += math.ceil(chunks) * op.kernels * hrm.launch_s
        link = on_cpu_share(_op_weight_bytes(model, name)) * groups
        ops[name] = ("gpu", Lin(chunks * op.flops), Lin(chunks * op.bytes), link, seconds)
    _check_group(hrm, policy)
    if hrm.gpus > 1:
        seconds = Lin(chunks * _allreduces_seconds(hrm, model, chunk, model.dtype_bytes))
        gpu += seconds
        launches += math.ceil(chunks) * _allreduces(model) * hrm.launch_s
        ops["all-reduce"] = ("gpu", Lin(), Lin(), Lin(), seconds)
    weights = on_cpu_share(model.layer_weight_bytes) * groups  # every expert: a prefill chunk routes to all of them
    kv = tokens * group_model(model, policy.gpus).kv_bytes_per_token  # MLA: each rank writes the whole latent
    d2h = Lin(kv, 0, -kv) if policy.attention_on_gpu else Lin(kv)
    pieces = {"gpu_compute": [gpu], "gpu_launch": [Lin(launches)], "cpu": []}
    pieces.update(_link_pieces(hrm, [weights], d2h, math.ceil(chunks), math.ceil(chunks), Lin()))
    pieces["dependency_chain"] = []
    return Terms(pieces, ops, [weights], workload.prompt_len)


def head_seconds(hrm: HierarchicalRoofline, model: ModelSpec, policy: Policy) -> float:
    """Final norm + LM head of one decode step (resident on the GPU), per micro-batch."""
    total = 0.0
    for size, count in _micro_batches(policy):
        op = model.head_op(size)
        total += count * max(hrm.gpu_seconds(op), op.kernels * hrm.launch_s)
    return total


def decode_contexts(workload: Workload, samples: int) -> list[tuple[float, float]]:
    """(weight in steps, context length) pairs: the generation split into equal chunks of steps, each
    evaluated at its mean context (exact for terms linear in the context)."""
    steps = workload.gen_len
    k = max(1, min(samples, steps))
    out = []
    for i in range(k):
        lo, hi = i * steps // k, (i + 1) * steps // k
        if hi > lo:  # step g attends to prompt + g + 1 tokens (its own included)
            out.append((hi - lo, workload.prompt_len + (lo + hi - 1) / 2 + 1))
    return out


# ----- memory -----
def memory_use(model: ModelSpec, policy: Policy, workload: Workload, options: CostOptions) -> tuple[dict, dict]:
    """(GPU, CPU) memory by purpose, each a :class:`Lin` in (x, y); GPU memory per GPU (tensor parallelism over
    ``policy.gpus``: each holds its share of the weights and KV cache, and the whole activations)."""
    # MLA over several GPUs: every rank caches the whole latent; activations are each rank's
    b, kvb, n_seq, mu = (model.dtype_bytes, group_model(model, policy.gpus).kv_bytes_per_token, policy.batch_size,
                         policy.micro_batch_size)
    layer, all_layers = model.largest_layer_weight_bytes, model.layers * model.layer_weight_bytes
    kv_tokens = n_seq * workload.mean_kv_tokens
    kv_all_layers = kv_tokens * model.layers * kvb
    staged = min(mu, n_seq) * workload.mean_kv_tokens * kvb
    chunk = min(options.prefill_chunk_tokens, n_seq * workload.prompt_len)
    qkv_width = model.qkv_dim
    # the runtime's own activation model: decode's buffers, or the room its prefill chunks need, the larger
    activations = max(decode_bytes(model, n_seq, mu, b),
                      prefill_room(model, n_seq, prefill_chunk(n_seq * workload.prompt_len,
                                                               options.prefill_chunk_tokens), b))
    share = 1.0 / policy.gpus
    gpu = {
        # the embedding and LM head whole on every GPU; each GPU its share of the layers
        "resident weights": Lin(model.other_weight_bytes, all_layers * share),
        "weight double buffer": Lin(2 * layer, -2 * layer) * share,
        "KV cache": Lin(0, 0, kv_all_layers) * share if policy.attention_on_gpu else Lin(),
        # GPU attention over a partly CPU-resident cache: one micro-batch's CPU share of a layer's KV, twice.
        "KV staging": Lin(2 * staged, 0, -2 * staged) * share if policy.attention_on_gpu else Lin(),
        "activations": Lin(activations),
    }
    cpu_kv = Lin(kv_all_layers, 0, -kv_all_layers) if policy.attention_on_gpu else Lin(kv_all_layers)
    attention_workspace = 0.0 if policy.attention_on_gpu else (
        mu * model.heads * (workload.prompt_len_max + workload.gen_len) * 4)
    cpu = {
        "weights": on_cpu_share(all_layers),
        "KV cache": cpu_kv,
        "pinned staging": Lin(2 * n_seq * (2 * model.hidden + qkv_width + model.q_dim) * b + 2 * chunk * kvb),
        "CPU attention workspace": Lin(attention_workspace),
    }
    return gpu, cpu


# ----- evaluation -----
def as_roofline(profile: HardwareProfile | HierarchicalRoofline, gpus: int = 1) -> HierarchicalRoofline:
    """The roofline of ``gpus`` GPUs of ``profile`` (a roofline of another GPU count: rebuilt from its profile)."""
    if isinstance(profile, HierarchicalRoofline):
        return profile if profile.gpus == gpus else HierarchicalRoofline(profile.profile, gpus)
    return HierarchicalRoofline(profile, gpus)


def decode_layer_time(policy: Policy, model: ModelSpec, profile, context_len: float) -> LayerTime:
    """Predicted time of one layer in one decode step at this context length, for any policy: compare it
    with a measured per-layer decode time."""
    return decode_terms(as_roofline(profile, policy.gpus), model, policy, context_len).evaluate(
        policy.weights_gpu_fraction, policy.kv_gpu_fraction)


def prefill_layer_time(policy: Policy, model: ModelSpec, profile, workload: Workload,
                       options: CostOptions | None = None) -> LayerTime:
    return prefill_terms(as_roofline(profile, policy.gpus), model, policy, workload, options or CostOptions()).evaluate(
        policy.weights_gpu_fraction, policy.kv_gpu_fraction)


def default_cpu_limit(profile: HardwareProfile, options: CostOptions) -> float:
    return options.cpu_memory_fraction * profile.cpu_memory


def _whole_batch(policy: Policy) -> Policy:
    """The batch as one micro-batch (the prefill's LM head), on the policy's GPUs."""
    return Policy(policy.batch_size, policy.batch_size, gpus=policy.gpus)


def objective(hrm: HierarchicalRoofline, model: ModelSpec, policy: Policy, workload: Workload,
              options: CostOptions, decode: list | None = None) -> list[tuple[float, list[Lin]]]:
    """Seconds of one batch as ``sum_i weight_i * max(pieces_i)``: the prefill, then the decode steps
    (``decode``: :func:`decode_groups` where already built; they do not depend on the prefill's chunk)."""
    prefill = prefill_terms(hrm, model, policy, workload, options)
    head = head_seconds(hrm, model, _whole_batch(policy))
    groups = [(1.0, [p * model.layers + head for p in prefill.all_pieces()])]
    return groups + (decode if decode is not None else decode_groups(hrm, model, policy, workload, options))


def decode_groups(hrm: HierarchicalRoofline, model: ModelSpec, policy: Policy, workload: Workload,
                  options: CostOptions) -> list[tuple[float, list[Lin]]]:
    """The decode steps' part of :func:`objective`: a group per sampled context, weighted by its steps."""
    head = head_seconds(hrm, model, policy)
    groups = []
    for steps, context in decode_contexts(workload, options.decode_samples):
        terms = decode_terms(hrm, model, policy, context, workload, per_op=False)
        groups.append((float(steps), [p * model.layers + head for p in terms.all_pieces()]))
    return groups


def predict(policy: Policy, model: ModelSpec, profile, workload: Workload, gpu_memory: float | None = None,
            cpu_memory: float | None = None, options: CostOptions | None = None) -> Prediction:
    """Predicted times, throughput and memory of ``policy`` (any policy, not only a searched one).
    ``gpu_memory`` / ``cpu_memory``: the budgets to report against (default: the profile's capacities)."""
    options = options or CostOptions()
    hrm = as_roofline(profile, policy.gpus)
    prof = hrm.profile
    x, y = policy.weights_gpu_fraction, policy.kv_gpu_fraction
    batch_s = sum(w * max(p.at(x, y) for p in pieces) for w, pieces in objective(hrm, model, policy, workload, options))
    prefill = prefill_terms(hrm, model, policy, workload, options).evaluate(x, y)
    head_prefill = head_seconds(hrm, model, _whole_batch(policy))
    prefill_s = model.layers * prefill.seconds + head_prefill
    mean_context = workload.prompt_len + (workload.gen_len + 1) / 2
    decode = decode_terms(hrm, model, policy, mean_context, workload).evaluate(x, y)
    gpu_mem, cpu_mem = memory_use(model, policy, workload, options)
    gpu_limit = float(gpu_memory if gpu_memory is not None else (prof.gpu_memory or math.inf))
    cpu_limit = float(cpu_memory if cpu_memory is not None else default_cpu_limit(prof, options))
    balance = hrm.balance_batch_size(model, policy.micro_batch_size, x) if (
        model.is_moe and policy.experts_on_gpu) else None
    return Prediction(
        model=model.name, hardware=prof.name, workload=workload.describe(), decode_layer=decode,
        prefill_layer=prefill, decode_step_s=(batch_s - prefill_s) / workload.gen_len, prefill_s=prefill_s,
        batch_s=batch_s, tokens_per_s=policy.batch_size * workload.gen_len / batch_s,
        gpu_memory={k: v.at(x, y) for k, v in gpu_mem.items()}, cpu_memory={k: v.at(x, y) for k, v in cpu_mem.items()},
        gpu_limit=gpu_limit, gpu_usable=gpu_limit * (1 - options.gpu_margin), cpu_limit=cpu_limit,
        balance_batch_size=balance, uncalibrated=_uncalibrated(hrm, model), notes=_notes(prof, gpu_limit, cpu_limit),
        routed_experts=model.active_experts(policy.batch_size) if policy.routed_experts else None,
        experts=model.experts, gpus=policy.gpus,
        prefill_chunk_tokens=int(min(options.prefill_chunk_tokens, policy.batch_size * workload.prompt_len)))


def _uncalibrated(hrm, model: ModelSpec) -> list[str]:
    """The profile's missing terms, and the experts' format where the profile did not measure its kernels."""
    missing = list(hrm.uncalibrated)
    if not hrm.calibrates(model.expert_format):
        missing.append(f"{model.expert_format}_moe_efficiency ({model.expert_format.upper()} expert kernels at bf16's "
                       "efficiency)")
    return missing


def _notes(profile: HardwareProfile, gpu_limit: float, cpu_limit: float) -> list[str]:
    notes = []
    if profile.cpu_memory and cpu_limit > profile.cpu_memory:
        notes.append(f"the CPU budget exceeds the {profile.cpu_memory / 2**30:.0f} GiB of the profiled host: planning "
                     "for a larger host")
    if profile.gpu_memory and gpu_limit > profile.gpu_memory:
        notes.append(f"the GPU budget exceeds the profiled GPU's {profile.gpu_memory / 2**30:.1f} GiB")
    if "spec sheet" in profile.source:
        notes.append("GPU terms are spec-sheet peaks: expect the real throughput to be lower")
    return notes
