"""Which bytes of an HF checkpoint are which bytes of the hf-scatter layout.

The hf-scatter layout is the model's own ``state_dict``: expert weights stacked per layer exactly as the
patched modules hold them (Mixtral / Qwen3-MoE ``gate_up_proj`` [E, 2I, H] with [gate; up] rows and
``down_proj`` [E, H, I]; DBRX ``w1``/``v1``/``w2`` [E*I, H]). The kernels read those in place as
K-contiguous [E, d_in, d_out] views, so loading is a plain copy per tensor and needs no per-expert stacking.

The HF side is either the same names (``fused``: a raw ``state_dict`` dump, or a family whose hub files are
already stacked) or the hub naming (``hub``): what transformers' ``save_pretrained`` writes, one tensor per
expert and projection for Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek. The hub naming is not ours to define:
transformers' own checkpoint conversion mapping (the one it applies at every load) is run backwards on a
*provenance* state dict, whose entries hold row numbers instead of weights, so whatever that mapping does
to a family we learn as a list of :class:`Link` (a contiguous run of elements on each side). The forward
conversion gathers the HF pieces into stacked tensors, the reverse one cuts the same pieces back out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

FORMAT_VERSION = 1
CONFIG_KEY = "hf_scatter"  # config.json entry that marks a converted checkpoint

HUB = "hub"  # transformers' checkpoint naming: what save_pretrained writes and the hub publishes
FUSED = "fused"  # the model's own parameter names (transformers 5's in-memory layout)
# names recorded in the config of checkpoints converted before the hub naming was read from transformers
_LEGACY_NAMES = {"per_expert": HUB, "dbrx": FUSED}
_EXPERT_KEY = re.compile(r"\.experts\.(\d+)\.")
# config.json's expert count, by the name each family gives it
EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class Link:
    """``count`` elements at ``hf_offset`` of ``hf_key`` are the ones at ``scatter_offset`` of
    ``scatter_key`` (offsets in elements of the row-major tensors)."""

    hf_key: str
    hf_offset: int
    scatter_key: str
    scatter_offset: int
    count: int


@dataclass
class Correspondence:
    hf_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    scatter_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    links: list[Link] = field(default_factory=list)
    optional: set[str] = field(default_factory=set)  # tied weights that checkpoints may leave out

    def whole(self, scatter_key: str, shape: tuple[int, ...], hf_key: str | None = None) -> None:
        """A tensor that is the same on both sides, possibly under another name."""
        hf_key = hf_key or scatter_key
        self.hf_shapes[hf_key] = self.scatter_shapes[scatter_key] = shape
        self.links.append(Link(hf_key, 0, scatter_key, 0, math.prod(shape)))


def meta_model(config) -> torch.nn.Module:
    """The model of ``config`` on the meta device: its parameter names and shapes, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Shapes of every tensor in the model's ``state_dict``, and the names of tied duplicates."""
    shapes, seen, tied = {}, set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(tensor.shape)
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    return shapes, tied


def scheme_name(name: str) -> str:
    """``name`` as the converter calls it today (older conversions recorded ``per_expert`` / ``dbrx``)."""
    return _LEGACY_NAMES.get(name, name)


def hub_correspondence(model: torch.nn.Module, shapes: dict[str, tuple[int, ...]]) -> Correspondence | None:
    """The links between transformers' checkpoint naming and the (meta) model's own, or None where the two
    are the same tensors under the same names (no conversion mapping applies to the family)."""
    from transformers.core_model_loading import revert_weight_conversion

    # Provenance: one number per row (every dimension but the last) of every tensor, so a mapping that
    # splits, chunks or renames shows where each row lands. The last dimension is never rearranged by
    # the mappings we accept (checked against the real shapes below); it holds the row number twice, as
    # a last dimension of 1 may be squeezed away (transformers 5.17's expert split does).
    keys = list(shapes)
    rows = [math.prod(shapes[k][:-1]) if shapes[k] else 1 for k in keys]
    firsts = torch.tensor([0, *rows]).cumsum(0)
    dtype = torch.int32 if int(firsts[-1]) < 2**31 else torch.int64
    provenance = {k: torch.arange(int(firsts[i]), int(firsts[i + 1]), dtype=dtype).view(*shapes[k][:-1], 1)
                  .expand(*shapes[k][:-1], 2) for i, k in enumerate(keys)}
    reverted = revert_weight_conversion(model, provenance)
    real = revert_weight_conversion(model, {k: torch.empty(shapes[k], device="meta") for k in keys})
    if set(reverted) == set(keys) and all(torch.equal(reverted[k], provenance[k]) for k in keys):
        return None
    c = Correspondence(scatter_shapes=dict(shapes))
    for hf_key, rows_of in reverted.items():
        intact = rows_of.shape[-1:] == (2,) and torch.equal(rows_of[..., 0], rows_of[..., 1])
        ids = rows_of[..., 0].reshape(-1).long()
        owner = torch.searchsorted(firsts[1:], ids, right=True)  # which tensor each row comes from
        cols = {shapes[keys[i]][-1] if shapes[keys[i]] else 1 for i in owner.unique().tolist()}
        shape = (*rows_of.shape[:-1], *cols) if len(cols) == 1 and intact else None
        if shape is None or hf_key not in real or tuple(real[hf_key].shape) != shape:
            raise ValueError(f"transformers' checkpoint mapping for {model.config.model_type} rearranges the last "
                             f"dimension of {hf_key!r}: the converter cannot express it; convert with "
                             f"transformers (from_pretrained, save_pretrained) instead")
        (width,) = cols
        c.hf_shapes[hf_key] = shape
        # runs of consecutive rows of one tensor are one link each
        breaks = torch.nonzero((ids[1:] != ids[:-1] + 1) | (owner[1:] != owner[:-1])).view(-1) + 1
        starts = [0, *breaks.tolist()]
        for start, end in zip(starts, [*starts[1:], len(ids)]):
            i = int(owner[start])
            c.links.append(Link(hf_key, start * width, keys[i], (int(ids[start]) - int(firsts[i])) * width,
                                (end - start) * width))
    return c


def fused_correspondence(shapes: dict[str, tuple[int, ...]]) -> Correspondence:
    c = Correspondence()
    for key, shape in shapes.items():
        c.whole(key, shape)
    return c


def correspondences(config) -> dict[str, Correspondence]:
    """Every HF naming a checkpoint of ``config``'s family can have, linked to the hf-scatter layout; the
    first is the one ``save_pretrained`` writes."""
    model = meta_model(config)
    shapes, tied = model_tensors(model)
    hub = hub_correspondence(model, shapes)
    found = {FUSED: fused_correspondence(shapes)} if hub is None else {HUB: hub, FUSED: fused_correspondence(shapes)}
    for c in found.values():  # tied duplicates, under either name, may be left out of a checkpoint
        c.optional = tied | {link.hf_key for link in c.links if link.scatter_key in tied}
    return found


def detect_scheme(found: dict[str, Correspondence], keys: set[str]) -> str:
    """Which HF naming a checkpoint's keys follow: the one that names more of them (fused on a tie)."""
    return max(reversed(list(found)), key=lambda scheme: len(keys & set(found[scheme].hf_shapes)))


def expert_index(key: str) -> int | None:
    """The expert number in a per-expert key, for expert-count errors."""
    m = _EXPERT_KEY.search(key)
    return int(m.group(1)) if m else None
