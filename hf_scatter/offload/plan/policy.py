"""What to run (the workload) and how (the policy): the inputs and the output of the policy search."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Sequence

from ...common.units import format_bytes


class PlanError(ValueError):
    """No policy can run this model and workload within the given memory (the message says what to change)."""


@dataclass(frozen=True)
class Workload:
    """Offline batch generation: prompts of mean length ``prompt_len`` (mean square ``prompt_len_sq``,
    longest ``prompt_len_max``), ``gen_len`` new tokens each, ``num_requests`` requests (None: unbounded)."""

    prompt_len: float
    gen_len: int
    num_requests: int | None = None
    prompt_len_sq: float | None = None
    prompt_len_max: float | None = None

    def __post_init__(self):
        if not self.prompt_len > 0:
            raise ValueError(f"prompt length must be positive, got {self.prompt_len}")
        if int(self.gen_len) != self.gen_len or self.gen_len < 1:
            raise ValueError(f"generation length must be a positive integer, got {self.gen_len}")
        if self.num_requests is not None and (int(self.num_requests) != self.num_requests or self.num_requests < 1):
            raise ValueError(f"number of requests must be a positive integer, got {self.num_requests}")
        if self.prompt_len_sq is None:
            object.__setattr__(self, "prompt_len_sq", float(self.prompt_len) ** 2)
        if self.prompt_len_max is None:
            object.__setattr__(self, "prompt_len_max", float(self.prompt_len))
        if self.prompt_len_sq < self.prompt_len**2 * (1 - 1e-9) or self.prompt_len_max < self.prompt_len:
            raise ValueError("prompt_len_sq must be >= prompt_len^2 and prompt_len_max >= prompt_len")

    @classmethod
    def from_prompts(cls, prompt_lens: float | Sequence[float], gen_len: int,
                     num_requests: int | None = None) -> "Workload":
        """A mean prompt length, or the list of prompt lengths (then ``num_requests`` defaults to its length)."""
        if isinstance(prompt_lens, (int, float)):
            return cls(float(prompt_lens), gen_len, num_requests)
        lens = [float(p) for p in prompt_lens]
        if not lens or min(lens) <= 0:
            raise ValueError("prompt lengths must be a non-empty list of positive numbers")
        mean = sum(lens) / len(lens)
        return cls(mean, gen_len, num_requests or len(lens), sum(p * p for p in lens) / len(lens), max(lens))

    @property
    def mean_kv_tokens(self) -> float:
        """KV-cache tokens a request holds at the end of its generation, on average."""
        return self.prompt_len + self.gen_len

    def describe(self) -> str:
        requests = f", {self.num_requests} requests" if self.num_requests else ""
        spread = f" (max {self.prompt_len_max:.0f})" if self.prompt_len_max > self.prompt_len else ""
        return f"prompt {self.prompt_len:.0f} tokens{spread}, generate {self.gen_len}{requests}"


@dataclass(frozen=True)
class Policy:
    """How to run a batch (MoE-Lightning's policy): ``batch_size`` N requests per batch, split into
    micro-batches of ``micro_batch_size`` mu; attention and the expert FFN each on the GPU or the CPU; the
    same fraction of every layer's weights, and a fraction of the KV cache, kept on the GPU. The rest lives in
    CPU memory: each layer's CPU share of the weights streams to the GPU every step (or, with the FFN on the
    CPU, its expert share is computed there), and the CPU KV cache is read by CPU attention or streamed to
    GPU attention. ``routed_experts``: each decode step fetches the streamed columns of only the experts the
    batch's rows choose, after routing, instead of every expert's ahead of time (pays when few rows touch
    few experts). ``prediction`` is filled by :func:`~hf_scatter.offload.search_policy` and
    :func:`~hf_scatter.offload.predict`."""

    batch_size: int
    micro_batch_size: int
    attention_on_gpu: bool = False
    experts_on_gpu: bool = True
    weights_gpu_fraction: float = 0.0
    kv_gpu_fraction: float = 0.0
    routed_experts: bool = False
    gpus: int = 1  # GPUs of one host splitting every projection (tensor parallelism); memory figures are per GPU
    prediction: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if int(self.batch_size) != self.batch_size or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size}")
        if int(self.micro_batch_size) != self.micro_batch_size or not 1 <= self.micro_batch_size <= self.batch_size:
            raise ValueError(f"micro_batch_size must be an integer in 1..batch_size ({self.batch_size}), "
                             f"got {self.micro_batch_size}")
        for name in ("weights_gpu_fraction", "kv_gpu_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.kv_gpu_fraction > 0 and not self.attention_on_gpu:
            raise ValueError("kv_gpu_fraction > 0 needs attention_on_gpu=True (CPU attention reads a CPU KV cache)")
        if int(self.gpus) != self.gpus or self.gpus < 1:
            raise ValueError(f"gpus must be a positive integer, got {self.gpus}")
        if self.routed_experts and not self.experts_on_gpu:
            raise ValueError("routed_experts=True streams the experts the GPU computes; it needs experts_on_gpu=True")

    @property
    def num_micro_batches(self) -> int:
        return math.ceil(self.batch_size / self.micro_batch_size)

    def _predicted(self):
        if self.prediction is None:
            raise ValueError("this policy has no prediction: use hf_scatter.offload.predict(policy, ...)")
        return self.prediction

    @property
    def tokens_per_s(self) -> float:
        return self._predicted().tokens_per_s

    @property
    def bottleneck(self) -> str:
        return self._predicted().decode_layer.bottleneck

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "prediction"}
        out["num_micro_batches"] = self.num_micro_batches
        if self.prediction is not None:
            out["prediction"] = self.prediction.to_dict()
        return out

    def placement(self) -> str:
        attention = "GPU" if self.attention_on_gpu else "CPU"
        kv = (f"{self.kv_gpu_fraction:.0%} of the KV cache on the GPU, the rest streamed from CPU memory"
              if self.attention_on_gpu else "KV cache in CPU memory")
        routed = ", only the chosen experts' columns streamed after routing" if self.routed_experts else ""
        return (f"attention on the {attention} ({kv}), expert FFN on the {'GPU' if self.experts_on_gpu else 'CPU'}, "
                f"{self.weights_gpu_fraction:.1%} of the layer weights resident on the GPU{routed}")

    def explain(self) -> str:
        """One paragraph: what runs where, which resource bounds the time, what limits going faster."""
        p = self._predicted()
        d = p.decode_layer
        ms = _ms
        group = (f" over {self.gpus} GPUs (tensor parallel: each holds and streams its share of every weight, "
                 "and the hidden states are all-reduced after attention and after the FFN)") if self.gpus > 1 else ""
        text = (f"{p.model} on {p.hardware}{group}, GPU budget {format_bytes(p.gpu_limit)}{_each(self)}, CPU budget "
                f"{format_bytes(p.cpu_limit)}: run batches of N={self.batch_size} requests in "
                f"{_micro_batches_text(self)}, with {self.placement()}. ")
        streamed = d.link_weight_bytes
        if streamed > 0:
            text += (f"Each layer streams {format_bytes(streamed)} of weights to the GPU"
                     f"{'s' if self.gpus > 1 else ''} per decode step. ")
        if p.routed_experts is not None:
            text += (f"Only the experts the batch's rows choose stream: about {p.routed_experts:.1f} of {p.experts} per "
                     "layer and decode step (uniform routing), fetched once the router has chosen. ")
        text += (f"Per layer and decode step (mean context {d.context_len:.0f}) the GPU needs "
                 f"{ms(max(d.terms['gpu_compute'], d.terms['gpu_launch']))}, the CPU {ms(d.terms['cpu'])}, the "
                 f"CPU->GPU link {ms(d.terms['h2d'])} and GPU->CPU {ms(d.terms['d2h'])}; the "
                 f"{TERM_LABELS[d.bottleneck]} is the bottleneck at {ms(d.seconds)} per layer, so a batch takes {_s(p.batch_s)} "
                 f"({p.prefill_s / p.batch_s:.0%} prefill) and the predicted throughput is {p.tokens_per_s:,.1f} "
                 f"generated tokens/s. ")
        full = [f"{name} memory is {used:.0%} used (largest: {top}, {format_bytes(mem[top])})"
                for name, used, mem in (("GPU", p.gpu_memory_total / p.gpu_usable, p.gpu_memory),
                                        ("CPU", p.cpu_memory_total / p.cpu_limit, p.cpu_memory))
                if used >= 0.9 for top in [max(mem, key=mem.get)]]
        if full:
            text += "; ".join(full) + ", which is what stops a larger batch or more resident weights. "
        if p.balance_batch_size is not None and math.isfinite(p.balance_batch_size):
            text += (f"Weight streaming stops limiting the FFN at N of about {p.balance_batch_size:,.0f} "
                     "(its balance point at P2). ")
        if p.notes:
            text += "Note: " + "; ".join(p.notes) + ". "
        if p.uncalibrated:
            text += "Not calibrated in this profile: " + "; ".join(p.uncalibrated) + "."
        return text.strip()

    def to_markdown(self) -> str:
        from ...common.markdown import markdown_table

        p = self._predicted()
        d = p.decode_layer
        ms = _ms
        breakdown = lambda mem: ", ".join(f"{k} {format_bytes(v)}" for k, v in mem.items() if v > 0)  # noqa: E731
        rows = [
            ["model", p.model],
            ["hardware profile", p.hardware],
            ["GPUs (tensor parallel)", str(self.gpus)],
            ["GPU / CPU memory budget", f"{format_bytes(p.gpu_limit)}{_each(self)} / {format_bytes(p.cpu_limit)}"],
            ["workload", p.workload],
            ["batch N / micro-batch mu (micro-batches)",
             f"{self.batch_size} / {self.micro_batch_size} ({self.num_micro_batches})"],
            ["attention", ("GPU" if self.attention_on_gpu else "CPU")],
            ["expert FFN", "GPU" if self.experts_on_gpu else "CPU"],
            ["weights on GPU", f"{self.weights_gpu_fraction:.1%}"],
            ["expert streaming", _expert_streaming_text(p)],
            ["KV cache on GPU", f"{self.kv_gpu_fraction:.1%}"],
            [f"decode time per layer (context {d.context_len:.0f})", ms(d.seconds)],
            ["  GPU compute / GPU launch", f"{ms(d.terms['gpu_compute'])} / {ms(d.terms['gpu_launch'])}"],
            ["  CPU", ms(d.terms["cpu"])],
            ["  CPU->GPU / GPU->CPU / both", f"{ms(d.terms['h2d'])} / {ms(d.terms['d2h'])} / "
                                            f"{ms(d.terms['link_duplex'])}"],
            ["  host memory / pipeline dependency", f"{ms(d.terms['host_memory'])} / "
                                                    f"{ms(d.terms['dependency_chain'])}"],
            ["bottleneck", TERM_LABELS[d.bottleneck]],
            ["decode step, all layers (mean)", ms(p.decode_step_s)],
            [f"prefill per batch ({p.prefill_chunk_tokens:,}-token chunks)", _s(p.prefill_s)],
            ["predicted throughput", f"{p.tokens_per_s:,.1f} tokens/s"],
            [f"GPU memory{_each(self)} ({format_bytes(p.gpu_memory_total)})", breakdown(p.gpu_memory)],
            [f"CPU memory ({format_bytes(p.cpu_memory_total)})", breakdown(p.cpu_memory)],
        ]
        return markdown_table(["policy", "value"], rows)


def _each(policy: Policy) -> str:
    return " per GPU" if policy.gpus > 1 else ""


def gpu_scaling_table(plans: dict) -> str:
    """Plans of one workload at several GPU counts (``{gpus: policy}``, each predicted): throughput, scaling
    against the fewest GPUs, the binding resource and the decode terms that move with the count."""
    from ...common.markdown import markdown_table

    first = plans[min(plans)].prediction
    rows = []
    for gpus, policy in sorted(plans.items()):
        p = policy.prediction
        d = p.decode_layer
        rows.append([gpus, f"{p.tokens_per_s:,.1f}", f"{p.tokens_per_s / first.tokens_per_s:.2f}x",
                     TERM_LABELS[d.bottleneck], f"{policy.batch_size} / {policy.micro_batch_size}",
                     f"{policy.weights_gpu_fraction:.1%}", format_bytes(p.gpu_memory_total),
                     _ms(max(d.terms["gpu_compute"], d.terms["gpu_launch"])), _ms(d.terms["cpu"]),
                     _ms(d.terms["h2d"]), _ms(d.terms["host_memory"])])
    return markdown_table(["GPUs", "tokens/s", f"vs {min(plans)} GPU{'s' if min(plans) > 1 else ''}",
                           "bottleneck", "batch / micro-batch", "weights on GPU", "GPU memory per GPU",
                           "GPU ms per layer", "CPU ms", "CPU->GPU ms", "host memory ms"], rows)


def _expert_streaming_text(p) -> str:
    if p.routed_experts is None:
        return "every expert, ahead of the stage"
    return f"routed only: about {p.routed_experts:.1f} of {p.experts} experts per layer and step, after routing"


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:,.0f} ms" if ms >= 100 else f"{ms:.3g} ms"


def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


def _micro_batches_text(policy: Policy) -> str:
    n = policy.num_micro_batches
    return "one micro-batch" if n == 1 else f"{n} micro-batches of {policy.micro_batch_size}"


TERM_LABELS = {
    "gpu_compute": "GPU compute", "gpu_launch": "GPU launch overhead", "cpu": "CPU", "h2d": "CPU->GPU link",
    "d2h": "GPU->CPU link", "link_duplex": "link (both directions)", "host_memory": "host memory bandwidth",
    "dependency_chain": "pipeline dependency (too few micro-batches)",
}
