"""A/B in one process: BERT-base fp16, one request of 40 tokens, the packed runtime's graph captured with dependent
launches (``pdl``: each of our kernels waits for the one before first thing, so its launch overlaps the end of its
predecessor; the runtime as it stands) and without (``plain``: captured with the option off); model call and graph
replay, alternating, two rounds. The timer flushes the L2 cache before each call.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_bert_pdl_ab.py   (writes $OUT/bert_pdl_ab.json)
"""
import contextlib
import copy
import json
import os
from unittest import mock

import torch

import hf_scatter
from hf_scatter.bench.bert import bert_base
from hf_scatter.common.timing import median_ms, run_header
from hf_scatter.kernels import dependent_launch
from hf_scatter.turbo import runtime
from hf_scatter.common.atomic_files import write_json


def main():
    dev = torch.device("cuda")
    vanilla = bert_base(dev)
    ids = torch.randint(1000, 30000, (1, 40), device=dev)
    mask = torch.ones_like(ids)
    models = {name: hf_scatter.patch_model(copy.deepcopy(vanilla)) for name in ("pdl", "plain")}
    with torch.inference_mode():
        want = vanilla(ids, attention_mask=mask).last_hidden_state
        for name, m in models.items():
            off = mock.patch.object(runtime, "dependent_launches", contextlib.nullcontext)
            with off if name == "plain" else contextlib.nullcontext():
                m(ids, attention_mask=mask)  # captures the 64-token bucket's graph
    report = {**run_header(), "what": __doc__, "pdl_supported": dependent_launch._pdl_supported(0), "rounds": []}
    with torch.inference_mode():
        for _ in range(2):
            row = {}
            for name, m in models.items():
                graph = next(iter(m.__dict__["_hf_scatter_runtime"].graphs.values())).graph
                row[name] = {"call_ms": median_ms(lambda: m(ids, attention_mask=mask), 100, 1000),
                             "replay_ms": median_ms(graph.replay, 100, 1000),
                             "max_abs_diff_vs_vanilla": (m(ids, attention_mask=mask).last_hidden_state.float()
                                                          - want.float()).abs().max().item()}
            report["rounds"].append(row)
            print(json.dumps(row), flush=True)
    write_json(os.path.join(os.environ.get("OUT", "/tmp"), "bert_pdl_ab.json"), report)


if __name__ == "__main__":
    main()
