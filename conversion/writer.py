"""Run a conversion plan: stream tensors into a temporary directory next to DST, then rename it into place.

Memory is one output tensor (plus one source piece when casting): each output tensor is assembled from
its pieces read straight into place, written, and dropped before the next. An exception or Ctrl-C at
any point removes the temporary directory, so DST either is complete or does not change.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
import torch
from tqdm.auto import tqdm

from .plan import INDEX_NAME, TO_HF, TO_SCATTER, OutputTensor, Plan, build_plan
from .safetensors_io import Reader, write_file


@dataclass
class ConversionResult:
    plan: Plan
    seconds: float
    max_abs_diff: float | None = None  # from --verify

    @property
    def gb_per_s(self) -> float:
        return self.plan.total_bytes / 1e9 / self.seconds


def _assemble(t: OutputTensor, reader: Reader) -> torch.Tensor:
    out = torch.empty(t.spec.shape, dtype=t.spec.dtype)
    flat = out.view(-1)
    for p in t.pieces:
        dst = flat[p.dst_offset:p.dst_offset + p.count]
        if p.source.dtype == out.dtype:
            reader.read_into(p.source, dst, p.src_offset)
        else:
            staged = torch.empty(p.count, dtype=p.source.dtype)
            reader.read_into(p.source, staged, p.src_offset)
            dst.copy_(staged)
    return out


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_checkpoint(plan: Plan, directory: str, progress: bool = True) -> None:
    """Write the plan's weights, index, config and copied files into the existing ``directory``."""
    bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc=f"convert to {plan.to}",
               disable=not progress)
    with Reader() as reader, bar:
        for name, tensors in plan.shards.items():
            write_file(os.path.join(directory, name), [t.spec for t in tensors],
                       (_assemble(t, reader) for t in tensors), on_written=lambda spec: bar.update(spec.nbytes))
    if len(plan.shards) > 1:
        weight_map = {t.spec.name: name for name, tensors in plan.shards.items() for t in tensors}
        _write_json(os.path.join(directory, INDEX_NAME),
                    {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map})
    _write_json(os.path.join(directory, "config.json"), plan.config)
    for name in plan.copies:
        shutil.copy2(os.path.join(plan.src, name), os.path.join(directory, name))


def _replace_dir(tmp: str, dst: str) -> None:
    """Put ``tmp`` at ``dst``; an old ``dst`` is moved aside first and removed only after the swap."""
    old = None
    if os.path.lexists(dst):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.rename(dst, os.path.join(old, "dst"))
    os.rename(tmp, dst)
    if old is not None:
        shutil.rmtree(old)


def convert(src: str, dst: str, to: str = TO_SCATTER, dtype=None, max_shard_size: int | str = "5GB",
            hf_naming: str | None = None, overwrite: bool = False, verify: bool = False,
            progress: bool = True) -> ConversionResult:
    """Convert the checkpoint directory ``src`` into ``dst`` (``to="hf-scatter"``, or back with ``to="hf"``).

    With ``verify``, the written checkpoint is loaded next to the source before it is renamed into place,
    and a logits mismatch leaves no ``dst``.
    """
    import time

    plan = build_plan(src, dst, to=to, dtype=dtype, max_shard_size=max_shard_size, hf_naming=hf_naming,
                      overwrite=overwrite)
    dst = os.path.abspath(dst)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.tmp-", dir=os.path.dirname(dst))
    try:
        start = time.perf_counter()
        write_checkpoint(plan, tmp, progress)
        result = ConversionResult(plan, time.perf_counter() - start)
        if verify:
            from .verify import verify_logits

            hf_dir, scatter_dir = (src, tmp) if to == TO_SCATTER else (tmp, src)
            result.max_abs_diff = verify_logits(hf_dir, scatter_dir, dtype=plan.dtype)
        _replace_dir(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


__all__ = ["ConversionResult", "convert", "write_checkpoint", "TO_HF", "TO_SCATTER"]
