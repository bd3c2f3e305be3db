"""Whether the ranks' CPU attention threads decide how fast (and how repeatably) tensor-parallel offloaded generation
runs: one torchrun (one process per GPU) builds the GPT-OSS-120B-shape model of the multi-GPU offload table once,
then generates the table's requests with each CPU attention thread count in THREADS, in interleaved rounds (so a
host that drifts affects every count alike). Per run: tokens/s and every rank's CPU attention busy time (traced).

The variance it looks into: the same two-GPU row gave 680 to 1,996 tokens/s across runs on one kind of host, its
CPU attention busy time 10.9 to 44.3 s per rank (docs/results/history/offload-gpus-gpt-oss-120b-h100-x4-repeats.json).
Run it twice, with and without OMP_WAIT_POLICY=PASSIVE (read at start-up), to see whether spinning teams matter.
Its runs on the 4 x H100 host, per run and rank, are in docs/results/history/offload-rank-threads-h100-x4.json.

With one process (``--nproc_per_node=1``) it asks the same of a lone offloaded model, whose CPU attention keeps every
core but two while its driver thread issues the GPU's work beside it.

Usage (GPU host, repository root):
  PYTHONPATH=. NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=2 scripts/probes/probe_rank_threads.py OUT.json
Settings (environment): THREADS (default "28,20,12"), ROUNDS (2), MODEL (gpt-oss-120b), LAYERS (8), WEIGHTS (bf16 or
mxfp4), REQUESTS (1024), NEW_TOKENS (32), GPU_MEMORY (16GiB), CPU_MEMORY (the planner's default), PROFILE (a profile
JSON, or a bench report holding one; default docs/results/history/profile-h100-x4.json), DEVICE (cuda;
cpu: gloo ranks, a smoke test of the script itself).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import hf_scatter
from hf_scatter.bench.engines import process_group
from hf_scatter.bench.offload_workload import build_model, left_padded, prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import Workload, load_profile
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker


def with_threads(off, threads: int) -> None:
    """The offloaded model's CPU attention worker replaced by one of ``threads`` intra-op threads (probe only)."""
    off.worker.close()
    off.worker = off.pipe.worker = AttentionWorker(threads)


def main() -> None:
    counts = [int(t) for t in os.environ.get("THREADS", "28,20,12").split(",")]
    rounds = int(os.environ.get("ROUNDS", 2))
    layers, new_tokens = int(os.environ.get("LAYERS", 8)), int(os.environ.get("NEW_TOKENS", 32))
    model, device = os.environ.get("MODEL", "gpt-oss-120b"), os.environ.get("DEVICE", "cuda")
    with process_group(on=True, device=device):
        rank = dist.get_rank()
        # torchrun gives each process one intra-op thread unless told (as bench offload --gpus does, its share)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
        begun = time.perf_counter()
        config = builtin_config(model, num_hidden_layers=layers)
        reqs = prompts(int(os.environ.get("REQUESTS", 1024)), config.vocab_size)
        ids, mask = left_padded(reqs)
        profile = load_profile(os.environ.get("PROFILE", "docs/results/history/profile-h100-x4.json"))
        extra = {"cpu_memory": os.environ["CPU_MEMORY"]} if "CPU_MEMORY" in os.environ else {}
        build = functools.partial(build_model, layers, model=model, weights=os.environ.get("WEIGHTS", "bf16"))
        off = hf_scatter.offload_model(build, gpu_memory=os.environ.get("GPU_MEMORY", "16GiB"), profile=profile,
                                       workload=Workload.from_prompts([len(r) for r in reqs], new_tokens),
                                       group=dist.group.WORLD if dist.get_world_size() > 1 else None,
                                       progress=False, **extra,
                                       **({"device": "cpu"} if device == "cpu" else {}))
        off.generate(ids[:off.policy.batch_size], attention_mask=mask[:off.policy.batch_size], max_new_tokens=3,
                     progress=False)
        if rank == 0:
            print(f"built and warmed up in {time.perf_counter() - begun:.0f} s", flush=True)
        runs = []
        for r in range(rounds):
            for threads in counts:
                with_threads(off, threads)
                trace = os.path.join(tempfile.gettempdir(), f"probe-threads-{rank}.json")
                dist.barrier()
                start = time.perf_counter()
                out = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True,
                                   progress=False, trace=trace)
                stats = dict(out.stats)
                busy = stats.pop("trace")["busy_s"]
                mine = {"threads": threads, "round": r, "rank": rank, "wall_s": time.perf_counter() - start,
                        "stats": stats, "cpu_attention_busy_s": busy["CPU attention"],
                        "h2d_weights_busy_s": busy["H2D weights"], "busy_s": busy}
                every = [None] * dist.get_world_size()
                dist.all_gather_object(every, mine)
                runs.append(every)
                if rank == 0:
                    print(threads, r, [(m["rank"], round(m["stats"]["tokens_per_s"], 1),
                                        round(m["cpu_attention_busy_s"], 1)) for m in every], flush=True)
        off.close()
        if rank == 0 and len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump({"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "cpu_count": os.cpu_count(),
                           "weights": os.environ.get("WEIGHTS", "bf16"), "layers": layers,
                           "torch": torch.__version__, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
