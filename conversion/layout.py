"""Which bytes of an HF checkpoint are which bytes of the hf-scatter layout.

The hf-scatter layout is the model's own ``state_dict``: expert weights stacked per layer exactly as the
patched modules hold them (Mixtral ``gate_up_proj`` [E, 2I, H] with [gate; up] rows and ``down_proj``
[E, H, I]; DBRX ``w1``/``v1``/``w2`` [E*I, H]). The kernels read those in place as K-contiguous
[E, d_in, d_out] views, so loading is a plain copy per tensor and needs no per-expert stacking.

One list of :class:`Link` (a contiguous run of elements on each side) describes a checkpoint scheme in
both directions: the forward conversion gathers HF pieces into stacked tensors, the reverse one cuts the
same pieces back out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import torch

FORMAT_VERSION = 1
CONFIG_KEY = "hf_scatter"  # config.json entry that marks a converted checkpoint

# Mixtral as published on the hub (transformers stacks these at load and splits them again on save)
PER_EXPERT = "per_expert"
# Mixtral with transformers 5's in-memory names (a raw state_dict dump)
FUSED = "fused"
# DBRX: already stacked per layer on disk
DBRX_NATIVE = "dbrx"

SCHEMES = {"mixtral": (PER_EXPERT, FUSED), "dbrx": (DBRX_NATIVE,)}

_MIXTRAL_EXPERT = re.compile(r"^(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")


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


def model_tensors(config) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """Shapes of every tensor in the model's ``state_dict`` (built on the meta device: no memory), and
    the names of tied duplicates."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    shapes, seen, tied = {}, set(), set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        shapes[name] = tuple(tensor.shape)
        if id(tensor) in seen:
            tied.add(name)
        seen.add(id(tensor))
    return shapes, tied


def _mixtral_expert_key(scatter_key: str) -> tuple[str, str] | None:
    """``model.layers.3.mlp.experts.gate_up_proj`` -> (``model.layers.3``, ``gate_up_proj``)."""
    m = re.match(r"^(.*)\.mlp\.experts\.(gate_up_proj|down_proj)$", scatter_key)
    return (m.group(1), m.group(2)) if m else None


def _mixtral_per_expert(shapes: dict[str, tuple[int, ...]]) -> Correspondence:
    c = Correspondence()
    for key, shape in shapes.items():
        expert = _mixtral_expert_key(key)
        if expert is None:
            c.whole(key, shape, hf_key=re.sub(r"\.mlp\.gate\.", ".block_sparse_moe.gate.", key))
            continue
        layer, proj = expert
        c.scatter_shapes[key] = shape
        num_experts, rows, cols = shape
        names = ("w1", "w3") if proj == "gate_up_proj" else ("w2",)
        part_rows = rows // len(names)
        for e in range(num_experts):
            for j, w in enumerate(names):
                hf_key = f"{layer}.block_sparse_moe.experts.{e}.{w}.weight"
                c.hf_shapes[hf_key] = (part_rows, cols)
                c.links.append(Link(hf_key, 0, key, (e * rows + j * part_rows) * cols, part_rows * cols))
    return c


def correspondence(scheme: str, config) -> Correspondence:
    """The links between the HF ``scheme`` and the hf-scatter layout for a model of ``config``."""
    shapes, tied = model_tensors(config)
    if scheme == PER_EXPERT:
        c = _mixtral_per_expert(shapes)
    else:  # FUSED and DBRX_NATIVE name every tensor as the model does
        c = Correspondence()
        for key, shape in shapes.items():
            c.whole(key, shape)
    c.optional = tied
    return c


def detect_scheme(model_type: str, keys: set[str]) -> str:
    """Which HF scheme a checkpoint's keys follow."""
    if model_type == "mixtral" and any(_MIXTRAL_EXPERT.match(k) for k in keys):
        return PER_EXPERT
    return SCHEMES[model_type][-1]


def expert_index(key: str) -> int | None:
    """The expert number in a per-expert key, for expert-count errors."""
    m = _MIXTRAL_EXPERT.match(key)
    return int(m.group(2)) if m else None
