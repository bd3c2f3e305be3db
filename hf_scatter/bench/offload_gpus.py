"""``hf-scatter bench offload --gpus 1,2,4``: offloaded generation over several GPUs of this host (tensor
parallelism), each count against the HRM's prediction for it.

Every GPU count is one ``torchrun`` of ``bench offload`` (one process per GPU, NCCL), with the same model shape,
the same requests, the same GPU budget per GPU and one hardware profile measured first (so each count's policy is
planned on the same numbers). Each process builds the model, keeps its share of every layer
(``hf_scatter.offload_model(..., group=...)``) and generates every request; all ranks produce the same tokens, so the
group's throughput is one rank's. The report has every rank's figures and the scaling over the first count.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from ..common.markdown import markdown_table
from ..common.timing import run_header
from .availability import BenchUnavailable, RunStopped, require_cuda

# NCCL settings the multi-GPU hosts we measure on need (NVLink SHARP multicast off); a caller's own values win
NCCL_DEFAULTS = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def run_counts(counts: list[int], *, model: str, layers: int, published_layers: int, new_tokens: int, requests: int,
               gpu_memory, profile: str | None, progress: bool, trace: str | None = None) -> dict:
    """One torchrun per GPU count in ``counts``; their reports side by side. ``trace``: each count writes one
    Chrome trace per rank beside it (``<trace>.gpus<N>.rank<R>.json``)."""
    from ..offload import ModelSpec, measure_profile

    require_cuda()
    available = torch.cuda.device_count()
    if max(counts) > available:
        raise BenchUnavailable(f"--gpus {max(counts)}: this host has {available} GPU(s); pass counts up to {available}")
    header = run_header()
    with tempfile.TemporaryDirectory(prefix="hf-scatter-offload-gpus-") as tmp:
        start = time.perf_counter()
        if profile is None:  # measured once, so every count is planned on the same numbers
            measured = measure_profile(progress=progress, attention_shapes=[ModelSpec.from_config(model)])
            profile = os.path.join(tmp, "profile.json")
            measured.save(profile)
            torch.cuda.empty_cache()  # the measurement's buffers: GPU 0 is the first rank's next
        profile_s = time.perf_counter() - start
        jobs = []
        for n in counts:
            out = os.path.join(tmp, f"gpus-{n}.json")
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
                       "-m", "hf_scatter.cli", "bench", "offload", "--model", model, "--layers", str(layers),
                       "--new-tokens", str(new_tokens), "--requests", str(requests), "--gpu-memory", str(gpu_memory),
                       "--profile", profile, "--out", out]
            if trace:
                root, ext = os.path.splitext(trace)
                command += ["--trace", f"{root}.gpus{n}{ext or '.json'}"]
            # torchrun gives each process one OpenMP thread unless told: the CPU attention wants the host's share
            env = {**NCCL_DEFAULTS, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // n)), **os.environ}
            jobs.append((n, command, env, out))
        with open(profile) as f:
            profile_json = json.load(f)
        fields = dict(model=model, layers=layers, published_layers=published_layers, new_tokens=new_tokens,
                      requests=requests, gpu_memory=gpu_memory, profile=profile_json, profile_s=profile_s)
        try:
            rows = run_rows(jobs, progress)
        except RowsStopped as stopped:  # keep the counts that finished
            raise RunStopped(_report(header, _with_scaling(stopped.rows), **fields), str(stopped)) from None
    return _report(header, _with_scaling(rows), **fields)


class RowsStopped(RuntimeError):
    """The run was told to stop (SIGTERM) during a row; ``rows`` holds the rows that finished before it."""

    def __init__(self, rows: list[dict], why: str):
        super().__init__(why)
        self.rows = rows


def run_rows(jobs: list[tuple], progress: bool = True) -> list[dict]:
    """Each job ``(gpus, command, env, out)`` in turn: its command's JSON report's row, or the error. A SIGTERM
    (``timeout``, a scheduler) stops the running command and raises :class:`RowsStopped` with the rows that
    finished, so a run cut short keeps what it measured."""
    import signal
    import threading

    class Terminated(Exception):
        pass

    def terminated(signum, frame):
        raise Terminated()

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminated) if main else None
    rows: list[dict] = []
    try:
        for n, command, env, out in jobs:
            if progress:
                print(f"bench offload: {n} GPU(s): {' '.join(command)}", file=sys.stderr, flush=True)
            proc = subprocess.Popen(command, env=env, stdout=None if progress else subprocess.DEVNULL)
            try:
                code = proc.wait()
            except Terminated:
                proc.terminate()  # torchrun passes it on to its ranks
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                raise RowsStopped(rows, f"stopped by SIGTERM during the {n}-GPU row; the rows before it are "
                                        "kept") from None
            if code != 0:
                rows.append({"gpus": n, "error": f"torchrun exited with {code}"})
                continue
            with open(out) as f:
                rows.append(json.load(f)["by_gpus"][0])
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    return rows


def _with_scaling(rows: list[dict]) -> list[dict]:
    """``rows`` with each measured row's tokens/s over the first measured row's."""
    first = next((r for r in rows if "error" not in r), None)
    for r in rows:
        if "error" not in r and first is not None:
            r["scaling"] = r["tokens_per_s"] / first["tokens_per_s"]
    return rows


def _report(header: dict, rows: list[dict], *, gpu_memory, **fields) -> dict:
    from ..offload import parse_bytes

    return {**header, **fields, "gpu_budget_per_gpu": parse_bytes(gpu_memory, "gpu_memory"), "by_gpus": rows}


def run_rank(*, model: str, layers: int, published_layers: int, new_tokens: int, requests: int, gpu_memory,
             profile: str | None, progress: bool, trace: str | None = None) -> dict | None:
    """This process's part of one GPU count under torchrun; rank 0 returns the report of that count alone (None
    elsewhere). ``trace``: each rank writes its Chrome trace (``<trace>.rank<R>.json``); its summary goes in
    the report."""
    import torch.distributed as dist

    import hf_scatter
    from ..offload import ModelSpec, Workload, load_profile, parse_bytes, predict
    from .engines import process_group
    from ..common.shapes import builtin_config
    from .offload_workload import build_model, left_padded, prompts

    if profile is None:
        raise BenchUnavailable("bench offload under torchrun needs --profile (hf-scatter bench offload --gpus ... "
                               "measures one and passes it to every count)")
    with process_group(on=True, device="cuda"):
        rank, world = dist.get_rank(), dist.get_world_size()
        prof = load_profile(profile)
        budget = parse_bytes(gpu_memory, "gpu_memory")
        config = builtin_config(model, num_hidden_layers=layers)
        reqs = prompts(requests, config.vocab_size)
        workload = Workload.from_prompts([len(r) for r in reqs], new_tokens)
        spec = ModelSpec.from_config(config, name=f"{model} ({layers} of {published_layers} layers)")
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        # the ranks build the model in turns, each keeping its share: one whole model in host memory at a time
        offloaded = hf_scatter.offload_model(functools.partial(build_model, layers, model=model), gpu_memory=budget,
                                             profile=prof, workload=workload, group=dist.group.WORLD,
                                             progress=progress and rank == 0)
        offload_s = time.perf_counter() - start  # every rank's build and packing, one after the other
        policy = offloaded.policy
        ids, mask = left_padded(reqs)
        warm = min(len(reqs), policy.batch_size)
        offloaded.generate(ids[:warm], attention_mask=mask[:warm], max_new_tokens=3, progress=False)  # kernels
        dist.barrier()
        result = offloaded.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True,
                                    progress=progress and rank == 0, trace=trace)
        stats = dict(result.stats)
        # the whole GPU's use: the CUDA context and NCCL's buffers too (GPU 0: the profiling parent's context)
        free, total = torch.cuda.mem_get_info()
        mine = {"rank": rank, **stats, "max_memory_allocated": torch.cuda.max_memory_allocated(),
                "max_memory_reserved": torch.cuda.max_memory_reserved(), "device_used_after": total - free,
                "offload_s": offload_s,
                "host_weight_bytes": offloaded.store.layout.host_bytes,
                "device_weight_bytes": offloaded.store.layout.device_bytes,
                "tokens_digest": hash(tuple(map(tuple, result.tokens)))}
        realised = dataclasses.replace(policy, weights_gpu_fraction=offloaded.store.layout.fraction, prediction=None)
        cpu_budget = offloaded.cpu_budget * world  # the host's, as the planner counts it
        options = offloaded.cost_options
        describe = offloaded.describe()
        offloaded.close()
        ranks = [None] * world
        dist.all_gather_object(ranks, mine)
        if rank != 0:
            return None
    prediction = predict(realised, spec, prof, workload, budget, cpu_budget, options)
    lead = ranks[0]
    row = {"gpus": world, "gpu_budget_per_gpu": budget, "cpu_budget": cpu_budget, "policy": realised.to_dict(),
            "policy_markdown": describe, "tokens_per_s": lead["tokens_per_s"],
            "tokens_per_s_per_gpu": lead["tokens_per_s"] / world,
            "same_tokens_on_every_rank": len({r["tokens_digest"] for r in ranks}) == 1,
            "max_memory_allocated_per_gpu": max(r["max_memory_allocated"] for r in ranks),
            "within_budget": max(r["max_memory_allocated"] for r in ranks) <= budget,
            "predicted": {"tokens_per_s": prediction.tokens_per_s, "bottleneck": prediction.decode_layer.bottleneck,
                          "decode_layer_s": prediction.decode_layer.seconds, "decode_step_s": prediction.decode_step_s,
                          "prefill_s": prediction.prefill_s},
            "fraction_of_prediction": lead["tokens_per_s"] / prediction.tokens_per_s,
            "decode_layer_s": lead["decode_s"] / max(lead["decode_steps"], 1) / layers,
            "full_model_tokens_per_s_scaled": lead["tokens_per_s"] * layers / published_layers,
            "ranks": ranks}
    return _report(run_header(), [row], model=model, layers=layers, published_layers=published_layers,
                   new_tokens=new_tokens, requests=requests, gpu_memory=gpu_memory, profile=prof.name)


# ----------------------------------------------------------------------------- output
def to_markdown(report: dict) -> str:
    gib = 2**30
    rows = []
    first = next((r["gpus"] for r in report["by_gpus"] if "error" not in r), 1)
    for r in report["by_gpus"]:
        if "error" in r:
            rows.append([r["gpus"], r["error"], "", "", "", "", "", ""])
            continue
        p = r["policy"]
        rows.append([r["gpus"], f"{r['tokens_per_s']:,.1f}", f"{r.get('scaling', 1.0):.2f}x",
                     f"{r['predicted']['tokens_per_s']:,.1f}", f"{r['fraction_of_prediction']:.0%}",
                     r["predicted"]["bottleneck"],
                     f"{p['batch_size']} / {p['micro_batch_size']}, {p['weights_gpu_fraction']:.1%} resident",
                     f"{r['max_memory_allocated_per_gpu'] / gib:.1f}"])
    budget = report.get("gpu_budget_per_gpu") or 0
    head = (f"{report['model']} shape, {report['layers']} of {report['published_layers']} layers, "
            f"{budget / gib:.0f} GiB per GPU, {report['requests']} requests, {report['new_tokens']} new tokens, "
            f"{report['device']}")
    table = markdown_table(["GPUs", "tokens/s", f"over {first} GPU{'s' if first > 1 else ''}", "HRM tokens/s", "measured / HRM", "HRM bottleneck",
                            "policy (N / mu, weights)", "peak GiB per GPU"], rows)
    return f"{head}\n\n{table}"


def plot(report: dict, path: str) -> None:
    """Tokens/s against the GPU count: measured, the HRM's prediction, and linear scaling from the first count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..common.atomic_files import save_figure

    rows = [r for r in report["by_gpus"] if "error" not in r]
    n = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.plot(n, [r["tokens_per_s"] for r in rows], "o-", color="tab:orange", label="hf-scatter, measured")
    ax.plot(n, [r["predicted"]["tokens_per_s"] for r in rows], "x--", color="tab:blue", label="HRM prediction")
    if rows:
        base = rows[0]["tokens_per_s"] / rows[0]["gpus"]
        ax.plot(n, [base * g for g in n], ":", color="tab:gray", label="linear in GPUs")
    ax.set_xticks(n, [str(v) for v in n])
    ax.set_ylim(bottom=0)
    ax.set_xlabel("GPUs (tensor parallel)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{report['model']} shape, {report['layers']} layers, "
                 f"{(report.get('gpu_budget_per_gpu') or 0) / 2**30:.0f} GiB per GPU", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
