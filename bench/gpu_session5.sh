#!/usr/bin/env bash
# GPU call: kernel-time (graph) benchmark of the target rows, group-order tuning, a profile.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_sm90.py -k "normal256 or swapped or graph" 2>&1 | tail -2
timeout 240 python3 -m moegemm bench --only "t-,dsv3-up 256x16,dsv3-up 32x32,dsv3-down 256x16,dsv3-down 32x32" --out "$OUT" --tag targets 2>&1 | grep -v "^\[" | tail -45
timeout 120 python3 bench/tune_sm90.py "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -v BEST
timeout 90 ncu --clock-control none --kernel-name grouped_matmul_sm90_kernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats \
  python3 bench/profile_sm90.py t-7168x3072 4x8192 > "$OUT/ncu.txt" 2>&1; grep -E "Throughput|Duration|Frequency|Warp Cycles|Hit Rate|Eligible|Issued Warp|No Eligible" "$OUT/ncu.txt" | head -24
