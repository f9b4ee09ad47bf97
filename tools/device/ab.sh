#!/usr/bin/env bash
# A/B decode benchmark of environment switches on prebuilt binaries (tools/gpu_check.sh --pack
# build build-pack; carried as build-xfer/pack.tar.xz, see quick.sh). Each variant is a
# space-separated list of VAR=value settings; variants are separated by ';' ("" = the defaults).
# Every variant runs the q4 bench (GEMV route 1, PDL on) at BENCH_CTX (default 0,4096), twice
# over the variant list (ABBA order against drift). Writes $OUT/ab.log and JSON under $OUT/results.
# AB_KIND=prefill: the q4 prompt bench instead (PREFILL prompt sizes, default 2048,4096; the
# default GEMM choice, median of 3 after a warm-up; PREFILL_PREFIX tokens cached before each).
#   VARIANTS='KESTREL_GEMV_PRELOAD=1;KESTREL_MOE_DOWN_EARLY=2;;exe=kestrel_old' TESTS=<gtest filter|none> SANITIZE=<filter> BIN=<dir>
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ab_out}
mkdir -p "$OUT/results"
if [ -z "${BIN:-}" ]; then  # (BIN=<dir with kestrel, test_cuda>: binaries already in place, as gpu_check.sh passes)
  [ -f build-xfer/pack.tar.xz ] && [ ! -d build-pack ] && tar -xJf build-xfer/pack.tar.xz
  export LD_LIBRARY_PATH=$PWD/build-pack/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  BIN=build-pack/bin
fi
if [ "${TESTS:-none}" != none ]; then
  T0=$(date +%s)
  timeout "${TEST_TIMEOUT:-300}" $BIN/test_cuda --gtest_filter="$TESTS" > "$OUT/test_cuda.log" 2>&1
  echo "tests: rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|Failure|tests ran" "$OUT/test_cuda.log" | head -40
fi
if [ -n "${SANITIZE:-}" ]; then
  T0=$(date +%s)
  timeout 240 /usr/local/cuda/bin/compute-sanitizer --error-exitcode 9 $BIN/test_cuda --gtest_filter="$SANITIZE" \
    > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer ($SANITIZE): rc=$? in $(( $(date +%s) - T0 )) s"; tail -3 "$OUT/sanitizer.log"
fi
IFS=';' read -r -a VARS <<< "${VARIANTS:-}"
[ ${#VARS[@]} -eq 0 ] && VARS=("")
for pass in 1 2; do
  order=("${VARS[@]}")
  if [ $pass = 2 ]; then order=(); for (( i=${#VARS[@]}-1; i>=0; i-- )); do order+=("${VARS[$i]}"); done; fi
  for v in "${order[@]}"; do
    echo "== variant [${v:-defaults}] pass $pass" | tee -a "$OUT/ab.log"
    exe=kestrel; vv=()  # (exe=NAME in a variant: run $BIN/NAME, e.g. an older build packed beside)
    for w in $v; do case $w in exe=*) exe=${w#exe=} ;; *) vv+=("$w") ;; esac; done
    if [ "${AB_KIND:-decode}" = prefill ]; then
      env ${vv[@]+"${vv[@]}"} timeout 180 $BIN/$exe bench --synthetic "${WEIGHTS:-q4}" --prefill "${PREFILL:-2048,4096}" --prefill-runs 3 \
        --prefill-prefix "${PREFILL_PREFIX:-0}" \
        --prefill-aprec split --prefill-gemm auto --out "$OUT/results" 2>&1 | grep -vE '^\s*$' | tail -4 | tee -a "$OUT/ab.log"
    else
      env ${vv[@]+"${vv[@]}"} timeout 120 $BIN/$exe bench --synthetic q4 --contexts "${BENCH_CTX:-0,4096}" --steps 128 --gemv 1 \
        --pdl on --moe mma --route auto --route-algo block --out "$OUT/results" 2>&1 | grep -vE '^\s*$' | tail -4 | tee -a "$OUT/ab.log"
    fi
  done
done
