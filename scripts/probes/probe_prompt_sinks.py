"""GPT-OSS's prompt attention with sinks on the GPU: one variable-length FlashAttention call per chunk (what
prompt_attention runs there) against the explicit matmuls in blocks of queries of padded calls, and against fused
padded kernels per call; each fused kernel also returns each query's log-sum-exp, its output rescaled by
sigmoid(lse - sink) (the identity decode uses on the CPU). For each candidate
op: the largest error against float64 attention of the same bf16 inputs, and the host and device time of a
4096-token chunk of MTBench-like prompts at one rank's share of GPT-OSS-120B's heads on 4 GPUs (16 query heads,
2 KV heads of 64).

Usage (GPU host, repository root): PYTHONPATH=. python3 scripts/probes/probe_prompt_sinks.py [OUT.json]
"""

from __future__ import annotations

import json
import sys
import time

import torch

from hf_scatter.bench.offload_workload import prompts
from hf_scatter.offload.families.adapter import Dims, LayerAttention
from hf_scatter.offload.runtime.attention import (_padded_prompt_attention, packed_prompts, prompt_attention,
                                                  prompt_calls)

HEADS, KV_HEADS, HEAD_DIM, CHUNK = 16, 2, 64, 4096


def _flash(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)[:2]
    return out, lse


def _efficient(q, k, v, scale):
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True, scale=scale)[:2]
    return out, lse[..., :q.shape[2]]  # the kernel pads the query axis of its log-sum-exp to a multiple of 32


def fused(op, expand: bool):
    """Prompt attention with sinks through ``op``; ``expand``: repeat the KV heads for the op (else it is given
    the grouped heads as they are)."""

    def attend(qkv, rows, d, layer, sinks, calls):
        out = torch.empty(qkv.shape[0], d.q_dim, dtype=qkv.dtype, device=qkv.device)
        G = d.heads // d.kv_heads
        for call in calls:
            g, p = call.count, call.length
            x = qkv[call.start:call.end] if call.gather is None else qkv.index_select(0, call.gather)
            q = x[:, :d.q_dim].view(g, p, d.heads, d.head_dim).transpose(1, 2)
            k = x[:, d.q_dim:d.q_dim + d.kv_dim].view(g, p, d.kv_heads, d.head_dim).transpose(1, 2)
            v = x[:, d.q_dim + d.kv_dim:].view(g, p, d.kv_heads, d.head_dim).transpose(1, 2)
            if expand:
                k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
            o, lse = op(q, k, v, layer.scale)  # [g, H, p, d], [g, H, p]
            keep = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
            o = (o.float() * keep.unsqueeze(-1)).to(qkv.dtype).transpose(1, 2).reshape(g * p, d.q_dim)
            if call.scatter is None:
                out[call.start:call.end] = o
            else:
                torch.index_select(o, 0, call.scatter, out=out[call.start:call.end])
        return out

    return attend


def reference(qkv, rows, d, sinks, scale):
    """float64 attention with sinks of every position of a few prompts."""
    out = {}
    for _, a, b in rows[:3] + rows[-2:]:
        x = qkv[a:b].double()
        q = x[:, :d.q_dim].view(-1, d.heads, d.head_dim).transpose(0, 1)
        k = x[:, d.q_dim:d.q_dim + d.kv_dim].view(-1, d.kv_heads, d.head_dim).transpose(0, 1)
        v = x[:, d.q_dim + d.kv_dim:].view(-1, d.kv_heads, d.head_dim).transpose(0, 1)
        G = d.heads // d.kv_heads
        k, v = k.repeat_interleave(G, 0), v.repeat_interleave(G, 0)
        s = q @ k.transpose(1, 2) * scale
        p = b - a
        s = s.masked_fill(torch.ones(p, p, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        s = torch.cat([s, sinks.double().view(-1, 1, 1).expand(-1, p, 1)], -1).softmax(-1)[..., :-1]
        out[(a, b)] = (s @ v).transpose(0, 1).reshape(p, -1)
    return out


def main() -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    d = Dims(name="gpt-oss rank", family="gpt_oss", hidden=2880, layers=1, heads=HEADS, kv_heads=KV_HEADS,
             head_dim=HEAD_DIM, intermediate=8, experts=2, top_k=1, vocab=8)
    lens, rows, a = sorted((len(p) for p in prompts(1024, 1000)), reverse=True), [], 0
    for i, p in enumerate(lens):
        if a + p > CHUNK:
            break
        rows.append((i, a, a + p))
        a += p
    qkv = torch.randn(a, d.qkv_dim, device=dev).to(torch.bfloat16)
    sinks = torch.randn(HEADS, device=dev)
    layer = LayerAttention(sinks=sinks, scale=HEAD_DIM ** -0.5)
    calls = prompt_calls(rows, dev)
    ref = reference(qkv, rows, d, sinks, layer.scale)
    packed = packed_prompts(rows, dev)
    candidates = {
        "flash varlen + lse (prompt_attention)": lambda *x: prompt_attention(x[0], x[1], x[2], x[3], x[4],
                                                                             packed=packed),
        "blocks (the padded path)": lambda *x: _padded_prompt_attention(
            x[0], x[1], x[2], x[3], x[4], CHUNK * d.q_dim * 2, x[5]),
        "flash + lse, KV heads repeated": fused(_flash, True),
        "flash + lse, grouped KV heads": fused(_flash, False),
        "efficient + lse, KV heads repeated": fused(_efficient, True),
    }
    results = {"prompts": len(rows), "tokens": a, "calls": len(calls), "torch": torch.__version__, "rows": {}}
    for name, fn in candidates.items():
        try:
            with torch.no_grad():
                out = fn(qkv, rows, d, layer, sinks, calls)
                err = max((out[a:b].double() - r).abs().max().item() for (a, b), r in ref.items())
                for _ in range(3):
                    fn(qkv, rows, d, layer, sinks, calls)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    fn(qkv, rows, d, layer, sinks, calls)
                host = (time.perf_counter() - t0) / 20
                torch.cuda.synchronize()
                wall = (time.perf_counter() - t0) / 20
            results["rows"][name] = {"max_abs_error": err, "host_ms": host * 1e3, "wall_ms": wall * 1e3}
        except Exception as e:  # an op this build or GPU lacks
            results["rows"][name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        print(name, results["rows"][name])
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
