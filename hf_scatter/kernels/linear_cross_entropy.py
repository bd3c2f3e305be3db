"""The LM head and the cross-entropy in one pass over token chunks: the [tokens, vocab] logits never exist.

Each chunk of rows makes its logits with one GEMM in the activations' dtype; one Triton program per row then
reads them twice (log-sum-exp, then the gradient) and overwrites them in place with the gradient the unfused
backward would hand the LM head, ``(softmax - onehot) * scale``; two GEMMs turn that into the hidden states'
and the head's gradients, made in the forward (the backward only scales them). Nothing waits for the GPU: no
``.item()``, no comparison read back on the host. That is why this is our own and not Liger-Kernel's fused
linear cross-entropy, which reads the count of valid labels back in its forward and compares the incoming
gradient with 1 on the host in its backward: two waits per step. Under FSDP2 on one H100 (whose per-layer
hooks need the host ahead of the GPU) a step of the Qwen3-30B-A3B layers took 342 ms with it and 243 ms with
this module's torch path (docs/distributed-earlier.md); ``bench loss`` runs both. Liger's path stays selectable
(``use_liger=True``). The torch reference (CPU, float64, the kernel's test oracle) makes the same chunks
with torch ops.

Both follow transformers' ``ForCausalLMLoss`` after its label shift: logits in the activations' dtype,
upcast to float32, mean over the tokens whose label is not ``ignore_index`` (or the sum over
``num_items_in_batch``, as the Trainer passes it).
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from ..common.dtypes import autocast_operands
from .backend import kernels_enabled, triton_runs
from .checks import fail
from .custom_ops import mutating_op, run_op

CHUNK_BYTES = 2 ** 29  # logits of one chunk: 512 MiB, [1024, 151936] in bf16 (Qwen3), all 8192 rows at 32k
ROW_BLOCK = 4096  # vocabulary entries a program reads at a time

if kernels_enabled():
    import triton
    import triton.language as tl

    @triton.jit
    def _cross_entropy_rows_kernel(z_ptr, labels_ptr, loss_ptr, V, stride_z, ignore_index, scale,
                                   BLOCK: tl.constexpr):
        """Row ``r`` of the logits ``z``: ``loss[r] = logsumexp(s z) - s z[y]`` (0 where ``y`` is ignored), and
        ``z[r]`` overwritten with ``(softmax(s z) - onehot(y)) * s`` (0 where ignored), ``s`` the logit scale."""
        row = tl.program_id(0)
        z_row = z_ptr + row.to(tl.int64) * stride_z
        y = tl.load(labels_ptr + row)
        tl.device_assert((y == ignore_index) | ((y >= 0) & (y < V)), "label out of the vocabulary")
        cols = tl.arange(0, BLOCK)
        top = tl.max(tl.full((BLOCK,), float("-inf"), tl.float32), 0)
        total = tl.sum(tl.zeros((BLOCK,), tl.float32), 0)
        for start in range(0, V, BLOCK):  # online log-sum-exp
            inside = start + cols < V
            x = tl.where(inside, tl.load(z_row + start + cols, mask=inside, other=0.0).to(tl.float32) * scale,
                         float("-inf"))
            new_top = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        valid = y != ignore_index
        target = tl.where(valid, y, 0)
        picked = tl.load(z_row + target).to(tl.float32) * scale
        tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
        weight = tl.where(valid, scale, 0.0)
        for start in range(0, V, BLOCK):
            idx = start + cols
            inside = idx < V
            x = tl.load(z_row + idx, mask=inside, other=0.0).to(tl.float32) * scale
            grad = (tl.exp(x - lse) - tl.where(idx == target, 1.0, 0.0)) * weight
            tl.store(z_row + idx, grad.to(z_ptr.dtype.element_ty), mask=inside)


def _cross_entropy_rows_torch(z: torch.Tensor, labels: torch.Tensor, ignore_index: int, scale: float,
                              loss: torch.Tensor) -> None:
    x = z.to(torch.promote_types(z.dtype, torch.float32)) * scale  # [n, V]; float64 stays float64
    valid = labels != ignore_index
    target = torch.where(valid, labels, 0)
    lse = torch.logsumexp(x, dim=-1)  # [n]
    loss.copy_(torch.where(valid, lse - x.gather(1, target[:, None])[:, 0], 0.0))
    grad = torch.exp(x - lse[:, None])
    grad.scatter_add_(1, target[:, None], -torch.ones_like(grad[:, :1]))
    z.copy_(grad * (valid[:, None] * scale))


def _cross_entropy_rows_impl(z: torch.Tensor, labels: torch.Tensor, ignore_index: int, scale: float,
                             loss: torch.Tensor) -> None:
    if z.shape[0] and triton_runs(z, "linear_cross_entropy"):
        _cross_entropy_rows_kernel[(z.shape[0],)](z, labels, loss, z.shape[1], z.stride(0), ignore_index, scale,
                                                  BLOCK=ROW_BLOCK, num_warps=8)
    else:
        _cross_entropy_rows_torch(z, labels, ignore_index, scale, loss)


_cross_entropy_rows_op = mutating_op("cross_entropy_rows", "z", "loss")(_cross_entropy_rows_impl)


def chunk_rows(vocab: int, dtype: torch.dtype) -> int:
    """Rows per chunk: a power of two whose logits fit :data:`CHUNK_BYTES` (at least 16)."""
    fit = CHUNK_BYTES // max(1, vocab * dtype.itemsize)
    return max(16, 1 << (max(1, fit).bit_length() - 1))


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
        labels = labels.contiguous()  # the kernel reads one label per row
        rows_per_chunk = chunk_rows(weight.shape[0], h.dtype)
        dh = torch.empty_like(h) if h.requires_grad else None
        dw = None
        if weight.requires_grad and N > rows_per_chunk:  # summed over the chunks in float32
            dw = torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32),
                             device=weight.device)
        losses = torch.empty(N, dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
        for start in range(0, N, rows_per_chunk):
            rows = slice(start, min(start + rows_per_chunk, N))
            z = torch.nn.functional.linear(h[rows], weight)  # [n, V] logits, then their gradient in place
            run_op(_cross_entropy_rows_op, _cross_entropy_rows_impl, z, labels[rows], ignore_index, scale,
                   losses[rows])
            if dh is not None:
                torch.mm(z, weight, out=dh[rows])
            if weight.requires_grad:  # the product in the activations' dtype (tensor cores), as unfused
                if dw is None:
                    dw = z.t() @ h[rows]  # one chunk: the unfused backward's single GEMM
                else:
                    dw += z.t() @ h[rows]
        ctx.save_for_backward(dh, dw)
        ctx.weight_dtype = weight.dtype
        return losses.sum()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        # grad (1 / the count of valid labels, usually) multiplies in float32: rounded to bf16 first, it would
        # scale every gradient by up to 0.4% off
        return (None if dh is None else (dh.float() * grad).to(dh.dtype),
                None if dw is None else (dw.float() * grad).to(ctx.weight_dtype), None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         num_items_in_batch=None, scale: float = 1.0, use_liger: bool | None = None) -> torch.Tensor:
    """``cross_entropy((hidden @ weight.T).float() * scale, labels)`` without the logits.

    ``hidden`` [N, H], ``weight`` [V, H] (the LM head), ``labels`` [N] already shifted. Mean over the valid
    labels, or sum / ``num_items_in_batch`` when given. ``use_liger``: Liger-Kernel's fused loss instead of
    ours (CUDA; it waits for the GPU twice per step, see the module's docstring). Inside ``torch.autocast`` the
    products run in the autocast dtype. Labels must be ``ignore_index`` or in ``[0, V)``: the torch path raises
    otherwise, the kernel checks them only in Triton's debug mode (``TRITON_DEBUG=1``; checking on every call
    would read them back to the host)."""
    op = "linear_cross_entropy"
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        fail(op, f"hidden must be [N, H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        fail(op, f"labels must be [{hidden.shape[0]}] (one per row of hidden), got {tuple(labels.shape)}")
    if not scale > 0:
        fail(op, f"scale must be positive (it multiplies the logits), got {scale}")
    if use_liger and not liger_available():
        fail(op, "use_liger=True needs liger-kernel (pip install liger-kernel)")
    hidden, weight, _ = autocast_operands(hidden, weight, None)
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
            num_items_in_batch = num_items_in_batch.to(loss.device, non_blocking=True)
        loss = loss / num_items_in_batch
    return loss
