"""The wheel: hf_scatter with conversion/ and eval/ inside its namespace, and a working console script."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _installed() -> bool:
    try:
        importlib.metadata.distribution("hf-scatter")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Build from a copy so the source tree gets no build/ or egg-info litter.
    src = tmp_path_factory.mktemp("src") / "hf-scatter"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(".venv", ".git", "build", "*.egg-info", "__pycache__",
                                                             ".pytest_cache", ".whl", ".gl"))
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, timeout=300)
    (whl,) = out.glob("hf_scatter-*.whl")
    return whl


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_scatter/conversion/__init__.py" in names
    assert "hf_scatter/eval/__init__.py" in names
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    # the package, and the lm-eval startup hook: a .pth file and the one small module it imports
    assert top_level == {"hf_scatter", "hf_scatter_lm_eval.pth", "_hf_scatter_lm_eval.py"}, top_level
    assert zipfile.ZipFile(wheel).read("hf_scatter_lm_eval.pth").decode().strip() == "import _hf_scatter_lm_eval"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hf-scatter = hf_scatter.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


@pytest.fixture(scope="module")
def wheel_venv(wheel, tmp_path_factory):
    """A clean venv holding only the wheel; its dependencies come from this environment through a .pth file.
    Returns (venv, environment for its commands)."""
    installed_before = _installed()
    venv = tmp_path_factory.mktemp("wheel-venv") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    vpy = venv / "bin" / "python"
    site = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    subprocess.run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300)
    # Only now expose the dependencies: pip must not see (and replace) this environment's own hf-scatter.
    # Every site directory this interpreter sees (on GPU machines that includes the host's, holding torch).
    sites = [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    Path(site, "_deps.pth").write_text("\n".join(sites) + "\n")
    if installed_before:
        assert _installed(), "pip must not have replaced this environment's own hf-scatter"
    env = {k: v for k, v in os.environ.items() if k not in {"TRITON_INTERPRET", "PYTHONPATH"}}
    return venv, env


def _said(text: str, prefix: str) -> str:
    return next(line for line in text.splitlines() if prefix in line).split(prefix, 1)[1].strip()


def test_installed_wheel_runs_env_and_the_demo_offline(wheel_venv, tmp_path):
    """The console script of the installed wheel, as a user runs it in fresh processes (no TRITON_INTERPRET, no
    network): `hf-scatter env` and `hf-scatter demo --quick` pass and make the same statement about the kernel
    path, the demo's table shows the kernels it says it checks, and on CPU those are the interpreted kernels."""
    import torch

    venv, env = wheel_venv
    env = {k: v for k, v in env.items() if k != "HF_SCATTER_KERNELS"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cli = venv / "bin" / "hf-scatter"
    run = lambda *argv: subprocess.run([cli, *argv], capture_output=True, text=True, env=env, cwd=tmp_path,  # noqa: E731
                                       timeout=600)
    said = run("env")
    assert said.returncode == 0, said.stderr
    location = _said(said.stdout, "hf-scatter location")  # (test_wheel_layout: conversion/ inside)
    assert location.startswith(str(venv)) and location.endswith("hf_scatter"), "not the installed wheel's copy"
    demo = run("demo", "--quick")
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "all" in demo.stdout and "checks passed" in demo.stdout and "FAIL" not in demo.stdout
    if not torch.cuda.is_available():
        assert "triton-interpreter" in demo.stdout, "on CPU the demo must exercise the kernels, interpreted"
    kernel_path = _said(said.stdout, "kernel path")
    assert _said(demo.stdout, "kernel path:") == kernel_path
    checked = kernel_path.rsplit("`hf-scatter demo` checks ", 1)[-1]
    table = demo.stdout.split("\n", 1)[1]
    assert all(checked in row for row in table.splitlines()[2:-1]), demo.stdout


def test_lm_eval_finds_and_runs_hf_scatter_after_pip_install(wheel_venv, tmp_path, tokenizer):
    """lm-eval <= 0.5.0.dev1 reads no model entry points; the wheel's startup hook registers them. In the venv's
    interpreter lm-eval's own lookup finds hf-scatter's three models in the installed wheel, and lm-eval's evaluator
    (what ``lm_eval run --model hf-scatter`` calls, by the model's name) evaluates a checkpoint on the task files the
    wheel ships. One interpreter for both: each start imports torch and transformers. (lm-eval's command line
    itself would index its thousands of built-in tasks first: half a minute of a 2-core machine.)"""
    pytest.importorskip("lm_eval", reason="lm-eval is in the dev extra: make test installs it")
    from hf_scatter.tiny import tiny_mixtral

    venv, env = wheel_venv
    (tasks,) = venv.glob("lib/python*/site-packages/hf_scatter/eval/tasks")  # the suite's task files ship in it
    shipped = sorted(p.relative_to(tasks).as_posix() for p in tasks.rglob("*") if p.is_file())
    source = sorted(p.relative_to(REPO / "eval" / "tasks").as_posix() for p in (REPO / "eval" / "tasks").rglob("*")
                    if p.is_file() and "__pycache__" not in p.parts)
    assert shipped == source
    model = tmp_path / "mixtral"
    tiny_mixtral().save_pretrained(model)
    tokenizer.save_pretrained(model)
    names = ("hf-scatter", "hf-scatter-mlm", "hf-scatter-offloaded")
    program = ("import inspect, lm_eval, lm_eval.models; from lm_eval.api.registry import get_model; "
               "from lm_eval.tasks import TaskManager; "
               f"print(*(inspect.getfile(get_model(n)) for n in {names!r})); "
               f"out = lm_eval.simple_evaluate(model='hf-scatter', model_args='pretrained={model},dtype=float32', "
               f"tasks=['hfs_arithmetic'], limit=2, device='cpu', "
               f"task_manager=TaskManager(include_path={str(tasks)!r}, include_defaults=False)); "
               "print(out['results'])")
    env = {**env, "HF_SCATTER_KERNELS": "torch"}  # the command's plumbing, not the kernels, is under test
    done = subprocess.run([venv / "bin" / "python", "-c", program], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    files = done.stdout.splitlines()[0].split()
    assert len(files) == 3 and all(f.startswith(str(venv)) and "/hf_scatter/eval/" in f for f in files), files
    assert "hfs_arithmetic" in done.stdout and "acc" in done.stdout
