"""The `group` kernel (gather into expert order with per-row coefficients) against a float64 reference."""

import pytest
import torch

from hf_scatter.kernels.backend import kernel_path
from hf_scatter.kernels.group import group, group_reference

DTYPES = {torch.float32: 1e-6, torch.float16: 1e-2, torch.bfloat16: 1e-2}


def test_triton_path_is_active(device):
    # On CPU the conftest switched on the interpreter, so the Triton kernel (not the fallback) is under test.
    assert kernel_path(device) in {"triton", "triton-interpreter"}


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("tokens,dim,fan_out,with_coeff", [(1, 7, 1, False), (13, 100, 3, True), (64, 600, 2, True),
                                                            (33, 129, 4, False)])
def test_group_matches_float64_reference(device, dtype, tokens, dim, fan_out, with_coeff):
    x = torch.randn(tokens, dim, device=device).to(dtype)
    idx = torch.randperm(tokens * fan_out, device=device)
    coeff = torch.rand(tokens * fan_out, device=device) if with_coeff else None
    out = torch.full((tokens * fan_out, dim), float("nan"), device=device, dtype=dtype)  # poisoned
    group(x, idx, fan_out, coeff, out=out)
    ref = group_reference(x.double(), idx, fan_out, None if coeff is None else coeff.double())
    assert not out.isnan().any(), "rows left unwritten"
    torch.testing.assert_close(out.double(), ref, rtol=DTYPES[dtype], atol=DTYPES[dtype])


def test_group_strided_input(device):
    base = torch.randn(20, 64, device=device)
    x = base[:, ::2]  # non-contiguous columns
    idx = torch.randperm(20, device=device)
    torch.testing.assert_close(group(x, idx), x[idx])


@pytest.mark.parametrize("bad,match", [
    (lambda x, i: group(x[0], i), "must be 2-D"),
    (lambda x, i: group(x, i.float()), "int32/int64"),
    (lambda x, i: group(x, i, fan_out=0), "fan_out"),
    (lambda x, i: group(x, i, coeff=torch.ones(3)), "coeff must have shape"),
])
def test_group_rejects_bad_input(bad, match):
    x, idx = torch.randn(8, 4), torch.arange(8)
    with pytest.raises(ValueError, match=match):
        bad(x, idx)
