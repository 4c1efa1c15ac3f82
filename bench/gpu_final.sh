#!/usr/bin/env bash
# The closing GPU call: every test, the demo, memcheck, accuracy, the full benchmark.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
timeout 300 make test > "$OUT/test.log" 2>&1; grep -E "passed|failed|error" "$OUT/test.log" | tail -3
timeout 120 make demo > "$OUT/demo.log" 2>&1; tail -8 "$OUT/demo.log"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 3 python3 bench/sanitize_sm90.py > "$OUT/memcheck.log" 2>&1; tail -3 "$OUT/memcheck.log"
timeout 100 python3 bench/accuracy.py "$OUT" 2>&1 | tail -16
timeout 330 python3 -m moegemm bench --out "$OUT" 2>&1 | grep -v "^\[" | tail -76
