"""Does FSDP2's gradient reduction in bf16 (``bench train --reduce-dtype bfloat16``, the tuned rows of the multi-GPU
tables) cost a patched MoE anything in training? Under torchrun, one run with float32 and one with bf16 reduction
of a tiny patched Qwen3-MoE (float32 parameters, FSDP2 per decoder layer then the root, AdamW) learning a fixed
random next-token table, each rank on its own rows, and a float32 run from another initialisation (how far two
runs differ anyway); every step's loss, averaged over the ranks. ``final``: the mean of the last tenth.

    torchrun --nproc_per_node 2 scripts/probes/probe_bf16_reduce.py OUT.json     (CPU: gloo; STEPS, default 300)
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from hf_scatter.bench import engines
from hf_scatter.bench.train import TrainConfig, build_model

SHAPE = TrainConfig(hidden=128, intermediate=96, experts=8, top_k=2, layers=2, heads=4, kv_heads=2, vocab=256,
                    batch=8, seq=64)


def rows(rank: int, steps: int) -> torch.Tensor:
    """[steps, batch, seq] token ids where each token is a fixed random function of the two before it (the second
    taken mod 16: 4,096 entries to learn, shared by every rank), from random starts different on each rank."""
    table = torch.randint(SHAPE.vocab, (SHAPE.vocab, 16), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(1000 + rank)
    ids = [torch.randint(SHAPE.vocab, (steps, SHAPE.batch, 1), generator=g) for _ in range(2)]
    for _ in range(SHAPE.seq - 2):
        ids.append(table[ids[-1], ids[-2] % 16])
    return torch.cat(ids, dim=-1)


def train(reduce_dtype: str, steps: int, device: torch.device, seed: int = 0) -> list[float]:
    model = build_model("qwen3_moe-hf-scatter", SHAPE, device, torch.float32, seed=seed)
    engines.fully_shard_layers(model, torch.float32, engines.Fsdp2Options(reduce_dtype=reduce_dtype))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = rows(engines.rank(), steps).to(device)
    losses = []
    for step in range(steps):
        loss = model(input_ids=data[step], labels=data[step]).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses


def main() -> None:
    steps = int(os.environ.get("STEPS", 300))
    cuda = torch.cuda.is_available()
    with engines.process_group(True, "cuda" if cuda else "cpu"):
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        # the noise floor: float32 again from another initialisation
        curves = {"float32": train("float32", steps, device), "bfloat16": train("bfloat16", steps, device),
                  "float32, another initialisation": train("float32", steps, device, seed=1)}
        if engines.rank() == 0:
            tail = max(1, steps // 10)
            report = {"world": dist.get_world_size(), "device": str(device), "steps": steps, "shape": vars(SHAPE),
                      "losses": curves, "final": {k: sum(v[-tail:]) / tail for k, v in curves.items()},
                      "mean_over_steps": {k: sum(v) / steps for k, v in curves.items()},
                      "first_loss": curves["float32"][0]}
            print(json.dumps({k: v for k, v in report.items() if k != "losses"}, indent=1))
            with open(sys.argv[1], "w") as f:
                json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
