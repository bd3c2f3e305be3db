"""The LM head and the cross-entropy in one pass over token chunks: the [tokens, vocab] logits never exist.

On a GPU this is Liger-Kernel's fused linear cross-entropy (a dependency on Linux x86-64): ``bench loss``
measured it against cut-cross-entropy on an H100 (docs/models.md): the same gradients as transformers'
unfused loss to float32 rounding, 30x less memory, and 0.95x its speed at a 32k vocabulary, where
cut-cross-entropy was slower and its input gradient several times further from float32 (it skips small
softmax blocks by default). Everywhere else (CPU, no Liger) the torch reference below runs: the same
chunking in plain torch, each chunk's gradient computed in the forward, as Liger does.

Both follow transformers' ``ForCausalLMLoss`` after its label shift: logits in the activations' dtype,
upcast to float32, mean over the tokens whose label is not ``ignore_index`` (or the sum over
``num_items_in_batch``, as the Trainer passes it).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from .backend import warn_missing_library
from .checks import fail

CHUNK_ROWS = 1024  # reference path: [1024, vocab] float32 logits at a time


@functools.lru_cache(maxsize=None)
def liger_available() -> bool:
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy  # noqa: F401
    except ImportError:
        return False
    return True


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over valid rows of ``logsumexp(z) - z[y]``, z = (h @ W.T).float() * scale, chunk by chunk; the
    gradients are made in the forward (the backward scales them)."""

    @staticmethod
    def forward(ctx, h, weight, labels, ignore_index, scale):
        N = h.shape[0]
        dh = torch.empty_like(h) if h.requires_grad else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if weight.requires_grad else None
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, N, CHUNK_ROWS):
            rows = slice(start, min(start + CHUNK_ROWS, N))
            z = torch.nn.functional.linear(h[rows], weight).float() * scale  # [n, V]
            y = labels[rows]
            valid = y != ignore_index
            target = torch.where(valid, y, 0)
            lse = torch.logsumexp(z, dim=-1)
            total += torch.where(valid, lse - z.gather(1, target[:, None])[:, 0], 0.0).sum()
            dz = torch.softmax(z, dim=-1)
            dz.scatter_add_(1, target[:, None], -torch.ones_like(dz[:, :1]))
            dz = (dz * (valid[:, None] * scale)).to(h.dtype)  # what the unfused backward hands the LM head
            if dh is not None:
                dh[rows] = dz @ weight
            if dw is not None:  # the product in the activations' dtype (tensor cores), as the unfused backward
                dw += (dz.t() @ h[rows]).float()  # makes it; summed over the chunks in float32
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * grad.to(dh.dtype),
                None if dw is None else (dw * grad).to(ctx.weight_dtype), None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         num_items_in_batch=None, scale: float = 1.0, use_liger: bool | None = None) -> torch.Tensor:
    """``cross_entropy((hidden @ weight.T).float() * scale, labels)`` without the logits.

    ``hidden`` [N, H], ``weight`` [V, H] (the LM head), ``labels`` [N] already shifted. Mean over the valid
    labels, or sum / ``num_items_in_batch`` when given. ``use_liger``: None picks Liger for CUDA tensors
    when it is installed."""
    op = "linear_cross_entropy"
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        fail(op, f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        fail(op, f"labels must be [{hidden.shape[0]}] (one per row of hidden), got {tuple(labels.shape)}")
    if use_liger is None:
        use_liger = hidden.is_cuda and liger_available()
        if hidden.is_cuda and not use_liger:
            warn_missing_library(op, "liger-kernel", "a chunked torch loss (more memory, slower)")
    reduction = "mean" if num_items_in_batch is None else "sum"
    if use_liger:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        x = hidden if scale == 1.0 else hidden * scale
        loss = liger_fused_linear_cross_entropy(x, weight, labels, ignore_index=ignore_index, reduction=reduction)
    else:
        loss = _ChunkedLinearCrossEntropy.apply(hidden, weight, labels, ignore_index, float(scale))
        if reduction == "mean":
            loss = loss / (labels != ignore_index).sum()
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
