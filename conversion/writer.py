"""Run a conversion plan: stream tensors into a temporary directory next to DST, then rename it into place.

Memory is one output tensor (plus one source piece when casting): each output tensor is assembled from
its pieces read straight into place, written, and dropped before the next. An exception, Ctrl-C or
SIGTERM at any point removes the temporary directory, so DST either is complete or does not change. A
process killed outright (SIGKILL, power loss) cannot clean up: every directory it creates next to DST
carries a marker naming the writing process, and the next conversion into DST removes those whose
writer is gone (and puts back a DST that an interrupted swap had moved aside).

Nothing at DST is replaced that the plan did not allow, whatever else runs meanwhile: one conversion per
DST at a time (a lock next to it), and the final rename refuses to land on anything that appeared at DST
or took the place of the checkpoint ``--overwrite`` was allowed to replace; the new checkpoint is then
kept beside DST instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import itertools
import json
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .plan import (INDEX_NAME, TO_HF, TO_SCATTER, OutputTensor, Plan, build_plan, check_folder, format_size,
                   not_a_checkpoint)
from .safetensors_io import ConversionError, Reader, write_file

_MARKER = ".hf-scatter-convert.json"  # in each directory the converter creates next to DST
_OUT = "out"  # the new checkpoint, inside the temporary directory: renamed to DST, so the marker never is
_MOVED = "dst"  # the old DST, inside the .old- directory during the final swap
_AT_FDCWD, _RENAME_NOREPLACE = -100, 1  # <fcntl.h>, <linux/fs.h>


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
    """A new hidden directory next to ``dst`` (``.DST.tmp-*`` or ``.DST.old-*``), marked as this process's; gone
    again if the marker cannot be written (a full disk)."""
    path = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.{kind}-", dir=os.path.dirname(dst))
    try:
        _write_json(os.path.join(path, _MARKER), {"pid": os.getpid(), "start": _start_time(os.getpid()),
                                                  "host": socket.gethostname(), "dst": dst, **extra})
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return path


def _identity(path: str) -> list[int]:
    """Device and inode of ``path`` itself (a link is not the directory it points to)."""
    st = os.lstat(path)
    return [st.st_dev, st.st_ino]


@contextlib.contextmanager
def _exclusive(dst: str):
    """Hold ``.DST.lock`` (``flock``, next to DST) for the whole conversion; a second conversion into DST
    stops at once, naming the pid that holds it.

    The lock file is removed at the end, while still held, so nothing stays beside DST. A process that
    opened it before the removal may lock it after: it then holds a file no longer at that path, which
    locks out nobody, so every acquirer checks after locking that the path still names the file it locked,
    and starts over if not. (Left in place, hidden lock files would pile up next to every DST.) A killed
    conversion leaves the file unlocked: the next one takes it over.
    """
    path = os.path.join(os.path.dirname(dst), f".{os.path.basename(dst)}.lock")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise ConversionError(f"another conversion is writing {dst} (pid {holder}): wait for it to finish, "
                                  f"or choose another DST") from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        if _same_file(fd, path):  # not if someone deleted it by hand and another run made a new one
            os.unlink(path)
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return os.path.samestat(os.fstat(fd), st)


def _holder(fd: int) -> str:
    """The pid in a lock file another process holds; it writes it just after locking, so wait a moment."""
    for _ in range(100):
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text:
            return text
        time.sleep(0.01)
    return "unknown"


@functools.lru_cache(maxsize=None)
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _renameat2(src: str, dst: str, flags: int) -> None:
    """Linux's renameat2(2) through libc; ENOSYS where libc lacks it (glibc before 2.28, other systems)."""
    call = getattr(_libc(), "renameat2", None)
    if call is None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS), src)
    if call(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), ctypes.c_uint(flags)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), src, None, dst)


def _rename_noreplace(src: str, dst: str) -> None:
    """Rename ``src`` to ``dst`` only while nothing is at ``dst``, atomically: FileExistsError if anything is
    there, however late it came.

    ``renameat2(RENAME_NOREPLACE)``; where the kernel or the file system lacks it (ENOSYS, EINVAL), an empty
    directory made at ``dst`` first (``mkdir`` fails on anything there), which rename(2) replaces only while
    it is still empty; for what is not a directory (a user's file put back), a hard link, which fails the
    same way.
    """
    try:
        _renameat2(src, dst, _RENAME_NOREPLACE)
        return
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL):
            raise
    if os.path.islink(src) or not os.path.isdir(src):
        os.link(src, dst, follow_symlinks=False)
        os.unlink(src)
        return
    os.mkdir(dst)
    try:
        os.rename(src, dst)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.rmdir(dst)  # only while empty: still the placeholder
        if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):  # something took the placeholder's place
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), src, None, dst) from None
        raise


class _Changed(Exception):
    """DST is no longer what the plan saw (the message says how); it stays as it is."""


def _replace_dir(new: str, dst: str, plan: Plan) -> None:
    """Put ``new`` at ``dst``: onto nothing, or onto the directory the plan allowed ``--overwrite`` to replace,
    which is moved aside first and removed only after the swap. :class:`_Changed` if anything else is there."""
    old = _move_aside(dst, new, plan) if plan.replaces is not None else None
    try:
        try:
            _rename_noreplace(new, dst)
        except FileExistsError:
            raise _Changed("appeared during the conversion") from None
    except BaseException:
        if old is not None:
            _put_back(old, dst)
        raise
    if old is not None:
        _remove(old)


def _move_aside(dst: str, new: str, plan: Plan) -> str | None:
    """Move DST into a marked ``.DST.old-`` directory and check it there, where nothing else changes it: still
    the directory the plan checked (device, inode) and still a checkpoint, else put back and :class:`_Changed`.
    None when DST is gone."""
    # the marker records the new checkpoint's identity: if this process dies after the swap, the next
    # run sees that DST is the new one and the old one may go; before it, the old one is put back
    old = _claim(dst, "old", new=_identity(new))
    moved = os.path.join(old, _MOVED)
    try:
        os.rename(dst, moved)
    except FileNotFoundError:
        _remove(old)
        return None
    if _identity(moved) != list(plan.replaces):
        reason = "was replaced during the conversion (it is not the directory --overwrite was given)"
    else:
        problems = not_a_checkpoint(moved, plan.copies)
        reason = f"changed during the conversion, it is no longer only a checkpoint ({'; '.join(problems)})"
        if not problems:
            return old
    _put_back(old, dst)
    raise _Changed(reason)


def _put_back(old: str, dst: str) -> None:
    """Return what :func:`_move_aside` took from ``dst``; if something else is at ``dst`` by now, keep it in
    ``old`` (saying so; the next run says so again) rather than replace either."""
    moved = os.path.join(old, _MOVED)
    try:
        _rename_noreplace(moved, dst)
    except FileExistsError:
        _say(f"kept {moved}: it was at {dst}, where something else appeared meanwhile; move it back yourself")
        return
    _remove(old)


def _keep_beside(new: str, dst: str) -> str:
    """Move the finished ``new`` to the first free ``DST.converted``, ``DST.converted-2``, ... and return it:
    not hidden and not marked, as it is the user's to keep or delete."""
    for i in itertools.count(1):
        path = f"{dst}.converted" + (f"-{i}" if i > 1 else "")
        try:
            _rename_noreplace(new, path)
        except FileExistsError:
            continue
        return path


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
                    _rename_noreplace(moved, dst)
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
    with _sigterm_raises():
        check_folder(dst)
        target = os.path.abspath(dst)
        try:
            if not os.path.isdir(os.path.dirname(target)):  # nothing is next to DST yet: check the input before
                build_plan(src, dst, to=to, dtype=dtype, max_shard_size=max_shard_size,  # a folder is made
                           hf_naming=hf_naming, overwrite=overwrite)
                os.makedirs(os.path.dirname(target), exist_ok=True)
            with _exclusive(target):  # before the leftovers and the plan: both look at what is next to DST
                _remove_leftovers(dst)
                plan = build_plan(src, dst, to=to, dtype=dtype, max_shard_size=max_shard_size, hf_naming=hf_naming,
                                  overwrite=overwrite)
                return _write(plan, target, verify, progress)
        except OSError as e:
            raise _failed(e, dst) from None


def _write(plan: Plan, dst: str, verify: bool, progress: bool) -> ConversionResult:
    """Write ``plan`` into a marked temporary directory next to ``dst``, (``verify``) compare logits, and
    put it in place; the temporary directory goes in any case."""
    tmp = _claim(dst, "tmp")
    try:
        out = os.path.join(tmp, _OUT)
        os.mkdir(out)  # unlike mkdtemp's 0700, its mode follows the umask, as save_pretrained's output does
        start = time.perf_counter()
        write_checkpoint(plan, out, progress, check_finite=verify)
        result = ConversionResult(plan, time.perf_counter() - start)
        if verify:
            from .verify import verify_logits

            hf_dir, scatter_dir = (plan.src, out) if plan.to == TO_SCATTER else (out, plan.src)
            result.max_abs_diff = verify_logits(hf_dir, scatter_dir, dtype=plan.dtype)
        try:
            _replace_dir(out, dst, plan)
        except _Changed as e:
            kept = _keep_beside(out, dst)
            raise ConversionError(f"{dst} {e}: left as it is; the new checkpoint is at {kept} instead") from None
    finally:
        with contextlib.suppress(OSError):  # what stays, with its marker, the next run removes
            _remove(tmp)
    return result


_FIXES = {errno.ENOSPC: "free some space or choose another DST", errno.EDQUOT: "free some space or choose another DST",
          errno.EROFS: "choose another DST", errno.EACCES: "choose another DST", errno.EPERM: "choose another DST"}


def _failed(e: OSError, dst: str) -> ConversionError:
    """A file system error while converting (a full disk, a folder made read-only meanwhile, a source file
    gone): one line with the path and the system's reason, as it is the user's to fix. The converter's own
    files next to DST are gone by now, so DST's folder is named for them."""
    folder, base = os.path.split(os.path.abspath(dst))
    path = e.filename
    ours = path is None or os.path.relpath(os.path.abspath(path), folder).startswith(f".{base}.")
    reason = os.strerror(e.errno) if e.errno else str(e)
    fix = f"; {_FIXES[e.errno]}" if ours and e.errno in _FIXES else ""
    return ConversionError(f"{folder if ours else path}: {reason}: {dst} was not written{fix}")


__all__ = ["ConversionResult", "Terminated", "convert", "write_checkpoint", "TO_HF", "TO_SCATTER"]
