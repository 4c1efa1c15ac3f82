#!/usr/bin/env bash
# One call on a lent GPU: environment, the whole test suite, the demo. Logs go to $OUT.
set -uo pipefail
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
python3 -m moegemm info 2>&1 | tee "$OUT/info.txt"
make test 2>&1 | tee "$OUT/test.log" | grep -Ev "^(SKIPPED|\.|s)" | tail -40
make demo 2>&1 | tee "$OUT/demo.log"
