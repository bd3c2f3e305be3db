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


def test_demo_runs_offline_and_passes():
    # A fresh process, as a user runs it: the CLI itself must switch on the interpreter on CPU.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "hf_scatter.cli", "demo", "--quick"], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all" in proc.stdout and "checks passed" in proc.stdout
    assert "FAIL" not in proc.stdout
    if not torch.cuda.is_available():
        assert "triton-interpreter" in proc.stdout, "on CPU the demo must exercise the kernels, interpreted"


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
