#!/usr/bin/env bash
# Issue 4, first GPU call: the block-format sm90 tests, then a short benchmark of decode and
# prefill rows (usage: OUT=dir bash bench/gpu_issue4.sh [bench --only filter]).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
ONLY=${1:-"dsv3-up 256x16,dsv3-up 32x32,dsv3-down 256x16,t-6144x7168 4x8192,t-4096x2048 64x128,gptoss-up 8x4096"}
timeout 240 python3 -m pytest -q -m gpu -x tests/test_dequantize_rows.py tests/test_sm90.py -k "block or auto or graph or rejects or compiled" > "$OUT/test-mx.log" 2>&1
grep -E "passed|failed|error|Error" "$OUT/test-mx.log" | tail -8
timeout 300 python3 -m moegemm bench --formats fp8_block,mxfp8,w4a8,mxfp4,nvfp4 --only "$ONLY" --out "$OUT" --tag quick 2>&1 | grep -v "^\[" | tail -40
