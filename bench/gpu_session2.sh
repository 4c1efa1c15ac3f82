#!/usr/bin/env bash
# GPU call: baselines probe, GPU tests, memcheck, accuracy, a first bench subset.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 300 python3 -m pytest -q -m gpu -x -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | grep -Ev "^(SKIPPED)" | tail -25
timeout 200 compute-sanitizer --tool memcheck --error-exitcode 3 python3 bench/sanitize_sm90.py 2>&1 | tee "$OUT/memcheck.log" | tail -8
timeout 120 python3 bench/accuracy.py "$OUT" 2>&1 | tail -20
timeout 200 python3 -m moegemm bench --formats fp8_block,bf16 --only "t-6144x7168,dsv3-up 256x16,dsv3-down 32x32" --out "$OUT" --tag first 2>&1 | tail -30
