"""How fast the profile's CPU attention call runs against the pipeline's: the same call (GPT-OSS-120B's attention
shape, its sinks or not) measured idle, beside pinned host->device copies (as the profile measures it), and
beside a thread issuing small GPU ops part of the time (as the pipeline's driver does while the CPU attends),
for the rows and contexts of the offload tables. A decode trace of that table (one H200, MXFP4 experts, 512 rows
per micro-batch, context about 85) showed each call taking 7-8.4 ms.

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_attention_load.py OUT.json
"""

from __future__ import annotations

import json
import sys

from hf_scatter.offload.measure import _cpu_attention_point, _driver_load, _link_traffic
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker, attention_threads

# GPT-OSS-120B: query heads, KV heads, head size, keys are not the values; without and with its sinks
PLAIN, SINKS = (64, 8, 64, False, False), (64, 8, 64, False, True)


def main() -> None:
    worker = AttentionWorker(attention_threads())
    rows = []
    for batch, context in ((512, 96), (256, 96), (256, 256)):
        for label, shape, link, duty in (("idle", PLAIN, False, 0.0), ("copies", PLAIN, True, 0.0),
                                          ("copies, sinks", SINKS, True, 0.0),
                                          ("copies, sinks, driver 50%", SINKS, True, 0.5),
                                          ("copies, sinks, driver 100%", SINKS, True, 1.0)):
            with (_link_traffic() if link else _driver_load(0.0)), _driver_load(duty):
                point = _cpu_attention_point(worker, batch, context, shape)
            rows.append({"batch": batch, "context": context, "case": label, "ms": point["seconds"] * 1e3})
            print(batch, context, label, round(point["seconds"] * 1e3, 2), flush=True)
    worker.close()
    with open(sys.argv[1], "w") as f:
        json.dump({"threads": worker.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
