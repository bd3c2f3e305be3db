"""Conversion throughput, and load time of the hf-scatter layout vs the HF checkpoint it came from.

A Mixtral-8x7B-shaped model (hidden 4096, 8 experts of 14336, vocab 32000) with few layers and random bf16
weights is saved the way transformers publishes it (per-expert tensors, 5 GB shards), converted, and
both directories are loaded on the CPU. Runs on the host side of any machine; files stay in the page
cache, so load times measure the work done per tensor, not the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from ..common.argtypes import positive_int
from ..common.atomic_files import save_figure
from ..common.markdown import markdown_table
from ..common.shapes import MIXTRAL_8X7B
from ..common.timing import run_header

LOADS = ("vanilla <- HF checkpoint", "patched <- HF checkpoint", "patched <- hf-scatter checkpoint")


def _touch_every_page(model) -> None:
    """Read one element per 4 KiB page of every weight: a lazily mapped checkpoint pays its reads here."""
    step = 4096 // 2  # bf16 elements per page
    torch.stack([p.detach().view(-1)[::step].float().sum() for p in model.parameters()]).sum().item()


def _load_seconds(path: str, patched: bool) -> tuple[float, float]:
    """Seconds for from_pretrained to return, and until every weight page has been read once."""
    from transformers import AutoModelForCausalLM

    import hf_scatter

    if patched:
        hf_scatter.patch_transformers()
    try:
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        loaded = time.perf_counter() - start
        _touch_every_page(model)
        touched = time.perf_counter() - start
    finally:
        hf_scatter.unpatch_transformers()
    assert bool(hf_scatter.patch_report(model)) == patched
    del model
    return loaded, touched


NEEDS_GPU = False  # conversion and CPU load times


def add_arguments(parser) -> None:
    """Flags of ``hf-scatter bench convert``, named after :func:`run`'s arguments."""
    parser.add_argument("--layers", type=positive_int, default=2,
                        help="layers of the Mixtral-8x7B-shaped model (default 2)")
    parser.add_argument("--workdir", help="where the checkpoints are written (default: the temp dir)")


def run(layers: int = 2, repeats: int = 2, workdir: str | None = None) -> dict:
    from transformers import AutoModelForCausalLM

    from ..conversion import convert
    from ..tiny import tiny_mixtral_config

    root = tempfile.mkdtemp(prefix="hf-scatter-bench-convert-", dir=workdir)
    hf_dir, scatter_dir = os.path.join(root, "hf"), os.path.join(root, "hf-scatter")
    try:
        config = tiny_mixtral_config(layers=layers, **MIXTRAL_8X7B)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(hf_dir, max_shard_size="5GB")
        del model
        result = convert(hf_dir, scatter_dir, progress=False)
        loads = {name: [] for name in LOADS}
        for _ in range(repeats):  # interleaved, so the page cache and allocator warm up for all alike
            loads[LOADS[0]].append(_load_seconds(hf_dir, patched=False))
            loads[LOADS[1]].append(_load_seconds(hf_dir, patched=True))
            loads[LOADS[2]].append(_load_seconds(scatter_dir, patched=True))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    header = run_header()
    header["dtype"] = "bfloat16"
    return {**header, "cpu_threads": torch.get_num_threads(), "layers": layers, "shape": MIXTRAL_8X7B,
            "checkpoint_gb": result.plan.total_bytes / 1e9, "convert_s": result.seconds,
            "convert_gb_per_s": result.gb_per_s, "load_s": {k: min(s[0] for s in v) for k, v in loads.items()},
            "load_and_touch_s": {k: min(s[1] for s in v) for k, v in loads.items()}, "load_s_all": loads}


def to_markdown(report: dict) -> str:
    base, base_touched = report["load_s"][LOADS[0]], report["load_and_touch_s"][LOADS[0]]
    rows = [[name, f"{s:.2f}", f"{base / s:.2f}x", f"{report['load_and_touch_s'][name]:.2f}",
             f"{base_touched / report['load_and_touch_s'][name]:.2f}x"] for name, s in report["load_s"].items()]
    return (f"Mixtral-8x7B shape, {report['layers']} layers, {report['checkpoint_gb']:.2f} GB bf16, "
            f"{report['cpu_threads']} CPU threads ({report['device']})\n\n"
            f"convert HF -> hf-scatter: {report['convert_s']:.2f} s, {report['convert_gb_per_s']:.2f} GB/s\n\n"
            + markdown_table(["from_pretrained (CPU)", "returns after s", "vs vanilla",
                              "every weight page read after s", "vs vanilla"], rows))


def plot(report: dict, path: str) -> None:
    """Load seconds per path, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["load_s"])
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.barh(names, [report["load_and_touch_s"][n] for n in names], color="tab:blue", alpha=0.35,
            label="... and every weight page read once")
    ax.barh(names, [report["load_s"][n] for n in names], label="from_pretrained returns",
            color=["tab:orange" if "hf-scatter checkpoint" in n else "tab:gray" for n in names])
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="lower right")
    ax.set_xlabel("seconds on the CPU (lower is better)")
    ax.set_title(f"Mixtral-8x7B shape, {report['layers']} layers, {report['checkpoint_gb']:.1f} GB bf16; "
                 f"convert {report['convert_gb_per_s']:.2f} GB/s", fontsize=10)
    fig.tight_layout()
    save_figure(fig, path)
