#!/usr/bin/env bash
# Creates (or refreshes) the project's virtual environment and installs hf-scatter into it.
#  - GPU machine whose python already has a CUDA torch: reuse that torch (no download, works offline).
#  - GPU machine without torch: default PyPI torch (a CUDA build).
#  - CPU machine: torch==2.13.0, the CPU build, so no CUDA wheels are ever pulled, and every other package at
#    the version .ci/constraints.txt pins (the test environment that last passed; `make lock` refreshes it).
#    HF_SCATTER_UNPINNED=1 takes the newest releases instead (`make test-latest`).
set -euo pipefail
venv=${1:-.venv}
python=${PYTHON:-python3}
constraints="$(cd "$(dirname "$0")/.." && pwd)/.ci/constraints.txt"

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
host_has_cuda_torch() { "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; }

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
vpy="$venv/bin/python"
# pip would byte-compile all it installs on one core; the Makefile's commands let Python compile what they import
# instead, once (see the end of this script).
pip_flags=(--disable-pip-version-check --no-compile)
uv_flags=()

if has_gpu && host_has_cuda_torch; then
    # Let the venv see the host's packages (torch, triton, transformers...) behind its own.
    host_site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    venv_site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    echo "$host_site" > "$venv_site/_hf_scatter_host_site.pth"
    pip_flags+=(--no-build-isolation)
elif has_gpu; then
    "$vpy" -c 'import torch' >/dev/null 2>&1 || "$vpy" -m pip install "${pip_flags[@]}" torch
else
    if [ -z "${HF_SCATTER_UNPINNED:-}${HF_SCATTER_CPU_TORCH:-}" ]; then  # another torch: its own dependency set
        # also inside pip's isolated build environment (setuptools, wheel), through the environment variable
        export PIP_CONSTRAINT="$constraints"
        pip_flags+=(--constraint "$constraints")
        uv_flags+=(--constraint "$constraints" --build-constraints "$constraints")
    fi
    "$vpy" -m pip install "${pip_flags[@]}" "torch==${HF_SCATTER_CPU_TORCH:-2.13.0}"
fi

# On CPU machines uv installs the rest: pip took 80 s of one core for it on a 2-core machine (resolving, unpacking
# triton's 286 MB wheel, building deepspeed's sdist), uv about 19 s. Where uv cannot be had or cannot reach the
# index (uv reads no pip configuration), pip does it as before.
if ! has_gpu && "$vpy" -m pip install "${pip_flags[@]}" uv \
        && UV_LINK_MODE=copy "$vpy" -m uv pip install --python "$vpy" "${uv_flags[@]}" -e ".[dev]"; then
    :
else
    "$vpy" -m pip install "${pip_flags[@]}" -e ".[dev]"
fi
# Nothing is byte-compiled here: the Makefile runs Python so that it writes each module's compiled file the first
# time it imports it (only what is used: a third of the files or less).
