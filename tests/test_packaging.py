"""The wheel: hf_scatter with conversion/ and eval/ inside its namespace, and a working console script."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


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
    assert top_level == {"hf_scatter"}, f"unexpected top-level packages: {top_level}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "hf-scatter = hf_scatter.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_runs_version_and_demo(wheel, tmp_path):
    # A clean venv holding only the wheel; its dependencies come from this environment through a .pth file.
    installed_before = _installed()
    venv = tmp_path / "venv"
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
    env = {k: v for k, v in os.environ.items() if k not in {"TRITON_INTERPRET", "PYTHONPATH"}}
    cli = venv / "bin" / "hf-scatter"
    version = subprocess.run([cli, "--version"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert version.returncode == 0 and version.stdout.startswith("hf-scatter "), version.stderr
    if installed_before:
        assert _installed(), "pip must not have replaced this environment's own hf-scatter"
    where = subprocess.run([vpy, "-c", "import hf_scatter.conversion as c; print(c.__file__)"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=120)
    assert str(venv) in where.stdout, "hf_scatter.conversion must come from the installed wheel"
    demo = subprocess.run([cli, "demo", "--quick"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "checks passed" in demo.stdout
