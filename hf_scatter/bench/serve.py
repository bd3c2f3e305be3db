"""Serving BERT-base under Poisson arrivals (TurboTransformers' Table 4 and Figure 12 on this GPU).

Requests with lengths uniform in 5..500 arrive as a Poisson process at each rate. One engine serves them;
a virtual clock advances by the measured time of each real batch (CUDA-synchronised) and of each
scheduling decision, so waiting for arrivals costs no benchmark time while every batch is really computed. Systems:

- PyTorch-NoBatch: vanilla transformers (SDPA), one request at a time, first come first served.
- PyTorch-NaiveBatch: vanilla, everything queued (up to 64) in one batch padded to its longest request.
- ours-NoBatch: the packed runtime (``hf_scatter.turbo.Encoder``), one request at a time.
- ours-DP-Batch: the packed runtime with the DP scheduler (hungry policy) over a measured cost table.

Per rate: response throughput (requests / (last completion - first arrival)) and latency mean, p50, p99,
max. "saturation" is every request arriving at once: the system's best throughput.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.timing import run_header
from .availability import require_cuda
from .bert import bert_base, padded, requests

SYSTEMS = ("PyTorch-NoBatch", "PyTorch-NaiveBatch", "ours-NoBatch", "ours-DP-Batch")
RATES = (100, 200, 400, 800, 1600, 3200, 6400, 12800)  # requests per second
NAIVE_MAX_BATCH = 64


def simulate(arrivals_ms: np.ndarray, lengths: list[int], execute, policy, timer=time.perf_counter) -> np.ndarray:
    """Completion time (ms, virtual clock) of every request. ``policy(queue) -> batches`` picks what runs
    when the engine is free (its own time, by ``timer`` in seconds, counts: a scheduler is on the serving
    path); ``execute(batch) -> ms`` runs one batch for real."""
    n = len(lengths)
    done = np.zeros(n)
    queue: list[int] = []
    clock, nxt, served = 0.0, 0, 0
    while served < n:
        while nxt < n and arrivals_ms[nxt] <= clock:
            queue.append(nxt)
            nxt += 1
        if not queue:
            clock = arrivals_ms[nxt]
            continue
        start = timer()
        batches = policy(queue)
        clock += (timer() - start) * 1e3
        for batch in batches:
            clock += execute(batch)
            done[batch] = clock
            served += len(batch)
        taken = {i for b in batches for i in b}
        queue = [i for i in queue if i not in taken]
    return done


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def _systems(vanilla, encoder, scheduler, reqs, device):
    def vanilla_run(batch):
        ids, mask = padded([reqs[i] for i in batch], device)
        return _timed(lambda: vanilla(ids, attention_mask=mask))

    def ours_run(batch):
        return _timed(lambda: encoder.run_batch([reqs[i] for i in batch]))

    fifo = lambda queue: [[queue[0]]]  # noqa: E731
    naive = lambda queue: [queue[:NAIVE_MAX_BATCH]]  # noqa: E731

    def dp(queue):
        return [[queue[i] for i in group] for group in scheduler.schedule([len(reqs[i]) for i in queue])]

    return {"PyTorch-NoBatch": (vanilla_run, fifo), "PyTorch-NaiveBatch": (vanilla_run, naive),
            "ours-NoBatch": (ours_run, fifo), "ours-DP-Batch": (ours_run, dp)}


def _stats(arrivals, done) -> dict:
    latency = done - arrivals
    return {"throughput_rps": len(done) / ((done.max() - arrivals.min()) / 1e3),
            "latency_ms": {"mean": float(latency.mean()), "p50": float(np.percentile(latency, 50)),
                           "p99": float(np.percentile(latency, 99)), "max": float(latency.max())}}


NEEDS_GPU = True


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench serve``, named after :func:`run`'s arguments."""
    parser.add_argument("--configs", nargs="*", metavar="SYSTEM", help=f"subset of {', '.join(SYSTEMS)} (default: all)")


def run(configs=None, num_requests: int = 400, rates=RATES) -> dict:
    require_cuda()
    import hf_scatter
    from hf_scatter.turbo import Encoder

    dev = torch.device("cuda")
    vanilla = bert_base(dev)
    import copy

    ours = hf_scatter.patch_model(copy.deepcopy(vanilla))
    encoder = Encoder(ours, scheduler=None, max_batch=64, max_tokens=16384, progress=False)
    warmup_s = encoder.warmup()  # every bucket planned and captured before the first request
    start = time.perf_counter()
    scheduler = encoder.calibrate(save=False)
    calibration_s = time.perf_counter() - start
    systems = [s for s in SYSTEMS if not configs or s in configs]
    reqs = requests(num_requests, 5, 500, seed=3)
    lengths = [len(r) for r in reqs]
    runs = _systems(vanilla, encoder, scheduler, reqs, dev)
    with torch.inference_mode():  # vanilla's SDPA (cuDNN) builds a plan per new shape: build them all first
        for i in range(num_requests):
            runs["PyTorch-NoBatch"][0]([i])
        for start_i in range(0, num_requests, NAIVE_MAX_BATCH):
            runs["PyTorch-NaiveBatch"][0](list(range(start_i, min(num_requests, start_i + NAIVE_MAX_BATCH))))
    rng = np.random.default_rng(4)
    gaps = rng.exponential(1.0, num_requests)
    results: dict = {s: {} for s in systems}
    for rate in [*rates, "saturation"]:
        arrivals = np.zeros(num_requests) if rate == "saturation" else np.cumsum(gaps) * 1e3 / rate
        for name in systems:
            execute, policy = runs[name]
            with torch.inference_mode():
                done = simulate(arrivals, lengths, execute, policy)
            results[name][str(rate)] = _stats(arrivals, done)
            print(f"  {rate!s:>10} {name:20s} {results[name][str(rate)]['throughput_rps']:8.0f} req/s  "
                  f"mean {results[name][str(rate)]['latency_ms']['mean']:8.1f} ms", flush=True)
    return {**run_header(), "dtype": "float16", "model": "bert-base (random weights)", "requests": num_requests,
            "lengths": [5, 500], "warmup_s": warmup_s, "calibration_s": calibration_s, "cost_table": scheduler.table.ms,
            "cost_lengths": scheduler.table.lengths, "cost_batches": scheduler.table.batches,
            "runtime": encoder.runtime.stats(), "results": results}


def to_markdown(report: dict) -> str:
    results = report["results"]
    systems = list(results)
    rates = list(next(iter(results.values())))
    sat = {s: results[s]["saturation"]["throughput_rps"] for s in systems}
    parts = [f"{report['device']}, BERT-base fp16, {report['requests']} requests of 5..500 tokens per rate\n",
             "Saturation throughput (all requests queued at once):\n",
             markdown_table(["system", "requests/s", "vs PyTorch-NoBatch"],
                            [[s, f"{sat[s]:.0f}", f"{sat[s] / sat[systems[0]]:.2f}x"] for s in systems])]
    rows = []
    for rate in rates:
        for s in systems:
            r = results[s][rate]
            lat = r["latency_ms"]
            rows.append([rate, s, f"{r['throughput_rps']:.0f}", f"{lat['mean']:.1f}", f"{lat['p50']:.1f}",
                         f"{lat['p99']:.1f}", f"{lat['max']:.1f}"])
    parts += ["\nPer arrival rate (requests/s):\n",
              markdown_table(["rate", "system", "throughput", "mean ms", "p50 ms", "p99 ms", "max ms"], rows),
              f"\nWarm-up (plan and capture every bucket) {report.get('warmup_s', 0):.1f} s, cost-table calibration "
              f"{report['calibration_s']:.1f} s; runtime {report['runtime']}"]
    return "\n".join(parts)


def saturation_table(report: dict) -> str:
    """The docs' view of a ``bench serve`` report: per system, its saturation throughput, that against the first
    system's (PyTorch-NoBatch) and its mean / p99 latency at saturation."""
    results = report["results"]
    base = next(iter(results.values()))["saturation"]["throughput_rps"]
    rows = []
    for name, per_rate in results.items():
        sat = per_rate["saturation"]
        lat = sat["latency_ms"]
        rows.append([name, f"{sat['throughput_rps']:.0f}", f"{sat['throughput_rps'] / base:.1f}x",
                     f"{lat['mean']:.0f} / {lat['p99']:.0f} ms"])
    first = next(iter(results))
    return markdown_table(["system", "saturation requests/s", f"vs {first}", "mean / p99 latency at saturation"],
                          rows)


def plot(report: dict, path: str) -> None:
    """Mean and p99 latency against achieved throughput per system (Figure 12 style), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, per_rate in report["results"].items():
        rates = [r for r in per_rate if r != "saturation"]
        thr = [per_rate[r]["throughput_rps"] for r in rates]
        for ax, stat in zip(axes, ("mean", "p99")):
            ax.plot(thr, [per_rate[r]["latency_ms"][stat] for r in rates], marker="o", label=name)
    for ax, stat in zip(axes, ("mean", "p99")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("response throughput (requests/s)")
        ax.set_ylabel(f"{stat} latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"BERT-base serving, Poisson arrivals, lengths 5..500, {report['device']}")
    fig.tight_layout()
    save_figure(fig, path)
