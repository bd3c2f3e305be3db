"""A/B in one process: BERT-base fp16, one request of 40 tokens, the packed runtime's graph with the few-rows
kernel (``skinny_linear``) and without it (cuBLAS); model call and graph replay, alternating, two rounds each.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_bert_skinny_ab.py   (writes $OUT/bert_skinny_ab.json)
"""
import copy
import json
import os

import torch

import hf_scatter
from hf_scatter.bench.bert import bert_base
from hf_scatter.common.timing import median_ms, run_header
from hf_scatter.common.atomic_files import write_json

dev = torch.device("cuda")
vanilla = bert_base(dev)
ids = torch.randint(1000, 30000, (1, 40), device=dev)
mask = torch.ones_like(ids)
models = {"skinny": hf_scatter.patch_model(copy.deepcopy(vanilla)),
          "cublas": hf_scatter.patch_model(copy.deepcopy(vanilla))}
with torch.inference_mode():
    want = vanilla(ids, attention_mask=mask).last_hidden_state
    for name, m in models.items():
        m(ids, attention_mask=mask)
        rt = m.__dict__["_hf_scatter_runtime"]
        if name == "cublas":
            rt.skinny = None
            rt.graphs.clear()
            m(ids, attention_mask=mask)
report = {**run_header(), "what": __doc__, "rounds": []}
with torch.inference_mode():
    for r in range(2):
        row = {}
        for name, m in models.items():
            rt = m.__dict__["_hf_scatter_runtime"]
            graph = next(iter(rt.graphs.values())).graph
            row[name] = {"call_ms": median_ms(lambda: m(ids, attention_mask=mask), 100, 1000),
                         "replay_ms": median_ms(graph.replay, 100, 1000),
                         "max_abs_diff_vs_vanilla": (m(ids, attention_mask=mask).last_hidden_state.float()
                                                      - want.float()).abs().max().item(),
                         "graphs": list(map(str, rt.graphs.keys()))}
        report["rounds"].append(row)
        print(json.dumps(row), flush=True)
write_json(os.path.join(os.environ.get("OUT", "/tmp"), "bert_skinny_ab.json"), report)
