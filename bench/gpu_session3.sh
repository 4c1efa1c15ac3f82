#!/usr/bin/env bash
# GPU call: all GPU tests, config tuning, one Nsight Compute profile.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
timeout 220 python3 bench/tune_sm90.py "$OUT/tune.json" 2>&1 | tee "$OUT/tune.log" | grep -E "BEST|failed"
timeout 120 ncu --clock-control none --kernel-name grouped_matmul_sm90_kernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
  --metrics sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active,sm__cycles_elapsed.avg.per_second \
  python3 bench/profile_sm90.py > "$OUT/ncu.txt" 2>&1; grep -E "gmma|Throughput|Duration|Stall|SM Frequency|Warp Cycles|L2 Cache Throughput|DRAM Throughput|per_second" "$OUT/ncu.txt" | head -30
timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | grep -Ev "^(SKIPPED)" | tail -15
