"""The fused LM head + cross-entropy against float64 autograd of transformers' unfused loss: odd sizes, chunk
boundaries, ignored labels, ``num_items_in_batch``, a logit scale, bf16; Liger's path on the GPU."""

import pytest
import torch
import torch.nn.functional as F

from hf_scatter.kernels import linear_cross_entropy as lce
from hf_scatter.kernels.linear_cross_entropy import linear_cross_entropy


def _unfused(h, w, y, items=None, scale=1.0):
    z = F.linear(h, w)
    z = z.to(torch.promote_types(z.dtype, torch.float32)) * scale  # float64 stays float64
    if items is None:
        return F.cross_entropy(z, y, ignore_index=-100)
    return F.cross_entropy(z, y, ignore_index=-100, reduction="sum") / items


def _case(N, H, V, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(device, dtype).requires_grad_(True)
    w = (torch.randn(V, H, generator=g) * H ** -0.5).to(device, dtype).requires_grad_(True)
    y = torch.randint(V, (N,), generator=g).to(device)
    y[::5] = -100
    return h, w, y


def _check(h, w, y, tol, use_liger, **kw):
    got = linear_cross_entropy(h, w, y, use_liger=use_liger, **kw)
    got.backward()
    hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = _unfused(hd, wd, y, kw.get("num_items_in_batch"), kw.get("scale", 1.0))
    want.backward()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=0)
    for name, a, b in (("dh", h.grad, hd.grad), ("dW", w.grad, wd.grad)):
        assert a.dtype == h.dtype, name
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < tol * 10, (name, err)


@pytest.mark.parametrize("N,H,V", [(2, 8, 5), (37, 24, 101), (300, 16, 64)])
@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": torch.tensor(23)}, {"scale": 0.5}],
                         ids=["mean", "items", "scale"])
def test_reference_matches_unfused_float64(monkeypatch, N, H, V, kw):
    monkeypatch.setattr(lce, "CHUNK_ROWS", 64)  # several chunks, the last one partial
    _check(*_case(N, H, V, torch.float32, "cpu"), 1e-5, False, **kw)


def test_reference_bf16_rounds_like_the_unfused_loss(monkeypatch):
    monkeypatch.setattr(lce, "CHUNK_ROWS", 32)
    _check(*_case(100, 32, 77, torch.bfloat16, "cpu"), 2e-2, False)


def test_only_ignored_labels_give_nan_like_torch():
    h, w, y = _case(4, 8, 5, torch.float32, "cpu")
    y[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, y, use_liger=False))
    assert torch.isnan(_unfused(h, w, y))


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": torch.tensor(1000)}, {"scale": 0.5}],
                         ids=["mean", "items", "scale"])
def test_liger_path_matches_unfused(kw):
    pytest.importorskip("liger_kernel")
    _check(*_case(2049, 256, 3001, torch.bfloat16, "cuda"), 2e-2, True, **kw)


@pytest.mark.parametrize("call,match", [
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long)),
     r"hidden must be \[N, H\] and weight \[V, H\]"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long)),
     r"labels must be \[4\]"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
