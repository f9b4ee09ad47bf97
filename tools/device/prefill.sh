#!/usr/bin/env bash
# Prefill kernels on the GPU machine: the Prefill* correctness tests, then the full-size stage
# benchmark (JSON records). Run from the repo root:
#   bash tools/device/prefill.sh [bindir]
# bindir holds a test_cuda built here (and libfmt.so.9); without a runnable one it builds test_cuda
# from source (needs carry [".devdeps"]). Logs and JSON go to $OUT (or /tmp/prefill-out).
set -uo pipefail
BIN=${1:-build-prefill/dev}
OUTD=${OUT:-/tmp/prefill-out}
mkdir -p "$OUTD"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv \
  > "$OUTD/prefill_gpu.txt" 2>&1
export LD_LIBRARY_PATH="$PWD/$BIN${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
if ! "$BIN/test_cuda" --gtest_list_tests > /dev/null 2>&1; then
  echo "carried test_cuda does not run here: building from source" | tee "$OUTD/prefill_build.log"
  source tools/device/env.sh
  export PATH=/opt/torch/.venv/bin:$PATH
  cmake -S . -B build-dev -G Ninja -DKESTREL_CUDA=ON -DCMAKE_BUILD_TYPE=Release >> "$OUTD/prefill_build.log" 2>&1 &&
    cmake --build build-dev -j16 --target test_cuda >> "$OUTD/prefill_build.log" 2>&1 || {
      tail -40 "$OUTD/prefill_build.log"; exit 1; }
  BIN=build-dev
fi
rc=0
timeout 170 "$BIN/test_cuda" --gtest_filter='Prefill*:-PrefillBench*' 2>&1 | tee "$OUTD/prefill_tests.log" || rc=1
KESTREL_PREFILL_BENCH_DIR="$OUTD" timeout 100 "$BIN/test_cuda" --gtest_filter='PrefillBench*' 2>&1 \
  | tee "$OUTD/prefill_bench.log" | grep -v '^\[ ' || rc=1
# Memory checker over the correctness tests (bounded; reported, it does not gate the run).
if command -v compute-sanitizer > /dev/null; then
  timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/test_cuda" \
    --gtest_filter='Prefill*:-PrefillBench*' > "$OUTD/prefill_memcheck.log" 2>&1
  echo "memcheck exit code $? (0 clean, 9 errors, 124 time limit)" | tee -a "$OUTD/prefill_memcheck.log"
fi
echo "---- summary"
grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUTD/prefill_tests.log" || true
grep -E 'prefill bench|total|stage|moe routed' "$OUTD/prefill_bench.log" || true
exit $rc
