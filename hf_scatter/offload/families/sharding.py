"""One process's share of a tensor-parallel group (MoE-Lightning, sec. 5; Megatron-LM's split of a layer).

Each of ``size`` processes drives one GPU and holds ``1/size`` of every projection: the attention by heads
(its query, key and value rows, and the output projection's matching input columns), each expert by its
intermediate columns (the adapters' column layout, so a rank's share is itself a smaller set of experts), a
shared expert and a dense MLP likewise. Multi-head latent attention splits its queries by heads and keeps the
latent whole on every rank (each rank caches all of it). The hidden states stay whole on every rank; the two
projections that end a block (attention's output, the MLP's down projection) give partial sums, which
:meth:`Shard.reduce` all-reduces. A bias added after such a sum is rank 0's; the other ranks hold zeros in its
place, so it is added once and every rank's shard has the same tensors and bytes. Norms, routers and the
embedding and head are small and stay whole on every rank, except q/k norms that span every head (OLMoE's),
split like the heads.

Every rank then runs the same program on the same hidden states: an all-reduce leaves bit-identical sums on
every rank (NCCL and gloo reduce each element once and share the result), so every rank's router picks the
same experts and every rank's head the same tokens. The same program also needs the same plan (batch,
resident fraction, prefill chunks and groups: each sets how many all-reduces run), which equal shards give and
``offload`` checks: a rank planning otherwise would wait forever in an all-reduce the others never issue.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .rows import Rows

# How each named tensor of a layer splits. The queries, keys and values (a [q; k; v] stack) split by heads;
# the output projection (by heads) and the shared expert's down projection by their input columns; the shared
# expert's [gate; up] by its intermediate rows; these biases are added to a partial sum, so once: rank 0's,
# zeros on the others.
SPLIT_QKV = frozenset({"qkv", "qkv_bias"})
SPLIT_INPUT_COLUMNS = frozenset({"o", "shared_down", "dense_down"})
SPLIT_GATE_UP_ROWS = frozenset({"shared_gate_up", "shared_gate_up_bias", "dense_gate_up", "dense_gate_up_bias"})
ON_RANK_ZERO = frozenset({"o_bias", "down_bias", "shared_down_bias", "dense_down_bias"})
# Multi-head latent attention (DeepSeek): the query projection's rows and the key / value halves of kv_b_proj
# ([heads, ., latent]) split by heads; the latent (kv_a, its norm) and the query's low-rank input are every
# head's, so whole on every rank, each rank caching the whole latent
SPLIT_HEAD_ROWS = frozenset({"q", "q_b", "w_uk", "w_uv"})
# whole on every rank: norms, routers, the shared expert's gate ([1, H]), MLA's latent and low-rank query input
REPLICATED = frozenset({"norm", "post_norm", "router", "router_bias", "shared_gate", "score_bias",
                        "q_a", "q_a_bias", "q_a_norm", "kv_a", "kv_a_bias", "kv_a_norm"})
# q/k norms: whole where they are per head (head_dim wide, Qwen3); split like the heads where they span the whole
# projection (OLMoE), the family then summing their squares over the group (``Shard.reduce``)
QK_NORMS = frozenset({"q_norm", "k_norm"})


def indivisible(spec, gpus: int) -> list[str]:
    """The counts of ``spec`` (a :class:`~.spec.ModelSpec`) that ``gpus`` ranks cannot split evenly, as "8 KV
    heads": query heads, KV heads (not MLA's one latent head, every rank's), expert columns, shared expert and
    dense MLP columns. The runtime and the planner refuse the same models with it."""
    parts = {"query heads": spec.heads, "KV heads": spec.kv_heads, "expert columns": spec.intermediate}
    if spec.is_mla:  # its one latent head is every rank's
        del parts["KV heads"]
    if spec.shared_intermediate:
        parts["shared expert columns"] = spec.shared_intermediate
    if spec.dense_layers:
        parts["dense MLP columns"] = spec.dense_intermediate
    if spec.expert_format == "mxfp4":  # a rank's columns are whole groups of 32 under one scale
        parts["groups of 32 expert columns (MXFP4)"] = spec.intermediate // 32
    return [f"{count} {what}" for what, count in parts.items() if count % gpus]


@dataclass(frozen=True)
class Shard:
    """This process's part of a tensor-parallel group: ``rank`` of ``size``, all-reducing over ``group`` (a
    ``torch.distributed`` process group; None for the whole model on one process)."""

    rank: int = 0
    size: int = 1
    group: object = None

    @classmethod
    def of(cls, group) -> "Shard":
        """The calling process's shard of ``group`` (None: no tensor parallelism)."""
        if group is None:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("group= names a torch.distributed process group, but torch.distributed is not "
                             "initialized: launch with torchrun and call dist.init_process_group first")
        return cls(dist.get_rank(group), dist.get_world_size(group), group)

    @property
    def whole(self) -> bool:
        return self.size == 1

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``partial`` (in place; one all-reduce on the current stream)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(partial, group=self.group)
        return partial

    # ----- shapes -----
    def check(self, dims, model_type: str) -> None:
        """Refuses, naming the count, a model whose counts :func:`indivisible` lists."""
        if self.whole:
            return
        odd = indivisible(dims, self.size)
        if odd:
            raise ValueError(f"tensor parallelism over {self.size} GPUs splits the heads and the experts' columns, "
                             f"but this {model_type} model has {', '.join(odd)}: use a GPU count that divides them")

    def dims(self, dims):
        """``dims`` as one rank sees them: its heads, KV heads (MLA's latent head whole) and MLP columns; the
        hidden size whole."""
        if self.whole:
            return dims
        n = self.size
        return dataclasses.replace(dims, heads=dims.heads // n,
                                   kv_heads=dims.kv_heads if dims.is_mla else dims.kv_heads // n,
                                   intermediate=dims.intermediate // n,
                                   shared_intermediate=dims.shared_intermediate // n,
                                   dense_intermediate=dims.dense_intermediate // n)

    # ----- weights -----
    def layer_tensors(self, tensors: dict, full_dims) -> dict:
        """This rank's share of a layer's dense tensors (pre- or post-attention), by name (see the tables
        above); a name the tables do not list is refused rather than guessed."""
        if self.whole:
            return tensors
        out = {}
        for name, t in tensors.items():
            if name in ON_RANK_ZERO:
                out[name] = t if self.rank == 0 else torch.zeros_like(t)
            elif name in SPLIT_QKV:
                out[name] = self._qkv(t, full_dims)
            elif name in SPLIT_INPUT_COLUMNS:
                out[name] = self._slice(t, 1)
            elif name in SPLIT_GATE_UP_ROWS:
                out[name] = Rows(*(self._slice(p, 0) for p in t.parts))
            elif name in SPLIT_HEAD_ROWS:  # [heads * rows, .] or [heads, ...]: head-major either way
                out[name] = self._slice(t, 0)
            elif name in REPLICATED:
                out[name] = t
            elif name in QK_NORMS:
                out[name] = t if t.shape[-1] == full_dims.head_dim else self._slice(t, 0)
            else:
                raise NotImplementedError(f"tensor parallelism does not know how to split the layer tensor {name!r}")
        return out

    def expert_tensors(self, tensors: dict, column_dims: dict[str, int]) -> dict:
        """This rank's intermediate columns of every expert (``column_dims``: each tensor's column axis)."""
        if self.whole:
            return tensors
        return {name: self._slice(t, column_dims[name]) for name, t in tensors.items()}

    def heads(self, per_head: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's entries of a per-query-head tensor (GPT-OSS's sinks)."""
        return per_head if per_head is None or self.whole else self._slice(per_head, 0).contiguous()

    def _slice(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        width = t.shape[dim] // self.size
        return t.narrow(dim, self.rank * width, width)

    def _qkv(self, t, full_dims):
        """Rank's heads of a [q; k; v] stack: a :class:`Rows` of parts, or one fused tensor (DBRX's Wqkv)."""
        parts = t.parts if isinstance(t, Rows) else t.split([full_dims.q_dim, full_dims.kv_dim, full_dims.kv_dim])
        return Rows(*(self._slice(p, 0) for p in parts))
