#!/usr/bin/env bash
# The GPU-machine check of the CUDA backend (issue 6), run from the repo root on the device:
#   1. build test_cuda + kestrel from scratch with -j16 (or, with --prebuilt DIR, use binaries built
#      elsewhere from this same tree: DIR/bin/{test_cuda,kestrel}, DIR/lib/*.so*; the device image
#      may lack the Debian -dev packages the CMake build needs, which this step records);
#   2. every GPU test (gtest JSON + log);
#   3. compute-sanitizer memcheck on the test binary (the full-size cases filtered out: memcheck
#      runs them ~100x slower);
#   4. the decode benchmarks (kestrel bench, JSON records) and the micro-benchmarks of the
#      dependency primitive (tools/device/sync_probe.cu), of q4 GEMV layouts and the decode GEMV's
#      parts (gemv_probe.cu), and of the MoE expert kernels' parts (moe_probe.cu);
#   5. the prompt benchmarks (tools/device/prefill_bench.sh, both GEMM routes);
#   6. per-kernel profiles of a decode step and a 4K prompt (tools/device/profile.sh, Nsight
#      Compute; summaries by kernel in profile/summary_*.txt);
# and writes everything under $OUT (one tarball, gpu_check.tar.gz, plus summary.txt).
# Usage: tools/gpu_check.sh [--prebuilt DIR] [--quick] [--no-sanitizer] [--no-bench] [--no-prefill-bench] [--no-profile] [--no-probes]
#        tools/gpu_check.sh --only-prefill-bench   (build, if needed, then only the prompt benchmarks;
#        a second call within the machine's warm period reuses build-gpu)
#   KESTREL_GIT_SHA: pass the commit from the checkout (the device copy is not a git repository).
#        tools/gpu_check.sh --pack BUILD_DIR DIR   (here: copy test_cuda, kestrel and the non-system
#        shared libraries they need into DIR/bin, DIR/lib, for --prebuilt on the device)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-/tmp/gpu_check_out}
PREBUILT=""
QUICK=0
SANITIZE=1
BENCH=1
PREFILL_BENCH=1
PROFILE=1
PROBES=1
TESTS=1
if [ "${1:-}" = --pack ]; then
  B=$2; D=$3
  rm -rf "$D"; mkdir -p "$D/bin" "$D/lib"
  cp "$B/test_cuda" "$B/kestrel" "$D/bin/"
  for bin in "$D/bin/"*; do
    ldd "$bin" | awk '/=>/ {print $3}' | grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*|libstdc\+\+|libgcc_s)\.so' \
      | while read -r l; do cp -Ln "$l" "$D/lib/" 2>/dev/null || true; done
  done
  ls -la "$D/bin" "$D/lib"; du -sh "$D"
  exit 0
fi
while [ $# -gt 0 ]; do
  case "$1" in
    --prebuilt) PREBUILT=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --no-sanitizer) SANITIZE=0; shift ;;
    --no-bench) BENCH=0; shift ;;
    --no-prefill-bench) PREFILL_BENCH=0; shift ;;
    --no-profile) PROFILE=0; shift ;;
    --no-probes) PROBES=0; shift ;;
    --only-prefill-bench) TESTS=0; SANITIZE=0; BENCH=0; PREFILL_BENCH=1; PROFILE=0; shift ;;
    *) echo "gpu_check: unknown argument $1" >&2; exit 2 ;;
  esac
done
W=$OUT/gpu_check
mkdir -p "$W/results"
SUMMARY=$W/summary.txt
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
# Packed after every stage, so that a call stopped at its time limit still returns what was done.
pack() { tar -czf "$OUT/gpu_check.tar.gz" -C "$OUT" gpu_check; cp "$SUMMARY" "$OUT/summary.txt"; }
export PATH=/usr/local/cuda/bin:$PATH
# The device image lacks PCRE2, utf8proc and cpp-httplib: carried as Debian packages (carry
# ".devdeps"; see tools/device/env.sh).
[ -d .devdeps ] && source tools/device/env.sh

note "== gpu_check $(date -u +%FT%TZ) sha=${KESTREL_GIT_SHA:-unknown}"
nvidia-smi > "$W/nvidia-smi.txt" 2>&1 || note "nvidia-smi failed"
head -15 "$W/nvidia-smi.txt" | tee -a "$SUMMARY"

# ---- 1. build
BIN=""
if [ -z "$PREBUILT" ]; then
  T0=$(date +%s)
  # test_cuda first: it needs only core/cpu/quant/engine/cuda, so a broken file elsewhere in the
  # tree does not stop the GPU tests; kestrel (bench) after.
  if cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON \
      -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$W/configure.log" 2>&1 &&
     cmake --build build-gpu -j16 --target test_cuda > "$W/build.log" 2>&1; then
    BIN=$ROOT/build-gpu
    note "build test_cuda: OK in $(( $(date +%s) - T0 )) s"
    cmake --build build-gpu -j16 --target kestrel >> "$W/build.log" 2>&1 && note "build kestrel: OK in $(( $(date +%s) - T0 )) s" || note "build kestrel: FAILED"
  else
    note "build test_cuda: FAILED (see build.log)"
    grep -E "error|FAILED" "$W/build.log" | head -8 | tee -a "$SUMMARY"
    # The test binary globs every tests/cuda/*.cpp; when a file that is not part of the decode
    # suite breaks it, build the decode tests alone against the same component libraries.
    if cmake --build build-gpu -j16 --target kestrel_engine kestrel_cuda kestrel_core >> "$W/build.log" 2>&1 &&
       g++ -std=gnu++20 -O2 -fopenmp -Isrc -I/usr/local/cuda/include -DFMT_SHARED \
         -DKESTREL_FIXTURES="\"$ROOT/tests/fixtures\"" tests/cuda/test_kernels.cpp tests/cuda/test_backend.cpp \
         build-gpu/libkestrel_engine.a build-gpu/libkestrel_cuda.a build-gpu/libkestrel_core.a \
         -lgtest_main -lgtest -L/usr/local/cuda/lib64 -lcudart -lfmt -lspdlog -lpthread \
         -o build-gpu/test_cuda >> "$W/build.log" 2>&1; then
      BIN=$ROOT/build-gpu
      note "build: decode tests built alone (tests/cuda/test_kernels.cpp, test_backend.cpp) in $(( $(date +%s) - T0 )) s"
      cmake --build build-gpu -j16 --target kestrel >> "$W/build.log" 2>&1 && note "build kestrel: OK" || note "build kestrel: FAILED"
    else
      note "build: FAILED"; grep -E "error|FAILED" "$W/build.log" | tail -8 | tee -a "$SUMMARY"
    fi
  fi
else
  BIN=$ROOT/$PREBUILT/bin
  export LD_LIBRARY_PATH=$ROOT/$PREBUILT/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  note "build: using prebuilt binaries from $PREBUILT (built from this tree off the device)"
  # Record whether the device image could build the tree itself.
  for h in /usr/include/nlohmann/json.hpp /usr/include/CLI/CLI.hpp /usr/include/fmt/core.h /usr/include/gtest/gtest.h /usr/include/httplib.h; do
    [ -e "$h" ] && note "  device has $h" || note "  device lacks $h"
  done
fi

if [ -n "$BIN" ] && [ "$TESTS" = 1 ]; then
  # ---- 2. tests
  T0=$(date +%s)
  FILTER='-PrefillBench*'  # the prefill stage benchmark runs from tools/device/prefill.sh
  [ "$QUICK" = 1 ] && FILTER='-*RealVocab*:*131072*:PrefillBench*'
  timeout 420 "$BIN/test_cuda" --gtest_filter="$FILTER" --gtest_output=json:"$W/results/test_cuda.json" \
    > "$W/test_cuda.log" 2>&1
  RC=$?
  note "tests: rc=$RC in $(( $(date +%s) - T0 )) s"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) |^\[  FAILED|Failure|error" "$W/test_cuda.log" | head -40 | tee -a "$SUMMARY"
  pack

  # ---- 3. compute-sanitizer
  if [ "$SANITIZE" = 1 ]; then
    T0=$(date +%s)
    timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 --print-limit 20 \
      "$BIN/test_cuda" --gtest_filter='CudaGemv.FusedSegments*:CudaGemv.RejectsBadShapes:CudaGdn.Decode*:CudaBackend.MatchesCpuBackendQ4:CudaBackend.MatchesCpuBackendQ4MoeFused:CudaBackend.MatchesCpuBackendQ4RouteGateUp:CudaBackend.MatchesCpuBackendQ4MoeScalar:CudaBackend.MatchesCpuBackendQ4GemvV5:CudaBackend.MatchesCpuBackendQ4DownEarlyLevels:CudaBackend.MatchesCpuBackendQ4Preload:CudaBackend.MatchesCpuBackendQ4GateUpDepth2:PrefillOps.*' \
      > "$W/sanitizer.log" 2>&1
    note "compute-sanitizer memcheck: rc=$? in $(( $(date +%s) - T0 )) s"
    grep -E "ERROR SUMMARY|========= (Invalid|Error)" "$W/sanitizer.log" | head -10 | tee -a "$SUMMARY"
    pack
  fi

  # ---- 4. benchmarks
  if [ "$BENCH" = 1 ]; then
    T0=$(date +%s)
    [ -x "$BIN/kestrel" ] || note "bench: no kestrel binary"
    timeout 240 "$BIN/kestrel" bench --synthetic q4 --contexts 0,4096,32768,131072 --steps 128 --gemv ${BENCH_GEMV:-1,5} \
      --pdl ${BENCH_PDL:-both} --moe mma --route auto --route-algo block --out "$W/results" > "$W/bench_q4.log" 2>&1
    note "bench q4: rc=$? in $(( $(date +%s) - T0 )) s"; cat "$W/bench_q4.log" | tee -a "$SUMMARY"
    T0=$(date +%s)
    timeout 80 "$BIN/kestrel" bench --synthetic bf16 --contexts 0,4096 --steps 128 --gemv ${BENCH_GEMV_BF16:-1,2} --pdl ${BENCH_PDL:-both} \
      --moe split --route auto --route-algo block --out "$W/results" > "$W/bench_bf16.log" 2>&1
    note "bench bf16: rc=$? in $(( $(date +%s) - T0 )) s"; cat "$W/bench_bf16.log" | tee -a "$SUMMARY"
    # The switches not yet on by default (bench/NOTES.md v14), q4 at ctx 0 / 4K, both orders.
    T0=$(date +%s)
    BIN=$BIN OUT=$W VARIANTS="${AB_VARIANTS-;KESTREL_GEMV_PRELOAD=1;KESTREL_MOE_DOWN_EARLY=1;KESTREL_MOE_DOWN_EARLY=2;KESTREL_MOE_GU_DEPTH=2;KESTREL_GEMV_PRELOAD=1 KESTREL_MOE_DOWN_EARLY=2 KESTREL_MOE_GU_DEPTH=2}" \
      timeout 300 bash tools/device/ab.sh > /dev/null 2>&1
    note "bench q4 switches (ab.sh): rc=$? in $(( $(date +%s) - T0 )) s"; cat "$W/ab.log" | tee -a "$SUMMARY"
    # The dependency-primitive micro-benchmark (kernel boundary vs in-kernel publish/wait).
    T0=$(date +%s)
    if [ "$PROBES" = 0 ]; then
      note "probes: skipped (--no-probes)"
    elif nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/device/sync_probe.cu \
         -o build-gpu/sync_probe > "$W/sync_probe_build.log" 2>&1; then
      timeout 60 build-gpu/sync_probe > "$W/results/sync_probe.json" 2> "$W/sync_probe.err"
      note "sync probe: rc=$? in $(( $(date +%s) - T0 )) s"; cat "$W/results/sync_probe.json" | tee -a "$SUMMARY"
    else
      note "sync probe: build FAILED"; tail -5 "$W/sync_probe_build.log" | tee -a "$SUMMARY"
    fi
    # What a q4 decode GEMV reaches at the real shapes in several launch layouts, and the decode
    # route's GEMV and MoE kernels with their parts switched on and off.
    for p in $([ "$PROBES" = 1 ] && echo gemv_probe moe_probe); do
      T0=$(date +%s)
      if nvcc -O3 -std=c++20 -Isrc --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
           tools/device/$p.cu -o build-gpu/$p > "$W/${p}_build.log" 2>&1; then
        timeout 120 build-gpu/$p > "$W/results/$p.json" 2> "$W/$p.err"
        note "$p: rc=$? in $(( $(date +%s) - T0 )) s"; cat "$W/results/$p.json" | tee -a "$SUMMARY"
        # The probes' machine code (the decode kernels compiled into them), for reading offline.
        command -v cuobjdump > /dev/null && cuobjdump -sass build-gpu/$p 2> /dev/null | gzip > "$W/$p.sass.gz"
      else
        note "$p: build FAILED"; tail -5 "$W/${p}_build.log" | tee -a "$SUMMARY"
      fi
    done
    pack
  fi
fi
# ---- 5. the prompt (prefill) benchmarks of issue 7
if [ -n "$BIN" ] && [ "$PREFILL_BENCH" = 1 ]; then
  T0=$(date +%s)
  KESTREL_BIN=$BIN/kestrel RESULTS=$W/results timeout 420 bash tools/device/prefill_bench.sh > "$W/bench_prefill.log" 2>&1
  note "bench prefill: rc=$? in $(( $(date +%s) - T0 )) s"; tail -30 "$W/bench_prefill.log" | tee -a "$SUMMARY"
  pack
fi
# ---- 6. per-kernel profiles (needs build-gpu/kestrel: not with --prebuilt)
if [ -z "$PREBUILT" ] && [ -n "$BIN" ] && [ "$PROFILE" = 1 ] && [ -x build-gpu/kestrel ]; then
  T0=$(date +%s)
  # PROFILE_PARTS (default "decode prefill") and STALLS=1 (warp stall reasons) pass through.
  OUT=$W PARTS="${PROFILE_PARTS:-decode prefill}" timeout 240 bash tools/device/profile.sh --prebuilt > "$W/profile.log" 2>&1
  note "profile: rc=$? in $(( $(date +%s) - T0 )) s"
  for f in "$W"/profile/summary_*.txt; do [ -f "$f" ] && { echo "-- $(basename "$f")"; head -14 "$f"; } | tee -a "$SUMMARY"; done
  [ -f "$W/profile/stalls_decode.txt" ] && head -40 "$W/profile/stalls_decode.txt" | tee -a "$SUMMARY"
fi

note "== done $(date -u +%FT%TZ)"
pack
