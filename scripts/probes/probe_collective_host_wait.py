"""Does the host wait for the GPU inside the ops FSDP2 issues per layer? Each op is called while the GPU is
busy (a ~0.5 s sleep kernel queued first); an op that returns at once leaves the host ahead, one whose host
time is about the sleep waited. Run under torchrun (NCCL, any world size, one GPU per rank); rank 0 prints
one JSON line of host milliseconds per op and world size. GPU only; a diagnostic, not a bench."""
import json
import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
n = 1 << 24
grads = [torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
shard = torch.randn(n, device="cuda", dtype=torch.bfloat16)
ops = {
    "chunk_cat bf16->fp32": lambda: torch._chunk_cat(grads, 0, world, out=torch.empty(world, 4 * n // world,
                                                                                       device="cuda")),
    "chunk_cat bf16->bf16": lambda: torch._chunk_cat(grads, 0, world, out=torch.empty(
        world, 4 * n // world, device="cuda", dtype=torch.bfloat16)),
    "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(world * n, device="cuda",
                                                                              dtype=torch.bfloat16), shard),
    "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(torch.empty(n, device="cuda"),
                                                                torch.randn(world * n, device="cuda")),
    "empty + copy_": lambda: torch.empty_like(shard).copy_(shard),
}
out = {}
for name, op in ops.items():
    op()  # warm: allocator, NCCL communicator
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(int(1e9))  # about 0.5 s of GPU time
    begin = time.perf_counter()
    op()
    out[name] = round((time.perf_counter() - begin) * 1e3, 2)
    torch.cuda.synchronize()
if rank == 0:
    print(json.dumps({"world": world, "host_ms_while_gpu_sleeps_500ms": out}), flush=True)
dist.destroy_process_group()
