"""Which form of one CPU decode-attention call is fastest on this host at GPT-OSS-120B's shape (64 query heads over
8 KV heads of 64, sinks, a length mask): the runtime's fused call (SDPA's CPU flash kernel, then the sinks'
rescaling) in bf16 and over a float32 cache, without its mask, and the same math as broadcast products and sums
compiled by torch.compile (inductor's C++ backend). Each is timed on an attention-worker thread and checked against
a float64 reference.

Usage (repository root): PYTHONPATH=. python3 scripts/probes/probe_cpu_decode_forms.py OUT.json
Settings (environment): ROWS (256 512), CONTEXT (100), COMPILE (1).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from hf_scatter.offload.measure import _median_s
from hf_scatter.offload.runtime.attention import decode_attention
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker, attention_threads

H, HKV, D = 64, 8, 64


def product_form(q, k, v, bias, sinks, scale: float):
    """Decode attention with the sink in the denominator, as broadcast products and sums (what inductor fuses):
    ``q`` [n, Hkv, G, d], ``k``/``v`` [n, Hkv, S, d], ``bias`` [n, S] float32 (0 or -inf), ``sinks`` [Hkv, G]."""
    scores = (q.float().unsqueeze(3) * k.float().unsqueeze(2)).sum(-1) * scale  # [n, Hkv, G, S]
    scores = scores + bias[:, None, None, :]
    top = torch.maximum(scores.amax(-1), sinks)  # [n, Hkv, G]
    p = torch.exp(scores - top.unsqueeze(-1))
    denom = p.sum(-1) + torch.exp(sinks - top)
    out = (p.unsqueeze(-1) * v.float().unsqueeze(2)).sum(3) / denom.unsqueeze(-1)  # [n, Hkv, G, d]
    return out.to(q.dtype)


def reference(q, k, v, mask, sinks, scale):
    n = q.shape[0]
    s = torch.einsum("nhd,nhsd->nhs", q.double().view(n, H, D),
                     k.double().repeat_interleave(H // HKV, 1)) * scale  # [n, H, S]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    s = torch.cat([s, sinks.double().view(1, H, 1).expand(n, H, 1)], -1)
    p = torch.softmax(s, -1)[..., :-1]
    return torch.einsum("nhs,nhsd->nhd", p, v.double().repeat_interleave(H // HKV, 1))


def main() -> None:
    worker = AttentionWorker(attention_threads())
    context = int(os.environ.get("CONTEXT", 100))
    rows_list = [int(x) for x in os.environ.get("ROWS", "256 512").split()]
    compiled = torch.compile(product_form, dynamic=True) if os.environ.get("COMPILE", "1") == "1" else None
    g = torch.Generator().manual_seed(0)
    report = {"threads": worker.threads, "context": context, "rows": []}
    for n in rows_list:
        cap = context + 31
        kc = torch.randn(n, HKV, cap, D, generator=g).to(torch.bfloat16)
        vc = torch.randn(n, HKV, cap, D, generator=g).to(torch.bfloat16)
        k, v = kc[:, :, :context], vc[:, :, :context]  # the cache's view at this step
        q = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
        lens = torch.randint(int(0.8 * context), context + 1, (n,), generator=g)
        mask = torch.arange(context)[None, :] < lens[:, None]  # [n, S]
        sinks = torch.randn(H, generator=g)
        scale = D ** -0.5
        ref = reference(q, k, v, mask, sinks, scale)
        out = torch.empty(n, H, D, dtype=torch.bfloat16)
        k32, v32, q32 = kc.float()[:, :, :context], vc.float()[:, :, :context], q.float()
        out32 = torch.empty(n, H, D)
        bias = torch.zeros(n, context).masked_fill_(~mask, float("-inf"))
        forms = {
            "fused bf16": lambda: decode_attention(q, k, v, mask, sinks, scale, out=out),
            "fused bf16, no mask": lambda: decode_attention(q, k, v, None, sinks, scale, out=out),
            "fused float32 cache": lambda: decode_attention(q32, k32, v32, mask, sinks, scale, out=out32),
        }
        if compiled is not None:
            qg = q.view(n, HKV, H // HKV, D)
            forms["compiled products bf16"] = lambda: compiled(qg, k, v, bias, sinks.view(HKV, -1), scale)
            forms["compiled products float32"] = lambda: compiled(q32.view(n, HKV, H // HKV, D), k32, v32, bias,
                                                                  sinks.view(HKV, -1), scale)
        for name, fn in forms.items():
            t0 = time.perf_counter()
            result = worker.submit(fn).result()
            first = time.perf_counter() - t0
            result = out if name.startswith("fused bf16") else out32 if name.startswith("fused float") else result
            err = (result.double().view(n, H, D) - ref).abs().max().item() if "no mask" not in name else None
            ms = 1e3 * _median_s(lambda: worker.submit(fn).result(), budget_s=1.0)
            row = {"rows": n, "form": name, "ms": ms, "first_call_s": first, "max_abs_error": err}
            report["rows"].append(row)
            print(json.dumps(row), flush=True)
    worker.close()
    with open(sys.argv[1], "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
