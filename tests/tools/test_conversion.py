"""`hf-scatter convert`: lossless both ways, loads patched with the same logits, streams, and refuses bad
input without leaving a partial destination."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import hf_scatter
from hf_scatter.cli import main as cli_main
from hf_scatter.conversion import CONFIG_KEY, ConversionError, build_plan, convert
from hf_scatter.tiny import DECODER_FAMILIES, TINY_BUILDERS, tiny_dbrx, tiny_mixtral

SHARD = "60KB"  # tiny models are ~900 kB: every checkpoint here has many shards


def _save_fused(model, path, shards: int = 3) -> None:
    """A Mixtral checkpoint under transformers 5's in-memory names (a raw state_dict dump), sharded."""
    os.makedirs(path)
    model.config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    keys = sorted(state)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = keys[i::shards]
        save_file({k: state[k] for k in part}, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _checkpoint(kind: str, path, tokenizer=None, **config):
    """Write a multi-shard tiny checkpoint of ``kind``; returns the model it holds."""
    if kind == "mixtral-fused":
        model = tiny_mixtral(experts=5, top_k=3, hidden=40, intermediate=56, **config)
        _save_fused(model, path)
    else:
        model = TINY_BUILDERS[kind](**config)
        model.save_pretrained(path, max_shard_size=SHARD)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return model


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def _digest(path) -> dict[str, str]:
    """Everything under ``path`` (a file, link or directory tree): contents, link targets, subdirectories."""
    def one(p):
        if os.path.islink(p):
            return "-> " + os.readlink(p)
        return "dir" if os.path.isdir(p) else hashlib.sha256(open(p, "rb").read()).hexdigest()

    if not os.path.isdir(path) or os.path.islink(path):
        return {".": one(path)}
    return {os.path.relpath(os.path.join(root, name), path): one(os.path.join(root, name))
            for root, dirs, files in os.walk(path) for name in sorted(dirs + files)}


def _leftovers(parent) -> list[str]:
    return [n for n in os.listdir(parent) if n.startswith(".")]


FUSED_ON_DISK = {"mixtral-fused", "dbrx", "gpt_oss"}
KINDS = ["mixtral", "mixtral-fused", "dbrx", *DECODER_FAMILIES]  # each as save_pretrained writes it


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bitwise_and_the_layout_is_stacked(kind, tmp_path, tokenizer):
    src, dst, back = tmp_path / "src", tmp_path / "hfs", tmp_path / "back"
    _checkpoint(kind, src, tokenizer)
    before = _digest(src)
    convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    convert(str(dst), str(back), to="hf", max_shard_size=SHARD, progress=False)
    assert _digest(src) == before, "the source directory changed"

    original, stacked, restored = _tensors(src), _tensors(dst), _tensors(back)
    assert set(restored) == set(original)
    for key, tensor in original.items():
        assert restored[key].dtype == tensor.dtype and torch.equal(restored[key], tensor), key
    assert not any(".experts.0." in k for k in stacked), "per-expert tensors left in the hf-scatter layout"
    assert sum(t.numel() for t in stacked.values()) == sum(t.numel() for t in original.values())
    assert len([n for n in os.listdir(dst) if n.endswith(".safetensors")]) > 1, "max shard size ignored"

    config = json.loads((dst / "config.json").read_text())
    assert config[CONFIG_KEY]["format_version"] == 1
    # transformers writes these families' experts one tensor per expert (Granite: under other names)
    assert config[CONFIG_KEY]["hf_naming"] == ("fused" if kind in FUSED_ON_DISK else "hub")
    assert (set(original) == set(stacked)) == (kind in FUSED_ON_DISK)
    assert CONFIG_KEY not in json.loads((back / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    assert _leftovers(tmp_path) == []


def _count_expert_stacking(monkeypatch) -> list[str]:
    """Records every per-expert merge/concatenation transformers runs while loading."""
    from transformers import core_model_loading as loading

    calls = []
    for cls in (loading.MergeModulelist, loading.Concatenate):
        original = cls.convert

        def convert(self, *args, _original=original, _name=cls.__name__, **kwargs):
            calls.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, "convert", convert)
    return calls


@pytest.mark.kernel_bodies("reference")  # the loading of the converted layout is under test, not the kernels
@pytest.mark.parametrize("kind", KINDS)
def test_converted_checkpoint_loads_patched_with_vanilla_logits_and_no_stacking(kind, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint(kind, src)
    convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    tokens = torch.randint(3, 300, (2, 11))
    vanilla = AutoModelForCausalLM.from_pretrained(src)
    expected = vanilla(tokens).logits

    stacking = _count_expert_stacking(monkeypatch)
    hf_scatter.patch_transformers()
    try:
        model = AutoModelForCausalLM.from_pretrained(dst)
    finally:
        hf_scatter.unpatch_transformers()
    assert stacking == [], f"loading the converted checkpoint stacked experts: {stacking}"
    assert hf_scatter.patch_report(model), "not patched"
    torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)

    model = hf_scatter.from_pretrained(dst)
    assert hf_scatter.patch_report(model)
    torch.testing.assert_close(model(tokens).logits, expected, rtol=1e-5, atol=1e-5)
    if kind not in FUSED_ON_DISK | {"granitemoe"}:  # the probe sees the stacking a per-expert checkpoint needs
        AutoModelForCausalLM.from_pretrained(src)
        assert stacking


def test_dtype_cast_verify_and_dry_run(tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    model = _checkpoint("mixtral", src)
    assert cli_main(["convert", str(src), str(dst), "--dtype", "bfloat16", "--dry-run"]) == 0
    plan_text = capsys.readouterr().out
    assert "model.layers.1.mlp.experts.gate_up_proj [4, 192, 64] bfloat16 <- 8 tensors" in plan_text
    assert not dst.exists()

    assert cli_main(["convert", str(src), str(dst), "--dtype", "bfloat16", "--verify", "--no-progress"]) == 0
    assert "verify: max abs logits difference" in capsys.readouterr().out
    stacked = _tensors(dst)
    assert all(t.dtype == torch.bfloat16 for t in stacked.values())
    state = model.state_dict()
    for key, tensor in stacked.items():
        assert torch.equal(tensor, state[key].to(torch.bfloat16)), key
    assert json.loads((dst / "config.json").read_text())["dtype"] == "bfloat16"


def test_verify_catches_a_wrong_conversion_and_leaves_no_dst(tmp_path, monkeypatch):
    from hf_scatter.conversion import writer

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    assemble = writer._assemble

    def swapped_experts(t, reader):  # gate and up halves exchanged: shapes fine, numbers wrong
        out = assemble(t, reader)
        return out.roll(out.shape[1] // 2, dims=1) if t.spec.name.endswith("gate_up_proj") else out

    monkeypatch.setattr(writer, "_assemble", swapped_experts)
    with pytest.raises(ConversionError, match="verify failed: logits of .* differ"):
        convert(str(src), str(dst), verify=True, progress=False)
    assert not dst.exists() and _leftovers(tmp_path) == []


def test_interrupted_run_leaves_no_partial_dst_and_keeps_an_old_one(tmp_path, monkeypatch):
    from hf_scatter.conversion import writer

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    assemble, calls = writer._assemble, []

    def interrupted(t, reader):
        calls.append(t.spec.name)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return assemble(t, reader)

    monkeypatch.setattr(writer, "_assemble", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    assert not dst.exists() and _leftovers(tmp_path) == []

    monkeypatch.setattr(writer, "_assemble", assemble)
    convert(str(src), str(dst), dtype="bfloat16", progress=False)
    (dst / "README.md").write_text("old")
    before = _digest(dst)
    monkeypatch.setattr(writer, "_assemble", interrupted)
    calls.clear()
    with pytest.raises(KeyboardInterrupt):
        convert(str(src), str(dst), overwrite=True, progress=False)
    assert _digest(dst) == before and _leftovers(tmp_path) == []

    monkeypatch.setattr(writer, "_assemble", assemble)
    convert(str(src), str(dst), overwrite=True, progress=False)
    assert not (dst / "README.md").exists() and _tensors(dst)["model.embed_tokens.weight"].dtype == torch.float32


# ------------------------------------------------------------------------------------ kills and signals
_PAUSED = """
import os, signal, sys, time
from hf_scatter.conversion import writer
flag, where, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
# Ctrl-C as a terminal delivers it: a test run started in the background (nohup ... &) hands its children
# SIGINT ignored, and Python then installs no KeyboardInterrupt handler
signal.signal(signal.SIGINT, signal.default_int_handler)


def pause():  # until the test creates FLAG.go
    open(flag, "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(flag + ".go") and time.monotonic() < deadline:
        time.sleep(0.02)


if where == "write":  # while the third tensor is assembled: shards half written
    assemble, calls = writer._assemble, []

    def _assemble(t, reader):
        calls.append(t)
        if len(calls) == 3:
            pause()
        return assemble(t, reader)

    writer._assemble = _assemble
elif where == "aside":  # the old DST moved aside, the new one not yet in place
    rename, dst = os.rename, os.path.abspath(argv[2])

    def _rename(a, b):
        rename(a, b)
        if a == dst:
            pause()

    os.rename = _rename
else:  # "swapped": just after the new one is in place
    rename_noreplace, dst = writer._rename_noreplace, os.path.abspath(argv[2])

    def _rename_noreplace(a, b):
        rename_noreplace(a, b)
        if b == dst:
            pause()

    writer._rename_noreplace = _rename_noreplace
from hf_scatter.cli import main
sys.exit(main(argv))
"""


@pytest.fixture
def paused_conversions(tmp_path):
    """Starts ``hf-scatter convert ARGS --no-progress`` processes, each paused at its point ``where``,
    together (importing transformers takes seconds); returns them once all are paused. The Nth started
    goes on once ``tmp_path / "paused-N.go"`` exists. Teardown kills whatever still runs."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = []

    def start(*runs: tuple[str, list]) -> list[subprocess.Popen]:
        flags = []
        for where, args in runs:
            flags.append(tmp_path / f"paused-{len(started)}")
            started.append(subprocess.Popen(
                [sys.executable, "-c", _PAUSED, str(flags[-1]), where, "convert", *map(str, args), "--no-progress"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
        procs = started[-len(runs):]
        deadline = time.monotonic() + 120
        for flag, proc in zip(flags, procs):
            while not flag.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise AssertionError(f"conversion never paused: {proc.communicate()}")
                time.sleep(0.05)
        return procs

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _du(path) -> int:
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def test_kill_term_and_ctrl_c_during_conversion(tmp_path, capsys, paused_conversions):
    """SIGTERM and Ctrl-C leave nothing and print one line; SIGKILL leaves a marked temporary directory
    that the next conversion into the same DST removes, saying so with its size."""
    from hf_scatter.conversion.plan import format_size

    src = tmp_path / "src"
    _checkpoint("mixtral", src)
    killed, termed, interrupted = paused_conversions(
        *[("write", [src, tmp_path / name, "--max-shard-size", SHARD]) for name in ("k", "t", "i")])
    killed.kill()
    termed.terminate()
    interrupted.send_signal(signal.SIGINT)
    for proc, status, verb in ((termed, 143, "terminated"), (interrupted, 130, "interrupted")):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == status, (out, err)
        assert (out + err).splitlines() == [f"hf-scatter convert: {verb}, nothing written"], (out, err)
    killed.communicate(timeout=60)

    lock, left = sorted(_leftovers(tmp_path))  # the others' lock files went with them
    assert lock == ".k.lock" and left.startswith(".k.tmp-"), (lock, left)
    marker = json.loads((tmp_path / left / ".hf-scatter-convert.json").read_text())
    assert marker["pid"] == killed.pid and marker["host"] == socket.gethostname() and marker["start"]
    size = _du(tmp_path / left)
    unmarked = tmp_path / ".k.tmp-unmarked"  # not the converter's (an older version's, a user's): never touched
    unmarked.mkdir()
    capsys.readouterr()
    convert(str(src), str(tmp_path / "k"), progress=False)
    assert capsys.readouterr().err.splitlines() == [
        f"hf-scatter convert: removed {tmp_path / left} ({format_size(size)}), left by an interrupted conversion "
        f"(pid {killed.pid})"]
    assert _leftovers(tmp_path) == [unmarked.name] and (tmp_path / "k" / "config.json").exists()
    assert not (tmp_path / "t").exists() and not (tmp_path / "i").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_conversion_killed_during_the_swap_loses_no_checkpoint(tmp_path, capsys, paused_conversions):
    """Killed after moving the old DST aside, the next run puts it back (or, when something else is at
    DST by then, keeps it and says so); killed just after the swap, the old DST goes as asked."""
    src, aside, swapped = tmp_path / "src", tmp_path / "aside", tmp_path / "swapped"
    _checkpoint("mixtral", src)
    previous = {}
    for dst in (aside, swapped):
        convert(str(src), str(dst), dtype="bfloat16", progress=False)
        (dst / "README.md").write_text("the previous checkpoint")
        previous[dst] = _digest(dst)
    procs = paused_conversions(("aside", [src, aside, "--overwrite"]), ("swapped", [src, swapped, "--overwrite"]))
    for proc in procs:
        proc.kill()
        proc.communicate(timeout=60)
    assert not aside.exists()
    old = next(tmp_path / n for n in _leftovers(tmp_path) if n.startswith(".aside.old-"))
    assert _digest(old / "dst") == previous[aside]
    capsys.readouterr()

    aside.mkdir()  # something else at DST now: the previous checkpoint may be the only copy
    (aside / "mine.txt").write_text("not the converter's")
    with pytest.raises(ConversionError, match="not a checkpoint directory"):
        convert(str(src), str(aside), overwrite=True, progress=False)
    kept, removed = capsys.readouterr().err.splitlines()
    assert kept.startswith(f"hf-scatter convert: kept {old / 'dst'}: the previous {aside}, moved aside by an "
                           f"interrupted conversion (pid {procs[0].pid})"), kept
    assert removed.startswith(f"hf-scatter convert: removed {tmp_path}/.aside.tmp-"), removed
    assert _digest(old / "dst") == previous[aside]
    (aside / "mine.txt").unlink()
    aside.rmdir()

    with pytest.raises(ConversionError, match="exists: pass --overwrite"):
        convert(str(src), str(aside), progress=False)
    assert capsys.readouterr().err.splitlines() == [
        f"hf-scatter convert: restored {aside}: an interrupted conversion (pid {procs[0].pid}) had moved it "
        f"aside to {old}"]
    assert _digest(aside) == previous[aside]

    new = _digest(swapped)
    assert new != previous[swapped] and "README.md" not in new
    convert(str(src), str(swapped), overwrite=True, progress=False)
    removed = sorted(capsys.readouterr().err.splitlines())
    assert len(removed) == 2, removed
    for line, kind in zip(removed, ("old", "tmp")):
        assert line.startswith(f"hf-scatter convert: removed {tmp_path}/.swapped.{kind}-"), line
    assert _digest(swapped) == new and _leftovers(tmp_path) == []


def test_leftovers_of_live_or_other_writers_are_left_alone(tmp_path, capsys):
    """Only a marked directory for this DST, from this host, whose writer is gone is removed: a reused pid
    (another start time) is gone, the pid of a running process on another host proves nothing."""
    from hf_scatter.conversion.plan import format_size
    from hf_scatter.conversion.writer import _start_time

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    me = {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(), "dst": str(dst)}
    markers = {".hfs.tmp-live": me, ".hfs.tmp-other-host": {**me, "host": "elsewhere", "pid": 2**22 + 1},
               ".hfs.tmp-other-dst": {**me, "dst": str(tmp_path / "x"), "pid": 2**22 + 1},
               ".hfs.tmp-reused-pid": {**me, "start": "1"}, ".hfs.tmp-bad-marker": None}
    for name, marker in markers.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x" * 1000)
        (tmp_path / name / ".hf-scatter-convert.json").write_text(json.dumps(marker) if marker else "{")
    capsys.readouterr()
    size = _du(tmp_path / ".hfs.tmp-reused-pid")
    convert(str(src), str(dst), progress=False)
    assert capsys.readouterr().err.splitlines() == [
        f"hf-scatter convert: removed {tmp_path / '.hfs.tmp-reused-pid'} ({format_size(size)}), left by an interrupted "
        f"conversion (pid {os.getpid()})"]
    assert sorted(_leftovers(tmp_path)) == sorted(set(markers) - {".hfs.tmp-reused-pid"})


# ------------------------------------------------------------------------- other processes, the file system
def _folder_appears(dst, src):
    """No DST when the conversion starts; the user makes a folder there while it writes."""
    def meanwhile():
        dst.mkdir()
        (dst / "mine.txt").write_text("mine")
    return [], meanwhile, "appeared during the conversion"


def _checkpoint_swapped(dst, src):
    """--overwrite of a checkpoint that the user moves away while it writes, putting a folder of their own at DST."""
    convert(str(src), str(dst), progress=False)

    def meanwhile():
        dst.rename(dst.parent / "moved")
        dst.mkdir()
        (dst / "mine.txt").write_text("mine")
    return ["--overwrite"], meanwhile, "was replaced during the conversion"


def _file_added(dst, src):
    """--overwrite of a checkpoint the user adds a file to while it writes."""
    convert(str(src), str(dst), progress=False)
    return (["--overwrite"], lambda: (dst / "mine.txt").write_text("mine"),
            "no longer only a checkpoint (1 entry a checkpoint does not hold: mine.txt)")


RACES = {"a folder appears at DST": _folder_appears, "DST swapped for a folder": _checkpoint_swapped,
         "a file added to DST": _file_added}


@pytest.mark.parametrize("rename", ["renameat2", "mkdir fallback"])
@pytest.mark.parametrize("race", list(RACES))
def test_race_what_is_at_dst_at_the_end_is_kept_unless_allowed(race, rename, tmp_path, capsys, monkeypatch):
    """What is at DST at the final rename, unless it is the checkpoint --overwrite was allowed to replace, stays
    as it is (exit 2); the finished checkpoint is kept beside it under the name the error prints. The same where
    the file system lacks renameat2's RENAME_NOREPLACE (EINVAL)."""
    from hf_scatter.conversion import writer

    src, dst, reference = tmp_path / "src", tmp_path / "hfs", tmp_path / "reference"
    _checkpoint("mixtral", src)
    convert(str(src), str(reference), progress=False)
    flags, meanwhile, reason = RACES[race](dst, src)
    if rename == "mkdir fallback":
        def no_renameat2(*args):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

        monkeypatch.setattr(writer, "_renameat2", no_renameat2)
    write, theirs = writer.write_checkpoint, {}

    def write_then_race(*args, **kwargs):
        write(*args, **kwargs)
        meanwhile()
        theirs.update({n: _digest(tmp_path / n) for n in os.listdir(tmp_path) if not n.startswith(".")})

    monkeypatch.setattr(writer, "write_checkpoint", write_then_race)
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(dst), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"hf-scatter convert: error: {dst} ") and reason in err, err
    assert err.endswith(f": left as it is; the new checkpoint is at {dst}.converted instead\n"), err
    assert (dst / "mine.txt").read_text() == "mine"
    after = {n: _digest(tmp_path / n) for n in os.listdir(tmp_path) if not n.startswith(".")}
    assert after == {**theirs, "hfs.converted": _digest(reference)}
    assert _leftovers(tmp_path) == []


def test_two_writers_into_one_dst_the_second_stops_naming_the_first(tmp_path, capsys, paused_conversions):
    """While a conversion writes DST (another process, paused mid-write), a second one into the same DST exits 2
    at once, naming the first's pid, and changes nothing; the first then finishes as if alone."""
    first, second, dst = tmp_path / "first", tmp_path / "second", tmp_path / "hfs"
    _checkpoint("mixtral", first)
    _checkpoint("dbrx", second)
    (proc,) = paused_conversions(("write", [first, dst]))
    capsys.readouterr()
    assert cli_main(["convert", str(second), str(dst), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"hf-scatter convert: error: another conversion is writing {dst} "
                                       f"(pid {proc.pid}): wait for it to finish, or choose another DST\n")
    (tmp_path / "paused-0.go").touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.startswith(f"wrote {dst}: "), (out, err)
    assert json.loads((dst / "config.json").read_text())["model_type"] == "mixtral"
    assert _leftovers(tmp_path) == []


def test_a_writer_that_locks_a_removed_lock_file_starts_over(tmp_path, monkeypatch):
    """The lock file goes at the end of each conversion; one that opened it just before and locks it just after
    holds a file no longer at its path, which would let a third in: it opens the path again instead."""
    from hf_scatter.conversion import writer

    dst, lock = str(tmp_path / "hfs"), tmp_path / ".hfs.lock"
    with writer._exclusive(dst):
        stale = os.open(lock, os.O_RDWR)
    assert not lock.exists()
    open_, opened = os.open, []

    def open_stale_first(path, *args, **kwargs):
        opened.append(path)
        return os.dup(stale) if len(opened) == 1 else open_(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_stale_first)
    with writer._exclusive(dst):
        with pytest.raises(ConversionError, match=f"another conversion is writing {dst} \\(pid {os.getpid()}\\)"):
            with writer._exclusive(dst):
                pass
        assert lock.read_text() == f"{os.getpid()}\n"
    assert not lock.exists() and len(opened) == 3
    os.close(stale)


def test_a_full_disk_exits_2_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    from hf_scatter.conversion import writer

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    write_file, calls = writer.write_file, []

    def disk_fills_up(path, *args, **kwargs):
        calls.append(path)
        if len(calls) == 3:  # two shards written, the third half
            with open(path, "wb") as f:
                f.write(bytes(1000))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write reports it: no file name
        write_file(path, *args, **kwargs)

    monkeypatch.setattr(writer, "write_file", disk_fills_up)
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(dst), "--no-progress", "--max-shard-size", SHARD]) == 2
    assert capsys.readouterr().err == (f"hf-scatter convert: error: {tmp_path}: {os.strerror(errno.ENOSPC)}: {dst} "
                                       f"was not written; free some space or choose another DST\n")
    assert len(calls) == 3 and not dst.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS], ids=errno.errorcode.get)
def test_an_unwritable_folder_is_refused_up_front(code, tmp_path, capsys, monkeypatch):
    """DST's folder cannot be written (no permission, a read-only mount): exit 2 naming it and the reason,
    --dry-run too. No permission is a chmod; but root writes through that, and making a read-only mount needs
    root: so under root, and for EROFS, os.mkdir in that folder fails the way the kernel would fail it."""
    src, folder = tmp_path / "src", tmp_path / "ro"
    _checkpoint("mixtral", src)
    folder.mkdir()
    dst = folder / "hfs"
    if code == errno.EROFS or os.geteuid() == 0:
        mkdir = os.mkdir

        def refused_in_folder(path, *args, **kwargs):
            if os.path.dirname(os.path.abspath(path)) == str(folder):
                raise OSError(code, os.strerror(code), path)
            return mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", refused_in_folder)
    folder.chmod(0o555)
    capsys.readouterr()
    try:
        for extra in (["--dry-run"], ["--no-progress"]):
            assert cli_main(["convert", str(src), str(dst), *extra]) == 2
            assert capsys.readouterr().err == (f"hf-scatter convert: error: {folder}: {os.strerror(code)}: cannot "
                                               f"write {dst} there; choose another DST\n")
        assert os.listdir(folder) == []
    finally:
        folder.chmod(0o755)


def test_a_file_in_dsts_path_is_refused_up_front(tmp_path, capsys):
    """A file where DST's folder should be: exit 2 naming it, --dry-run too. A folder that does not exist yet
    is fine (--dry-run does not create it)."""
    src, notes = tmp_path / "src", tmp_path / "notes.txt"
    _checkpoint("mixtral", src)
    notes.write_text("mine")
    dst = notes / "models" / "hfs"
    capsys.readouterr()
    for extra in (["--dry-run"], ["--no-progress"]):
        assert cli_main(["convert", str(src), str(dst), *extra]) == 2
        assert capsys.readouterr().err == (f"hf-scatter convert: error: {notes}: {os.strerror(errno.ENOTDIR)}: "
                                           f"cannot create {dst} in it; choose another DST\n")
    assert notes.read_text() == "mine" and _leftovers(tmp_path) == []
    assert cli_main(["convert", str(src), str(tmp_path / "new" / "models" / "hfs"), "--dry-run"]) == 0
    assert not (tmp_path / "new").exists()


def test_a_shard_gone_during_the_conversion_is_named(tmp_path, capsys, monkeypatch):
    from hf_scatter.conversion import writer

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    shard, build_plan = src / _shard_of(src, EXPERT), writer.build_plan

    def plan_then_delete(*args, **kwargs):
        plan = build_plan(*args, **kwargs)
        shard.unlink()
        return plan

    monkeypatch.setattr(writer, "build_plan", plan_then_delete)
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(dst), "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"hf-scatter convert: error: {shard}: {os.strerror(errno.ENOENT)}: {dst} "
                                       f"was not written\n")
    assert not dst.exists() and _leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------------- --overwrite
def _user_folder(dst, src):
    dst.mkdir()
    for i in range(7):
        (dst / f"thesis-{i}.tex").write_text("mine")
    return ["no config.json", "7 entries a checkpoint does not hold: thesis-0.tex", "(and 2 more)"]


def _checkpoint_and_more(dst, src):
    convert(str(src), str(dst), progress=False)
    (dst / "runs").mkdir()
    (dst / "runs" / "loss.csv").write_text("1.0")
    (dst / "notes.txt").write_text("mine")
    return ["2 entries a checkpoint does not hold: notes.txt, runs/"]


def _config_only(dst, src):
    dst.mkdir()
    (dst / "config.json").write_text("{}")
    (dst / "README.md").write_text("mine")
    return ["no safetensors weights"]


def _file(dst, src):
    dst.write_text("mine")
    return ["is a file"]


def _symlink(dst, src):
    convert(str(src), str(dst.parent / "elsewhere"), progress=False)
    dst.symlink_to(dst.parent / "elsewhere")
    return ["is a symbolic link", "elsewhere"]


NOT_CHECKPOINTS = {"a folder of user files": _user_folder, "a checkpoint and user files": _checkpoint_and_more,
                   "config.json and no weights": _config_only, "a file": _file, "a symlink": _symlink}


@pytest.mark.parametrize("case", list(NOT_CHECKPOINTS))
def test_overwrite_refuses_what_is_not_a_checkpoint(case, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    names = NOT_CHECKPOINTS[case](dst, src)
    before = _digest(tmp_path)
    for extra in (["--dry-run"], ["--no-progress"]):
        capsys.readouterr()
        assert cli_main(["convert", str(src), str(dst), "--overwrite", *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hf-scatter convert: error: {dst}") and "choose another DST" in err, err
        for name in names:
            assert name in err, (name, err)
    assert _digest(tmp_path) == before


def test_overwrite_replaces_checkpoints(tmp_path, tokenizer):
    """HF checkpoints (sharded or one file) with tokenizer, generation config, model card and license, an
    earlier conversion, files the plan copies, an empty directory."""
    src = tmp_path / "src"
    _checkpoint("mixtral", src, tokenizer)
    (src / "notes.md").write_text("copied along")
    reference = tmp_path / "reference"
    convert(str(src), str(reference), progress=False)
    sharded, single, earlier, empty = (tmp_path / n for n in ("sharded", "single", "earlier", "empty"))
    _checkpoint("dbrx", sharded, tokenizer)
    tiny_dbrx().save_pretrained(single)
    for name in ("README.md", "LICENSE", ".gitattributes", "special_tokens_map.json"):
        (sharded / name).write_text(name)
    convert(str(src), str(earlier), dtype="bfloat16", progress=False)
    empty.mkdir()
    for dst in (sharded, single, earlier, empty):
        convert(str(src), str(dst), overwrite=True, progress=False)
        assert _digest(dst) == _digest(reference), dst


@pytest.mark.parametrize("umask", [0o022, 0o027], ids=oct)
def test_output_follows_the_umask(umask, tmp_path, tokenizer):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src, tokenizer)
    os.chmod(src / "tokenizer.json", 0o600)  # copied files too get the umask's mode, as save_pretrained's
    previous = os.umask(umask)
    try:
        convert(str(src), str(dst), max_shard_size=SHARD, progress=False)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(dst.stat().st_mode) == 0o777 & ~umask
    modes = {name: stat.S_IMODE((dst / name).stat().st_mode) for name in os.listdir(dst)}
    assert set(modes.values()) == {0o666 & ~umask}, modes
    assert "tokenizer.json" in modes and len(modes) > 5


# ------------------------------------------------------------------------------------------ bad input
def _edit_config(src, **changes):
    config = json.loads((src / "config.json").read_text())
    for key, value in changes.items():
        if isinstance(value, dict):
            config[key].update(value)
        else:
            config[key] = value
    (src / "config.json").write_text(json.dumps(config))


def _rewrite_shard(src, key: str, new: torch.Tensor | None, new_key: str | None = None) -> str:
    """Replace (or drop, with ``new=None``) tensor ``key`` in its shard, keeping the index consistent;
    ``new_key`` adds ``new`` as an extra tensor instead."""
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"][key]
    with safe_open(str(src / shard), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if new_key is not None:
        tensors[new_key] = new
        index["weight_map"][new_key] = shard
    elif new is None:
        del tensors[key], index["weight_map"][key]
    else:
        tensors[key] = new
    save_file(tensors, str(src / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index))
    return shard


def _shard_of(src, key: str) -> str:
    return json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key]


EXPERT = "model.layers.1.block_sparse_moe.experts.2.w3.weight"


def _truncate(src):
    shard = _shard_of(src, EXPERT)
    path = src / shard
    path.write_bytes(path.read_bytes()[:-100])
    return [shard]


def _corrupt_header(src):
    shard = _shard_of(src, EXPERT)
    data = bytearray((src / shard).read_bytes())
    data[8:40] = b"\x00garbage, not a json header!!!!"[:32]
    (src / shard).write_bytes(bytes(data))
    return [shard]


BAD_INPUTS = {
    "unknown architecture": (lambda src: _edit_config(src, model_type="llama") or ["config.json", "'llama'"],
                             "unknown architecture"),
    "missing key": (lambda src: _rewrite_shard(src, EXPERT, None) and [EXPERT], "missing tensor"),
    "extra key": (lambda src: [_rewrite_shard(src, EXPERT, torch.zeros(3), "model.layers.0.extra.weight"),
                               "model.layers.0.extra.weight"], "unexpected tensor"),
    "shape mismatch": (lambda src: [_rewrite_shard(src, EXPERT, torch.zeros(95, 64)), EXPERT, "[95, 64]"],
                       "has shape"),
    "truncated file": (_truncate, "truncated"),
    "missing shard file": (lambda src: (src / _shard_of(src, EXPERT)).unlink() or [_shard_of(src, EXPERT)],
                           "which does not exist"),
    "corrupt file": (_corrupt_header, "corrupt"),
    "too few experts in config": (lambda src: _edit_config(src, num_local_experts=3) or
                                  [_shard_of(src, "model.layers.0.block_sparse_moe.experts.3.w1.weight"),
                                   "model.layers.0.block_sparse_moe.experts.3.w1.weight"], "expert count mismatch"),
    "too many experts in config": (lambda src: _edit_config(src, num_local_experts=6) or
                                   ["model.layers.0.block_sparse_moe.experts.4.w1.weight"],
                                   "expert count mismatch"),
}


def test_a_family_without_experts_is_refused_before_its_tensors_are_read(tmp_path, capsys):
    """BERT is patched, but the hf-scatter layout is a layout of experts: refused up front, not at a tensor."""
    TINY_BUILDERS["bert"]().save_pretrained(tmp_path / "bert")
    assert cli_main(["convert", str(tmp_path / "bert"), str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "unknown architecture model_type='bert'" in err and "supports dbrx, deepseek_v2" in err, err
    assert "bert" not in err.split("supports", 1)[1] and not (tmp_path / "out").exists()


def test_refused_input_into_new_folders_creates_none_of_them(tmp_path, capsys):
    """The folders DST needs are made only once the input is known good: a refusal leaves the tree as it was."""
    src = tmp_path / "src"
    _checkpoint("mixtral", src)
    _edit_config(src, model_type="llama")
    assert cli_main(["convert", str(src), str(tmp_path / "new" / "deeper" / "ckpt"), "--no-progress"]) == 2
    assert "unknown architecture" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    _checkpoint("mixtral", tmp_path / "good")
    assert cli_main(["convert", str(tmp_path / "good"), str(tmp_path / "new" / "deeper" / "ckpt"),
                     "--no-progress"]) == 0
    assert (tmp_path / "new" / "deeper" / "ckpt" / "config.json").is_file()


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_names_file_and_tensor_exits_nonzero_and_leaves_no_dst(case, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    damage, message = BAD_INPUTS[case]
    names = damage(src)
    before = _digest(src)
    capsys.readouterr()
    assert cli_main(["convert", str(src), str(dst), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hf-scatter convert: error: ") and message in err, err
    for name in names:
        assert name in err, (name, err)
    assert not dst.exists() and _leftovers(tmp_path) == []
    assert _digest(src) == before


@pytest.mark.parametrize("bad,dtype,message", [
    (float("nan"), None, "contains NaN"), (float("-inf"), None, "contains Inf"),
    (1e5, "float16", "has values up to 1e+05, beyond float16's range")])
def test_verify_names_nan_inf_or_an_overflowing_cast_in_a_source_tensor(bad, dtype, message, tmp_path, capsys):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("mixtral", src)
    weight = _tensors(src)[EXPERT]
    weight[3, 5] = bad
    shard = _rewrite_shard(src, EXPERT, weight)
    args = ["--dtype", dtype] if dtype else []
    assert cli_main(["convert", str(src), str(dst), "--verify", "--no-progress", *args]) == 2
    err = capsys.readouterr().err
    assert f"{src / shard}: source tensor '{EXPERT}' {message}" in err, err
    assert not dst.exists() and _leftovers(tmp_path) == []


@pytest.mark.parametrize("kind,edit", [("dbrx", {"ffn_config": {"moe_num_experts": 3}}),
                                       ("mixtral-fused", {"num_local_experts": 4})])
def test_expert_count_mismatch_in_stacked_checkpoints(kind, edit, tmp_path):
    src = tmp_path / "src"
    _checkpoint(kind, src)
    _edit_config(src, **edit)
    with pytest.raises(ConversionError, match=r"\.safetensors: tensor '.*experts.*' has shape .*expert count"):
        build_plan(str(src), str(tmp_path / "hfs"))


def test_refusals_name_the_fix(tmp_path):
    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("dbrx", src)
    dst.mkdir()
    with pytest.raises(ConversionError, match="exists: pass --overwrite"):
        build_plan(str(src), str(dst))
    with pytest.raises(ConversionError, match="outside the source"):
        build_plan(str(src), str(src / "inside"))
    with pytest.raises(ConversionError, match="not an hf-scatter checkpoint"):
        build_plan(str(src), str(tmp_path / "x"), to="hf")
    convert(str(src), str(dst), overwrite=True, progress=False)
    with pytest.raises(ConversionError, match="already in the hf-scatter layout.*--to hf"):
        build_plan(str(dst), str(tmp_path / "x"))
    with pytest.raises(ConversionError, match="max shard size 'lots'"):
        build_plan(str(src), str(tmp_path / "x"), max_shard_size="lots")
    with pytest.raises(ConversionError, match="'hub' does not exist for dbrx: use fused"):
        build_plan(str(dst), str(tmp_path / "x"), to="hf", hf_naming="hub")


_MEASURE = """
import json, resource, sys
from hf_scatter.conversion import build_plan, convert
src, dst, shard = sys.argv[1:]
build_plan(src, dst + "-plan", max_shard_size=shard)  # imports and a meta model: not what we measure
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
convert(src, dst, max_shard_size=shard, progress=False)
print(json.dumps({"before_kb": before, "after_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
"""


def test_peak_memory_is_bounded_by_shards_not_the_model(tmp_path):
    """A 100 MB model converts with 8 MB shards; its peak resident memory grows by about one shard."""
    src, dst = tmp_path / "src", tmp_path / "hfs"
    shard = 8 * 2**20
    tiny_mixtral(hidden=256, intermediate=512, experts=8, layers=6, vocab=512).save_pretrained(
        src, max_shard_size=shard)
    model_bytes = sum(os.path.getsize(src / n) for n in os.listdir(src) if n.endswith(".safetensors"))
    assert model_bytes > 9 * shard
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(src), str(dst), str(shard)], check=True,
                         capture_output=True, text=True, env=env).stdout
    rss = json.loads(out.splitlines()[-1])
    growth = (rss["after_kb"] - rss["before_kb"]) * 1024
    assert growth < 2 * shard, f"peak RSS grew by {growth / 2**20:.1f} MiB for a {model_bytes / 2**20:.0f} MiB model"
    assert set(_tensors(dst)) == set(tiny_mixtral(hidden=8, intermediate=8, experts=8, layers=6,
                                                  vocab=512).state_dict())


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_expert_count_errors_name_the_familys_config_key(kind, tmp_path):
    src = tmp_path / "src"
    _checkpoint(kind, src)
    saved = json.loads((src / "config.json").read_text())
    (key,) = {"num_local_experts", "num_experts", "n_routed_experts"} & set(saved)  # as this release names it
    _edit_config(src, **{key: 3})
    with pytest.raises(ConversionError, match=rf"{key}=3 \(expert count mismatch\)"):
        build_plan(str(src), str(tmp_path / "hfs"))


def test_a_mapping_that_moves_the_last_dimension_is_refused_up_front(tmp_path, monkeypatch):
    """The hub naming comes from transformers' own mapping; one the converter's element runs cannot express
    (here: a transpose) is refused with the fix, before anything is written."""
    from transformers import core_model_loading

    src, dst = tmp_path / "src", tmp_path / "hfs"
    _checkpoint("qwen3_moe", src)
    revert = core_model_loading.revert_weight_conversion
    monkeypatch.setattr(core_model_loading, "revert_weight_conversion", lambda model, state: {
        k: v.transpose(-1, -2) if ".experts.1.down_proj" in k else v for k, v in revert(model, state).items()})
    with pytest.raises(ConversionError, match=r"rearranges the last dimension of 'model\.layers\.0\.mlp\.experts\.1"
                                              r"\.down_proj\.weight'.*save_pretrained\) instead"):
        build_plan(str(src), str(dst))
    assert not dst.exists()


def test_fp8_scales_that_a_run_of_rows_would_split_are_refused():
    """A weight whose rows go to the output in runs that start or end inside one of its scale blocks cannot keep
    the FP8 layout: the plan names the tensor and the block instead of writing scales that read wrong."""
    from hf_scatter.conversion.layout import Correspondence, Link
    from hf_scatter.conversion.quantized import with_scales
    from hf_scatter.conversion.safetensors_io import TensorInfo

    def info(name, shape, dtype=torch.float8_e4m3fn):
        return TensorInfo(name, "model.safetensors", dtype, shape, 0, 0)

    tensors = {"a.weight": info("a.weight", (96, 64)), "a.weight_scale_inv": info("a.weight_scale_inv", (3, 2),
                                                                                    torch.float32)}
    whole = Correspondence({"a.weight": (96, 64)}, {"b": (2, 48, 64)},
                           [Link("a.weight", 0, "b", 0, 48 * 64), Link("a.weight", 48 * 64, "b", 48 * 64, 48 * 64)])
    with pytest.raises(ConversionError, match=r"'a.weight': rows 0..48 go to 'b', but its scales cover blocks of "
                                              r"32 rows"):
        with_scales(whole, True, tensors, (32, 32))
    aligned = Correspondence({"a.weight": (96, 64)}, {"b": (3, 32, 64)},
                             [Link("a.weight", i * 32 * 64, "b", i * 32 * 64, 32 * 64) for i in range(3)])
    scaled = with_scales(aligned, True, tensors, (32, 32))
    assert scaled.scatter_shapes["b_scale_inv"] == (3, 1, 2)
    assert [link.count for link in scaled.links[3:]] == [2, 2, 2]
