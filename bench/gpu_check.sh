#!/usr/bin/env bash
# The GPU checks of a change, one mode a device call (each fits its 10 minutes on one H100):
#   bash bench/gpu_check.sh tests      the GPU test suite, 8 pytest workers (pytest-xdist; WORKERS=n)
#   bash bench/gpu_check.sh fuzz       bench/fuzz.py: >= 500 random problems, twice each
#   bash bench/gpu_check.sh sanitize   bench/sanitize.py: memcheck, racecheck, synccheck
#   bash bench/gpu_check.sh ep-tests   the expert-parallel GPU tests (NCCL, every GPU of the machine)
#   bash bench/gpu_check.sh ep-bench   bench/ep_layer.py on WORLD GPUs (default: all; EP_ARGS adds options)
# Logs and result files go to $OUT (default gpu-out); each names this script and the commit of the
# tree. MOEGEMM_COMMIT names that commit where the copy that runs has a stale or no git history.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
mode=${1:-tests}
commit=${MOEGEMM_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
if [ -z "${MOEGEMM_COMMIT:-}" ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
  commit="$commit (with uncommitted changes)"
fi
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv > "$OUT/nvidia-smi-$mode.txt" 2>&1
case "$mode" in
  tests)
    # TESTS: the test paths (default: all); PART names the log of a part (gpu-tests-PART.log);
    # PYTEST_ADDOPTS (pytest's own) adds options such as -k.
    # Verbose into gpu-tests*.full.log, so that a run its timeout stops still names every failure
    # so far; gpu-tests*.log keeps the header, the failures and the summary. The whole suite takes
    # 7-9 minutes on one H100 with 14 workers: on a slow machine run it in two parts (PART=1
    # TESTS=tests/test_sm90.py, then PART=2 with the other files).
    log="$OUT/gpu-tests${PART:+-$PART}.log"
    echo "# bash bench/gpu_check.sh tests (python3 -m pytest -v -m gpu -n ${WORKERS:-8} ${TESTS:-tests}" \
      "${PYTEST_ADDOPTS:-}), one $gpu, commit $commit" > "$log"
    timeout ${T_TESTS:-540} python3 -m pytest -v -rfE -m gpu -n ${WORKERS:-8} ${TESTS:-tests} > "${log%.log}.full.log" 2>&1
    echo "pytest rc=$? (124: stopped by its timeout, T_TESTS=${T_TESTS:-540} s)" >> "$log"
    grep -E "^\[gw[0-9]+\].* (FAILED|ERROR) " "${log%.log}.full.log" | sed -E 's/^\[gw[0-9]+\] \[ *[0-9]+%\] //' | sort -u >> "$log"
    echo "$(grep -cE ' PASSED ' "${log%.log}.full.log") passed so far" >> "$log"
    grep -E "^=+ .*(passed|failed|error).* =+$" "${log%.log}.full.log" | tail -1 >> "$log"
    cat "$log" | head -40 ;;
  fuzz)
    timeout ${T_FUZZ:-560} python3 bench/fuzz.py --out "$OUT" ${FUZZ_ARGS:-} > "$OUT/fuzz.log" 2>&1
    echo "fuzz rc=$?"; grep -v "^ *\[" "$OUT/fuzz.log" | tail -40 ;;
  ep-tests)
    echo "# bash bench/gpu_check.sh ep-tests (python3 -m pytest -q -m gpu tests/test_distributed.py)," \
      "$(nvidia-smi -L | wc -l) x $gpu, commit $commit" > "$OUT/ep-tests.log"
    timeout ${T_EP_TESTS:-400} python3 -m pytest -q -m gpu tests/test_distributed.py >> "$OUT/ep-tests.log" 2>&1
    tail -15 "$OUT/ep-tests.log" ;;
  ep-bench)
    world=${WORLD:-$(nvidia-smi -L | wc -l)}
    echo "# bash bench/gpu_check.sh ep-bench (python3 bench/ep_layer.py --world $world ${EP_ARGS:-})," \
      "$(nvidia-smi -L | wc -l) x $gpu, commit $commit" > "$OUT/ep-bench-w$world.log"
    timeout ${T_EP_BENCH:-560} python3 bench/ep_layer.py --world "$world" --out "$OUT" ${EP_ARGS:-} \
      >> "$OUT/ep-bench-w$world.log" 2>&1
    echo "ep-bench rc=$?"; tail -30 "$OUT/ep-bench-w$world.log" ;;
  sanitize)
    timeout ${T_SANITIZE:-570} python3 bench/sanitize.py --out "$OUT/sanitize" ${SANITIZE_ARGS:-} > "$OUT/sanitize.log" 2>&1
    echo "sanitize rc=$?"; tail -30 "$OUT/sanitize.log"
    mv "$OUT"/sanitize/sanitize-*.json "$OUT"/ 2>/dev/null
    tar czf "$OUT/sanitize-logs.tgz" -C "$OUT" sanitize && rm -r "$OUT/sanitize" ;;
esac
