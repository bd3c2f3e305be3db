"""Request batching (runtime/batching.py): balanced micro-batches, no request lost."""

import pytest

from hf_scatter.offload import plan_batches

from offload_cases import torch_kernels_on_cpu  # noqa: F401 - the autouse fixture


def test_request_batching_balances_micro_batches_without_losing_requests():
    lens = [77, 3, 120, 40, 40, 9, 300, 64, 15, 88, 1, 52, 33]
    batches = plan_batches(lens, batch_size=6, micro_batch_size=2)
    assert [b.size for b in batches] == [6, 6, 1]
    seen = [r for b in batches for r in b.requests]
    assert sorted(seen) == list(range(len(lens)))
    # longest requests first: every request of batch 0 is at least as long as any of batch 1
    assert min(lens[r] for r in batches[0].requests) >= max(lens[r] for r in batches[1].requests)
    for b in batches:
        for mb in b.micro_batches:
            assert len(mb) <= 2 and list(mb.requests) == sorted(mb.requests, key=lambda r: -lens[r])
            assert mb.tokens == sum(lens[r] for r in mb.requests)
    # Algorithm 2 on one batch: 3 micro-batches of 4, tokens balanced (a plain split in sorted order: 30/14/4)
    one = plan_batches([9, 8, 7, 6, 5, 4, 3, 2, 1, 1, 1, 1], batch_size=12, micro_batch_size=4)[0]
    assert [len(mb) for mb in one.micro_batches] == [4, 4, 4]
    tokens = [mb.tokens for mb in one.micro_batches]
    assert sum(tokens) == 48 and max(tokens) - min(tokens) <= 2
    with pytest.raises(ValueError, match="empty prompt"):
        plan_batches([3, 0], 2, 1)
