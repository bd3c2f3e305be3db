#!/usr/bin/env bash
# One device-machine call: the whole test suite on the GPU, then the given benchmark commands.
# Usage (from the repository root, on the GPU machine): scripts/gpu-session.sh "bench train" "bench moe"
# Logs, JSON and plots go under $OUT (the device tool brings them back).
set -uo pipefail
out=${OUT:-/tmp/hf-scatter-out}
mkdir -p "$out"
export PYTHONPATH=$PWD PATH=$PATH:/usr/bin:/usr/local/bin  # Triton compiles its launcher with the host C compiler
# conversion/ and eval/ install as hf_scatter.conversion / hf_scatter.eval; from a bare tree, link them there
for pkg in conversion eval; do [ -e hf_scatter/$pkg ] || ln -s ../$pkg hf_scatter/$pkg; done
nvidia-smi --query-gpu=name,memory.total,clocks.sm,power.limit --format=csv,noheader | tee "$out/gpu.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 420 python3 -m pytest -q -x --ignore=tests/tools/test_packaging.py -p no:cacheprovider >"$out/pytest.log" 2>&1
  echo "pytest exit $?"; tail -4 "$out/pytest.log"
fi
for cmd in "$@"; do
  name=$(echo "$cmd" | tr ' ' '-')
  python3 -m hf_scatter.cli $cmd --out "$out/$name.json" --plot "$out/$name.png" >"$out/$name.md" 2>"$out/$name.err"
  echo "$cmd exit $?"; cat "$out/$name.md"; tail -3 "$out/$name.err"
done
