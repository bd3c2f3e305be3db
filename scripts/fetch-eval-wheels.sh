#!/usr/bin/env bash
# Re-create .whl/ (git-ignored) with the wheels listed in scripts/eval-wheels.txt, for a GPU machine
# without network: CPython 3.12, manylinux x86_64. Source-only packages are built into pure wheels here.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)  # keeps .whl/ out of git, in a worktree too
grep -qx "/.whl/" "$exclude" 2>/dev/null || { mkdir -p "$(dirname "$exclude")"; echo "/.whl/" >> "$exclude"; }
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
grep -v '^\s*#' scripts/eval-wheels.txt | grep -v '^\s*$' | while read -r spec; do
  if ! python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl "$spec" 2>/dev/null; then
    python3 -m pip wheel -q --no-deps -w .whl "$spec"  # no wheel published: build the pure-Python one
  fi
done
du -sh .whl
