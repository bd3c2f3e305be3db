"""A different float32 summation order in every matmul of the process: what another processor's BLAS (AVX-512
blocking, another thread count) does, so a tolerance that holds only on this machine's order fails here.

``HF_SCATTER_TEST_OTHER_BLAS=1 make test`` loads it (``conftest.py``): every ``F.linear``, ``torch.matmul``
(and ``@``) and ``torch.bmm`` of the test processes sums its inner dimension in chunks of 5, last chunk first.
The products are the same up to float32 rounding; the Triton interpreter's own products are left alone, as
a machine with another BLAS would leave them. Tests only: nothing here is imported by hf-scatter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 5
_linear, _matmul, _bmm, _tensor_matmul = F.linear, torch.matmul, torch.bmm, torch.Tensor.__matmul__


def _reversed_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    out = parts[-1]
    for part in parts[-2::-1]:
        out = out + part
    return out


def linear(x, weight, bias=None):
    k = x.shape[-1]
    if k <= CHUNK or weight.dim() != 2:
        return _linear(x, weight, bias)
    out = _reversed_sum([_linear(x[..., s:s + CHUNK], weight[:, s:s + CHUNK]) for s in range(0, k, CHUNK)])
    return out if bias is None else out + bias


def matmul(a, b, *, out=None):
    if out is not None or a.dim() < 2 or b.dim() < 2 or a.shape[-1] <= CHUNK:
        return _matmul(a, b) if out is None else _matmul(a, b, out=out)
    k = a.shape[-1]
    return _reversed_sum([_matmul(a[..., s:s + CHUNK], b[..., s:s + CHUNK, :]) for s in range(0, k, CHUNK)])


def bmm(a, b, *, out=None):
    if out is not None or a.shape[-1] <= CHUNK:
        return _bmm(a, b) if out is None else _bmm(a, b, out=out)
    k = a.shape[-1]
    return _reversed_sum([_bmm(a[..., s:s + CHUNK], b[:, s:s + CHUNK, :]) for s in range(0, k, CHUNK)])


def install() -> None:
    F.linear, torch.matmul, torch.bmm = linear, matmul, bmm
    torch.Tensor.__matmul__ = lambda a, b: matmul(a, b)
