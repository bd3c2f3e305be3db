#!/usr/bin/env bash
# Writes the exact versions installed in a virtual environment as pip constraints (make lock): the test
# environment that CI and `make test` install on a CPU machine. The venv's own torch local label (+cpu) is
# dropped so the pin also names the CPU file pip finds on the machine's disk. Written atomically.
set -euo pipefail
venv=$1
out=$2
tmp=$(mktemp "$out.XXXXXX")
trap 'rm -f "$tmp"' EXIT
{
    echo "# The test environment that passed \`make test\` (CPU machine, Python $("$venv/bin/python" -c 'import platform; print(platform.python_version())')), written by \`make lock\` on $(date -u +%F)."
    echo "# Used as pip constraints by scripts/setup-env.sh on CPU machines; users' \`pip install hf-scatter\` keeps ranges."
    "$venv/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check \
        | grep -v -E '^(pip|hf-scatter)==' | sed -E 's/\+cpu$//' | LC_ALL=C sort -f
} > "$tmp"
chmod 644 "$tmp"
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out ($(grep -vc '^#' "$out") pins)"
