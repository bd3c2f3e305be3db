#!/usr/bin/env bash
# The multi-GPU offload table of docs/offload-gpus.md on one host of several GPUs, in one device call: the two-GPU
# tests, then `hf-scatter bench offload --gpus` (one torchrun per GPU count, on one measured profile). Reports go
# to $OUT (default /tmp/hf-scatter-out): offload-gpus-<model>.json / .png / .md, the logs beside them.
# Settings (environment): GPUS (default 1,2,4), MODEL (gpt-oss-120b), LAYERS (8), NEW_TOKENS (32), REQUESTS (1024),
# GPU_MEMORY per GPU (16GiB), PROFILE (a saved profile JSON; default: measured first), SKIP_TESTS=1,
# BENCH_TIMEOUT (seconds, default 480: under it, the rows finished before it are written), TRACE=1 (a Chrome
# trace per rank and count beside the report, their summaries in it).
# Usage (repository root, GPU host): scripts/bench-offload-multi-gpu.sh
set -uo pipefail
out=${OUT:-/tmp/hf-scatter-out}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-$PWD} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for pkg in conversion eval; do [ -e hf_scatter/$pkg ] || ln -s ../$pkg hf_scatter/$pkg; done
model=${MODEL:-gpt-oss-120b}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/offload/runtime/test_offload_tensor_parallel.py \
    >"$out/pytest-offload-tp.log" 2>&1
  echo "pytest exit $?"; tail -3 "$out/pytest-offload-tp.log"
fi
profile=()
[ -n "${PROFILE:-}" ] && profile=(--profile "$PROFILE")
trace=()
[ "${TRACE:-0}" = 1 ] && trace=(--trace "$out/trace.json")
name="offload-gpus-$model"
timeout "${BENCH_TIMEOUT:-480}" python3 -m hf_scatter.cli bench offload --gpus "${GPUS:-1,2,4}" --model "$model" \
  --layers "${LAYERS:-8}" --new-tokens "${NEW_TOKENS:-32}" --requests "${REQUESTS:-1024}" \
  --gpu-memory "${GPU_MEMORY:-16GiB}" "${profile[@]}" "${trace[@]}" --out "$out/$name.json" --plot "$out/$name.png" \
  >"$out/$name.md" 2>"$out/$name.err"
echo "bench exit $?"; cat "$out/$name.md"; grep -v "it/s\]\|step/s" "$out/$name.err" | tail -5
