"""Where a padded BERT-base (fp16) batch should run row for row (no host wait for its mask, the padding computed)
rather than packed (the mask read on the host, only real tokens computed): the patched call's CUDA-event median
both ways, and vanilla's, for full and half-padded batches of several shapes. Sets PADDED_ROWS_LIMIT.
Run: PYTHONPATH=. python3 scripts/probes/probe_bert_padded_rows.py (writes $OUT/bert_padded_rows.json)"""
import copy
import os

import numpy as np
import torch

import hf_scatter
import hf_scatter.turbo.hf_forward as hff
from hf_scatter.bench.bert import bert_base
from hf_scatter.common.timing import median_ms, run_header
from hf_scatter.common.atomic_files import write_json
vanilla = bert_base("cuda")
patched = hf_scatter.patch_model(copy.deepcopy(vanilla))
rng = np.random.default_rng(0)
cases = [(1, 40, 1.0), (1, 128, 1.0), (4, 64, .5), (4, 128, .5), (8, 64, .5), (2, 256, .5), (8, 128, .5),
         (4, 256, .5), (16, 64, .5), (8, 128, 1.0), (16, 128, .5), (32, 64, .5), (4, 512, .5), (16, 64, 1.0)]
res = []
with torch.inference_mode():
    for B, S, fill in cases:
        lengths = [S] * B if fill == 1.0 else list(rng.integers(S // 4, S + 1, B))
        ids = torch.randint(1000, 30000, (B, S), device="cuda")
        mask = (torch.arange(S, device="cuda")[None] < torch.tensor(lengths, device="cuda")[:, None]).long()
        row = {"B": B, "S": S, "tokens": int(sum(lengths))}
        for mode, limit in (("rows", 10 ** 9), ("packed", 0)):
            hff.PADDED_ROWS_LIMIT = limit
            call = lambda: patched(ids, attention_mask=mask)  # noqa: E731
            call()
            call()
            row[mode] = median_ms(call, 100, 600)
        row["vanilla"] = median_ms(lambda: vanilla(ids, attention_mask=mask), 100, 600)
        print(row, flush=True)
        res.append(row)
write_json(os.path.join(os.environ.get("OUT", "/tmp"), "bert_padded_rows.json"),
           {"what": __doc__.split("Run:")[0].strip(), "header": run_header(), "cases": res})
