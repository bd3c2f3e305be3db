"""Where a packed BERT-base inference call spends its time (GPU): the whole call, the graph replay alone, and
a cProfile of the host side. Run: PYTHONPATH=. python3 scripts/probes/probe_bert_host_time.py"""
import cProfile
import copy
import pstats

import torch

import hf_scatter
from hf_scatter.bench.bert import bert_base, padded, requests
from hf_scatter.common.timing import median_ms

vanilla = bert_base("cuda")
patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
cases = {"b1s40": (torch.randint(1000, 30000, (1, 40), device="cuda"),) * 1,
         "batch20": padded(requests(20, 5, 500, seed=1), "cuda")}
cases["b1s40"] = (cases["b1s40"][0], torch.ones_like(cases["b1s40"][0]))
with torch.inference_mode():
    for name, (ids, mask) in cases.items():
        call = lambda: patched(ids, attention_mask=mask)  # noqa: E731
        call()
        runtime = patched._hf_scatter_runtime
        graph = next(reversed(runtime.graphs.values())).graph
        full, replay = median_ms(call, 100, 1000), median_ms(graph.replay, 100, 1000)
        print(f"{name}: whole call {full:.3f} ms, graph replay alone {replay:.3f} ms, vanilla "
              f"{median_ms(lambda: vanilla(ids, attention_mask=mask), 100, 1000):.3f} ms")
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            call()
        torch.cuda.synchronize()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(22)

# Kernel time by kernel for one large batch (eager on the planned memory: same kernels as the graph).
from hf_scatter.turbo.packing import pack_sequences  # noqa: E402
from hf_scatter.turbo.runtime import UnpaddedRuntime  # noqa: E402

batch = pack_sequences(requests(32, 8, 512, seed=2), "cuda", [[0] * n for n in (len(r) for r in requests(32, 8, 512, seed=2))])
with torch.inference_mode():
    graphs = UnpaddedRuntime(patched)
    graphs.run(batch)
    print(f"batch of 32 ({batch.num_tokens} tokens): graph {median_ms(lambda: graphs.run(batch), 100, 1000):.3f} ms")
    rt = UnpaddedRuntime(patched, cuda_graphs=False)
    rt.run(batch)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        rt.run(batch)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=10, max_name_column_width=60))

# Which GELU does torch._addmm_activation(use_gelu=True) compute on this GPU?
x = torch.randn(4096, 256, device="cuda", dtype=torch.float64)
w = torch.randn(512, 256, device="cuda", dtype=torch.float64) / 16
b = torch.randn(512, device="cuda", dtype=torch.float64)
for dtype in (torch.float32, torch.float16):
    got = torch._addmm_activation(b.to(dtype), x.to(dtype), w.to(dtype).t(), use_gelu=True).double()
    z = torch.addmm(b, x, w.t())
    print(dtype, "vs erf", (got - torch.nn.functional.gelu(z)).abs().max().item(),
          "vs tanh", (got - torch.nn.functional.gelu(z, approximate="tanh")).abs().max().item())
