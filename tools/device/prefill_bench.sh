#!/usr/bin/env bash
# Prompt (prefill) benchmark of issue 7 on the GPU machine: `kestrel bench --synthetic q4|bf16
# --prefill ...` through the real backend step on the full-size synthetic model (JSON records,
# kind=prefill). Called by tools/gpu_check.sh when present (KESTREL_BIN, RESULTS set there), or by
# hand from the repo root:
#   bash tools/device/prefill_bench.sh            # KESTREL_BIN defaults to build-gpu/kestrel
# The q4 short prompts on both GEMM routes (split, f16), the rest on split (the default) unless APREC is set;
# the short prompts' split route on both of its GEMM kernels (reg, pipe), the long ones on the
# default choice (auto: pipe for 8K chunks), unless GEMM is set. Order: the short prompts of both formats first, then 32K, then 128K, one process each (the
# synthetic model is rebuilt per process, a few seconds), so that an outer time limit cuts the
# longest runs and keeps the records already written.
set -uo pipefail
BIN=${KESTREL_BIN:-build-gpu/kestrel}
RES=${RESULTS:-${OUT:-/tmp/prefill-bench}}
mkdir -p "$RES"
[ -x "$BIN" ] || { echo "prefill_bench: no kestrel binary at $BIN" >&2; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,temperature.gpu --format=csv 2>&1 | head -3
rc=0
run() {  # weights prompts timeout_s
  local t0=$(date +%s)
  timeout "$3" "$BIN" bench --synthetic "$1" --prefill "$2" --prefill-runs 3 --prefill-aprec "${APREC:-both}" \
    --prefill-gemm "${GEMM:-both}" --out "$RES" || {
    echo "prefill_bench: $1 $2 failed or timed out (rc $?)"; rc=1; }
  echo "prefill_bench: $1 $2 took $(( $(date +%s) - t0 )) s"
}
run q4 512,1024,2048,4096 60                        # both routes (APREC default: both)
APREC=f16 GEMM=reg KESTREL_PREFILL_MOE_BM=64 run q4 4096 60  # the F16 route with 64-row expert tiles
APREC=${APREC:-split} run bf16 512,4096 60
APREC=${APREC:-split} GEMM=${GEMM:-auto} run q4 32768 60
APREC=${APREC:-split} GEMM=${GEMM:-auto} run bf16 32768 60
APREC=${APREC:-split} GEMM=${GEMM:-auto} run q4 131072 150
[ "${SKIP_BF16_128K:-0}" = 1 ] || APREC=${APREC:-split} GEMM=${GEMM:-auto} run bf16 131072 150
ls -la "$RES"/prefill-*.json 2>/dev/null
exit $rc
