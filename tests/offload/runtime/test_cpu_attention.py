"""The CPU KV cache of a batch (runtime/cpu_attention.py): decode attention over its length buckets, prompt
stores into each row's slots, and the buckets' partition."""

import math

import pytest
import torch

from hf_scatter.offload.plan.attention_buckets import length_buckets
from hf_scatter.offload.runtime.cpu_attention import KVCache
from hf_scatter.offload.families.adapter import LayerAttention

from offload_cases import reference_attention, torch_kernels_on_cpu  # noqa: F401 - the autouse fixture


@pytest.mark.parametrize("window, with_sinks, latent", [
    (None, False, False), (7, False, False), (None, True, False), (7, True, False), (None, False, True)])
def test_cpu_attention_over_bucketed_cache_matches_plain_attention(window, with_sinks, latent):
    """``latent``: MLA's absorbed form, one KV head that is also the value (cached once) and its own scale."""
    torch.manual_seed(0)
    H, Hkv, d, layers = 4, (1 if latent else 2), 8, 2
    prompts, new = [30, 29, 26, 13, 12, 4], 5  # longest first
    sinks = torch.randn(H) * 2 if with_sinks else None
    scale = 0.3 if latent else None
    attention = [LayerAttention(), LayerAttention(window=window, sinks=sinks, scale=scale)]
    cache = KVCache([[(p, p + new - 1) for p in prompts]], layers, Hkv, d, H, torch.float32, attention=attention,
                    values_are_keys=latent)
    # the fewest buckets padded at most 1.25x: 34..30 (102 slots for 97 tokens) | 17..8 (51 for 41)
    assert [(b.start, b.end) for b in cache.buckets[0]] == [(0, 3), (3, 6)]
    keys = [torch.randn(p + new - 1, Hkv, d) for p in prompts]
    values = keys if latent else [torch.randn(p + new - 1, Hkv, d) for p in prompts]
    layer = 1
    kv = torch.cat([torch.cat([k[:p].reshape(p, -1)] + ([] if latent else [v[:p].reshape(p, -1)]), 1)
                    for k, v, p in zip(keys, values, prompts)])
    rows, a = [], 0
    for i, p in enumerate(prompts):
        rows.append((i, a, a + p))
        a += p
    cache.write_prompts(layer, 0, rows, kv)
    for step in range(new - 1):
        q = torch.randn(len(prompts), H, d)
        parts = [q, torch.stack([k[p + step] for k, p in zip(keys, prompts)])]
        if not latent:
            parts.append(torch.stack([v[p + step] for v, p in zip(values, prompts)]))
        qkv = torch.cat([t.reshape(len(prompts), -1) for t in parts], 1)
        out = torch.full((len(prompts), H * d), float("nan"))
        cache.attend(layer, 0, step, qkv, out)
        for i, p in enumerate(prompts):
            ref = reference_attention(q[i], keys[i][:p + step + 1], values[i][:p + step + 1], window, sinks, scale)
            torch.testing.assert_close(out[i].double(), ref, rtol=1e-5, atol=1e-5)
    planned = KVCache.planned_bytes([[(p, p + new - 1) for p in prompts]], layers, Hkv, d, 4, values_are_keys=latent)
    assert cache.nbytes == planned
    if latent:  # the keys, once
        assert planned == KVCache.planned_bytes([[(p, p + new - 1) for p in prompts]], layers, Hkv, d, 4) // 2
    assert length_buckets([10, 9, 8, 2]) == [(0, 3, 10), (3, 4, 2)]


@pytest.mark.parametrize("latent", [False, True])
def test_prompt_stores_land_in_each_rows_cache_slots(latent):
    """Prompts of equal length go in one copy per run; runs break at a chunk's edge and where prompts are not side
    by side in the token buffer. Every row's slots hold its own keys (and values), the
    slots past its prompt stay untouched."""
    torch.manual_seed(1)
    Hkv, d, new = 2, 4, 3
    prompts = [9, 9, 9, 9, 7, 7, 3, 3, 3]  # longest first; 1.25x slack puts the 3s in a bucket of their own
    cache = KVCache([[(p, p + new - 1) for p in prompts]], 2, Hkv, d, 4, torch.float32, values_are_keys=latent)
    assert len(cache.buckets[0]) >= 2
    width = (1 if latent else 2) * Hkv * d
    sources = {}
    # two chunks, the first ending inside the run of 9s; the second has a gap of garbage tokens between two rows
    chunks = [[0, 1], [2, 3, 4, 5, 6, 7, 8]]
    for rows in chunks:
        spans, a = [], 0
        for r in rows:
            if r == 7:
                a += 5  # tokens of no row, between two prompts of 3
            spans.append((r, a, a + prompts[r]))
            a += prompts[r]
        kv = torch.randn(a, width)
        cache.write_prompts(1, 0, spans, kv)
        sources.update({r: kv[x:y] for r, x, y in spans})
    for r, src in sources.items():
        bucket, i = cache.row_bucket[0][r]
        b, p = cache.buckets[0][bucket], prompts[r]
        torch.testing.assert_close(b.k[1, i, :, :p], src[:, :Hkv * d].view(p, Hkv, d).transpose(0, 1), rtol=0, atol=0)
        if not latent:
            torch.testing.assert_close(b.v[1, i, :, :p], src[:, Hkv * d:].view(p, Hkv, d).transpose(0, 1), rtol=0,
                                       atol=0)
        assert not b.k[1, i, :, p:].any() and not b.k[0].any()


def test_length_buckets_are_the_cheapest_partition_within_the_padding_bound():
    import itertools
    import random

    rng = random.Random(0)
    for trial in range(60):
        caps = sorted((rng.randint(1, 40) for _ in range(rng.randint(1, 8))), reverse=True)
        call_s, token_s, slack = rng.choice([0.0, 1.0, 5.0]), rng.choice([0.0, 0.1, 1.0]), rng.choice([0.0, 0.25, 1.0])
        got = length_buckets(caps, slack, call_s, token_s)
        assert [s for s, _, _ in got] == [0] + [e for _, e, _ in got[:-1]] and got[-1][1] == len(caps)
        assert all(cap == caps[s] for s, _, cap in got)

        def cost(ranges):
            if any((e - s) * caps[s] > (1 + slack) * sum(caps[s:e]) + 1e-9 for s, e in ranges):
                return math.inf
            return sum(call_s + token_s * (e - s) * caps[s] for s, e in ranges)

        best = min(cost(list(zip((0,) + cut, cut + (len(caps),))))
                   for r in range(len(caps)) for cut in itertools.combinations(range(1, len(caps)), r))
        assert cost([(s, e) for s, e, _ in got]) == pytest.approx(best), (caps, call_s, token_s, slack, got)
    with pytest.raises(ValueError, match="longest first"):
        length_buckets([1, 2])
