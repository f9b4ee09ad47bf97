#!/usr/bin/env bash
# One device call for prompt-path work with binaries built here (carry ["build-xfer"]:
# build-xfer/pack.tar.xz = tar -cJf of build-pack from `tools/gpu_check.sh --pack build build-pack`,
# optionally with an older kestrel as build-pack/bin/kestrel_old for the A/B):
#   1. the prompt-path GPU tests (TESTS, a gtest filter; "none" skips);
#   2. the A/B of the q4 prompt bench (tools/device/ab.sh, AB_KIND=prefill) over VARIANTS;
#   3. the records: q4 at REC_Q4 prompt sizes, bf16 at REC_BF16 (JSON under results/);
#   4. a Nsight Compute profile of one 4K q4 prompt (tools/device/profile.sh, PROFILE=0 skips).
# Everything goes into $OUT/call.tgz, re-packed after each stage so that a call stopped at its
# limit still returns what was done; $OUT/summary.txt is the short log.
#   KESTREL_GIT_SHA: the commit of the binaries (the device copy is not a git repository).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/prefill_call_out}
W=$OUT/call
mkdir -p "$W/results"
S=$OUT/summary.txt
: > "$S"
note() { echo "$*" | tee -a "$S"; }
pack() { cp "$S" "$W/"; tar -czf "$OUT/call.tgz" -C "$OUT" call; }
[ -f build-xfer/pack.tar.xz ] && [ ! -d build-pack ] && tar -xJf build-xfer/pack.tar.xz
export LD_LIBRARY_PATH=$PWD/build-pack/lib:/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
B=build-pack/bin
note "== prefill_call $(date -u +%FT%TZ) sha=${KESTREL_GIT_SHA:-unknown}"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee -a "$S"

T="${TESTS:-PrefillPipe.*:PrefillE2E.*:PrefillMoe.*:PrefillGdn*:PrefillOps.*}"
if [ "$T" != none ]; then
  T0=$(date +%s)
  timeout "${TEST_TIMEOUT:-240}" $B/test_cuda --gtest_filter="$T" --gtest_output=json:"$W/tests.json" > "$W/test_cuda.log" 2>&1
  note "tests: rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests ran" "$W/test_cuda.log" | head -40 | tee -a "$S"
  pack
fi

if [ -n "${VARIANTS+x}" ]; then
  T0=$(date +%s)
  OUT=$W/ab AB_KIND=prefill PREFILL="${AB_PREFILL:-2048,4096,32768}" BIN=$B bash tools/device/ab.sh > "$W/ab_stdout.log" 2>&1
  note "ab: rc=$? in $(( $(date +%s) - T0 )) s"
  grep -E "^== |tok/s" "$W/ab/ab.log" | tee -a "$S"
  pack
fi

if [ "${REC_Q4:-512,4096,32768,131072}" != none ]; then
  T0=$(date +%s)
  timeout 200 $B/kestrel bench --synthetic q4 --prefill "${REC_Q4:-512,4096,32768,131072}" --prefill-runs 3 \
    --prefill-aprec split --prefill-gemm auto --out "$W/results" > "$W/rec_q4.log" 2>&1
  note "records q4: rc=$? in $(( $(date +%s) - T0 )) s"; grep -vE '^\s*$' "$W/rec_q4.log" | tail -6 | tee -a "$S"
  pack
fi
if [ "${REC_BF16:-512,4096,32768}" != none ]; then
  T0=$(date +%s)
  timeout 150 $B/kestrel bench --synthetic bf16 --prefill "${REC_BF16:-512,4096,32768}" --prefill-runs 3 \
    --prefill-aprec split --prefill-gemm auto --out "$W/results" > "$W/rec_bf16.log" 2>&1
  note "records bf16: rc=$? in $(( $(date +%s) - T0 )) s"; grep -vE '^\s*$' "$W/rec_bf16.log" | tail -5 | tee -a "$S"
  pack
fi

if [ "${PROFILE:-1}" != 0 ]; then
  T0=$(date +%s)
  OUT=$W KESTREL_BIN=$B/kestrel PARTS=prefill DETAIL="${DETAIL:-1}" DETAIL_KERNEL="${DETAIL_KERNEL:-pipe_gemm_kernel}" \
    DETAIL_COUNT="${DETAIL_COUNT:-1}" timeout "${PROFILE_TIMEOUT:-200}" bash tools/device/profile.sh --prebuilt > "$W/profile_stdout.log" 2>&1
  note "profile: rc=$? in $(( $(date +%s) - T0 )) s"
  head -30 "$W"/profile/summary_prefill*.txt 2>/dev/null | tee -a "$S"
  pack
fi
note "== done $(date -u +%FT%TZ)"
pack
