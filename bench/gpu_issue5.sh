#!/usr/bin/env bash
# Issue 5 GPU calls. `tests`: the MoE-layer GPU tests (fused epilogue, routing kernels, layer,
# CUDA graph, torch.compile) and the sm90 regression tests. `parity`: the transformers parity
# tests (wheels carried in .scratch/hfwheels, installed into a local target dir). `bench`: the
# layer benchmark.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mode=${1:-tests}
if [ "$mode" = tests ]; then
  nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
  timeout ${T_MOE:-300} python3 -m pytest -q -m gpu --maxfail=15 tests/test_moe.py tests/test_routing.py > "$OUT/test-moe.log" 2>&1
  grep -E "passed|failed|error|Error" "$OUT/test-moe.log" | tail -15
  if [ -n "${REGRESSION:-}" ]; then
    timeout 280 python3 -m pytest -q -m gpu tests/test_sm90.py tests/test_grouped_matmul.py tests/test_dequantize_rows.py > "$OUT/test-sm90.log" 2>&1
    grep -E "passed|failed|error" "$OUT/test-sm90.log" | tail -5
  fi
elif [ "$mode" = parity ]; then
  if [ -d .scratch/hfwheels ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/hfsite .scratch/hfwheels/*.whl > "$OUT/pip.log" 2>&1
    export PYTHONPATH=/tmp/hfsite${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -c "import transformers; print('transformers', transformers.__version__)"
  timeout 200 python3 -m pytest -q tests/test_moe_parity.py tests/test_hf_moe_helper.py > "$OUT/test-parity.log" 2>&1
  grep -E "passed|failed|error|Error" "$OUT/test-parity.log" | tail -15
else
  timeout 560 python3 bench/moe_layer.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -60
fi
