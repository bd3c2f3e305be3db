"""The pipeline's attention math (runtime/attention.py): decode with sinks fused, prompts in padded calls, with
windows and sinks, against float64 attention."""

import math

import pytest
import torch

from hf_scatter.offload.families.adapter import LayerAttention

from offload_cases import reference_attention, torch_kernels_on_cpu  # noqa: F401 - the autouse fixture


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.bfloat16, 2 ** -7)])
def test_fused_decode_with_sinks_matches_the_unfused_softmax(dtype, tol):
    """The fused decode path (SDPA's CPU kernel, then each head rescaled by its sink) against a float64 softmax with
    the sink column, over strided cache slices and a mask, odd sizes; in bf16 within 2^-7 (inputs and output
    each rounded at 2^-9, values of order one)."""
    from hf_scatter.offload.runtime import attention

    if attention._FUSED_WITH_LSE is None:
        pytest.skip("this torch build has no fused CPU attention returning the log-sum-exp")
    torch.manual_seed(3)
    n, H, Hkv, d, cap, S = 5, 6, 2, 16, 13, 11
    q = torch.randn(n, H, d, dtype=torch.float64)
    k_cache, v_cache = torch.randn(2, n, Hkv, cap, d, dtype=torch.float64)
    mask = torch.rand(n, S) > 0.3
    mask[:, -1] = True  # every row sees its own key
    sinks = torch.randn(H) * 2
    k = k_cache[:, :, 1:S + 1].repeat_interleave(H // Hkv, dim=1)  # [n, H, S, d]: query head h reads h // G
    v = v_cache[:, :, 1:S + 1].repeat_interleave(H // Hkv, dim=1)
    for m in (mask, None):
        scores = torch.einsum("nhd,nhsd->nhs", q, k) / math.sqrt(d)
        if m is not None:
            scores = scores.masked_fill(~m[:, None, :], float("-inf"))
        with_sink = torch.cat([scores, sinks.double().view(1, H, 1).expand(n, H, 1)], -1)
        ref = torch.einsum("nhs,nhsd->nhd", with_sink.softmax(-1)[..., :-1], v)
        out = attention.decode_attention(q.to(dtype), k_cache[:, :, 1:S + 1].to(dtype),
                                         v_cache[:, :, 1:S + 1].to(dtype), m, sinks)
        assert out.dtype == dtype and out.shape == (n, H, d)
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
        rows = torch.full((n + 2, H * d + 3), float("nan"), dtype=dtype)  # the pipeline's [rows, q] output buffer
        dest = rows[1:n + 1, :H * d].view(n, H, d)
        into = attention.decode_attention(q.to(dtype), k_cache[:, :, 1:S + 1].to(dtype),
                                          v_cache[:, :, 1:S + 1].to(dtype), m, sinks, out=dest)
        assert into.data_ptr() == rows[1].data_ptr() and torch.equal(into, out)  # the same values, written in place
        assert rows[0].isnan().all() and rows[n + 1].isnan().all() and rows[:, H * d:].isnan().all()


@pytest.mark.parametrize("lens", [
    [11, 11, 6, 3],  # two prompts of one length share a call
    [12, 11, 10, 10, 9, 5, 4, 1],  # longest first: prompts of near lengths share a padded call
    [3, 9, 9, 5, 12],  # any order: a call per run of one length
])
@pytest.mark.parametrize("window, with_sinks", [(None, False), (5, False), (None, True), (5, True)])
@pytest.mark.parametrize("device, dtype, tol", [
    ("cpu", torch.float32, 1e-5),
    # bf16 on the GPU, FlashAttention's variable-length kernel: its probabilities round to bf16 before the values'
    # matmul (2^-9 of each, times |v| up to ~4: 8e-3), its output rounds to bf16 (8e-3), and so does the sinks'
    # rescaled output (8e-3)
    pytest.param("cuda", torch.bfloat16, 3e-2, marks=pytest.mark.gpu),
])
def test_prompt_attention_with_windows_and_sinks_matches_the_reference(window, with_sinks, lens, device, dtype, tol):
    """The prefill's attention within each prompt of a chunk (on the CPU fused where no window cuts a prompt, else
    in blocks of queries small enough that the sink path takes several: max_score_bytes; on the GPU one
    variable-length FlashAttention call), against float64 attention of every position of the same inputs."""
    from hf_scatter.offload.families.adapter import Dims
    from hf_scatter.offload.runtime.attention import prompt_attention

    torch.manual_seed(0)
    H, Hkv, d = 4, 2, 8
    dims = Dims(name="t", family="t", hidden=32, layers=1, heads=H, kv_heads=Hkv, head_dim=d, intermediate=8,
                experts=2, top_k=1, vocab=8)
    rows, a = [], 0
    for i, p in enumerate(lens):
        rows.append((i, a, a + p))
        a += p
    qkv = torch.randn(a, dims.qkv_dim).to(dtype)
    sinks = torch.randn(H) * 2 if with_sinks else None
    on = None if sinks is None else sinks.to(device)
    out = prompt_attention(qkv.to(device), rows, dims, LayerAttention(window=window, sinks=sinks), on,
                           max_score_bytes=4 * H * 11 * 2 * 3).cpu()  # 3 queries a block
    for _, a, b in rows:
        q = qkv[a:b, :H * d].view(-1, H, d)
        k = qkv[a:b, H * d:(H + Hkv) * d].view(-1, Hkv, d)
        v = qkv[a:b, (H + Hkv) * d:].view(-1, Hkv, d)
        for t in range(b - a):
            ref = reference_attention(q[t], k[:t + 1], v[:t + 1], window, sinks)
            torch.testing.assert_close(out[a + t].double(), ref, rtol=tol, atol=tol)


def test_prompt_calls_pad_near_lengths_together_within_the_slack():
    """A chunk's prompts (longest first) go in fewer attention calls than it has lengths, each call padded to
    at most 1.25x its real tokens, every real token gathered once and scattered back to its own place."""
    from hf_scatter.offload.runtime.attention import prompt_calls

    lens = [40, 38, 37, 37, 30, 29, 12, 11, 11, 2]
    rows, a = [], 0
    for i, p in enumerate(lens):
        rows.append((i, a, a + p))
        a += p
    calls = prompt_calls(rows)
    assert len(calls) < len(set(lens))
    assert [c.start for c in calls] == sorted(c.start for c in calls) and calls[-1].end == a
    covered = []
    for c in calls:
        real = c.end - c.start
        assert c.count * c.length <= 1.25 * real
        if c.gather is None:
            covered += list(range(c.start, c.end))
            continue
        assert c.gather.shape == (c.count * c.length,) and c.scatter.shape == (real,)
        assert c.gather[c.scatter].tolist() == list(range(c.start, c.end))  # each token lands on itself
        covered += c.gather[c.scatter].tolist()
    assert covered == list(range(a))
