"""The dtypes kernels and checks accept, written once."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


__all__ = ["FLOAT_DTYPES", "INDEX_DTYPES"]
