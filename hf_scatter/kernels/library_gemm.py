"""The library grouped GEMM: CUTLASS's Hopper/Blackwell grouped GEMM through ``torch._grouped_mm`` (the kernel
transformers' own grouped_mm experts use), where it beats our Triton kernels.

At fine-grained shapes each expert owns only about 1-4k sorted rows, and its products are short: a weight
gradient reduces over those rows, the output projection over d_expert (768 for Qwen3-30B-A3B). A Triton
tile then spends a large share of its time filling its pipeline and storing its output, where CUTLASS's
warp-specialised persistent kernel overlaps both with the next tile's loads (Triton's warp specialisation
targets Blackwell only). The library reads grouped rows only, so it takes the products whose operands are
grouped anyway, or whose copy pays (docs/moe-kernel-changes.md has the measurements):

- :func:`grouped_mm_weight_grad`: the expert weight gradients, ``dW[e] = X_e^T dY_e``;
- :func:`grouped_mm_rows`: ``Y[i] = X[i] W[e(i)]`` from grouped rows to grouped rows (the SwiGLU experts'
  output projection and input gradient, mixed back per token by ``gating.gate_mix`` through the slot
  positions), at training-sized batches (:func:`grouped_mm_rows_apply`).
"""

from __future__ import annotations

import functools

import torch

from .backend import compute_capability, env_switch, use_triton

_ENV_GROUPED_MM = "HF_SCATTER_GROUPED_MM"  # 0/false/no/off: every expert product runs our Triton kernels


@functools.lru_cache(maxsize=None)
def _grouped_mm_device(index: int) -> bool:
    """torch's grouped GEMM is a CUTLASS kernel on compute capability 9.x and 10.x; elsewhere torch falls
    back to a loop of matmuls, slower than our kernels."""
    return hasattr(torch, "_grouped_mm") and compute_capability(index)[0] in (9, 10)


# Largest expert matrix (K * N) whose gradient goes to the library: it was faster (H100, fwd+bwd of the SwiGLU
# experts) for 3-17M-element experts (Qwen3-30B-A3B, OLMoE, DeepSeek-V2-Lite, GPT-OSS-20B, 4096 x 4096) and
# slower for Mixtral-8x7B's 59-117M-element ones, where groupXTY's many tiles per expert already fill the GPU.
LIBRARY_MAX_EXPERT_ELEMENTS = 1 << 25

# Fewest mean rows per expert at which grouped-row products go to the library: measured faster end to end from
# there (H100; Qwen3-30B-A3B at 16k tokens has 1,024). From 512 to 1,024 rows the two were within run-to-run
# spread, in either order by shape; at decode sizes our kernels' tiles stream each expert's weights once.
LIBRARY_MIN_ROWS_PER_EXPERT = 1024

# CUTLASS's grouped GEMM takes at most this many groups (experts) per call.
_MAX_GROUPS = 1023


def grouped_mm_applies(weight: torch.Tensor, *operands: torch.Tensor) -> bool:
    """Whether products with ``weight`` [E, K, N] may run as the library grouped GEMM: ``weight`` and the
    tensors its operands come from are bf16 on a Hopper or Blackwell GPU, K and N keep rows 16-byte aligned,
    at most 1,023 experts (the library's limit), the expert matrix is at most ``LIBRARY_MAX_EXPERT_ELEMENTS``,
    the kernels are not forced to the torch reference, and ``HF_SCATTER_GROUPED_MM`` does not switch it off
    (0, false, no or off). Callers then make the operands grouped. The weight gradient takes it whenever this
    holds (a bias gradient is then summed apart, ``groupxty.group_sum``)."""
    if not isinstance(weight, torch.Tensor):  # a quantized weight: our kernels decode it
        return False
    E, K, N = weight.shape
    return (weight.is_cuda and weight.dtype == torch.bfloat16 and all(t.dtype == torch.bfloat16 for t in operands)
            and K % 8 == 0 and N % 8 == 0 and E <= _MAX_GROUPS and K * N <= LIBRARY_MAX_EXPERT_ELEMENTS
            and env_switch(_ENV_GROUPED_MM) is not False and use_triton(weight, "groupXTY")
            and _grouped_mm_device(weight.device.index if weight.device.index is not None
                                   else torch.cuda.current_device()))


def grouped_mm_rows_apply(weight: torch.Tensor, x_grouped: torch.Tensor) -> bool:
    """Whether ``x_grouped @ W[e]`` (grouped rows in and out, no bias) runs as the library grouped GEMM:
    :func:`grouped_mm_applies`, at a batch of at least ``LIBRARY_MIN_ROWS_PER_EXPERT`` mean rows per expert,
    with the weight as the library reads an operand (16-byte aligned start, one unit stride in its matrices:
    transformers' tensors and their transposed views; other views stay on our kernels)."""
    return (isinstance(weight, torch.Tensor) and x_grouped.shape[0] >= LIBRARY_MIN_ROWS_PER_EXPERT * weight.shape[0]
            and weight.data_ptr() % 16 == 0
            and 1 in weight.stride()[-2:] and grouped_mm_applies(weight, x_grouped))


def grouped_mm_rows(x_grouped: torch.Tensor, weight: torch.Tensor, expert_offsets: torch.Tensor) -> torch.Tensor:
    """``Y[i] = X[i] @ W[e(i)]`` for expert-ordered rows ``X`` [M, K] (expert ``e`` owns rows
    ``[offsets[e-1], offsets[e])``), ``weight`` [E, K, N] row- or column-major (a transposed view of
    transformers' tensor as it lies): [M, N] in the same expert order."""
    return torch._grouped_mm(x_grouped, weight, offs=expert_offsets.to(torch.int32))  # [M, N]


def grouped_mm_weight_grad(x_grouped: torch.Tensor, dy_grouped: torch.Tensor, expert_offsets: torch.Tensor,
                           weight: torch.Tensor) -> torch.Tensor:
    """``dW[e] = X_e^T dY_e`` for grouped operands ([M, K], [M, N]) as one ``torch._grouped_mm`` call, laid
    out like ``weight`` [E, K, N]: a transposed view of transformers' [E, N, K] tensor (its usual case) is
    computed as ``dY_e^T X_e`` into [E, N, K] and returned transposed, so neither needs a copy. Experts
    without rows get zeros."""
    offsets = expert_offsets.to(torch.int32)  # [E], cumulative row ends
    if weight.stride(1) == 1:  # K contiguous: [E, N, K] storage
        return torch._grouped_mm(dy_grouped.t(), x_grouped, offs=offsets).transpose(1, 2)  # [E, K, N] view
    return torch._grouped_mm(x_grouped.t(), dy_grouped, offs=offsets)  # [E, K, N]
