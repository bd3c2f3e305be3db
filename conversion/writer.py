"""Run a conversion plan: stream tensors into a temporary directory next to DST, then rename it into place.

Memory is one output tensor (plus one source piece when casting): each output tensor is assembled from
its pieces read straight into place, written, and dropped before the next. An exception, Ctrl-C or
SIGTERM at any point removes the temporary directory, so DST either is complete or does not change. A
process killed outright (SIGKILL, power loss) cannot clean up: every directory it creates next to DST
carries a marker naming the writing process, and the next conversion into DST removes those whose
writer is gone (and puts back a DST that an interrupted swap had moved aside).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .plan import INDEX_NAME, TO_HF, TO_SCATTER, OutputTensor, Plan, build_plan, format_size
from .safetensors_io import ConversionError, Reader, write_file

_MARKER = ".hf-scatter-convert.json"  # in each directory the converter creates next to DST
_OUT = "out"  # the new checkpoint, inside the temporary directory: renamed to DST, so the marker never is
_MOVED = "dst"  # the old DST, inside the .old- directory during the final swap


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived during :func:`convert`; a KeyboardInterrupt, so whatever handles Ctrl-C handles it
    (the command line exits 128 + SIGTERM, as a process killed by it would)."""

    exit_status = 143
    verb = "terminated"


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


def _check_finite(t: OutputTensor, out: torch.Tensor, reader: Reader) -> torch.Tensor:
    """``--verify``: NaN or Inf in a source tensor, or a cast that overflows, is named here rather than
    found later as a logits difference of NaN.

    One ``aminmax`` pass per piece: NaN propagates into both ends and an Inf is one of them (``isfinite``
    alone takes longer than the whole conversion). Even so it adds 10-20% to a conversion on 2 cores, so
    it runs with ``--verify`` only (docs/conversion.md).
    """
    flat = out.view(-1)
    for p in t.pieces:
        piece = flat[p.dst_offset:p.dst_offset + p.count]
        if not piece.is_floating_point() or not p.count:
            continue
        lo, hi = torch.aminmax(piece if piece.element_size() > 1 else piece.float())  # no float8 aminmax on CPU
        if lo.isfinite() and hi.isfinite():
            continue
        bad = "NaN" if lo.isnan() else "Inf"
        if bad == "Inf" and p.source.dtype != out.dtype:  # the source's Inf, or the cast's?
            source = torch.empty(p.count, dtype=p.source.dtype)
            reader.read_into(p.source, source, p.src_offset)
            if source.isfinite().all():
                name = str(out.dtype).removeprefix("torch.")
                raise ConversionError(f"{p.source.path}: source tensor {p.source.name!r} has values up to "
                                      f"{source.abs().max().item():.4g}, beyond {name}'s range: the cast makes "
                                      f"them Inf; use a wider --dtype (bfloat16 keeps float32's range)")
        raise ConversionError(f"{p.source.path}: source tensor {p.source.name!r} contains {bad}: the checkpoint "
                              f"is damaged (re-download or re-save it); nothing was written")
    return out


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def write_checkpoint(plan: Plan, directory: str, progress: bool = True, check_finite: bool = False) -> None:
    """Write the plan's weights, index, config and copied files into the existing ``directory``."""
    bar = tqdm(total=plan.total_bytes, unit="B", unit_scale=True, desc=f"convert to {plan.to}",
               disable=not progress)
    with Reader() as reader, bar:
        for name, tensors in plan.shards.items():
            outputs = (_assemble(t, reader) for t in tensors)
            if check_finite:
                outputs = (_check_finite(t, out, reader) for t, out in zip(tensors, outputs))
            write_file(os.path.join(directory, name), [t.spec for t in tensors], outputs,
                       on_written=lambda spec: bar.update(spec.nbytes))
    if len(plan.shards) > 1:
        weight_map = {t.spec.name: name for name, tensors in plan.shards.items() for t in tensors}
        _write_json(os.path.join(directory, INDEX_NAME),
                    {"metadata": {"total_size": plan.total_bytes}, "weight_map": weight_map})
    _write_json(os.path.join(directory, "config.json"), plan.config)
    for name in plan.copies:  # contents only: the copy's mode follows the umask, like everything written here
        shutil.copyfile(os.path.join(plan.src, name), os.path.join(directory, name))


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks since boot, /proc/<pid>/stat): with the pid, it names one
    process, so a reused pid is not taken for a live writer. None when no such process runs (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold anything
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def _alive(marker: dict) -> bool:
    if os.path.exists("/proc/self/stat"):
        return _start_time(marker["pid"]) == marker["start"]
    try:  # no /proc: the pid alone
        os.kill(marker["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _claim(dst: str, kind: str, **extra) -> str:
    """A new hidden directory next to ``dst`` (``.DST.tmp-*`` or ``.DST.old-*``), marked as this process's."""
    path = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.{kind}-", dir=os.path.dirname(dst))
    _write_json(os.path.join(path, _MARKER), {"pid": os.getpid(), "start": _start_time(os.getpid()),
                                              "host": socket.gethostname(), "dst": dst, **extra})
    return path


def _identity(path: str) -> list[int]:
    st = os.stat(path)
    return [st.st_dev, st.st_ino]


def _replace_dir(new: str, dst: str) -> None:
    """Put ``new`` at ``dst``; an old ``dst`` is moved aside first and removed only after the swap."""
    old = None
    if os.path.lexists(dst):
        # the marker records the new checkpoint's identity: if this process dies after the swap, the next
        # run sees that DST is the new one and the old one may go; before it, the old one is put back
        old = _claim(dst, "old", new=_identity(new))
        os.rename(dst, os.path.join(old, _MOVED))
    try:
        os.rename(new, dst)
    except BaseException:
        if old is not None:
            os.rename(os.path.join(old, _MOVED), dst)
            _remove(old)
        raise
    if old is not None:
        _remove(old)


def _tree_bytes(path: str) -> int:
    return sum(os.lstat(os.path.join(root, name)).st_size
               for root, _, names in os.walk(path) for name in names)


def _say(line: str) -> None:
    print(f"hf-scatter convert: {line}", file=sys.stderr)


def _remove(path: str) -> None:
    """Remove a directory from :func:`_claim`, its marker last: interrupted here too, the next run finishes it."""
    for name in os.listdir(path):
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        elif name != _MARKER:
            os.unlink(entry)
    shutil.rmtree(path)


def _remove_leftovers(dst: str) -> None:
    """Remove the ``.DST.tmp-*`` and ``.DST.old-*`` directories that killed conversions into ``dst`` left.

    Only directories with this converter's marker, written on this host by a process that no longer runs;
    anything else is not ours to judge. An ``.old-`` directory that holds the only copy of the previous
    DST (the writer died between moving it aside and renaming the new one in) is put back instead.
    """
    parent, base = os.path.split(os.path.abspath(dst))
    pattern = re.compile(rf"\.{re.escape(base)}\.(tmp|old)-[^/]+")
    stale = []
    for name in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        path, match = os.path.join(parent, name), pattern.fullmatch(name)
        if match is None or os.path.islink(path) or not os.path.isdir(path):
            continue
        try:
            with open(os.path.join(path, _MARKER)) as f:
                marker = json.load(f)
            ours = (os.path.basename(marker["dst"]) == base and marker["host"] == socket.gethostname()
                    and not _alive(marker))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if ours:
            stale.append((match[1] != "old", path, marker))  # .old- first: a DST put back is not a leftover
    dst = os.path.join(parent, base)
    for _, path, marker in sorted(stale):
        writer = f"pid {marker['pid']}"
        moved = os.path.join(path, _MOVED)
        try:
            if os.path.lexists(moved):
                if not os.path.lexists(dst):
                    os.rename(moved, dst)
                    _remove(path)
                    _say(f"restored {dst}: an interrupted conversion ({writer}) had moved it aside to {path}")
                    continue
                if _identity(dst) != marker.get("new"):
                    _say(f"kept {moved}: the previous {dst}, moved aside by an interrupted conversion ({writer}); "
                         f"{dst} is not that conversion's output, so this may be the only copy: keep what you "
                         f"want and delete {path}")
                    continue
            size = _tree_bytes(path)
            _remove(path)
            _say(f"removed {path} ({format_size(size)}), left by an interrupted conversion ({writer})")
        except OSError as e:
            _say(f"could not clean up {path}, left by an interrupted conversion ({writer}): {e}")


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM's default action kills without cleanup; meanwhile it raises :class:`Terminated` instead.

    Only where it can (the main thread) and only over the default: an ignored SIGTERM stays ignored, and
    a handler someone installed keeps deciding what SIGTERM means.
    """
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated("SIGTERM")

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def convert(src: str, dst: str, to: str = TO_SCATTER, dtype=None, max_shard_size: int | str = "5GB",
            hf_naming: str | None = None, overwrite: bool = False, verify: bool = False,
            progress: bool = True) -> ConversionResult:
    """Convert the checkpoint directory ``src`` into ``dst`` (``to="hf-scatter"``, or back with ``to="hf"``).

    With ``verify``, the written checkpoint is loaded next to the source before it is renamed into place,
    and a logits mismatch leaves no ``dst``.
    """
    import time

    with _sigterm_raises():
        _remove_leftovers(dst)
        plan = build_plan(src, dst, to=to, dtype=dtype, max_shard_size=max_shard_size, hf_naming=hf_naming,
                          overwrite=overwrite)
        dst = os.path.abspath(dst)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        tmp = _claim(dst, "tmp")
        try:
            out = os.path.join(tmp, _OUT)
            os.mkdir(out)  # unlike mkdtemp's 0700, its mode follows the umask, as save_pretrained's output does
            start = time.perf_counter()
            write_checkpoint(plan, out, progress, check_finite=verify)
            result = ConversionResult(plan, time.perf_counter() - start)
            if verify:
                from .verify import verify_logits

                hf_dir, scatter_dir = (src, out) if to == TO_SCATTER else (out, src)
                result.max_abs_diff = verify_logits(hf_dir, scatter_dir, dtype=plan.dtype)
            _replace_dir(out, dst)
        finally:
            with contextlib.suppress(OSError):  # what stays, with its marker, the next run removes
                _remove(tmp)
    return result


__all__ = ["ConversionResult", "Terminated", "convert", "write_checkpoint", "TO_HF", "TO_SCATTER"]
