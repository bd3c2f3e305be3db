"""Fused reductions: residual add + LayerNorm / RMSNorm, masked softmax with dropout, MoE router top-k.

Every check compares forward and backward with float64 autograd of the unfused HF computation (fp32 1e-5,
fp16/bf16 1e-2, relative to the largest reference value) and allocates outputs NaN-poisoned so unwritten
elements fail. On CPU the Triton kernels run under the interpreter; tests taking ``path`` also run the
torch references that serve as the fallback. Shapes: many rows at small hidden sizes, few at large ones.
"""

import pytest
import torch
import torch.nn.functional as F

from hf_scatter.kernels.backend import kernel_path
from hf_scatter.kernels.norms import fused_add_layer_norm, fused_add_rms_norm
from hf_scatter.kernels.router import router_topk
from hf_scatter.kernels.softmax import fused_masked_softmax
from test_scattermoe import poisoned_empty

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def assert_close(got, want, tol, what=""):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.isfinite(got).all(), f"{what}: non-finite values (unwritten elements?)"
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Run the Triton kernel (the interpreter on CPU) or the torch reference."""
    monkeypatch.setenv("HF_SCATTER_KERNELS", request.param)
    return request.param


def rounds_like_torch(dtype, device):
    """False where the Triton interpreter rounds fp32 to bf16 by truncation (GPUs round to nearest, as torch)."""
    return dtype != torch.bfloat16 or kernel_path(device) != "triton-interpreter"


def _leaf(t):
    return None if t is None else t.detach().double().requires_grad_(True)


def _rounded(exact, value):
    """``value`` forward, gradient of ``exact``: a rounding step of the unfused low-precision code."""
    return exact + (value.double() - exact).detach()


# --------------------------------------------------------------------------------------------- norms
def _norm_inputs(device, dtype, M, N, residual=True, weight=True, bias=True, add_bias=True, offset=0.0,
                 spread=1.0, first=0.0, param_dtype=None):
    """``first``: added to each row's first element (the LayerNorm kernels' shift) to make it an outlier."""
    param_dtype = param_dtype or dtype
    x = offset + spread * torch.randn(M, N, device=device)
    x[:, 0] += first
    x = x.to(dtype)
    res = (spread * torch.randn(M, N, device=device)).to(dtype) if residual else None
    w = (1 + 0.5 * torch.randn(N, device=device)).to(param_dtype) if weight else None
    b = torch.randn(N, device=device).to(param_dtype) if bias else None
    ab = (spread * torch.randn(N, device=device)).to(dtype) if add_bias else None
    return [t if t is None else t.requires_grad_(True) for t in (x, res, w, b, ab)]


def _norm_reference(x, res, w, b, ab, eps, rms, casting="llama"):
    """float64 autograd of the unfused code: adds and the RMSNorm's cast round to x's dtype (MixtralRMSNorm's
    before the weight, GptOssRMSNorm's after it)."""
    leaves = [_leaf(t) for t in (x, res, w, b, ab)]
    x64, r64, w64, b64, ab64 = leaves
    s_low, s64 = x.detach(), x64
    if ab is not None:
        s_low, s64 = s_low + ab.detach(), _rounded(s64 + ab64, s_low + ab.detach())
    if res is not None:
        s_low, s64 = s_low + res.detach(), _rounded(s64 + r64, s_low + res.detach())
    if rms and casting == "gpt_oss":
        n = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
        y = n if w64 is None else n * w64
        y = _rounded(y, y.to(x.dtype))
    elif rms:
        n = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + eps)
        n = _rounded(n, n.to(x.dtype))
        y = n if w64 is None else n * w64
    else:
        y = F.layer_norm(s64, s64.shape[-1:], w64, b64, eps)
    return y, s64, leaves


def _check_norm(device, dtype, M, N, rms, eps=1e-5, return_sum=True, casting="llama", **inputs):
    x, res, w, b, ab = _norm_inputs(device, dtype, M, N, **inputs)
    if rms:
        b = ab = None
    with poisoned_empty():
        if rms:
            out = fused_add_rms_norm(x, res, w, eps=eps, return_sum=return_sum, casting=casting)
        else:
            out = fused_add_layer_norm(x, res, w, b, eps=eps, add_bias=ab, return_sum=return_sum)
        y, s = out if return_sum else (out, None)
        dy = torch.randn_like(y)
        loss = (y * dy).sum()
        if return_sum:
            dsum = torch.randn_like(s)
            loss = loss + (s * dsum).sum()
        loss.backward()
    y_ref, s_ref, leaves = _norm_reference(x, res, w, b, ab, eps, rms, casting)
    ref_loss = (y_ref * dy.double()).sum() + ((s_ref * dsum.double()).sum() if return_sum else 0)
    ref_loss.backward()
    tol = TOL[dtype]
    assert_close(y, y_ref, tol, "y")
    if return_sum:  # the same roundings in the same order: bit for bit
        assert_close(s, s_ref, 0 if rounds_like_torch(dtype, x.device) else tol, "sum")
    for name, got, want in zip(["dx", "dresidual", "dweight", "dbias", "dadd_bias"], (x, res, w, b, ab), leaves):
        if got is not None:
            assert_close(got.grad, want.grad, tol, name)


NORM_SIZES = [(32, 5000), (384, 700), (768, 129), (1000, 1), (1000, 37), (4096, 6), (6144, 3)]


@pytest.mark.parametrize("N,M", NORM_SIZES, ids=[f"N{n}xM{m}" for n, m in NORM_SIZES])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_add_norm_fp32(device, N, M, rms):
    _check_norm(device, torch.float32, M, N, rms)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,M", [(768, 64), (6144, 2)], ids=["N768", "N6144"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_add_norm_half(device, dtype, N, M, rms):
    _check_norm(device, dtype, M, N, rms)


@pytest.mark.parametrize("parts", ["x", "x+res", "x+bias-of-add", "no-affine", "weight-only", "fp32-params"])
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_add_norm_optional_parts(device, path, parts, rms):
    inputs = dict(residual="res" in parts, add_bias="bias-of-add" in parts, weight=parts not in ("x", "no-affine"),
                  bias=parts in ("fp32-params", "x+res"))
    dtype = torch.bfloat16 if parts == "fp32-params" else torch.float32
    _check_norm(device, dtype, 50, 384, rms, param_dtype=torch.float32, return_sum=parts != "x", **inputs)


@pytest.mark.parametrize("N,M", [(32, 300), (1000, 9), (6144, 2)], ids=["N32", "N1000", "N6144-chunked"])
@pytest.mark.parametrize("first", [0.0, 1.0], ids=["plain", "first-element-outlier"])
def test_layer_norm_mean_offset_1e4(device, path, N, M, first):
    """Rows at 1e4 with spread 1e-2: the one-pass E[x^2] - E[x]^2 keeps no digit of the variance there, and
    centring with an fp32 mean (known to 5e-4) would move every output by 5%. A first element 100 spreads
    away from the rest defeats the shifted one-pass form too (the kernels shift by it, then centre)."""
    x = 1e4 + 1e-2 * torch.randn(M, N, device=device)
    naive_var = (x * x).mean(-1) - x.mean(-1) ** 2
    true_var = x.double().var(-1, unbiased=False)
    assert ((naive_var.double() - true_var).abs() / true_var).max() > 0.1, "inputs too easy to test stability"
    _check_norm(device, torch.float32, M, N, rms=False, eps=1e-12, offset=1e4, spread=1e-2, first=first)


def _same_bits(got, want, path, what):
    """The torch path runs HF's own ops: equal bit for bit. Triton reduces in another order, so fp32 results
    differ in the last bits and bf16 ones where that flips a rounding (rarely); the interpreter truncates to
    bf16, so there they are only close."""
    assert got.dtype == want.dtype, what
    if path == "torch":
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=what)
    elif got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * want.abs().max().item(), msg=what)
    elif rounds_like_torch(got.dtype, got.device):
        assert (got == want).float().mean().item() > 0.99, what
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item(), msg=what)
    else:
        torch.testing.assert_close(got, want, rtol=2 ** -6, atol=2 ** -6 * want.abs().max().item(), msg=what)


def test_rms_norm_matches_mixtral_module(device, path):
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

    for dtype in (torch.float32, torch.bfloat16):
        module = MixtralRMSNorm(1000, eps=1e-6).to(device=device, dtype=dtype)
        with torch.no_grad():
            module.weight.normal_()
        x, res = (torch.randn(2, 19, 1000, device=device, dtype=dtype) for _ in range(2))
        y, s = fused_add_rms_norm(x, res, module.weight, eps=1e-6, return_sum=True)
        _same_bits(s, x + res, path, f"sum {dtype}")
        _same_bits(y, module(x + res), path, f"y {dtype}")


# RMSNorm in GPT-OSS's casting: (weight * normed).to(dtype), one rounding, where Llama's rounds before the weight.
GPT_OSS_SIZES = [(100, 13), (1, 7), (6144, 2)]  # odd, one column, the chunked path under the interpreter


@pytest.mark.parametrize("N,M", GPT_OSS_SIZES, ids=[f"N{n}xM{m}" for n, m in GPT_OSS_SIZES])
@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                               (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32w"])
def test_add_rms_norm_gpt_oss_casting(device, dtype, param_dtype, N, M):
    """float64 autograd of GptOssRMSNorm's order (bf16 activations with float32 weights: how GPT-OSS
    checkpoints keep their norms): y, the sum, d(x), d(residual), d(weight)."""
    _check_norm(device, dtype, M, N, rms=True, casting="gpt_oss", param_dtype=param_dtype)


@pytest.mark.parametrize("parts", ["x", "x+res"])
def test_rms_norm_gpt_oss_casting_without_weight(device, path, parts):
    _check_norm(device, torch.bfloat16, 13, 100, rms=True, casting="gpt_oss", weight=False,
                residual=parts == "x+res", return_sum=parts == "x+res")


def _bf16_roundings(exact, delta, truncates):
    """The bf16 values that fp32 values within ``delta`` of ``exact`` round to (both ends; monotone rounding
    puts every value between them): to nearest even (torch, GPUs) or toward zero (the Triton interpreter)."""
    def rounded(v):
        if truncates:  # clearing the 16 low bits is exact, so the conversion after it rounds nothing
            v = (v.view(torch.int32) & -65536).view(torch.float32)
        return v.to(torch.bfloat16)

    return rounded(exact - delta), rounded(exact + delta)


def _check_gpt_oss_norm_parity(device, path, dtype, param_dtype, casting="gpt_oss", N=100):
    """``fused_add_rms_norm(x, res, w, casting=...)`` against vanilla GptOssRMSNorm of ``x + res`` [2, 13, N].

    Forward: the torch path runs HF's own ops, so it must equal vanilla bit for bit. The kernel sums the squares
    in another order, so its fp32 value before the one rounding is vanilla's within delta = (N + 32) fp32 ulps
    relative (a sum of N positive terms in any order is within (N - 1) ulps, the rest a few roundings and the
    GPU's approximate sqrt and division); rounded to bf16 it must then be exactly what vanilla's fp32 value
    rounds to, except where delta reaches across a rounding boundary (0.3% of the values at N = 100), and
    there one of the two neighbours. The rounding is the device's: GPUs round to nearest even like torch, the
    interpreter truncates (the sum too: so vanilla normalises the kernel's sum). Gradients: vanilla's autograd
    within TOL relative to the largest value."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    module = GptOssRMSNorm(N, eps=1e-5).to(device=device, dtype=param_dtype)
    with torch.no_grad():
        module.weight.normal_()
    x, res = (torch.randn(2, 13, N, device=device).to(dtype).requires_grad_(True) for _ in range(2))
    with poisoned_empty():
        y, s = fused_add_rms_norm(x, res, module.weight, eps=1e-5, return_sum=True, casting=casting)
    truncates = not rounds_like_torch(dtype, x.device)
    summed = x + res if dtype == torch.float32 else _bf16_roundings(x.float() + res.float(), 0, truncates)[0]
    assert torch.equal(s, summed), "x + res, rounded"
    s_v = s.detach().clone().requires_grad_(True)
    want = module(s_v)
    assert y.dtype == want.dtype == dtype, (y.dtype, want.dtype)
    h = s_v.detach().float()
    exact = module.weight.detach() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5))  # vanilla's fp32
    assert torch.equal(exact.to(dtype), want), "vanilla's fp32 value, rounded"
    if path == "torch":
        assert torch.equal(y, want), "the torch path runs vanilla's ops"
    else:
        delta = (N + 32) * 2.0 ** -24 * exact.abs()
        if dtype == torch.float32:
            assert ((y - want).abs() <= delta).all(), (y - want).abs().max().item()
        else:
            lo, hi = _bf16_roundings(exact, delta, truncates)
            assert ((y == lo) | (y == hi)).all(), f"{((y != lo) & (y != hi)).float().mean().item():.1%} off vanilla"
            assert (lo != hi).float().mean().item() < 0.05, "the check must be bitwise almost everywhere"
    dy = torch.randn_like(want)
    (y * dy).sum().backward()
    (want * dy).sum().backward()
    for name, got in [("dx", x.grad), ("dresidual", res.grad)]:  # both are d(sum)
        assert got.dtype == s_v.grad.dtype
        assert_close(got, s_v.grad, TOL[dtype], name)


@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32,) * 2, (torch.bfloat16,) * 2,
                                               (torch.bfloat16, torch.float32)], ids=["fp32", "bf16", "bf16-fp32w"])
def test_rms_norm_matches_gpt_oss_module(device, path, dtype, param_dtype):
    _check_gpt_oss_norm_parity(device, path, dtype, param_dtype)


def test_gpt_oss_module_weight_gradient(device, path):
    """d(weight) of GptOssRMSNorm multiplies dy by the unrounded normalised row (Llama's by the rounded one).
    bf16 x and dy are exact in fp32, so with float32 weights vanilla rounds nothing to bf16 on the way: the
    tolerance is the weight's dtype's (fp32 sums in another order), which the rounded row would miss by 1e-3."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

    for dtype, param_dtype in [(torch.float32,) * 2, (torch.bfloat16,) * 2, (torch.bfloat16, torch.float32)]:
        module = GptOssRMSNorm(100, eps=1e-5).to(device=device, dtype=param_dtype)
        with torch.no_grad():
            module.weight.normal_()
        x = torch.randn(26, 100, device=device).to(dtype)
        y = fused_add_rms_norm(x, None, module.weight, eps=1e-5, casting="gpt_oss")
        dy = torch.randn_like(y)
        (dw,) = torch.autograd.grad(y, module.weight, dy)
        (want,) = torch.autograd.grad(module(x), module.weight, dy)
        assert dw.dtype == want.dtype == param_dtype
        assert_close(dw, want, TOL[param_dtype], f"dweight {dtype} {param_dtype}")


def test_llama_casting_is_not_what_gpt_oss_gets(device, path):
    """The mutation the parity check must catch: MixtralRMSNorm's casting in place of GptOssRMSNorm's. With
    float32 weights its output would not even be bf16; with bf16 weights it rounds twice (about a quarter of
    the values end one bf16 step off). In fp32 the two castings are one computation."""
    with pytest.raises(AssertionError):
        _check_gpt_oss_norm_parity(device, path, torch.bfloat16, torch.bfloat16, casting="llama")
    with pytest.raises(AssertionError):
        _check_gpt_oss_norm_parity(device, path, torch.bfloat16, torch.float32, casting="llama")
    x, w = torch.randn(13, 100, device=device), torch.randn(100, device=device)
    llama, gpt_oss = (fused_add_rms_norm(x, None, w, casting=c) for c in ("llama", "gpt_oss"))
    assert torch.equal(llama, gpt_oss)


def test_layer_norm_matches_bert_post_norm(device, path):
    ln = torch.nn.LayerNorm(768, eps=1e-12).to(device)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    h, inp = torch.randn(3, 11, 768, device=device), torch.randn(3, 11, 768, device=device)
    torch.testing.assert_close(fused_add_layer_norm(h, inp, ln.weight, ln.bias, eps=1e-12), ln(h + inp),
                               rtol=1e-5, atol=1e-5)


def test_norm_leading_dims_strided_rows_and_empty(device):
    base = torch.randn(6, 2, 200, device=device)
    x = base[:, 1, :160]  # rows 400 apart, last dim contiguous
    w = torch.randn(160, device=device)
    torch.testing.assert_close(fused_add_rms_norm(x, weight=w), w * (x * torch.rsqrt(x.pow(2).mean(-1, True) + 1e-6)))
    empty = torch.randn(0, 7, 64, device=device, requires_grad=True)
    w, b = torch.ones(64, device=device, requires_grad=True), torch.zeros(64, device=device, requires_grad=True)
    with poisoned_empty():
        y = fused_add_layer_norm(empty, torch.randn(0, 7, 64, device=device), w, b)
        y.sum().backward()
    assert y.shape == (0, 7, 64) and empty.grad.shape == empty.shape
    assert (w.grad == 0).all() and (b.grad == 0).all(), "no rows: the parameter gradients are zeros"


# ------------------------------------------------------------------------------------------- softmax
def _mask(shape, kind, device, dtype=torch.float32):
    """Additive mask with random key padding; for [B, 1, S, S] masks some query rows are fully masked too.
    Batch 0 is padding only (every row fully masked)."""
    fill = float("-inf") if kind == "-inf" else torch.finfo(dtype).min
    S = shape[-1]
    keep = torch.rand(shape, device=device) > 0.3
    keep[..., 0] = True
    keep[0] = False
    if len(shape) == 4 and shape[2] > 1:
        keep[1:, :, 1::3] = False
    return torch.zeros(shape, device=device, dtype=dtype).masked_fill(~keep, fill)[..., :S]


def _softmax_reference(x, mask, scale):
    """float64 softmax(scale * x + mask) with masked entries at -inf and fully masked rows set to 0."""
    x64 = _leaf(x)
    z = x64 * scale
    if mask is not None:
        m = mask.double()
        z = torch.where(m <= torch.finfo(mask.dtype).min, float("-inf"), z + m)
    dead = (z == float("-inf")).all(-1, keepdim=True)
    y = torch.softmax(torch.where(dead, 0.0, z), -1) * ~dead
    return x64, y


SOFTMAX_CASES = [  # scores shape, mask shape
    ((5000, 32), None),
    ((2, 3, 17, 17), (2, 1, 1, 17)),
    ((3, 2, 9, 384), (3, 1, 9, 384)),
    ((2, 1, 3, 1000), (2, 1, 1, 1000)),
    ((3, 2, 5, 7), (5, 7)),
    ((7,), None),
]


@pytest.mark.parametrize("shapes", SOFTMAX_CASES, ids=lambda c: f"{c[0]}-mask{c[1]}")
@pytest.mark.parametrize("kind", ["-inf", "finfo.min"])
def test_masked_softmax_fp32(device, shapes, kind):
    x_shape, m_shape = shapes
    x = torch.randn(x_shape, device=device, requires_grad=True)
    mask = None if m_shape is None else _mask(m_shape, kind, device)
    with poisoned_empty():
        y = fused_masked_softmax(x, mask, scale=0.37)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
    x64, y_ref = _softmax_reference(x, mask, 0.37)
    (y_ref * dy.double()).sum().backward()
    assert_close(y, y_ref, 1e-5, "y")
    assert_close(x.grad, x64.grad, 1e-5, "dx")
    if mask is not None and m_shape[0] == x_shape[0]:
        assert (y[0] == 0).all(), "fully masked rows must give zeros"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_masked_softmax_half(device, path, dtype):
    x = torch.randn(4, 2, 12, 128, device=device, dtype=dtype, requires_grad=True)
    mask = _mask((4, 1, 1, 128), "finfo.min", device, dtype)
    with poisoned_empty():
        y = fused_masked_softmax(x, mask, scale=0.125)
        dy = torch.randn_like(y)
        (y * dy).sum().backward()
    assert y.dtype == dtype and x.grad.dtype == dtype
    x64, y_ref = _softmax_reference(x, mask, 0.125)
    (y_ref * dy.double()).sum().backward()
    assert_close(y, y_ref, 1e-2, "y")
    assert_close(x.grad, x64.grad, 1e-2, "dx")


def test_masked_softmax_learned_bias_gets_its_gradient(device, path):
    x = torch.randn(2, 4, 6, 6, device=device, requires_grad=True)
    bias = torch.randn(1, 4, 6, 6, device=device, requires_grad=True)  # e.g. a relative-position bias
    y = fused_masked_softmax(x, bias, scale=2.0)
    dy = torch.randn_like(y)
    (y * dy).sum().backward()
    x64, b64 = _leaf(x), _leaf(bias)
    (torch.softmax(2.0 * x64 + b64, -1) * dy.double()).sum().backward()
    assert_close(x.grad, x64.grad, 1e-5, "dx")
    assert_close(bias.grad, b64.grad, 1e-5, "dbias")


def _dropout_run(device, p, seed, training=True):
    x = torch.randn(3, 2, 40, 256, device=device, requires_grad=True)
    mask = _mask((3, 1, 1, 256), "finfo.min", device)
    torch.manual_seed(seed)
    with poisoned_empty():
        out = fused_masked_softmax(x, mask, scale=0.5, dropout_p=p, training=training)
        dy = torch.randn_like(out)
        (out * dy).sum().backward()
    return x, mask, out, dy


def test_softmax_dropout_statistics_and_backward(device):
    p = 0.3
    torch.manual_seed(0)
    x, mask, out, dy = _dropout_run(device, p, seed=11)
    x64, y_ref = _softmax_reference(x, mask, 0.5)
    live = y_ref.detach() > 0
    kept = out != 0
    assert abs((~kept[live]).double().mean().item() - p) < 0.015, "dropped fraction"
    assert (out[~live] == 0).all()
    out_ref = y_ref * kept / (1 - p)  # the kernel's keep mask, read off its output
    assert_close(out, out_ref, 1e-5, "out")
    (out_ref * dy.double()).sum().backward()
    assert_close(x.grad, x64.grad, 1e-5, "dx")


def test_softmax_dropout_is_seeded_and_paths_agree(device, monkeypatch):
    torch.manual_seed(0)
    a = _dropout_run(device, 0.2, seed=5)
    torch.manual_seed(0)
    b = _dropout_run(device, 0.2, seed=5)
    torch.manual_seed(0)
    c = _dropout_run(device, 0.2, seed=6)
    assert torch.equal(a[2], b[2]) and torch.equal(a[0].grad, b[0].grad)
    assert not torch.equal(a[2] != 0, c[2] != 0)
    monkeypatch.setenv("HF_SCATTER_KERNELS", "torch")  # the reference draws the same Philox stream
    torch.manual_seed(0)
    r = _dropout_run(device, 0.2, seed=5)
    assert torch.equal(a[2] != 0, r[2] != 0)
    assert_close(r[2], a[2], 1e-6, "out")
    assert_close(r[0].grad, a[0].grad, 1e-6, "dx")


def test_softmax_dropout_off_in_eval_and_p_one(device):
    torch.manual_seed(0)
    x, mask, out, _ = _dropout_run(device, 0.5, seed=1, training=False)
    assert_close(out, _softmax_reference(x, mask, 0.5)[1], 1e-5, "eval")
    x, _, out, _ = _dropout_run(device, 1.0, seed=1)
    assert (out == 0).all() and (x.grad == 0).all()


# -------------------------------------------------------------------------------------------- router
def _router_reference(logits, indices, p, softmax_dtype):
    """float64 autograd of HF's router at the given choice: softmax, gather, divide by the p-norm."""
    z = _leaf(logits)
    probs = torch.softmax(z, -1)
    top = probs.gather(1, indices)
    if p is not None:
        top = top / torch.linalg.vector_norm(top, ord=p, dim=-1, keepdim=True)
    return z, top, probs


def _stable_topk(probs, k):
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :k]


ROUTER_CASES = [(1, 6, 3), (1000, 8, 2), (513, 16, 4), (64, 256, 8), (5, 256, 256), (33, 6, 6), (300, 60, 1)]


def _untied_logits(T: int, E: int, device, seed: int) -> torch.Tensor:
    """Seeded [T, E] logits whose float32 softmax has no two probabilities within 1e-6 of each other (relative):
    with an exact or near tie the top-k order is up to each implementation's rounding and tie rule (about 1 draw
    in 100 at E=256 held an exact float32 tie)."""
    g = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(T, E, generator=g)
    for _ in range(1000):
        p = torch.softmax(logits, -1).sort(-1, descending=True).values
        tied = ((p[:, :-1] - p[:, 1:]) <= 1e-6 * p[:, :-1]).any(-1)
        if not tied.any():
            return logits.to(device)
        logits[tied] = 2 * torch.randn(int(tied.sum()), E, generator=g)
    raise AssertionError("no untied logits in 1000 draws")


@pytest.mark.parametrize("T,E,k", ROUTER_CASES, ids=[f"T{t}E{e}k{k}" for t, e, k in ROUTER_CASES])
def test_router_mixtral(device, T, E, k):
    logits = _untied_logits(T, E, device, seed=T * 1000 + E * 10 + k).requires_grad_(True)
    with poisoned_empty():
        w, idx, probs = router_topk(logits, k, "sum", torch.float32, return_probs=True)
        dw, dp = torch.randn_like(w), torch.randn_like(probs)
        ((w * dw).sum() + (probs * dp).sum()).backward()
    assert w.dtype == probs.dtype == torch.float32 and idx.dtype == torch.int64
    assert torch.equal(idx, torch.topk(probs.detach(), k).indices), "choice differs from torch.topk"
    z, w_ref, p_ref = _router_reference(logits, idx, 1.0, torch.float32)
    assert_close(probs, p_ref, 1e-5, "probs")
    assert_close(w, w_ref, 1e-5, "weights")
    ((w_ref * dw.double()).sum() + (p_ref * dp.double()).sum()).backward()
    assert_close(logits.grad, z.grad, 1e-5, "dlogits")


@pytest.mark.parametrize("p", [1.0, 2.0, 0.5, None], ids=["p1", "p2", "p0.5", "none"])
def test_router_dbrx_bf16(device, path, p):
    logits = torch.randn(77, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
    with poisoned_empty():
        w, idx, probs = router_topk(logits, 4, p, torch.bfloat16, return_probs=True)
        dw = torch.randn_like(w)
        (w * dw).sum().backward()
    assert w.dtype == probs.dtype == logits.grad.dtype == torch.bfloat16
    assert torch.equal(idx, _stable_topk(probs, 4)), "choice differs from the stable descending order"
    z, w_ref, p_ref = _router_reference(logits, idx, p, torch.bfloat16)
    assert_close(probs, p_ref, 1e-2, "probs")
    assert_close(w, w_ref, 1e-2, "weights")
    (w_ref * dw.double()).sum().backward()
    assert_close(logits.grad, z.grad, 1e-2, "dlogits")


def test_router_ties_lowest_index_first(device, path):
    logits = torch.tensor([[1.0, 3, 3, 2, 3, 0, 3]], device=device)
    for k, want in [(1, [1]), (2, [1, 2]), (4, [1, 2, 4, 6]), (5, [1, 2, 4, 6, 3]), (7, [1, 2, 4, 6, 3, 0, 5])]:
        w, idx = router_topk(logits, k, None)
        assert idx[0].tolist() == want, k
    for E, k in [(6, 3), (64, 8), (256, 20)]:
        logits = torch.randint(0, 3, (200, E), device=device).float()  # ties everywhere
        w, idx, probs = router_topk(logits, k, "sum", return_probs=True)
        assert torch.equal(idx, _stable_topk(probs, k))
        chosen = probs.gather(1, idx)
        assert_close(w, chosen / chosen.sum(-1, keepdim=True), 1e-6, "weights")


@pytest.mark.parametrize("family", ["mixtral", "dbrx-p1", "dbrx-p2", "dbrx-none"])
def test_router_matches_hf_modules(device, path, family):
    """Against HF's own router code. Choices are compared on the rows whose k-th and (k+1)-th probabilities
    are further apart than twice the largest difference between the two computations (the interpreter also
    rounds to bf16 differently), so ties, broken by CPU torch.topk in an implementation-defined way, are out;
    weights are compared as sorted values on all rows."""
    from types import SimpleNamespace

    from transformers import MixtralConfig
    from transformers.models.dbrx.modeling_dbrx import DbrxFFN
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    T, E, k = 300, 16, 4
    if family == "mixtral":
        hf_router = MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=E, num_experts_per_tok=k))
        with torch.no_grad():
            hf_router.weight.normal_()
        logits, want_w, want_idx = hf_router.to(device)(torch.randn(T, 32, device=device))
        got_w, got_idx, probs = router_topk(logits, k, "sum", torch.float32, return_probs=True)
        hf_probs = torch.softmax(logits.float(), -1)
    else:
        p = {"p1": 1.0, "p2": 2.0, "none": None}[family.split("-")[1]]
        logits = torch.randn(T, E, device=device, dtype=torch.bfloat16)
        want_w, want_idx = DbrxFFN.route_tokens_to_experts(SimpleNamespace(top_k=k, moe_normalize_expert_weights=p),
                                                           logits)
        got_w, got_idx, probs = router_topk(logits, k, p, logits.dtype, return_probs=True)
        hf_probs = torch.softmax(logits, -1, dtype=logits.dtype)
    ranked = hf_probs.float().sort(-1, descending=True).values
    clear = ranked[:, k - 1] - ranked[:, k] > 2 * (probs.float() - hf_probs.float()).abs().amax(-1)
    assert clear.float().mean() > 0.5
    assert torch.equal(got_idx[clear].sort(-1).values, want_idx[clear].sort(-1).values)
    _same_bits(got_w.sort(-1).values, want_w.sort(-1).values, path, "weights")


def test_router_float64_and_no_grad(device):
    logits = torch.randn(9, 6, device=device, dtype=torch.float64)
    w, idx = router_topk(logits, 3, 2.0, torch.float64)
    probs = torch.softmax(logits, -1)
    assert torch.equal(idx, torch.topk(probs, 3).indices)
    top = probs.gather(1, idx)
    torch.testing.assert_close(w, top / top.norm(dim=-1, keepdim=True))


# ------------------------------------------------------------------------------------- torch.compile
def test_compile_fullgraph(device):
    torch._dynamo.reset()
    x = torch.randn(2, 5, 64, device=device, requires_grad=True)
    res = torch.randn(2, 5, 64, device=device, requires_grad=True)
    w, b, ab = (torch.randn(64, device=device, requires_grad=True) for _ in range(3))
    scores = torch.randn(2, 2, 5, 5, device=device, requires_grad=True)
    mask = _mask((2, 1, 1, 5), "-inf", device)
    logits = torch.randn(10, 6, device=device, requires_grad=True)

    def step(x, res, w, b, ab, scores, mask, logits):
        y, s = fused_add_layer_norm(x, res, w, b, eps=1e-5, add_bias=ab, return_sum=True)
        r = fused_add_rms_norm(x, s, w)
        a = fused_masked_softmax(scores, mask, 0.5, dropout_p=0.1, training=True)
        gw, gi, gp = router_topk(logits, 3, 1.0, return_probs=True)
        return y.sum() + r.square().sum() + (a * a).sum() + (gw * gi).sum() + gp.square().sum()

    inputs = (x, res, w, b, ab, scores, mask, logits)
    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        torch.manual_seed(3)
        loss = fn(*inputs)
        grads = torch.autograd.grad(loss, [x, res, w, b, ab, scores, logits])
        results.append((loss, grads))
    (eager_loss, eager_grads), (comp_loss, comp_grads) = results
    torch.testing.assert_close(comp_loss, eager_loss)
    for got, want in zip(comp_grads, eager_grads):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------------------- validation
def _t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("call,match", [
    (lambda: fused_add_layer_norm(_t(4, 8), _t(4, 9)), r"residual has shape \(4, 9\)"),
    (lambda: fused_add_layer_norm(_t(4, 8), _t(4, 8).half()), "cast them to one dtype"),
    (lambda: fused_add_layer_norm(_t(4, 8), weight=_t(9)), r"weight must have shape \(8,\)"),
    (lambda: fused_add_layer_norm(_t(4, 8), weight=_t(8).half()), "weight has dtype torch.float16"),
    (lambda: fused_add_layer_norm(_t(4, 8).half(), add_bias=_t(8)), "add_bias has dtype"),
    (lambda: fused_add_layer_norm(_t(8, 4).t()), r"contiguous along its last dimension.*\.contiguous\(\)"),
    (lambda: fused_add_layer_norm(_t(4, 8), eps=-1.0), "eps must be a finite number"),
    (lambda: fused_add_layer_norm(_t(4, 0)), "last dimension .* is empty"),
    (lambda: fused_add_rms_norm(_t(4, 8).long()), "must be float32, float16, bfloat16 or float64"),
    (lambda: fused_add_rms_norm(_t(4, 8), weight=_t(2, 4)), r"weight must have shape \(8,\)"),
    (lambda: fused_add_rms_norm(_t(4, 8), casting="gemma"), "casting must be one of 'llama', 'gpt_oss', got 'gemma'"),
    (lambda: fused_masked_softmax(_t(2, 2, 2, 2, 2)), "1 to 4 dimensions"),
    (lambda: fused_masked_softmax(_t(2, 3, 4), _t(3, 3)), "does not broadcast"),
    (lambda: fused_masked_softmax(_t(2, 4), torch.ones(2, 4, dtype=torch.bool)), "additive float mask"),
    (lambda: fused_masked_softmax(_t(2, 4), dropout_p=1.5, training=True), r"dropout_p must be a number in \[0, 1\]"),
    (lambda: fused_masked_softmax(_t(2, 4), scale=float("nan")), "scale must be a finite number"),
    (lambda: router_topk(_t(2, 3, 4), 2), r"logits must be \[tokens, experts\]"),
    (lambda: router_topk(_t(5, 4), 5), r"top_k must be an int in \[1, 4\]"),
    (lambda: router_topk(_t(5, 4), 0), r"top_k must be an int in \[1, 4\]"),
    (lambda: router_topk(_t(5, 4), 2, normalize="max"), "normalize must be 'sum', None or"),
    (lambda: router_topk(_t(5, 4), 2, normalize=0.0), "normalize must be"),
    (lambda: router_topk(_t(5, 4), 2, softmax_dtype=torch.int32), "softmax_dtype must be"),
    (lambda: router_topk(_t(4, 5).t(), 2), "contiguous along its last dimension"),
])
def test_bad_input_is_a_clear_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ---------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layer", "rms"])
def test_gpu_chunked_rows(device, rms):
    """Rows longer than a register block (8192 on a GPU) take the chunked path (6144 does on CPU)."""
    _check_norm(device, torch.float32, 300, 10000, rms, offset=0.0 if rms else 1e4, spread=1e-2, eps=1e-12, first=1.0)
    _check_norm(device, torch.bfloat16, 5, 10000, rms)


@pytest.mark.gpu
def test_gpu_router_tie_set_matches_cuda_topk(device):
    for E, k in [(8, 2), (16, 4), (64, 6), (256, 8)]:
        logits = torch.randint(0, 3, (4096, E), device=device).float()
        _, idx, probs = router_topk(logits, k, "sum", return_probs=True)
        cuda = torch.topk(probs, k).indices
        assert torch.equal(idx.sort(-1).values, cuda.sort(-1).values), (E, k)


@pytest.mark.parametrize("rms", [False, True])
def test_inference_path_equals_the_autograd_path_and_writes_the_sum_only_when_asked(rms, device):
    """Without grad the norms skip the autograd node and the pre-norm sum store; results must not change."""
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(37, 96, generator=g).to(device) for _ in range(2))
    w = torch.randn(96, generator=g).to(device)
    call = (lambda *a, **k: fused_add_rms_norm(*a, **k)) if rms else (
        lambda x, r, w, **k: fused_add_layer_norm(x, r, w, w.flip(0), **k))
    y_grad, s_grad = call(x.clone().requires_grad_(True), r, w, return_sum=True)
    with torch.no_grad():
        y_plain = call(x, r, w)
        y_sum, s = call(x, r, w, return_sum=True)
        y_unchecked = call(x, r, w, validate=False)
    for y in (y_plain, y_sum, y_unchecked):
        assert not y.requires_grad and torch.equal(y, y_grad.detach())
    assert torch.equal(s, s_grad.detach()) and torch.equal(s, x + r)
