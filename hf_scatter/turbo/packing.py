"""Packed (unpadded) batches: the real tokens of every sequence back to back, and the way back to padding.

A padded [B, S] batch of requests of lengths 5..500 is half padding; packing drops it, so every GEMM and
norm runs on real tokens only and attention runs per sequence (``cu_seqlens``). Positions and token types
are kept per token exactly as the padded model would see them (BERT's position of a token is its column
in the padded row), so packed outputs at real positions equal the padded model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch


@dataclass
class PackedBatch:
    """Tokens of ``len(lengths)`` sequences back to back ([T] each); ``lengths`` are host ints.

    ``padded_index``: for a batch packed from a padded [B, S] tensor, each token's flat index in B*S
    (``unpack`` puts outputs back there); None for batches packed from request lists. ``first_column_padded``:
    some row of that tensor starts with padding (left padding). ``inputs_embeds``: [T, H] word embeddings
    given by the caller instead of ``input_ids`` (then None). ``key_mask``: [T], 0 at rows that are padding
    (a padded batch run row for row, :func:`padded_rows`: every row attends over its sequence's real keys).
    """

    input_ids: torch.Tensor | None
    position_ids: torch.Tensor
    token_type_ids: torch.Tensor | None
    lengths: list[int]
    padded_shape: tuple[int, int] | None = None
    padded_index: torch.Tensor | None = None
    first_column_padded: bool = False
    inputs_embeds: torch.Tensor | None = None
    key_mask: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tokens(self) -> int:
        return int(self.position_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        return len(self.lengths)

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    def to(self, device: torch.device | str) -> "PackedBatch":
        """The batch with its token tensors on ``device`` (itself if they are there already)."""
        device = torch.device(device)
        if self.device == device:
            return self
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return PackedBatch(move(self.input_ids), move(self.position_ids), move(self.token_type_ids),
                           self.lengths, self.padded_shape, move(self.padded_index), self.first_column_padded,
                           move(self.inputs_embeds), move(self.key_mask))

    def first_token_index(self) -> torch.Tensor:
        """Row of each sequence's first token ([CLS] for BERT) in the packed tensor (0 for empty ones)."""
        if "first" not in self._cache:
            self._cache["first"] = torch.from_numpy(first_token_rows(self.lengths)).to(self.device)
        return self._cache["first"]

    def unpack(self, packed: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[T, ...] packed rows -> [B, S, ...] with ``fill`` at padded positions (zeros by default)."""
        if self.padded_index is None and self.padded_shape is not None:  # run row for row (padded_rows)
            return unpack_padded_rows(packed, self.key_mask, self.padded_shape, fill)
        if self.padded_index is None:
            raise ValueError("unpack: this batch was packed from a list of sequences, not a padded tensor; "
                             "use split() for per-sequence outputs")
        return unpack_rows(packed, self.padded_index, self.padded_shape, fill)

    def split(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """[T, ...] packed rows -> one [length, ...] view per sequence, in order."""
        return list(torch.split(packed[:self.num_tokens], self.lengths))


def unpack_rows(packed: torch.Tensor, index: torch.Tensor, shape: tuple[int, int], fill: float = 0.0) -> torch.Tensor:
    """[T, ...] packed rows -> a new [B, S, ...] tensor with ``fill`` at padded positions (``index``: each row's flat
    position in B*S); one copy where nothing is padded."""
    B, S = shape
    T = index.shape[0]
    if T == B * S:
        return packed[:T].clone().view(B, S, *packed.shape[1:])
    out = packed.new_full((B * S, *packed.shape[1:]), fill)
    return out.index_copy_(0, index, packed[:T]).view(B, S, *packed.shape[1:])


def unpack_padded_rows(rows: torch.Tensor, key_mask: torch.Tensor | None, shape: tuple[int, int],
                       fill: float = 0.0) -> torch.Tensor:
    """[>= B*S, ...] rows of a batch run row for row -> a new [B, S, ...] tensor with ``fill`` where ``key_mask``
    ([B*S]) is 0 (a comparison and a select; a copy without a mask)."""
    B, S = shape
    out = rows[:B * S].view(B, S, *rows.shape[1:])
    if key_mask is None:
        return out.clone()
    keep = key_mask.view(B, S, *([1] * (rows.dim() - 1))) != 0
    return torch.where(keep, out, fill)


def first_token_rows(lengths) -> np.ndarray:
    """int64 row of each sequence's first token in a packed batch; 0 for empty sequences (read, never used)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    return np.where(lengths > 0, starts, 0).astype(np.int64)


def _check_ids(name: str, t, shape=None) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in (torch.int64, torch.int32) or t.dim() != 2:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"pack_padded: {name} must be a [batch, seq] integer tensor, got {got}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"pack_padded: {name} has shape {tuple(t.shape)} but the batch is {tuple(shape)}")


@dataclass(frozen=True)
class PaddedLayout:
    """Where the real tokens of a padded [B, S] batch sit, worked out on the host from its mask (the packed shapes
    need the lengths there anyway): ``lengths`` per row, ``index`` each real token's flat index in B*S (int64, row
    order), ``first_column_padded``: some row starts with padding (left padding)."""

    shape: tuple[int, int]
    lengths: list[int]
    index: np.ndarray
    first_column_padded: bool

    @property
    def num_tokens(self) -> int:
        return len(self.index)


def check_padded(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                 token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                 inputs_embeds: torch.Tensor | None = None) -> tuple[int, int]:
    """``(B, S)`` of a padded HF batch after checking every input's shape (exactly one of ``input_ids`` [B, S] and
    ``inputs_embeds`` [B, S, H] gives the tokens); looks at shapes only, never at values."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pack_padded: pass exactly one of input_ids and inputs_embeds")
    if input_ids is not None:
        _check_ids("input_ids", input_ids)
        B, S = input_ids.shape
    elif not isinstance(inputs_embeds, torch.Tensor) or inputs_embeds.dim() != 3:
        got = tuple(inputs_embeds.shape) if isinstance(inputs_embeds, torch.Tensor) else type(inputs_embeds).__name__
        raise ValueError(f"pack_padded: inputs_embeds must be a [batch, seq, hidden] tensor, got {got}")
    else:
        B, S = inputs_embeds.shape[:2]
    if token_type_ids is not None:
        _check_ids("token_type_ids", token_type_ids, (B, S))
    if position_ids is not None:
        _check_ids("position_ids", positions_of(position_ids, B, S), (B, S))
    if attention_mask is not None and (not isinstance(attention_mask, torch.Tensor)
                                       or tuple(attention_mask.shape) != (B, S)):
        got = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask)
        raise ValueError(f"pack_padded: attention_mask must be a [batch, seq] = {(B, S)} tensor of 0/1, got {got} "
                         "(4-D or float masks: pass the 2-D padding mask)")
    return B, S


def padded_layout(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                  token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                  inputs_embeds: torch.Tensor | None = None) -> PaddedLayout:
    """The :class:`PaddedLayout` of a padded HF batch (tokens with ``attention_mask`` 1, in row order: left, right or
    any padding), after :func:`check_padded`. Costs one device-to-host copy of the mask."""
    return mask_layout(attention_mask, check_padded(input_ids, attention_mask, token_type_ids, position_ids,
                                                    inputs_embeds))


def mask_layout(attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> PaddedLayout:
    """:func:`padded_layout` of a batch of ``shape`` (B, S) whose inputs :func:`check_padded` already passed."""
    B, S = shape
    if attention_mask is None:
        return PaddedLayout((B, S), [S] * B, np.arange(B * S, dtype=np.int64), False)
    keep = attention_mask.detach().cpu().numpy() != 0
    return PaddedLayout((B, S), keep.sum(1).tolist(), np.flatnonzero(keep), bool(B and S and not keep[:, 0].all()))


def key_mask_of(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
    """A [B, S] padding mask as the [B*S] key mask of a batch run row for row (integers and bools as they are:
    the kernels test != 0; other dtypes compared with 0 here)."""
    if attention_mask is None:
        return None
    mask = attention_mask.reshape(-1)
    return mask if not mask.is_floating_point() and not mask.is_complex() else mask != 0


def padded_rows(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> PackedBatch:
    """A padded [B, S] batch as B sequences of S rows, padding included, with its mask as the key mask: every
    position computes what the padded model computes there, and nothing on the host reads the mask (no
    device-to-host wait, unlike :func:`pack_padded`); the price is the padded rows' work. ``unpack`` returns
    zeros at padded positions, like packed batches."""
    B, S = check_padded(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
    device = (input_ids if input_ids is not None else inputs_embeds).device
    positions = (torch.arange(S, device=device).repeat(B) if position_ids is None
                 else positions_of(position_ids, B, S).reshape(-1))
    types = None if token_type_ids is None else token_type_ids.reshape(-1)
    ids = None if input_ids is None else input_ids.reshape(-1)
    embeds = None if inputs_embeds is None else inputs_embeds.reshape(B * S, -1)
    return PackedBatch(ids, positions, types, [S] * B, (B, S), inputs_embeds=embeds,
                       key_mask=key_mask_of(attention_mask))


def positions_of(position_ids: torch.Tensor, B: int, S: int) -> torch.Tensor:
    """``position_ids`` as [B, S] (HF callers also pass one row [1, S] for the whole batch)."""
    if isinstance(position_ids, torch.Tensor) and position_ids.dim() == 2 and position_ids.shape[0] == 1:
        return position_ids.expand(B, S)
    return position_ids


def pack_padded(input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> PackedBatch:
    """Pack a padded HF batch: its :func:`padded_layout`, then :func:`pack_with_layout`."""
    layout = padded_layout(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds)
    return pack_with_layout(layout, input_ids, token_type_ids, position_ids, inputs_embeds)


def pack_with_layout(layout: PaddedLayout, input_ids: torch.Tensor | None, token_type_ids: torch.Tensor | None = None,
                     position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> PackedBatch:
    """The packed tensors of a checked padded batch on its device: the layout goes there as one index, the tokens,
    positions and types are gathered with it (a token's default position is its padded column)."""
    (B, S), tokens = layout.shape, (input_ids if input_ids is not None else inputs_embeds)
    index = torch.from_numpy(layout.index).to(tokens.device)
    positions = index % S if position_ids is None else positions_of(position_ids, B, S).reshape(-1)[index]
    types = None if token_type_ids is None else token_type_ids.reshape(-1)[index]
    ids = None if input_ids is None else input_ids.reshape(-1)[index]
    embeds = None if inputs_embeds is None else inputs_embeds.reshape(B * S, -1)[index]
    return PackedBatch(ids, positions, types, layout.lengths, (B, S), index, layout.first_column_padded, embeds)


def pack_sequences(sequences: Sequence, device: torch.device | str = "cpu",
                   token_type_ids: Sequence | None = None) -> PackedBatch:
    """Pack a list of token-id sequences (lists, arrays or 1-D tensors); positions count from 0 in each."""
    if not isinstance(sequences, (list, tuple)):
        raise ValueError(f"pack_sequences: expected a list of token-id sequences, got {type(sequences).__name__}")
    arrays = [np.asarray(s.cpu() if isinstance(s, torch.Tensor) else s, dtype=np.int64).reshape(-1) for s in sequences]
    lengths = [len(a) for a in arrays]
    ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    positions = np.concatenate([np.arange(n) for n in lengths]) if arrays else np.zeros(0, np.int64)
    types = None
    if token_type_ids is not None:
        type_arrays = [np.asarray(t, dtype=np.int64).reshape(-1) for t in token_type_ids]
        if [len(t) for t in type_arrays] != lengths:
            raise ValueError("pack_sequences: token_type_ids must have one entry per token of each sequence")
        types = torch.from_numpy(np.concatenate(type_arrays) if type_arrays else ids[:0]).to(device)
    return PackedBatch(torch.from_numpy(ids).to(device), torch.from_numpy(positions).to(device), types, lengths)
