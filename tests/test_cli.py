"""The command line: version, environment report, and the offline demo end to end."""

import os
import subprocess
import sys

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
