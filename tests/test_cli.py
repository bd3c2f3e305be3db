"""The command line: version, environment report, and the offline demo end to end."""

import os
import subprocess
import sys

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


def _kernel_path_said(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if prefix in line).split(prefix, 1)[1].strip()


def test_demo_runs_offline_passes_and_reports_the_kernel_path_env_reports():
    # Fresh processes, as a user runs them: the CLI itself must switch on the interpreter on CPU.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_SCATTER_KERNELS")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = lambda *argv: subprocess.run([sys.executable, "-m", "hf_scatter.cli", *argv], capture_output=True,  # noqa: E731
                                       text=True, env=env, timeout=600)
    proc = run("demo", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all" in proc.stdout and "checks passed" in proc.stdout
    assert "FAIL" not in proc.stdout
    if not torch.cuda.is_available():
        assert "triton-interpreter" in proc.stdout, "on CPU the demo must exercise the kernels, interpreted"
    # `hf-scatter env` and the demo make the same statement about the kernel path on this machine, and the
    # demo's table shows the kernels it says it checks
    said = _kernel_path_said(run("env").stdout, "kernel path")
    assert _kernel_path_said(proc.stdout, "kernel path:") == said
    checked = said.rsplit("`hf-scatter demo` checks ", 1)[-1]
    table = proc.stdout.split("\n", 1)[1]
    assert all(checked in row for row in table.splitlines()[2:-1]), proc.stdout


_PROBE = """
import torch, hf_scatter
from hf_scatter.kernels.backend import kernel_path
from hf_scatter.tiny import tiny_dbrx
model = hf_scatter.patch_model(tiny_dbrx())
assert model(torch.randint(3, 100, (1, 5))).logits.shape == (1, 5, 384)
print(kernel_path("cpu"))
"""


@pytest.mark.parametrize("force", [None, "triton"])
def test_plain_import_on_cpu_uses_the_fast_reference_unless_kernels_are_asked_for(force):
    """A user process that never heard of TRITON_INTERPRET: importing works, CPU tensors take the torch
    reference (interpreted kernels are far slower), and HF_SCATTER_KERNELS=triton interprets them."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "HF_SCATTER_KERNELS")}
    if force:
        env["HF_SCATTER_KERNELS"] = force
    cpu_only = not torch.cuda.is_available()
    # On a CPU-only machine the reference is the designed path: no warning. (On a GPU machine CPU tensors
    # are a fallback, and say so.)
    strict = ["-W", "error::RuntimeWarning"] if cpu_only else []
    proc = subprocess.run([sys.executable, *strict, "-c", _PROBE], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = "triton-interpreter" if (force and cpu_only) else "torch"
    assert proc.stdout.strip().splitlines()[-1] == expected


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
])
def test_eval_rejects_bad_options_in_one_line_before_any_model_loads(capsys, no_work, args, option):
    _one_line_error(capsys, ["eval", "--random", "tiny-mixtral", *args], "hf-scatter eval", option)


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
    """Saved to the default place, `plan` finds it by itself; saved elsewhere, the message says --profile FILE."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
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
    readme = open(os.path.join(os.path.dirname(__file__), "..", "README.md")).read()
    line = next(line for line in readme.splitlines() if "hf-scatter profile &&" in line)
    assert "--profile h100-host-anchors" in line


def test_ctrl_c_prints_one_line_and_exits_130(capsys, monkeypatch):
    import hf_scatter.env as env

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(env, "environment_report", interrupted)
    assert main(["env"]) == 130
    captured = capsys.readouterr()
    assert captured.err.strip() == "hf-scatter env: interrupted, nothing written" and "Traceback" not in captured.err
