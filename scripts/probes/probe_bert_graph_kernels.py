"""How many kernels one packed BERT-base graph replays and their GPU time, at 40 and 500 tokens, with a kernel table of
the same ops run eagerly on planned memory. Run: PYTHONPATH=. python3 scripts/probes/probe_bert_graph_kernels.py"""
import copy, os, torch
import hf_scatter
from hf_scatter.bench.bert import bert_base
from hf_scatter.turbo.packing import pack_sequences
from hf_scatter.turbo.runtime import UnpaddedRuntime
from hf_scatter.common.timing import median_ms
from hf_scatter.common.atomic_files import write_json
vanilla = bert_base("cuda")
patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
res = {}
with torch.inference_mode():
    for T in (40, 500):
        batch = pack_sequences([list(range(1000, 1000 + T))], "cuda")
        g = UnpaddedRuntime(patched); g.run(batch)
        cap = next(reversed(g.graphs.values()))
        res[f"graph replay ms T={T}"] = median_ms(cap.graph.replay, 100, 1000)
        rt = UnpaddedRuntime(patched, cuda_graphs=False); rt.run(batch); rt.run(batch)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10): rt.run(batch)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=90)
        print(T, table)
        res[f"kernels T={T}"] = table
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10): cap.graph.replay()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        res[f"graph kernels per replay T={T}"] = len(evs) / 10
        res[f"graph kernel time sum us T={T}"] = sum(e.device_time for e in evs) / 10
        print(T, res[f"graph replay ms T={T}"], res[f"graph kernels per replay T={T}"], res[f"graph kernel time sum us T={T}"])
write_json(os.path.join(os.environ.get("OUT", "/tmp"), "bert_kernels.json"), res)
