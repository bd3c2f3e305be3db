#!/usr/bin/env bash
# The multi-GPU training table of docs/distributed-measured.md on one host of 4 GPUs: one torchrun per row (every variant
# of a row in that process group), one row at a time (two rows side by side share the host's processors, and
# the host-bound FSDP2 one-GPU row lost a quarter of its speed that way). Reports go to $OUT (default
# /tmp/hf-scatter-out): train-<shape>-<engine>-<N>gpu.json, each row's log beside it.
# BASELINE_DIR: where the unwrapped rows' reports are, if not in $OUT (a later lease's rows).
# QWEN_ROWS / MIXTRAL_ROWS: rows per GPU, several for a sweep (each side reported at its fastest batch that fits).
# Usage (repository root, GPU host): scripts/bench-train-multi-gpu.sh [PHASE ...]   (default: every phase)
#   phases: none (unwrapped, one GPU), one (none, then FSDP2 on one GPU), fsdp1 (FSDP2 on one GPU only),
#   two (FSDP2 on 2), four (FSDP2 on 4), ep (expert parallelism),
#   zero3 (DeepSpeed ZeRO-3 on 4 GPUs: on 2 its float32 weights and Adam states, 8 bytes per parameter per GPU,
#   leave too little room even at 2 rows per GPU; needs deepspeed and accelerate), tuned (FSDP2 on 4 with bf16 gradient reduction, explicit prefetch and the
#   parameters kept gathered from forward to backward; Qwen3 and Mixtral), ep4 (expert parallelism on 4 only),
#   large (GPT-OSS-120B's layers and DeepSeek-V2-Lite, tuned FSDP2 and expert parallelism on 4; GPTOSS_ROWS,
#   DEEPSEEK_ROWS)
# ONLY: the models whose rows run (qwen3 mixtral gptoss deepseek; default: all of the phases' rows)
set -uo pipefail
out=${OUT:-/tmp/hf-scatter-out}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-$PWD} NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
for pkg in conversion eval; do [ -e hf_scatter/$pkg ] || ln -s ../$pkg hf_scatter/$pkg; done
read -ra QROWS <<<"${QWEN_ROWS:-4}"
read -ra MROWS <<<"${MIXTRAL_ROWS:-4}"
read -ra GROWS <<<"${GPTOSS_ROWS:-2 4 8}"
read -ra DROWS <<<"${DEEPSEEK_ROWS:-2 4 8}"
QWEN=(--shape qwen3-30b-a3b --layers 8 --batch "${QROWS[@]}")
MIXTRAL=(--shape mixtral-8x7b --layers 4 --batch "${MROWS[@]}")
# Neither fits one GPU for training (GPT-OSS-120B's 4 layers: 12.7B parameters; DeepSeek-V2-Lite: 15.7B), so
# their rows have no unwrapped baseline and no scaling efficiency.
GPTOSS=(--shape gpt-oss-120b --layers 4 --batch "${GROWS[@]}")
DEEPSEEK=(--shape deepseek-v2-lite --batch "${DROWS[@]}")
row() {  # row NAME GPUS ENGINE SHAPE_ARGS... : one torchrun on the listed GPUs
    local name=$1 gpus=$2 engine=$3; shift 3
    [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" ${name%%-*} "* ]] && return
    local n; n=$(awk -F, '{print NF}' <<<"$gpus")
    local base=() ref="${BASELINE_DIR:-$out}/train-${name%-*}-none-1gpu.json"
    [ "$engine" != none ] && [ -f "$ref" ] && base=(--baseline "$ref")
    local port=$((29500 + n))
    CUDA_VISIBLE_DEVICES=$gpus timeout 560 python3 -m torch.distributed.run --nproc_per_node "$n" \
        --master_port "$port" -m hf_scatter.cli bench train --engine "$engine" --no-breakdown "$@" "${base[@]}" \
        --out "$out/train-$name-$engine-${n}gpu.json" >"$out/train-$name-$engine-${n}gpu.log" 2>&1
    echo "row $name $engine ${n}gpu exit $?"
}

phase_none() { row qwen3 0 none "${QWEN[@]}"; row mixtral 0 none "${MIXTRAL[@]}"; }
phase_fsdp1() { row qwen3 0 fsdp2 "${QWEN[@]}"; row mixtral 0 fsdp2 "${MIXTRAL[@]}"; }
phase_one() { phase_none; phase_fsdp1; }
phase_two() { row qwen3 0,1 fsdp2 "${QWEN[@]}"; row mixtral 0,1 fsdp2 "${MIXTRAL[@]}"; }
phase_four() { row qwen3 0,1,2,3 fsdp2 "${QWEN[@]}"; row mixtral 0,1,2,3 fsdp2 "${MIXTRAL[@]}"; }
phase_zero3() { row qwen3 0,1,2,3 zero3 "${QWEN[@]}"; row mixtral 0,1,2,3 zero3 "${MIXTRAL[@]}"; }
TUNED=(--reduce-dtype bfloat16 --prefetch next --reshard-after-forward false)
phase_tuned() {
    row qwen3-tuned 0,1,2,3 fsdp2 "${QWEN[@]}" "${TUNED[@]}"; row mixtral-tuned 0,1,2,3 fsdp2 "${MIXTRAL[@]}" "${TUNED[@]}"
}
phase_large() {  # GPT-OSS-120B layers and the whole DeepSeek-V2-Lite: tuned FSDP2 and expert parallelism on 4
    row gptoss-tuned 0,1,2,3 fsdp2 "${GPTOSS[@]}" "${TUNED[@]}"; row gptoss 0,1,2,3 ep "${GPTOSS[@]}"
    row deepseek-tuned 0,1,2,3 fsdp2 "${DEEPSEEK[@]}" "${TUNED[@]}"; row deepseek 0,1,2,3 ep "${DEEPSEEK[@]}"
}
phase_ep4() { row qwen3 0,1,2,3 ep "${QWEN[@]}"; row mixtral 0,1,2,3 ep "${MIXTRAL[@]}"; }
phase_ep() { phase_ep4; row qwen3 0,1 ep "${QWEN[@]}"; row mixtral 0,1 ep "${MIXTRAL[@]}"; }

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpus.txt"
for phase in "${@:-one two four ep tuned zero3}"; do
    for p in $phase; do "phase_$p"; done
done

# every row's report in one file, in the table's order, with its plot: docs/results/train-multi-gpu-h100.json
python3 - "$out" <<'PY'
import json, os, sys
from hf_scatter.bench.train import combine_rows, plot_scaling, scaling_table
out = sys.argv[1]
order = [f"{m}-{e}-{n}gpu" for m in ("qwen3", "mixtral", "gptoss", "deepseek") for e, n in
         (("none", 1), ("fsdp2", 1), ("fsdp2", 2), ("fsdp2", 4), ("tuned-fsdp2", 4), ("ep", 2), ("ep", 4),
          ("zero3", 4))]
rows = [json.load(open(f"{out}/train-{o}.json")) for o in order if os.path.exists(f"{out}/train-{o}.json")]
combined = combine_rows(rows, "scripts/bench-train-multi-gpu.sh")
with open(f"{out}/train-multi-gpu.json", "w") as f:
    json.dump(combined, f, indent=1)
plot_scaling(combined, f"{out}/train-multi-gpu.png")
print(scaling_table(combined))
PY
