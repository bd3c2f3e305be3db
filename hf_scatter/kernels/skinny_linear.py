"""``skinny_linear``: ``act(x @ W^T + b)`` for at most 64 rows (one short request through an encoder), in one launch.

At 40 tokens BERT-base's four projections take cuBLAS 4 to 8 us each on an H200 (a split-K GEMM and a separate
reduce for the deep one), against 1 to 3 us of reading the weight once. Here the weight streams through every SM:
a program owns BLOCK_N output columns and one range of K; with K split, the last program of a column tile to
arrive (an arrival counter it resets to zero) sums the float32 partials in a fixed order and applies the bias and
the activation, rounding once. One launch, no memset, the same bits whichever program arrives last.

The partials and counters belong to a :class:`SkinnyWorkspace` that one caller keeps across calls and CUDA-graph
replays (the packed BERT runtime, whose graphs run one at a time); calls sharing a workspace must not overlap.
Without a workspace K is not split. Half precision only: the float32 reference (``skinny_linear_reference``)
runs everything else, and is what the tests compare against.
"""

from __future__ import annotations

from typing import Optional

import torch

from .backend import cdiv, kernels_enabled, multiprocessors, next_power_of_2, triton_interpreted, triton_runs
from .checks import check_like, check_out, fail
from .custom_ops import mutating_op, run_op
from .dependent_launch import dependent_launch

MAX_ROWS = 64  # one tile of rows; more rows are a GEMM cuBLAS runs at full speed
ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_tanh": 2}  # GELU's erf form and its tanh form
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
BLOCK_N, BLOCK_K = 32, 128  # measured on an H200 at BERT-base's projections (scripts/probes/probe_skinny_linear.py)
K_PER_PROGRAM = 768  # K is split until each program sums at most this much of it (fewer SMs idle, short tails)

if kernels_enabled():
    import triton
    import triton.language as tl

    from .dependent_launch import wait_for_predecessor

    @triton.jit
    def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K,
                              stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on, K_PER_SPLIT,
                              SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              USE_PDL: tl.constexpr = False):
        wait_for_predecessor(USE_PDL)  # a dependent launch waits for the kernel before
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        k_start = pid_k * K_PER_SPLIT
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_step in range(0, K_PER_SPLIT, BLOCK_K):
            k = k_start + k_step + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
                        mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)  # [BLOCK_M, BLOCK_K]
            w = tl.load(w_ptr + rn[:, None] * stride_wn + k[None, :] * stride_wk,
                        mask=(rn[:, None] < N) & (k[None, :] < K), other=0.0)  # [BLOCK_N, BLOCK_K]
            acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32)
        tile = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # offsets in a partial
        last = True
        if SPLIT > 1:
            tl.store(part_ptr + (pid_n * SPLIT + pid_k) * BLOCK_M * BLOCK_N + tile, acc)
            tl.debug_barrier()  # every thread's partial is written before the arrival is published
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
            last = arrived == SPLIT - 1
        if last:
            if SPLIT > 1:
                tl.debug_barrier()
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT):  # a fixed order: the same sum whichever program arrives last
                    acc += tl.load(part_ptr + (pid_n * SPLIT + s) * BLOCK_M * BLOCK_N + tile, cache_modifier=".cg")
                tl.atomic_xchg(count_ptr + pid_n, 0)  # ready for the next call (and the next graph replay)
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            if ACT == 1:
                acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
            elif ACT == 2:
                inner = 0.7978845608028654 * (acc + 0.044715 * acc * acc * acc)
                acc = acc * tl.sigmoid(2.0 * inner)  # 0.5 * (1 + tanh(u)) = sigmoid(2u)
            tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on,
                     acc.to(out_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


class SkinnyWorkspace:
    """Split-K partial sums and arrival counters of :func:`skinny_linear`, made on first use per tile layout and
    kept by one caller (the counters start at zero and every call leaves them so). Made during a CUDA-graph
    capture they would belong to the graph's pool: then K is not split instead."""

    def __init__(self):
        self._buffers: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def buffers(self, device: torch.device, tiles: int, split: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        key = (device, tiles, split, block_m)
        if key not in self._buffers:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None
            self._buffers[key] = (torch.empty(tiles * split * block_m * BLOCK_N, dtype=torch.float32, device=device),
                                  torch.zeros(tiles, dtype=torch.int32, device=device))
        return self._buffers[key]


def runs_skinny(x: torch.Tensor) -> bool:
    """Whether ``x`` [M, K] is a call for the kernel: at most MAX_ROWS rows of half precision on a GPU."""
    return x.is_cuda and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype in KERNEL_DTYPES


def skinny_plan(M: int, N: int, K: int, multiprocessors: int) -> tuple[int, int, int, int]:
    """``(BLOCK_M, column tiles, split, K per split)``: K split so that each program sums at most K_PER_PROGRAM of
    it, and so that the programs do not outnumber the multiprocessors by much."""
    block_m = max(16, next_power_of_2(M))
    tiles = cdiv(N, BLOCK_N)
    k_tiles = cdiv(K, BLOCK_K)
    split = max(1, min(k_tiles, cdiv(K, K_PER_PROGRAM), round(multiprocessors / tiles)))
    k_per_split = cdiv(k_tiles, split) * BLOCK_K
    return block_m, tiles, cdiv(K, k_per_split), k_per_split


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a few programs per tile are enough to split K in the tests
    return multiprocessors(device.index or 0)


# ------------------------------------------------------------------------------------------ reference
def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            activation: str) -> torch.Tensor:
    """``act(x @ W^T + b)`` in float32 (float64 for float64 inputs), rounded once to x's dtype."""
    acc = torch.promote_types(x.dtype, torch.float32)
    y = x.to(acc) @ weight.to(acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    if activation != "none":
        y = torch.nn.functional.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")
    return y.to(x.dtype)


# ------------------------------------------------------------------------------------------------ op
def _skinny_linear_impl(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], act: int,
                        out: torch.Tensor, partials: Optional[torch.Tensor], counters: Optional[torch.Tensor]) -> None:
    activation = next(name for name, code in ACTIVATIONS.items() if code == act)
    if x.dtype not in KERNEL_DTYPES or not triton_runs(x, "skinny_linear"):
        out.copy_(skinny_linear_reference(x, weight, bias, activation))
        return
    M, K = x.shape
    N = weight.shape[0]
    block_m, tiles, split, k_per_split = skinny_plan(M, N, K, _multiprocessors(x.device))
    if partials is None:  # no workspace: one program per tile sums all of K
        split, k_per_split = 1, cdiv(K, BLOCK_K) * BLOCK_K
    _skinny_linear_kernel[(tiles, split)](
        x, weight, out if bias is None else bias, out, out if partials is None else partials,
        out if counters is None else counters, M, N, K, x.stride(0), x.stride(1), weight.stride(0),
        weight.stride(1), out.stride(0), out.stride(1), k_per_split, SPLIT=split, HAS_BIAS=bias is not None,
        ACT=act, BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
        **({} if triton_interpreted() else {"num_stages": 3}), **dependent_launch(x))


_skinny_linear_op = mutating_op("skinny_linear", "out", "partials", "counters")(_skinny_linear_impl)


# ---------------------------------------------------------------------------------------- public call
def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none",
                  *, out: torch.Tensor | None = None, workspace: SkinnyWorkspace | None = None) -> torch.Tensor:
    """``act(x @ weight^T + bias)`` for ``x`` [M, K] with 1 <= M <= 64, ``weight`` [N, K] (nn.Linear's layout),
    ``bias`` [N]; ``activation`` "none", "gelu" (erf form) or "gelu_tanh". Written into ``out`` [M, N] if given.
    ``workspace``: lets deep K split over more programs (see :class:`SkinnyWorkspace`)."""
    op = "skinny_linear"
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            fail(op, f"{name} must be a 2-D tensor, got {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
    M, K = x.shape
    if not 1 <= M <= MAX_ROWS:
        fail(op, f"x has {M} rows; the kernel takes 1 to {MAX_ROWS} (use torch.nn.functional.linear for more)")
    if weight.shape[1] != K:
        fail(op, f"weight is {tuple(weight.shape)} but x has {K} columns; weight must be [out_features, {K}]")
    check_like(op, "weight", weight, x)
    N = weight.shape[0]
    if bias is not None:
        check_like(op, "bias", bias, x)
        if tuple(bias.shape) != (N,):
            fail(op, f"bias must be [{N}], got {tuple(bias.shape)}")
    if activation not in ACTIVATIONS:
        fail(op, f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")
    if out is None:
        out = x.new_empty((M, N))
    else:
        check_out(op, out, (M, N), x)
    buffers = None
    if workspace is not None and x.dtype in KERNEL_DTYPES:
        block_m, tiles, split, _ = skinny_plan(M, N, K, _multiprocessors(x.device))
        buffers = workspace.buffers(x.device, tiles, split, block_m) if split > 1 else None
    partials, counters = buffers or (None, None)
    run_op(_skinny_linear_op, _skinny_linear_impl, x, weight, bias, ACTIVATIONS[activation], out, partials, counters)
    return out
