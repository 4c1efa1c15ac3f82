#!/usr/bin/env bash
# GPU call: tune the new tile arrangements, test them, then the full benchmark.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 200 python3 bench/tune_sm90.py "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -E "BEST|failed"
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sm90.py 2>&1 | tee "$OUT/sm90-tests.log" | tail -4
timeout 330 python3 -m moegemm bench --out "$OUT" 2>&1 | grep -v "^\[" | tail -80
