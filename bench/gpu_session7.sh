#!/usr/bin/env bash
# GPU call: decode ring depth once the swapped tiles stop reserving an epilogue buffer.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 120 python3 bench/tune_sm90.py "$OUT/tune-decode.json" 2>&1 | tee "$OUT/tune-decode.log" | grep -v BEST
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sm90.py -k "swapped or graph or auto" 2>&1 | tail -2
