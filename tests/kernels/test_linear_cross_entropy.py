"""The fused LM head + cross-entropy against float64 autograd of transformers' unfused loss: odd sizes, chunk
boundaries, ignored labels, ``num_items_in_batch``, a logit scale, bf16; the per-row kernel against float64
on fresh inputs with poisoned outputs; Liger's path on the GPU."""

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


def _check(h, w, y, tol, use_liger, grad_tol=None, **kw):
    got = linear_cross_entropy(h, w, y, use_liger=use_liger, **kw)
    got.backward()
    hd, wd = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    want = _unfused(hd, wd, y, kw.get("num_items_in_batch"), kw.get("scale", 1.0))
    want.backward()
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=0)
    for name, a, b in (("dh", h.grad, hd.grad), ("dW", w.grad, wd.grad)):
        assert a.dtype == h.dtype, name
        err = ((a.double() - b).norm() / b.norm()).item()
        assert err < (grad_tol or tol * 10), (name, err)


@pytest.mark.parametrize("N,H,V", [(2, 8, 5), (37, 24, 101), (150, 16, 64)])
@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": torch.tensor(23)}, {"scale": 0.5}],
                         ids=["mean", "items", "scale"])
def test_chunked_loss_matches_unfused_float64(monkeypatch, N, H, V, kw):
    monkeypatch.setattr(lce, "chunk_rows", lambda vocab, dtype: 64)  # several chunks, the last one partial
    _check(*_case(N, H, V, torch.float32, "cpu"), 1e-5, False, **kw)


def test_chunked_loss_in_bf16_rounds_like_the_unfused_loss(monkeypatch):
    """bf16 gradients within a few bf16 roundings (2^-9 each) of float64's, in norm."""
    monkeypatch.setattr(lce, "chunk_rows", lambda vocab, dtype: 32)
    _check(*_case(100, 32, 77, torch.bfloat16, "cpu"), 2e-2, False, grad_tol=1e-2)


def test_under_autocast_the_products_run_in_its_dtype_and_gradients_reach_float32():
    """A float32 model trained under bf16 autocast (Trainer's bf16=True): the products in bf16, as the unfused
    loss makes them under autocast, and float32 gradients for the float32 tensors."""
    h, w, y = _case(70, 32, 77, torch.float32, "cpu")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, w, y)
    got.backward()
    assert h.grad.dtype == w.grad.dtype == torch.float32
    hb, wb = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _unfused(hb, wb, y)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for a, b in ((h.grad, hb.grad), (w.grad, wb.grad)):
        assert ((a - b).norm() / b.norm()).item() < 1e-2


def test_a_scale_that_is_not_positive_is_refused():
    with pytest.raises(ValueError, match="scale must be positive"):
        linear_cross_entropy(*_case(4, 8, 5, torch.float32, "cpu"), scale=0.0)


def test_one_chunk_and_no_head_gradient_give_the_same_loss(monkeypatch):
    """A single chunk makes the head's gradient in one GEMM, several sum it in float32: the same values;
    a frozen head (LoRA) makes none."""
    h, w, y = _case(50, 16, 33, torch.float32, "cpu")
    one = linear_cross_entropy(h, w, y)
    one.backward()
    dh_one, dw_one = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    monkeypatch.setattr(lce, "chunk_rows", lambda vocab, dtype: 16)
    linear_cross_entropy(h, w, y).backward()
    torch.testing.assert_close(h.grad, dh_one, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(w.grad, dw_one, rtol=1e-5, atol=1e-6)
    h.grad = None
    frozen = linear_cross_entropy(h, w.detach(), y)
    frozen.backward()
    torch.testing.assert_close(frozen, one)
    torch.testing.assert_close(h.grad, dh_one, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("vocab,dtype", [(151936, torch.bfloat16), (32000, torch.bfloat16), (7, torch.float32),
                                         (10 ** 9, torch.float32)])
def test_a_chunk_of_logits_stays_within_its_budget(vocab, dtype):
    rows = lce.chunk_rows(vocab, dtype)
    assert rows & (rows - 1) == 0 and rows >= 16
    assert rows == 16 or rows * vocab * dtype.itemsize <= lce.CHUNK_BYTES < 2 * rows * vocab * dtype.itemsize


def _rows_reference(z, y, scale):
    """float64: each row's loss and ``(softmax - onehot) * scale``, 0 where the label is ignored."""
    x = z.double() * scale
    valid = y != -100
    lse = torch.logsumexp(x, -1)
    loss = torch.where(valid, lse - x.gather(1, torch.where(valid, y, 0)[:, None])[:, 0], 0.0)
    grad = torch.softmax(x, -1) - F.one_hot(torch.where(valid, y, 0), z.shape[1]).double()
    return loss, grad * valid[:, None] * scale


@pytest.mark.parametrize("n,V", [(0, 9), (1, 1), (7, 203), (4, 257), (12, 100)])
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_row_kernel_matches_float64(monkeypatch, n, V, scale):
    """The per-row kernel (the Triton interpreter on the CPU) on fresh logits, some rows ignored, a
    vocabulary crossing its block several times (blocks of 16 here), each row's maximum planted in another
    block (the online log-sum-exp must rescale what it summed before), the loss buffer poisoned: float32
    results within float32 rounding of the exact ones (the log-sum-exp of V terms: a few ulps of its
    magnitude)."""
    monkeypatch.setattr(lce, "ROW_BLOCK", 16)
    for seed in range(2):
        g = torch.Generator().manual_seed(seed + 100 * n + V)
        z = torch.randn(n, V, generator=g) * 4
        for r in range(n):  # the largest logit first in the last block, then in the first, then elsewhere
            z[r, (V - 1, 0, (7 * r) % V)[r % 3]] = 12.0
        y = torch.randint(V, (n,), generator=g)
        y[::3] = -100
        want_loss, want_grad = _rows_reference(z, y, scale)
        loss = torch.full((n,), float("nan"))
        lce._cross_entropy_rows_impl(z, y, -100, scale, loss)
        bound = 64 * torch.finfo(torch.float32).eps
        assert ((loss.double() - want_loss).abs() <= bound * (want_loss.abs() + 4 * scale + 1)).all()
        assert ((z.double() - want_grad).abs() <= bound * scale).all()


def test_row_kernel_in_bf16_rounds_each_gradient_once():
    """bf16 logits: each gradient is the exact one rounded to bf16 (at most one bf16 ulp away)."""
    g = torch.Generator().manual_seed(7)
    z = (torch.randn(9, 300, generator=g) * 3).bfloat16()
    y = torch.randint(300, (9,), generator=g)
    y[4] = -100
    want_loss, want_grad = _rows_reference(z, y, 1.0)
    loss = torch.full((9,), float("nan"))
    lce._cross_entropy_rows_impl(z, y, -100, 1.0, loss)
    ulp = 2.0 ** -7 * want_grad.abs() + 2.0 ** -133
    assert ((z.double() - want_grad).abs() <= ulp).all()
    assert ((loss.double() - want_loss).abs() <= 1e-5 * (want_loss.abs() + 1)).all()


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


@pytest.mark.gpu
@pytest.mark.parametrize("kw", [{}, {"num_items_in_batch": torch.tensor(1000)}, {"scale": 0.5}],
                         ids=["mean", "items", "scale"])
def test_chunked_loss_matches_unfused_on_the_gpu(monkeypatch, kw):
    monkeypatch.setattr(lce, "chunk_rows", lambda vocab, dtype: 512)
    _check(*_case(2049, 256, 5003, torch.bfloat16, "cuda"), 2e-2, False, **kw)


def test_liger_asked_for_without_liger_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(lce, "liger_available", lambda: False)
    with pytest.raises(ValueError, match="use_liger=True needs liger-kernel"):
        linear_cross_entropy(*_case(4, 8, 5, torch.float32, "cpu"), use_liger=True)


@pytest.mark.parametrize("call,match", [
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 7), torch.zeros(4, dtype=torch.long)),
     r"hidden must be \[N, H\] and weight \[V, H\]"),
    (lambda: linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long)),
     r"labels must be \[4\]"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
