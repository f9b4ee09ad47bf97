#!/usr/bin/env bash
# Per-kernel profile of one decode step on the GPU machine (Nsight Compute, graph kernel nodes one
# by one, clocks left alone): kernel name, duration, DRAM bytes, grid, registers, occupancy.
# Writes $OUT/profile/{ncu_q4.csv, ncu_bf16.csv, bench_*.log}. Usage: tools/device/profile_decode.sh
# [--prebuilt BUILD_DIR]   (run from the repo root; carry ".devdeps")
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/profile_out}
P=$OUT/profile
mkdir -p "$P"
[ -d .devdeps ] && source tools/device/env.sh
export PATH=/usr/local/cuda/bin:$PATH
B=${1:-}
mkdir -p /tmp/benchres
if [ "$B" != --prebuilt ]; then
  T0=$(date +%s)
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$P/configure.log" 2>&1 &&
  cmake --build build-gpu -j16 --target kestrel > "$P/build.log" 2>&1 || { echo "build FAILED"; tail -30 "$P/build.log"; exit 1; }
  echo "build kestrel: $(( $(date +%s) - T0 )) s"
fi
K=build-gpu/kestrel
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active
for w in ${WEIGHTS:-q4 bf16}; do
  T0=$(date +%s)
  # Launches before the timed region: synthetic weight fills + context fill + 16 warm-up replays
  # (252 kernels each); skip 3000 to land inside the warm-up replays, profile 2 steps' worth.
  timeout 240 ncu --clock-control none --graph-profiling node --launch-skip 3000 --launch-count 520 \
    --metrics $METRICS --export "/tmp/ncu_$w" --force-overwrite \
    $K bench --synthetic $w --contexts ${CTX:-0} --steps 64 --warmup 32 --out /tmp/benchres > "$P/bench_${w}_ctx${CTX:-0}.log" 2> "$P/ncu_$w.err"
  echo "ncu $w: rc=$? in $(( $(date +%s) - T0 )) s"
  ncu --import "/tmp/ncu_$w.ncu-rep" --csv --page raw > "$P/ncu_${w}_ctx${CTX:-0}.csv" 2>> "$P/ncu_$w.err"
  echo "  $(wc -l < "$P/ncu_${w}_ctx${CTX:-0}.csv") csv lines"
  tail -3 "$P/ncu_$w.err"
done
