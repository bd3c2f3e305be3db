"""Whether Python's GIL hand-over slows offloaded generation's CPU attention: one torchrun (one process per GPU, or one
process) builds the offloaded model once, then generates the same requests with each of SWITCH's values of
``sys.setswitchinterval`` in interleaved rounds. Per run and rank: tokens/s, the traced busy time of each lane (CPU
attention among them), and the HRM's prediction for the plan as it ran.

The question: the CPU attention thread runs a few dozen torch ops per bucket, and between two ops it needs the GIL,
which the driver thread (busy issuing GPU work most of a stage) holds. A thread that waits for the GIL takes it only
when the holder releases it and it wakes first, or when the switch interval (5 ms by default) has passed; the
pipeline's CPU attention ran about twice as long as the profile's fit of the same calls measured alone.

Usage (GPU host, repository root):
  PYTHONPATH=. NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc_per_node=N scripts/probes/probe_gil_switch.py OUT.json
Settings (environment): SWITCH (seconds, default "0.005,0.0005,0.0001"), ROUNDS (2), MODEL (gpt-oss-120b), LAYERS (8),
WEIGHTS (bf16 or mxfp4), REQUESTS (1024), NEW_TOKENS (32), GPU_MEMORY (16GiB), CPU_MEMORY (the planner's default),
PROFILE (a saved profile JSON, or a bench report holding one), DEVICE (cuda; cpu: gloo ranks, a smoke test).
"""

from __future__ import annotations

import dataclasses
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
from hf_scatter.offload import Workload, load_profile, parse_bytes, predict


def main() -> None:
    intervals = [float(s) for s in os.environ.get("SWITCH", "0.005,0.0005,0.0001").split(",")]
    rounds = int(os.environ.get("ROUNDS", 2))
    layers, new_tokens = int(os.environ.get("LAYERS", 8)), int(os.environ.get("NEW_TOKENS", 32))
    model, device = os.environ.get("MODEL", "gpt-oss-120b"), os.environ.get("DEVICE", "cuda")
    weights = os.environ.get("WEIGHTS", "bf16")
    default_interval = sys.getswitchinterval()
    with process_group(on=True, device=device):
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        begun = time.perf_counter()
        config = builtin_config(model, num_hidden_layers=layers)
        reqs = prompts(int(os.environ.get("REQUESTS", 1024)), config.vocab_size)
        ids, mask = left_padded(reqs)
        workload = Workload.from_prompts([len(r) for r in reqs], new_tokens)
        profile = load_profile(os.environ.get("PROFILE", "docs/results/history/profile-h200-x4.json"))
        extra = {"cpu_memory": os.environ["CPU_MEMORY"]} if "CPU_MEMORY" in os.environ else {}
        # every rank builds its own copy at once (host memory allowing): the build is the probe's longest part
        budget = parse_bytes(os.environ.get("GPU_MEMORY", "16GiB"), "gpu_memory")
        off = hf_scatter.offload_model(build_model(layers, model=model, weights=weights),
                                       gpu_memory=budget, profile=profile,
                                       workload=workload, group=dist.group.WORLD if world > 1 else None,
                                       progress=False, **extra, **({"device": "cpu"} if device == "cpu" else {}))
        off.generate(ids[:off.policy.batch_size], attention_mask=mask[:off.policy.batch_size], max_new_tokens=3,
                     progress=False)
        realised = dataclasses.replace(off.policy, weights_gpu_fraction=off.store.layout.fraction, prediction=None)
        prediction = predict(realised, off.spec, profile, workload, budget, off.cpu_budget * world,
                             off.cost_options)
        if rank == 0:
            print(f"built and warmed up in {time.perf_counter() - begun:.0f} s; HRM "
                  f"{prediction.tokens_per_s:.0f} tok/s, {prediction.decode_layer.bottleneck}", flush=True)
        runs = []
        for r in range(rounds):
            for interval in intervals:
                sys.setswitchinterval(interval)
                trace = os.path.join(tempfile.gettempdir(), f"probe-gil-{rank}.json")
                dist.barrier()
                start = time.perf_counter()
                out = off.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, return_dict=True,
                                   progress=False, trace=trace)
                sys.setswitchinterval(default_interval)
                stats = dict(out.stats)
                summary = stats.pop("trace")
                mine = {"switch_interval_s": interval, "round": r, "rank": rank,
                        "wall_s": time.perf_counter() - start, "stats": stats, "busy_s": summary["busy_s"],
                        "span_s": summary.get("span_s")}
                every = [None] * world
                dist.all_gather_object(every, mine)
                runs.append(every)
                if rank == 0:
                    print(interval, r, [(m["rank"], round(m["stats"]["tokens_per_s"], 1),
                                         round(m["busy_s"]["CPU attention"], 2)) for m in every], flush=True)
        off.close()
        if rank == 0 and len(sys.argv) > 1:
            with open(sys.argv[1], "w") as f:
                json.dump({"model": model, "layers": layers, "weights": weights, "world": world,
                           "cpu_count": os.cpu_count(), "python": sys.version, "torch": torch.__version__,
                           "policy": realised.to_dict(),
                           "predicted": {"tokens_per_s": prediction.tokens_per_s,
                                         "bottleneck": prediction.decode_layer.bottleneck,
                                         "decode_layer_s": prediction.decode_layer.seconds},
                           "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
