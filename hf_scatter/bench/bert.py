"""Packed BERT inference against transformers' padded SDPA BERT, in one run (GPU, fp16, BERT-base shapes).

Cases (the variable-length runtime's acceptance points):
- ``batch20``: one batch of 20 requests with lengths uniform in 5..500, padded for vanilla (also with the
  erf GELU kept, ``fast_gelu=False``, to show what the fused tanh-form epilogue buys and changes).
- ``b1s40``: one request of 40 tokens (launch-bound).
- ``b20s128``: 20 x 128, no padding (where fused norms alone lost to vanilla: host-bound).
- ``stream512``: 512 requests with lengths uniform in 8..512, served as 16 batches of 32 in arrival order;
  throughput, and the peak activation memory over the stream after one warm pass (everything allocated
  beyond the weights and inputs: for hf-scatter that includes its planned arena and graph pools, which
  persist; one-time buffers of the first pass, such as Triton's autotuning scratch, do not count).
Timings are CUDA-event medians of whole calls (host work included: that is what a caller waits for).
"""

from __future__ import annotations

import copy
import gc

import numpy as np
import torch

from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.timing import median_ms, run_header
from .availability import require_cuda

DTYPE = torch.float16


def bert_base(device, attn_implementation: str = "sdpa", seed: int = 0):
    from transformers import AutoModel, BertConfig

    torch.manual_seed(seed)
    return AutoModel.from_config(BertConfig(), attn_implementation=attn_implementation).to(device, DTYPE).eval()


def requests(n: int, low: int, high: int, seed: int, vocab: int = 30522) -> list[np.ndarray]:
    """``n`` random token sequences with lengths uniform in [low, high] (token 101 first, like [CLS])."""
    rng = np.random.default_rng(seed)
    out = []
    for length in rng.integers(low, high + 1, size=n):
        seq = rng.integers(1000, vocab, size=int(length))
        seq[0] = 101
        out.append(seq)
    return out


def padded(batch: list[np.ndarray], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask)`` as a tokenizer would give them."""
    S = max(len(s) for s in batch)
    ids = np.zeros((len(batch), S), dtype=np.int64)
    mask = np.zeros((len(batch), S), dtype=np.int64)
    for i, s in enumerate(batch):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


def _max_abs_diff(vanilla, patched, ids, mask) -> float:
    with torch.inference_mode():
        want = vanilla(ids, attention_mask=mask).last_hidden_state
        got = patched(ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    return (want[keep].float() - got[keep].float()).abs().max().item()


def _latency(vanilla, patched, ids, mask) -> dict:
    with torch.inference_mode():
        ms = {"vanilla sdpa (padded)": median_ms(lambda: vanilla(ids, attention_mask=mask), 100, 1000),
              "hf-scatter (packed)": median_ms(lambda: patched(ids, attention_mask=mask), 100, 1000)}
    return {"ms": ms, "tokens": int(mask.sum()), "padded_tokens": int(mask.numel()),
            "max_abs_diff": _max_abs_diff(vanilla, patched, ids, mask)}


def _stream(model, batches, device, base: int | None = None) -> tuple[float, float]:
    """(seconds for the whole stream, peak bytes allocated beyond ``base``, default what was live before it)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if base is None else base
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        start.record()
        for ids, mask in batches:
            model(ids, attention_mask=mask)
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3, torch.cuda.max_memory_allocated() - base


def _timed_loop(fn) -> float:
    """Seconds of ``fn()`` between CUDA events (host and device work both inside)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.inference_mode():
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3


def _stream512(vanilla, patched_factory, device) -> dict:
    reqs = requests(512, 8, 512, seed=2)
    batches = [padded(reqs[i:i + 32], device) for i in range(0, 512, 32)]
    by_length = sorted(reqs, key=len)
    sorted_batches = [padded(by_length[i:i + 32], device) for i in range(0, 512, 32)]
    tokens = sum(len(r) for r in reqs)
    results = {}
    _stream(vanilla, batches, device)  # warm-up
    van_s, van_peak = min(_stream(vanilla, batches, device) for _ in range(3))
    van_sorted_s, _ = min(_stream(vanilla, sorted_batches, device) for _ in range(3))
    patched = patched_factory()
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()  # the planned arena and graph pools count towards the peak
    first_s, _ = _stream(patched, batches, device)  # plans, captures and tunes on the way (one-time buffers)
    ours_s, ours_peak = _stream(patched, batches, device, base=before)  # like vanilla's: after a warm pass
    ours_s = min([ours_s] + [_stream(patched, batches, device)[0] for _ in range(2)])
    from ..turbo import Encoder

    encoder = Encoder(patched, scheduler=None, progress=False)  # host-packed requests: no sync per batch
    request_batches = [[list(r) for r in reqs[i:i + 32]] for i in range(0, 512, 32)]
    encoder_s = min(_timed_loop(lambda: [encoder.run_batch(b) for b in request_batches]) for _ in range(4))
    results = {
        "requests": 512, "tokens": tokens, "batch": 32,
        "seconds": {"vanilla sdpa, arrival-order batches": van_s, "vanilla sdpa, length-sorted batches": van_sorted_s,
                    "hf-scatter model call, arrival-order batches": ours_s,
                    "hf-scatter Encoder, arrival-order batches": encoder_s,
                    "hf-scatter, first pass (planning + graph capture)": first_s},
        "peak_activation_bytes": {"vanilla sdpa": van_peak, "hf-scatter": ours_peak},
        "runtime": patched.__dict__["_hf_scatter_runtime"].stats(),
    }
    return results


NEEDS_GPU = True


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench bert``, named after :func:`run`'s arguments."""
    parser.add_argument("--configs", nargs="*", metavar="CASE",
                        help="subset of batch20, b1s40, b20s128, stream512 (default: all)")


def run(configs=None) -> dict:
    require_cuda()
    import hf_scatter

    dev = torch.device("cuda")
    vanilla = bert_base(dev)
    factory = lambda: hf_scatter.patch_model(copy.deepcopy(vanilla))  # noqa: E731
    patched = factory()
    wanted = lambda name: not configs or name in configs  # noqa: E731
    report = {**run_header(), "dtype": "float16", "model": "bert-base (random weights)", "cases": {}}
    if wanted("batch20"):
        ids, mask = padded(requests(20, 5, 500, seed=1), dev)
        report["cases"]["batch20"] = _latency(vanilla, patched, ids, mask)
        exact = hf_scatter.patch_model(copy.deepcopy(vanilla), fast_gelu=False)
        report["cases"]["batch20, exact GELU"] = _latency(vanilla, exact, ids, mask)
        del exact
    if wanted("b1s40"):
        ids = torch.randint(1000, 30000, (1, 40), device=dev)
        report["cases"]["b1s40"] = _latency(vanilla, patched, ids, torch.ones_like(ids))
    if wanted("b20s128"):
        ids = torch.randint(1000, 30000, (20, 128), device=dev)
        report["cases"]["b20s128"] = _latency(vanilla, patched, ids, torch.ones_like(ids))
    for name, case in report["cases"].items():
        print(f"  {name}: {case['ms']}", flush=True)
    if wanted("stream512"):
        del patched
        report["stream512"] = _stream512(vanilla, factory, dev)
    return report


def to_markdown(report: dict) -> str:
    rows = []
    for name, case in report["cases"].items():
        (vn, vt), (pn, pt) = case["ms"].items()
        rows.append([name, case["tokens"], case["padded_tokens"], f"{vt:.3f}", f"{pt:.3f}", f"{vt / pt:.2f}x",
                     f"{case['max_abs_diff']:.2g}"])
    parts = [f"{report['device']}, BERT-base fp16, CUDA-event medians of whole calls\n",
             markdown_table(["case", "real tokens", "padded tokens", "vanilla sdpa ms", "hf-scatter ms", "speedup",
                             "max abs diff"], rows)]
    s = report.get("stream512")
    if s:
        sec = s["seconds"]
        base = sec["vanilla sdpa, arrival-order batches"]
        rows = [[name, f"{t * 1e3:.1f}", f"{s['requests'] / t:.0f}", f"{s['tokens'] / t / 1e3:.0f}k",
                 f"{base / t:.2f}x"] for name, t in sec.items()]
        peak = s["peak_activation_bytes"]
        parts += [f"\n512 requests, lengths 8..512 ({s['tokens']} tokens), batches of {s['batch']}\n",
                  markdown_table(["system", "ms", "requests/s", "tokens/s", "vs vanilla"], rows),
                  f"\nPeak activation memory over the stream: vanilla {peak['vanilla sdpa'] / 2**20:.0f} MiB, "
                  f"hf-scatter {peak['hf-scatter'] / 2**20:.0f} MiB "
                  f"({peak['hf-scatter'] / peak['vanilla sdpa']:.2f}x); runtime {s['runtime']}"]
    return "\n".join(parts)


_CASE_LABELS = {"batch20": "batch of 20, lengths 5..500", "batch20, exact GELU": "same, `fast_gelu=False` (erf GELU)",
                "b1s40": "B=1, S=40", "b20s128": "B=20, S=128"}
_STREAM_LABELS = {"vanilla sdpa, arrival-order batches": "vanilla SDPA, arrival-order batches (padded)",
                  "vanilla sdpa, length-sorted batches": "vanilla SDPA, length-sorted batches",
                  "hf-scatter model call, arrival-order batches": "hf-scatter, patched model call (pads, then packs)",
                  "hf-scatter Encoder, arrival-order batches": "hf-scatter `Encoder.run_batch` on the same batches",
                  "hf-scatter, first pass (planning + graph capture)":
                      "hf-scatter, first pass (planning, graph capture, autotuning)"}


def latency_table(report: dict) -> str:
    """The docs' view of a ``bench bert`` report's cases: ``to_markdown``'s first table, cases named in words."""
    rows = []
    for name, case in report["cases"].items():
        (_, vt), (_, pt) = case["ms"].items()
        rows.append([_CASE_LABELS.get(name, name), case["tokens"], case["padded_tokens"], f"{vt:.3f}", f"{pt:.3f}",
                     f"{vt / pt:.2f}x", f"{case['max_abs_diff']:.2g}"])
    return markdown_table(["case", "real tokens", "padded tokens", "vanilla SDPA ms", "hf-scatter ms", "speedup",
                           "max abs diff"], rows)


def stream_table(report: dict) -> str:
    """The docs' view of a ``bench bert`` report's 512-request stream: time, requests/s and speedup over
    vanilla's arrival-order batches per system, the best steady-state speedup in bold (none for the first
    pass, which includes one-time work)."""
    s = report["stream512"]
    sec = s["seconds"]
    base = sec["vanilla sdpa, arrival-order batches"]
    steady = {name: base / t for name, t in sec.items() if "first pass" not in name}
    best = max(steady, key=steady.get)
    rows = []
    for name, t in sec.items():
        ratio = f"{steady[name]:.2f}x" if name in steady else ""
        rows.append([_STREAM_LABELS.get(name, name), f"{t * 1e3:.1f}", f"{s['requests'] / t:.0f}",
                     f"**{ratio}**" if name == best else ratio])
    return markdown_table(["system", "ms", "requests/s", "vs vanilla"], rows)


def plot(report: dict, path: str) -> None:
    """Latency per case, vanilla next to hf-scatter, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["cases"])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    xs = np.arange(len(names))
    for offset, impl, color in ((-0.2, 0, "tab:gray"), (0.2, 1, "tab:orange")):
        label = list(report["cases"][names[0]]["ms"])[impl]
        ax.bar(xs + offset, [list(report["cases"][n]["ms"].values())[impl] for n in names], width=0.4,
               color=color, label=label)
    ax.set_xticks(xs, names)
    ax.set_ylabel("ms per call (lower is better)")
    ax.set_title(f"BERT-base fp16 inference, {report['device']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
