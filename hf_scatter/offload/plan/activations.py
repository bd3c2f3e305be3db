"""Device memory of the offloaded pipeline's activations: one model for the planner, which reserves it, and the
runtime, which sizes its buffers and prefill chunks by it.

With two models of the same memory, a plan that filled the GPU with weights by the planner's model left the
runtime too little for the prefill chunks the planner had priced: the runtime halved them, and the prefill ran
slower than predicted. Every function takes the model's shapes (a :class:`~..families.spec.ModelSpec`) and the
bytes per activation element ``b``.
"""

from __future__ import annotations

import math

from ..families.spec import ModelSpec
from .attention_buckets import SLACK

PREFILL_CHUNK_TOKENS = 4096  # prompt tokens per prefill kernel call at most
MIN_CHUNK_TOKENS = 64
HEAD_ROWS = 64  # rows through the LM head and sampling at a time: bounds the [rows, vocab] fp32 temporaries
# A prefill chunk's stage temporaries take at most 1 / PREFILL_ROOM of the activation memory; the rest holds the
# prompt tokens of a group, and every group streams the weights once more.
PREFILL_ROOM = 4
# the prefill chunks the runtime chooses among, the largest first
CHUNK_CHOICES = tuple(c for c in (PREFILL_CHUNK_TOKENS >> i for i in range(7)) if c >= MIN_CHUNK_TOKENS)


def stage_bytes(d: ModelSpec, tokens: int, b: int) -> int:
    """Transient device memory of ``tokens`` rows through one stage (upper bound: every temporary of the
    largest step counted as live at once; prompt attention's padded copies of the QKV and of its output
    at their most, 1 + SLACK times the tokens)."""
    padded = math.ceil(tokens * (1 + SLACK)) * b * (d.qkv_dim + d.q_dim)
    pre = tokens * b * (d.hidden + d.qkv_dim + 3 * (d.q_dim + d.kv_dim) + d.q_dim + 2 * d.kv_dim) + padded
    experts = tokens * (3 * d.ffn_width + d.top_k * d.hidden) * b + tokens * d.top_k * 32
    post = tokens * b * 5 * d.hidden + tokens * d.experts * 16 + experts
    return max(pre, post)


def head_bytes(d: ModelSpec, tokens: int, b: int) -> int:
    """One slice of at most HEAD_ROWS rows through the LM head and sampling: logits, their fp32 copy, top-p's
    sorted values and indices, ..."""
    return min(tokens, HEAD_ROWS) * d.vocab * (b + 32)


def workspace_bytes(d: ModelSpec, tokens: int, b: int) -> int:
    """Transient device memory of ``tokens`` rows through one stage, plus one slice of the LM head."""
    return stage_bytes(d, tokens, b) + head_bytes(d, tokens, b)


def row_bytes(d: ModelSpec, b: int) -> int:
    """Device memory a row (a request in decode, a prompt token in prefill) holds across stages."""
    return (d.hidden + d.q_dim + 2 * d.head_dim) * b + 16


def decode_bytes(d: ModelSpec, batch: int, micro: int, b: int) -> int:
    """Decoding ``batch`` requests in micro-batches of ``micro``."""
    return batch * row_bytes(d, b) + workspace_bytes(d, micro, b)


def graph_bytes(d: ModelSpec, batch: int, micro: int, b: int) -> int:
    """Device memory decode's CUDA graphs hold for the whole run: one stage's temporaries in their pool, and
    every row's QKV buffer."""
    return stage_bytes(d, micro, b) + batch * d.qkv_dim * b


def prefill_bytes(d: ModelSpec, batch: int, chunk: int, group: int, b: int) -> int:
    """A group of ``group`` prompt tokens in chunks of at most ``chunk``, with the batch's decode buffers."""
    return group * row_bytes(d, b) + workspace_bytes(d, chunk, b) + batch * (d.q_dim * b + 16)


def prefill_chunk(tokens: float, limit: int = PREFILL_CHUNK_TOKENS) -> int:
    """The chunk a batch of ``tokens`` prompt tokens needs: the smallest power of two of :func:`chunk_tokens`'s
    choices that takes them in one call, at most ``limit``."""
    chunk = max(MIN_CHUNK_TOKENS, 1 << max(0, math.ceil(math.log2(max(tokens, 1)))))
    return min(chunk, limit)


def prefill_room(d: ModelSpec, batch: int, chunk: int, b: int) -> int:
    """The least activation memory in which :func:`chunk_tokens` picks prefill chunks of at least ``chunk``
    tokens (a power of two) for ``batch`` requests: what a plan that prices such chunks must leave (the smallest
    chunk is taken wherever it fits at all)."""
    if chunk <= MIN_CHUNK_TOKENS:
        return prefill_bytes(d, batch, chunk, chunk, b)
    return max(prefill_bytes(d, batch, chunk, chunk, b), _roomy_bytes(d, chunk, b))


def _roomy_bytes(d: ModelSpec, chunk: int, b: int) -> int:
    """Activation memory in which ``chunk``'s stage temporaries take 1 / PREFILL_ROOM of it, besides the LM
    head's slice (the same for every chunk size)."""
    return PREFILL_ROOM * stage_bytes(d, chunk, b) + head_bytes(d, chunk, b)


def chunk_tokens(d: ModelSpec, batch: int, available: int, b: int) -> int:
    """Prefill chunk size in ``available`` bytes of activation memory: the largest power of two up to
    PREFILL_CHUNK_TOKENS whose stage temporaries take at most 1 / PREFILL_ROOM of it, else the largest that fits
    at all (0: none). The LM head's slice is the same for every chunk size, so it does not count against that
    share: with a 152k vocabulary (Qwen3) it alone took it and left 256-token chunks, whose per-chunk host cost
    made the prefill 40x slower than the planner's 4096-token chunks (H100, 24 Qwen3-30B-A3B layers)."""
    fits = [c for c in CHUNK_CHOICES if prefill_bytes(d, batch, c, c, b) <= available]
    roomy = [c for c in fits if _roomy_bytes(d, c, b) <= available]
    return (roomy or fits or [0])[0]
