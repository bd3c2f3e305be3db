"""Tensors stacked along dim 0 without building the stack: Mixtral's separate Q, K and V projections are
stored as one [q + 2 kv, H] matrix of the weight store, and a rank of a tensor-parallel group keeps its rows
of each part."""

from __future__ import annotations

import torch


class Rows:
    """Tensors stacked along dim 0 without building the stack (Mixtral's separate Q, K and V projections are
    stored as one [q + 2 kv, H] matrix): shape and dtype for the layout, :meth:`copy_into` for the packing."""

    def __init__(self, *parts: torch.Tensor):
        self.parts = parts
        self.shape = torch.Size((sum(p.shape[0] for p in parts), *parts[0].shape[1:]))
        self.dtype = parts[0].dtype

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.parts[0].element_size()

    def copy_into(self, dst: torch.Tensor) -> None:
        start = 0
        for p in self.parts:
            dst[start:start + p.shape[0]].copy_(p)
            start += p.shape[0]


def copy_weight(dst: torch.Tensor, src) -> None:
    src.copy_into(dst) if isinstance(src, Rows) else dst.copy_(src)
