"""CPU decode attention with GPT-OSS's sinks on the offload pipeline's attention worker (512 rows, 64 query heads over
8 KV heads, head size 64, 96 keys): the whole call, ways to rescale by the sinks, and an op-level profile.
Run (a GPU host's CPU, as the pipeline uses it): PYTHONPATH=. python3 scripts/probes/probe_sink_rescale.py"""
import os, time, torch
from hf_scatter.offload.runtime.attention import _FUSED_WITH_LSE, decode_attention
from hf_scatter.offload.runtime.cpu_attention import AttentionWorker
from hf_scatter.common.atomic_files import write_json
n, H, Hkv, d, S = 512, 64, 8, 64, 96
G = H // Hkv
res = {}
w = AttentionWorker(14)
def on_worker(f, N=30):
    for _ in range(5): w.submit(f).result()
    s = time.perf_counter()
    for _ in range(N): w.submit(f).result()
    return round((time.perf_counter() - s) / N * 1e3, 3)
for dtype in (torch.bfloat16, torch.float32):
    q = torch.randn(n, H, d, dtype=dtype); k = torch.randn(n, Hkv, 128, d, dtype=dtype)[:, :, :S]
    v = torch.randn(n, Hkv, 128, d, dtype=dtype)[:, :, :S]; sinks = torch.randn(H)
    dest = torch.empty(n, H, d, dtype=dtype)
    sv = sinks.view(1, Hkv, G)
    def fused(): return _FUSED_WITH_LSE(q.view(n, Hkv, G, d), k, v, attn_mask=None, scale=None)
    def A(): dest.copy_(decode_attention(q, k, v, None, sinks))
    def B():
        o, lse = fused(); keep = torch.sigmoid(lse - sv).to(dtype).unsqueeze(-1)
        dest.view(n, Hkv, G, d).copy_(o.mul_(keep))
    def C():
        o, lse = fused(); keep = torch.sigmoid(lse - sv).unsqueeze(-1)
        torch.mul(o, keep, out=dest.view(n, Hkv, G, d))
    def E():  # fp32 math by hand: o -> fp32 in place buffer, scale, cast back
        o, lse = fused(); keep = torch.sigmoid(lse - sv).unsqueeze(-1)
        dest.view(n, Hkv, G, d).copy_(o.float().mul_(keep))
    def N0(): dest.copy_(decode_attention(q, k, v, None, None))
    x32 = torch.randn(n * H * d)
    row = {name: on_worker(f) for name, f in
           {"A now": A, "B bf16 math in place": B, "C mul out= fp32 math": C, "E float, mul_, copy_": E,
            "no sinks": N0, "fused alone": fused,
            "cast fp32->dtype 2M": lambda: x32.to(dtype), "cast dtype->fp32 2M": lambda: x32.to(dtype).float()}.items()}
    res[str(dtype)] = row
    print(dtype, row, flush=True)
    def prof_target():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
            for _ in range(10): A()
        return p.key_averages().table(sort_by="cpu_time_total", row_limit=15)
    table = w.submit(prof_target).result()
    print(table)
    res[str(dtype) + " profile"] = table
w.close()
write_json(os.path.join(os.environ.get("OUT", "/tmp"), "sink_probe2.json"), res)
