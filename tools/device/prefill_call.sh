#!/usr/bin/env bash
# One device call for prompt-path work with binaries built here (carry ["build-xfer"]:
# build-xfer/pack.tar.xz = tar -cJf of build-pack from `tools/gpu_check.sh --pack build build-pack`,
# optionally with an older kestrel as build-pack/bin/kestrel_old for the A/B):
#   1. the prompt-path GPU tests (TESTS, a gtest filter; "none" skips; TESTS2 + TESTS2_ENV a second
#      run under other settings); SASS (a regex) dumps those kernels' SASS;
#   2. the A/B of the q4 prompt bench (tools/device/ab.sh, AB_KIND=prefill) over VARIANTS (";X=1"
#      is the defaults and X=1; ab.sh drops a trailing empty variant) at AB_PREFILL prompt sizes;
#      with AB_PREFIX, again at AB_PREFIX_PREFILL sizes after a cached prefix of AB_PREFIX tokens;
#   3. the records: q4 at REC_Q4 prompt sizes, bf16 at REC_BF16 (JSON under results/; REC_ENV);
#   3b. decode: the A/B of DEC_VARIANTS at DEC_CTX and the records at REC_DEC_Q4 / REC_DEC_BF16 (under REC_DEC_ENV);
#   4. a Nsight Compute profile of one 4K q4 prompt (tools/device/profile.sh, PROFILE=0 skips;
#      PROFILE_ENV).
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

# A second test run under other settings (TESTS2, a gtest filter; TESTS2_ENV, VAR=value words).
if [ -n "${TESTS2:-}" ]; then
  T0=$(date +%s)
  env ${TESTS2_ENV:-} timeout "${TEST_TIMEOUT:-240}" $B/test_cuda --gtest_filter="$TESTS2" > "$W/test_cuda2.log" 2>&1
  rc2=$?
  note "tests [${TESTS2_ENV:-}]: rc=$rc2 in $(( $(date +%s) - T0 )) s"
  # IF_TESTS2_PASS=1: the records and the profile run under TESTS2_ENV only if these tests passed.
  if [ "${IF_TESTS2_PASS:-0}" = 1 ]; then
    if [ $rc2 = 0 ]; then REC_ENV=$TESTS2_ENV; PROFILE_ENV=$TESTS2_ENV; else REC_ENV=""; PROFILE_ENV=""; fi
    note "records and profile under [${REC_ENV}]"
  fi
  grep -E "^\[  (PASSED|FAILED) |^\[  FAILED|tests ran" "$W/test_cuda2.log" | head -40 | tee -a "$S"
  pack
fi
# The SASS of the kernels matching SASS (a regex on mangled names): instruction mix per kernel.
if [ -n "${SASS:-}" ]; then
  /usr/local/cuda/bin/cuobjdump -sass $B/kestrel 2>/dev/null | awk -v re="$SASS" '
    /Function :/ { keep = ($0 ~ re) } keep { print }' > "$W/sass.txt"
  note "sass: $(grep -c 'Function :' "$W/sass.txt") functions, $(wc -l < "$W/sass.txt") lines"
  pack
fi

if [ -n "${VARIANTS+x}" ]; then
  T0=$(date +%s)
  OUT=$W/ab TESTS=none SANITIZE= AB_KIND=prefill PREFILL="${AB_PREFILL:-2048,4096,32768}" PREFILL_PREFIX=0 BIN=$B bash tools/device/ab.sh > "$W/ab_stdout.log" 2>&1
  note "ab: rc=$? in $(( $(date +%s) - T0 )) s"
  cat "$W/ab/ab.log" | tee -a "$S"
  pack
  # AB_PREFIX (tokens): the same variants on prompts of AB_PREFIX_PREFILL tokens after a cached
  # prefix of that many (a follow-up turn: a short chunk attending to a long context).
  if [ -n "${AB_PREFIX:-}" ]; then
    T0=$(date +%s)
    OUT=$W/abpre TESTS=none SANITIZE= AB_KIND=prefill PREFILL="${AB_PREFIX_PREFILL:-512,4096}" PREFILL_PREFIX="$AB_PREFIX" \
      BIN=$B bash tools/device/ab.sh > "$W/abpre_stdout.log" 2>&1
    note "ab after a prefix of $AB_PREFIX: rc=$? in $(( $(date +%s) - T0 )) s"
    cat "$W/abpre/ab.log" | tee -a "$S"
    pack
  fi
fi

# Decode: the A/B of DEC_VARIANTS (ab.sh, q4 at DEC_CTX) and the decode records (q4 at REC_DEC_Q4
# contexts, bf16 at REC_DEC_BF16; "none" or unset skips), the defaults of `gpu_check.sh`'s bench.
if [ -n "${DEC_VARIANTS+x}" ]; then
  T0=$(date +%s)
  OUT=$W/abdec TESTS=none SANITIZE= BENCH_CTX="${DEC_CTX:-0,4096}" BIN=$B VARIANTS="$DEC_VARIANTS" bash tools/device/ab.sh > "$W/abdec_stdout.log" 2>&1
  note "ab decode: rc=$? in $(( $(date +%s) - T0 )) s"
  cat "$W/abdec/ab.log" | tee -a "$S"
  pack
fi
# rec_dec WEIGHTS CONTEXTS MOE LIMIT_S: the decode bench's JSON records (under REC_DEC_ENV) into results/.
rec_dec() {
  [ -n "$2" ] && [ "$2" != none ] || return 0
  local T0; T0=$(date +%s)
  env ${REC_DEC_ENV:-} timeout "$4" $B/kestrel bench --synthetic "$1" --contexts "$2" --steps 128 --gemv 1 --pdl on \
    --moe "$3" --route auto --route-algo block --out "$W/results" > "$W/rec_dec_$1.log" 2>&1
  note "decode records $1: rc=$? in $(( $(date +%s) - T0 )) s"; grep -vE '^\s*$' "$W/rec_dec_$1.log" | tail -6 | tee -a "$S"
  pack
}
rec_dec q4 "${REC_DEC_Q4:-}" mma 200
rec_dec bf16 "${REC_DEC_BF16:-}" split 100

# record WEIGHTS SIZES LIMIT_S: the prompt bench's JSON records (under REC_ENV) into results/.
record() {
  [ "$2" = none ] && return
  local T0=$(date +%s)
  env ${REC_ENV:-} timeout "$3" $B/kestrel bench --synthetic "$1" --prefill "$2" --prefill-runs 3 \
    --prefill-aprec split --prefill-gemm auto --out "$W/results" > "$W/rec_$1.log" 2>&1
  note "records $1: rc=$? in $(( $(date +%s) - T0 )) s"; grep -vE '^\s*$' "$W/rec_$1.log" | tail -6 | tee -a "$S"
  pack
}
record q4 "${REC_Q4:-512,4096,32768,131072}" 200
record bf16 "${REC_BF16:-512,4096,32768}" 150

if [ "${PROFILE:-1}" != 0 ]; then
  T0=$(date +%s)
  env ${PROFILE_ENV:-} OUT=$W KESTREL_BIN=$B/kestrel PARTS=prefill DETAIL="${DETAIL:-1}" DETAIL_KERNEL="${DETAIL_KERNEL:-pipe_gemm_kernel}" \
    DETAIL_COUNT="${DETAIL_COUNT:-1}" timeout "${PROFILE_TIMEOUT:-200}" bash tools/device/profile.sh --prebuilt > "$W/profile_stdout.log" 2>&1
  note "profile: rc=$? in $(( $(date +%s) - T0 )) s"
  head -30 "$W"/profile/summary_prefill*.txt 2>/dev/null | tee -a "$S"
  pack
fi
note "== done $(date -u +%FT%TZ)"
pack
