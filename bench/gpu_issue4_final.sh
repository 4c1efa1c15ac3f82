#!/usr/bin/env bash
# Issue 4, closing GPU calls. `tests`: every test, the demo, memcheck, accuracy.
# `bench`: the full benchmark (all six formats).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "${1:-tests}" = tests ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  timeout 330 make test > "$OUT/test.log" 2>&1; grep -E "passed|failed|error" "$OUT/test.log" | tail -3
  timeout 90 make demo > "$OUT/demo.log" 2>&1; tail -8 "$OUT/demo.log"
  timeout 100 compute-sanitizer --tool memcheck --error-exitcode 3 python3 bench/sanitize_sm90.py > "$OUT/memcheck.log" 2>&1; tail -4 "$OUT/memcheck.log"
  timeout 60 python3 bench/accuracy.py "$OUT" 2>&1 | tail -26
else
  timeout 590 python3 -m moegemm bench --out "$OUT" 2>&1 | grep -v "^\[" | tail -230
fi
