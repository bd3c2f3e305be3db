"""Where a packed BERT-base inference call spends its time (GPU): the whole call, the graph replay alone, and
a cProfile of the host side. Run: PYTHONPATH=. python3 scripts/probe_bert_host_time.py"""
import cProfile
import copy
import pstats

import torch

import hf_scatter
from hf_scatter.bench.bert import bert_base, padded, requests
from hf_scatter.bench.timing import median_ms

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
