#!/usr/bin/env bash
# A short GPU-machine call with binaries built off the device (tools/gpu_check.sh --pack build
# build-pack; nvcc ... tools/device/gemv_probe.cu -o build-probe/gemv_probe), carried as
# ["build-pack", "build-probe"]: the GEMV tests and the q4 end-to-end tests, gemv_probe, and the
# q4 decode bench over the given GEMV routes. Writes under $OUT. (Or carry ["build-xfer"] with
# build-xfer/pack.tar.xz = tar -cJf of build-pack and build-probe: the tree's 64 MiB limit.)
#   TESTS (gtest filter), BENCH_GEMV (default 1,5,5x2), BENCH_CTX (default 0,4096), BENCH_PDL (both)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/quick_out}
mkdir -p "$OUT"
[ -f build-xfer/pack.tar.xz ] && [ ! -d build-pack ] && tar -xJf build-xfer/pack.tar.xz
export LD_LIBRARY_PATH=$PWD/build-pack/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
T0=$(date +%s)
if [ "${TESTS:-}" != none ]; then
  timeout 240 build-pack/bin/test_cuda --gtest_filter="${TESTS:-CudaGemv.*:CudaBackend.MatchesCpuBackendQ4:CudaBackend.MatchesCpuBackendQ4GemvV5}" \
    > "$OUT/test_cuda.log" 2>&1
  echo "tests: rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure" "$OUT/test_cuda.log" | head -30
fi
if [ -x build-probe/gemv_probe ]; then
  T0=$(date +%s)
  timeout 120 build-probe/gemv_probe > "$OUT/gemv_probe.json" 2> "$OUT/gemv_probe.err"
  echo "gemv_probe: rc=$? in $(( $(date +%s) - T0 )) s"
fi
T0=$(date +%s)
timeout 200 build-pack/bin/kestrel bench --synthetic q4 --contexts "${BENCH_CTX:-0,4096}" --steps 128 \
  --gemv "${BENCH_GEMV:-1,5,5x2}" --pdl "${BENCH_PDL:-both}" --moe mma --route auto --route-algo block \
  --out "$OUT/results" > "$OUT/bench_q4.log" 2>&1
echo "bench q4: rc=$? in $(( $(date +%s) - T0 )) s"
cat "$OUT/bench_q4.log"
