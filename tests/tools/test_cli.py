"""The command line: version, environment report, fresh user processes, every command's bad input."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

import hf_scatter
from hf_scatter.cli import main


def test_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"hf-scatter {hf_scatter.__version__}"


def test_env_reports_versions_and_kernel_path(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    for key in ("torch", "triton", "transformers", "device", "triton mode", "kernel path"):
        assert key in out


# `hf-scatter demo` and `env` in fresh processes, as a user runs them: from the installed wheel, in
# tests/tools/test_packaging.py


_PROBE = """
import json, os
before = dict(os.environ)
import torch, hf_scatter
from hf_scatter.kernels.backend import kernel_path
from hf_scatter.tiny import tiny_dbrx
model = hf_scatter.patch_model(tiny_dbrx())
assert model(torch.randint(3, 100, (1, 5))).logits.shape == (1, 5, 384)
print(kernel_path("cpu"))
print(json.dumps(sorted(set(os.environ.items()) ^ set(before.items()))))
"""


def _fresh_user_process(**users_env) -> tuple[str, list]:
    """A user process that never heard of TRITON_INTERPRET imports hf_scatter and runs a patched model: the
    kernel path it takes on CPU tensors and the environment variables that changed meanwhile. On a CPU-only
    machine the reference is the designed path: any RuntimeWarning fails (on a GPU machine CPU tensors are a
    fallback, and say so)."""
    # this process imported torch._dynamo already, which set TORCHINDUCTOR_CACHE_DIR here: the child starts without it
    unset = ("TRITON_INTERPRET", "HF_SCATTER_KERNELS", "TORCHINDUCTOR_CACHE_DIR")
    env = {**{k: v for k, v in os.environ.items() if k not in unset}, **users_env}
    strict = ["-W", "error::RuntimeWarning"] if not torch.cuda.is_available() else []
    proc = subprocess.run([sys.executable, *strict, "-c", _PROBE], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    path, changed = proc.stdout.strip().splitlines()[-2:]
    return path, [tuple(item) for item in json.loads(changed)]


@pytest.mark.parametrize("force", [None, "triton"])
def test_plain_import_on_cpu_uses_the_fast_reference_unless_kernels_are_asked_for(force):
    """Importing works, CPU tensors take the torch reference (interpreted kernels are far slower), and
    HF_SCATTER_KERNELS=triton interprets them. ``import hf_scatter`` (and a patched model's forward) sets no
    environment variable a user did not ask for, whether the user set inductor's cache folder (the second
    process) or not (the first); HF_SCATTER_KERNELS=triton on a machine without a GPU is the one request that
    needs TRITON_INTERPRET."""
    cpu_only = not torch.cuda.is_available()
    users = {"HF_SCATTER_KERNELS": force,
             "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), "users-inductor-cache")} if force else {}
    path, changed = _fresh_user_process(**users)
    assert path == ("triton-interpreter" if (force and cpu_only) else "torch")
    assert changed == ([("TRITON_INTERPRET", "1")] if (force and cpu_only) else [])


# ----------------------------------------------------------------------------- bad input, caught up front
def _one_line_error(capsys, argv, *needles) -> str:
    """``argv`` exits 2 with one line on stderr naming every needle (argparse errors exit through SystemExit)."""
    try:
        rc = main(argv)
    except SystemExit as exit_:
        rc = exit_.code
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err
    return err


@pytest.fixture
def no_work(monkeypatch):
    """Fails the test if a command gets as far as loading a model or measuring anything."""
    import hf_scatter.bench.moe
    import hf_scatter.eval.random_checkpoint as random_checkpoint
    import hf_scatter.eval.runner as runner
    import hf_scatter.offload as offload
    import hf_scatter.offload.measure as measure

    def forbidden(*args, **kwargs):
        raise AssertionError("the input should have been rejected before any work started")

    for owner, name in ((runner, "run_parity"), (random_checkpoint, "temporary_random_checkpoint"),
                        (hf_scatter.bench.moe, "run"), (measure, "measure_profile"), (offload, "search_policy")):
        monkeypatch.setattr(owner, name, forbidden)


@pytest.mark.parametrize("args, option", [
    (["--limit", "0"], "--limit"), (["--limit", "-1"], "--limit"), (["--limit", "1.5"], "--limit"),
    (["--batch-size", "0"], "--batch-size"), (["--max-length", "0"], "--max-length"),
    (["--device", "gpu"], "--device"), (["--device", "banana"], "--device"),
    (["--gpu-memory", "abc"], "--gpu-memory"), (["--gpu-memory", "inf"], "--gpu-memory"),
    (["--random-layers", "0"], "--random-layers"), (["--tolerance", "nan"], "--tolerance"),
    (["--out", "/proc/hf-scatter-report.json"], "--out"), (["--plot", "/no/such/folder/plot.png"], "--plot"),
    (["--workdir", "/no/such/folder"], "--workdir"),
    (["--tokenizer", "/no/such/folder"], "--tokenizer"), (["--include-path", "/no/such/folder"], "--include-path"),
    (["--backends", "vanilla,banana"], "--backends"), (["--backends", "vanilla"], "--backends"),
])
def test_eval_rejects_bad_options_in_one_line_before_any_model_loads(capsys, no_work, args, option):
    _one_line_error(capsys, ["eval", "--random", "tiny-mixtral", *args], "hf-scatter eval", option)


def test_eval_refuses_model_and_random_together(capsys, no_work, tmp_path):
    _one_line_error(capsys, ["eval", "--model", str(tmp_path), "--random", "tiny-mixtral"], "hf-scatter eval",
                    "--random: not allowed with argument --model")


def test_eval_outside_a_git_checkout_prints_no_git_complaint(capfd, monkeypatch, tmp_path):
    """lm-eval asks git for the working directory's revision after every backend, with git's stderr on ours:
    outside a checkout each run printed "fatal: not a git repository"."""
    evaluator = pytest.importorskip("lm_eval.evaluator")
    import lm_eval

    from hf_scatter.eval.backends import Backend, LoadSettings
    from hf_scatter.eval.runner import _run_backend

    if shutil.which("git") is None:
        pytest.skip("no git on this machine: nothing to complain")
    loud = evaluator.get_git_commit_hash

    def evaluate(**kwargs):
        evaluator.get_git_commit_hash()  # what lm_eval.simple_evaluate asks after each backend
        raise RuntimeError("stopped after the lookup")

    monkeypatch.setattr(lm_eval, "simple_evaluate", evaluate)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))  # not in a checkout, wherever tmp is
    monkeypatch.delenv("GIT_DIR", raising=False)
    settings = LoadSettings(model=str(tmp_path), tokenizer=str(tmp_path), dtype="float32", device="cpu", batch_size=1)
    with pytest.raises(RuntimeError, match="stopped after the lookup"):
        _run_backend(Backend("fake", "fake", lambda s: object()), settings, [], None, None, lambda msg: None)
    assert capfd.readouterr().err == ""
    assert evaluator.get_git_commit_hash is loud, "lm-eval's own lookup is put back"


def test_git_revision_is_quiet_outside_a_checkout(capfd, monkeypatch, tmp_path):
    from hf_scatter.common.timing import git_revision

    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("GIT_DIR", raising=False)
    assert git_revision(str(tmp_path)) is None
    assert capfd.readouterr().err == ""
    checkout = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if shutil.which("git") and os.path.isdir(os.path.join(checkout, ".git")):
        assert re.fullmatch(r"[\w.-]+", git_revision(checkout) or "")


def test_eval_without_a_gpu_rejects_a_cuda_device(capsys, no_work):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _one_line_error(capsys, ["eval", "--random", "tiny-mixtral", "--device", "cuda"], "--device", "--device cpu")


def test_eval_rejects_a_checkpoint_without_tokenizer_before_loading_it(capsys, tmp_path, monkeypatch):
    from hf_scatter.tiny import tiny_mixtral

    import hf_scatter.eval.runner as runner

    def forbidden(*args, **kwargs):
        raise AssertionError("no model may load before the tokenizer is checked")

    monkeypatch.setattr(runner, "_run_backend", forbidden)
    tiny_mixtral().save_pretrained(tmp_path)
    capsys.readouterr()
    _one_line_error(capsys, ["eval", "--model", str(tmp_path), "--device", "cpu"], "tokenizer", str(tmp_path))


def test_eval_crash_is_not_reported_as_a_parity_failure(capsys, monkeypatch, tmp_path):
    """Exit 1 means 'parity failed' (docs/eval.md); a run that breaks before a verdict exits 3."""
    import hf_scatter.eval.runner as runner

    def broken(*args, **kwargs):
        raise RuntimeError("simulated crash inside lm-eval")

    monkeypatch.setattr(runner, "run_parity", broken)
    assert main(["eval", "--random", "tiny-mixtral", "--device", "cpu", "--workdir", str(tmp_path)]) == 3
    err = capsys.readouterr().err
    assert "simulated crash" in err and "before a verdict" in err


@pytest.mark.parametrize("argv, option", [
    (["bench", "moe", "--out", "/no/such/folder/moe.json"], "--out"),
    (["bench", "moe", "--plot", "/proc/moe.png"], "--plot"),
    (["bench", "offload", "--trace", "/no/such/folder/trace.json"], "--trace"),
    (["profile", "--out", "/no/such/folder/profile.json"], "--out"),
    (["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--plot", "/proc/plan.png"], "--plot"),
    (["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--prompt-len", "abc"], "--prompt-len"),
    (["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--gpu-memory", "nan"], "--gpu-memory"),
    (["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--gpu-memory", "1e30GiB"], "--gpu-memory"),
    (["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--cpu-memory", "inf"], "--cpu-memory"),
    (["bench", "offload", "--gpu-memory", "2PiB"], "--gpu-memory"),
    (["bench", "offload", "--model", "olmoe-1b-7b", "--layers", "17"], "--layers"),
    (["bench", "offload", "--model", "llama-3-8b"], "--model"),
    (["bench", "moe", "--replot", "/no/such/results.json"], "--replot"),
])
def test_output_paths_and_values_are_checked_before_measuring(capsys, no_work, tmp_path, argv, option):
    if option == "--plot" and argv[0] == "bench":
        os.makedirs(tmp_path / "existing", exist_ok=True)
    _one_line_error(capsys, argv, option)


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--gpu-memory", "16"],
    ["plan", "--model", "mixtral-8x7b", "--profile", "h100-host-anchors", "--cpu-memory", "200"],
    ["eval", "--random", "tiny-mixtral", "--gpu-memory", "16"],
    ["bench", "offload", "--gpu-memory", "24"],
    ["convert", "/no/such/src", "/no/such/dst", "--max-shard-size", "5"],
])
def test_a_size_without_a_unit_is_not_taken_for_bytes(capsys, no_work, argv):
    """`--gpu-memory 16` means 16GiB: read as 16 bytes it made a plan fail for lack of memory."""
    option, number = argv[-2:]
    _one_line_error(capsys, argv, option, f"{number} bytes: did you mean {number}GiB?")


def test_sizes_with_a_unit_or_of_a_mebibyte_and_more_are_taken_as_written():
    from hf_scatter.common.argtypes import byte_size

    for text in ("16GiB", "500MB", "64KiB", "2.5 GB", "17179869184", "1048576"):
        assert byte_size(text) == text
    with pytest.raises(argparse.ArgumentTypeError, match="65536 bytes is less than 1 MiB: write the unit"):
        byte_size("65536")


def _config(folder, **config) -> str:
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder / "config.json")


def test_an_unknown_model_type_lists_the_planners_families_not_all_of_transformers(capsys, no_work, tmp_path):
    from hf_scatter.offload.families.registry import offloaded_model_types

    config = _config(tmp_path, model_type="no_such_family")
    for argv in (["plan", "--model", config, "--profile", "h100-host-anchors"], ["profile", "--model", config]):
        err = _one_line_error(capsys, argv, f"hf-scatter {argv[0]}: error: --model", "'no_such_family'",
                              *offloaded_model_types())
        assert len(err) < 600, err  # transformers' own message lists ~500 model types


@pytest.mark.parametrize("config, kind", [
    (dict(model_type="bert", architectures=["BertForMaskedLM"]), "is an encoder"),
    (dict(model_type="roberta"), "is an encoder"),
    (dict(model_type="t5"), "is an encoder-decoder model"),
])
def test_plan_refuses_models_that_do_not_generate(capsys, no_work, tmp_path, config, kind):
    """A BERT config.json was planned as a dense decoder generating tokens."""
    _one_line_error(capsys, ["plan", "--model", _config(tmp_path, **config), "--gpu-memory", "16GiB", "--profile",
                             "h100-host-anchors"], kind, "generation of decoders")


def test_plan_and_profile_name_a_wrong_model_first(capsys, no_work, monkeypatch, tmp_path):
    """Before the profile is looked for (none saved here): plan would send the user to measure one first."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    for command in ("plan", "profile"):
        _one_line_error(capsys, [command, "--model", "gpt-5"], f"hf-scatter {command}: error: --model", "'gpt-5'")


def test_json_that_is_no_profile_model_or_report_is_one_line(capsys, no_work, tmp_path):
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    (tmp_path / "other.json").write_text("{}")
    _one_line_error(capsys, ["plan", "--model", "dbrx", "--profile", str(listing)], "--profile",
                    "not a hardware profile")
    _one_line_error(capsys, ["plan", "--model", str(listing), "--profile", "h100-host-anchors"], "--model",
                    "not a model config")
    for report in (listing, tmp_path / "other.json"):
        _one_line_error(capsys, ["bench", "moe", "--replot", str(report)], "--replot",
                        "not a report of `hf-scatter bench moe`")


@pytest.mark.parametrize("argv, command", [
    (["env"], "env"), (["demo"], "demo"), (["convert", "src", "dst"], "convert"), (["eval"], "eval"),
    (["bench", "moe"], "bench moe"), (["profile"], "profile"), (["plan", "--model", "dbrx"], "plan"),
])
def test_an_unknown_option_is_reported_by_its_command(capsys, no_work, argv, command):
    err = _one_line_error(capsys, [*argv, "--bogus"], "unrecognized arguments: --bogus")
    assert err.startswith(f"hf-scatter {command}: error:"), err


def test_an_existing_folder_is_not_an_output_file(capsys, no_work, tmp_path):
    _one_line_error(capsys, ["bench", "moe", "--replot", str(tmp_path / "x.json"), "--plot", str(tmp_path)],
                    "--plot", "is a directory")


def test_every_gpu_suite_says_the_same_thing_without_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    messages = {suite: _one_line_error(capsys, ["bench", suite], "needs a CUDA GPU")
                for suite in ("moe", "train", "norms", "bert", "serve", "offload")}
    assert len(set(messages.values())) == 1, messages


def test_replot_of_a_file_that_is_not_json_is_one_line(capsys, tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text("not json")
    _one_line_error(capsys, ["bench", "moe", "--replot", str(bad)], "--replot", "not a JSON report")


def test_profile_says_where_plan_finds_it(capsys, monkeypatch, tmp_path):
    """Saved to the default place, `plan` finds it by itself; saved elsewhere, the message says --profile FILE.
    (The measuring itself is tested in tests/offload/plan/test_hrm.py: here a profile of this machine's name.)"""
    import hf_scatter.offload.measure as measure
    from hf_scatter.offload.plan.profile import HardwareProfile, current_machine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    host, device = current_machine()
    monkeypatch.setattr(measure, "measure_profile", lambda **_: HardwareProfile(
        name="this machine", host=host, device=device, cpu_flops_bf16=1e11, cpu_bandwidth=1e10,
        cpu_memory=64 * 2**30, cpu_flops_fp32=1e11))
    out = tmp_path / "mine.json"
    assert main(["profile", "--quick", "--no-progress", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"--profile {out}" in last and "finds it" not in last
    assert main(["profile", "--quick", "--no-progress"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "`hf-scatter plan` finds it" in last and str(tmp_path / "cache") in last


def test_plan_on_a_profile_measured_without_a_gpu_names_the_ways_out(capsys, tmp_path):
    """The README's `profile && plan` line on a machine without a GPU: plan says what to pass instead, and the
    README says so too."""
    from hf_scatter.offload import HardwareProfile

    cpu_only = HardwareProfile(name="cpu host", device="cpu", cpu_flops_bf16=1e11, cpu_bandwidth=1e10,
                               cpu_memory=64 * 2**30, cpu_flops_fp32=1e11)
    path = cpu_only.save(str(tmp_path / "cpu.json"))
    _one_line_error(capsys, ["plan", "--model", "mixtral-8x7b", "--gpu-memory", "16GiB", "--profile", path],
                    "--profile h100-host-anchors", "--gpu")
    readme = open(os.path.join(os.path.dirname(__file__), "..", "..", "README.md")).read()
    line = next(line for line in readme.splitlines() if "hf-scatter profile &&" in line)
    assert "--profile h100-host-anchors" in line


def _help(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def _unnamed(text: str, names) -> list[str]:
    return [n for n in names if not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", text)]


def test_help_names_every_family_model_gpu_and_profile_the_commands_take(capsys, monkeypatch):
    """Generated from the registry and the tables, so a new family or built-in shows in the help by itself."""
    from hf_scatter.conversion.plan import supported_model_types
    from hf_scatter.offload import BUILTIN_MODELS, GPU_SPECS, KNOWN_PROFILES
    from hf_scatter.offload.families.registry import offloaded_model_types

    monkeypatch.setenv("COLUMNS", "70")  # narrow: a name must not be wrapped at its hyphen either
    assert _unnamed(_help(capsys, []), supported_model_types()) == []
    assert _unnamed(_help(capsys, ["convert"]), supported_model_types()) == []
    plan = _help(capsys, ["plan"])
    assert _unnamed(plan, [*BUILTIN_MODELS, *offloaded_model_types(), *GPU_SPECS, *KNOWN_PROFILES]) == []


def test_ctrl_c_prints_one_line_and_exits_130(capsys, monkeypatch):
    import hf_scatter.env as env

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(env, "environment_report", interrupted)
    assert main(["env"]) == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "hf-scatter env: interrupted, nothing written" and "Traceback" not in captured.err
