"""Whether SDPA's CPU flash kernel runs GPT-OSS-120B's decode attention faster when R rows share one call's task:
their keys side by side ([n / R, kv_heads, R * S, d], as a cache laid out in groups of R rows would hold them) and a
block-diagonal mask, so each task multiplies [R * G, d] by [d, R * S] (R times the products, 1/R of the tasks).

Usage (repository root): PYTHONPATH=. python3 scripts/probes/probe_cpu_decode_rowgroups.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from hf_scatter.offload.measure import _median_s
from hf_scatter.offload.runtime.attention import _FUSED_WITH_LSE
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker, attention_threads

H, HKV, D = 64, 8, 64
G = H // HKV
SIZES = ((512, 100), (256, 100), (512, 140))


def main() -> None:
    worker = AttentionWorker(attention_threads())
    g = torch.Generator().manual_seed(0)
    rows = []
    for n, S in SIZES:
        k = torch.randn(n, HKV, S, D, generator=g).to(torch.bfloat16)
        v = torch.randn(n, HKV, S, D, generator=g).to(torch.bfloat16)
        q = torch.randn(n, HKV, G, D, generator=g).to(torch.bfloat16)
        lens = torch.randint(int(0.8 * S), S + 1, (n,), generator=g)
        base = None
        for R in (1, 2, 4, 8, 16):
            m = n // R
            kr = k.view(m, R, HKV, S, D).transpose(1, 2).reshape(m, HKV, R * S, D)  # one-time layout
            vr = v.view(m, R, HKV, S, D).transpose(1, 2).reshape(m, HKV, R * S, D)
            qr = q.view(m, R, HKV, G, D).transpose(1, 2).reshape(m, HKV, R * G, D)
            own = torch.arange(R).repeat_interleave(G)[:, None] == torch.arange(R).repeat_interleave(S)[None, :]
            visible = lens.view(m, R).repeat_interleave(G, 1)[:, :, None]  # [m, R G, 1] each query's row length
            keep = own[None] & (torch.arange(S).repeat(R)[None, None, :] < visible)
            bias = torch.zeros(m, 1, R * G, R * S, dtype=torch.bfloat16).masked_fill_(~keep[:, None], float("-inf"))
            call = lambda: _FUSED_WITH_LSE(qr, kr, vr, attn_mask=bias, scale=D ** -0.5)
            o = worker.submit(call).result()[0]  # [m, Hkv, R G, d]
            o = o.view(m, HKV, R, G, D).transpose(1, 2).reshape(n, HKV, G, D)
            if base is None:
                base = o.float()
            ms = 1e3 * _median_s(lambda: worker.submit(call).result(), budget_s=1.0)
            row = {"rows": n, "context": S, "group": R, "ms": ms,
                   "max_diff_vs_group_1": (o.float() - base).abs().max().item()}
            rows.append(row)
            print(json.dumps(row), flush=True)
    worker.close()
    with open(sys.argv[1], "w") as f:
        json.dump({"threads": worker.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
