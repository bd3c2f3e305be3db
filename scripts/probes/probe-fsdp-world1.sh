#!/usr/bin/env bash
# Why is FSDP2 at world size 1 slower for hf-scatter than for the default (one H100)? Runs the Qwen3-30B-A3B
# layers (8, 4 x 2048 tokens) under FSDP2 on one GPU in both orders of the variants, the probe of host time,
# and the unwrapped step at 8 rows. Reports to $OUT (default /tmp/hf-scatter-out).
set -uo pipefail
out=${OUT:-/tmp/hf-scatter-out}
mkdir -p "$out"
export PYTHONPATH=${PYTHONPATH:-$PWD}
for pkg in conversion eval; do [ -e hf_scatter/$pkg ] || ln -s ../$pkg hf_scatter/$pkg; done
Q=(--shape qwen3-30b-a3b --layers 8 --no-breakdown)
one() {  # one NAME ARGS... : one torchrun on one GPU
    local name=$1; shift
    timeout 400 python3 -m torch.distributed.run --nproc_per_node 1 --master_port 29511 -m hf_scatter.cli bench train \
        "${Q[@]}" "$@" --out "$out/$name.json" >"$out/$name.log" 2>&1
    echo "$name exit $? $(grep -E 'tok/s|memory' "$out/$name.log" | tr '\n' ' ')"
}
one fsdp1-ours-first --engine fsdp2 --batch 4 --configs qwen3_moe-hf-scatter qwen3_moe-grouped_mm
one fsdp1-default-first --engine fsdp2 --batch 4 --configs qwen3_moe-grouped_mm qwen3_moe-hf-scatter
one none-b8 --engine none --batch 8 --no-comm-profile
SHAPE=qwen3-30b-a3b LAYERS=8 BATCH=4 FSDP=1 TAG=-now timeout 300 python3 scripts/probes/probe_train_host_time.py \
    qwen3_moe-hf-scatter qwen3_moe-grouped_mm >"$out/probe-host.log" 2>&1; echo "probe exit $?"
tail -30 "$out/probe-host.log"
