#!/usr/bin/env bash
# Per-kernel profiles on the GPU machine (Nsight Compute, clocks and caches left alone), summarised
# by kernel name: where a decode step and a prompt spend their time.
#   decode: graph kernel nodes of two q4 steps at ctx ${CTX:-0} (duration, DRAM bytes, grid, regs);
#   prefill: every kernel of one ${PROMPT:-4096}-token q4 prompt (duration only, one pass).
# Writes $OUT/profile/{decode,prefill}_*.csv, summary_*.txt (kernel, count, total us, share).
# Usage (repo root on the device, carry ".devdeps"): tools/device/profile.sh [--prebuilt]
#   PARTS="decode prefill" (default both), WEIGHTS=q4; DETAIL=1 adds full ncu sections of
#   DETAIL_COUNT launches of DETAIL_KERNEL (regex) in the prompt
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/profile_out}
P=$OUT/profile
mkdir -p "$P"
[ -d .devdeps ] && source tools/device/env.sh
export PATH=/usr/local/cuda/bin:$PATH
if [ "${1:-}" != --prebuilt ]; then
  T0=$(date +%s)
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DKESTREL_CUDA=ON \
    -DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc > "$P/configure.log" 2>&1 &&
  cmake --build build-gpu -j16 --target kestrel > "$P/build.log" 2>&1 || { echo "build FAILED"; tail -30 "$P/build.log"; exit 1; }
  echo "build kestrel: $(( $(date +%s) - T0 )) s"
fi
K=${KESTREL_BIN:-build-gpu/kestrel}
W=${WEIGHTS:-q4}
mkdir -p /tmp/benchres
summarise() {  # csv -> summary: kernel name (demangled base), launches, total us, share, avg us
  python3 - "$1" "$2" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3: print("no rows"); sys.exit()
h = rows[0]; data = rows[2:]
def col(name):
    for i, c in enumerate(h):
        if c == name: return i
    return None
ni, ti = col("Kernel Name"), col("gpu__time_duration.sum")
bi, gi, ri = col("dram__bytes_read.sum"), col("launch__grid_size"), col("launch__registers_per_thread")
unit = rows[1][ti]
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
agg = collections.OrderedDict()
for r in data:
    try: t = float(r[ti].replace(",", "")) * scale
    except ValueError: continue
    name = r[ni].replace("(anonymous namespace)::", "").replace("<unnamed>::", "").replace("unnamed>::", "").replace("kestrel::cuda::", "").replace("void ", "")
    key = name.split("(")[0][:70]
    if gi is not None: key += f" grid={r[gi]}"
    a = agg.setdefault(key, [0, 0.0, 0.0, r[ri] if ri is not None else ""])
    a[0] += 1; a[1] += t
    if bi is not None:
        try: a[2] += float(r[bi].replace(",", "")) * {"byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3}[rows[1][bi]]
        except ValueError: pass
tot = sum(a[1] for a in agg.values())
with open(sys.argv[2], "w") as f:
    f.write(f"{len(data)} kernels, {tot:.1f} us total (kernel durations, serialised by the profiler)\n")
    f.write(f"{'kernel':<72} {'n':>5} {'total_us':>10} {'share':>6} {'avg_us':>8} {'GB/s':>7} regs\n")
    for k, a in sorted(agg.items(), key=lambda kv: -kv[1][1]):
        bw = a[2] * 1e6 / (a[1] * 1e-6) / 1e9 if a[1] > 0 and a[2] > 0 else 0  # MB -> GB/s
        f.write(f"{k:<72} {a[0]:>5} {a[1]:>10.1f} {100*a[1]/tot:>5.1f}% {a[1]/a[0]:>8.2f} {bw:>7.0f} {a[3]}\n")
print(open(sys.argv[2]).read()[:6000])
PY
}
for part in ${PARTS:-decode prefill}; do
  T0=$(date +%s)
  if [ "$part" = decode ]; then
    # Launches before the timed region: synthetic fills + context fill + warm-up replays (~252
    # kernels each); skip 3000 to land inside the warm-up replays and profile two steps' worth.
    timeout 300 ncu --clock-control none --cache-control none --graph-profiling node \
      --launch-skip 3000 --launch-count 504 \
      --metrics gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__registers_per_thread \
      --export /tmp/ncu_decode --force-overwrite \
      $K bench --synthetic $W --contexts ${CTX:-0} --pdl off --steps 64 --warmup 32 --out /tmp/benchres \
      > "$P/decode_bench.log" 2> "$P/decode_ncu.err"
    echo "ncu decode: rc=$? in $(( $(date +%s) - T0 )) s"
    ncu --import /tmp/ncu_decode.ncu-rep --csv --page raw > "$P/decode_${W}_ctx${CTX:-0}.csv" 2>> "$P/decode_ncu.err"
    summarise "$P/decode_${W}_ctx${CTX:-0}.csv" "$P/summary_decode_${W}_ctx${CTX:-0}.txt"
    if [ "${STALLS:-0}" = 1 ]; then
      # Where each kernel's warps wait (WarpStateStats: cycles per issued instruction by reason;
      # "no_instruction" = instruction fetch), one step's kernels.
      T1=$(date +%s)
      timeout 200 ncu --clock-control none --cache-control none --graph-profiling node \
        --launch-skip 3000 --launch-count 252 --section WarpStateStats \
        --export /tmp/ncu_stalls --force-overwrite \
        $K bench --synthetic $W --contexts ${CTX:-0} --pdl off --steps 64 --warmup 32 --out /tmp/benchres \
        > "$P/stalls_bench.log" 2> "$P/stalls_ncu.err"
      echo "ncu stalls: rc=$? in $(( $(date +%s) - T1 )) s"
      ncu --import /tmp/ncu_stalls.ncu-rep --csv --page raw > "$P/stalls_decode.csv" 2>> "$P/stalls_ncu.err"
      python3 - "$P/stalls_decode.csv" > "$P/stalls_decode.txt" <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
if len(rows) < 3: print("no rows"); sys.exit()
h = rows[0]; data = rows[2:]
ni = h.index("Kernel Name")
cols = [i for i, c in enumerate(h) if "issue_stalled" in c and c.endswith("_per_warp_active.pct")]
if not cols: cols = [i for i, c in enumerate(h) if "issue_stalled" in c and "per_issue_active" in c]
agg = collections.OrderedDict()
for r in data:
    k = r[ni].split("(")[0].replace("(anonymous namespace)::", "").replace("kestrel::cuda::", "").replace("void ", "")[-48:]
    a = agg.setdefault(k, [0] + [0.0] * len(cols))
    a[0] += 1
    for j, i in enumerate(cols):
        try: a[j + 1] += float(r[i].replace(",", ""))
        except ValueError: pass
short = [h[i].replace("smsp__average_warps_issue_stalled_", "").replace("smsp__warps_issue_stalled_", "")[:22] for i in cols]
for k, a in agg.items():
    v = sorted(((a[j + 1] / a[0], short[j]) for j in range(len(cols))), reverse=True)[:6]
    print(f"{k:<48} n={a[0]:<3} " + "  ".join(f"{n}={x:.2f}" for x, n in v))
PY
    fi
  else
    # Only the prompt path's kernels (names of prefill*.cu); the warm-up prompt is the one profiled.
    timeout 300 ncu --clock-control none --cache-control none \
      --kernel-name regex:'(gemm_kernel|dq_kernel|ws_kernel|rs_kernel|split_kernel|gemm_f32_kernel|gemm_tc_kernel|gdn_prep_kernel|gdn_scan_kernel|conv_kernel|conv_state_kernel|flash_kernel|attn_prep_kernel|route_|combine_kernel|rmsnorm_rows_kernel|gated_norm_kernel|embed_kernel|to_bf16_kernel|seq_end_kernel)' \
      --launch-count ${PREFILL_LAUNCHES:-1500} --metrics gpu__time_duration.sum,launch__grid_size \
      --export /tmp/ncu_prefill --force-overwrite \
      $K bench --synthetic $W --prefill ${PROMPT:-4096} --prefill-runs 1 --out /tmp/benchres \
      > "$P/prefill_bench.log" 2> "$P/prefill_ncu.err"
    echo "ncu prefill: rc=$? in $(( $(date +%s) - T0 )) s"
    ncu --import /tmp/ncu_prefill.ncu-rep --csv --page raw > "$P/prefill_${W}_${PROMPT:-4096}.csv" 2>> "$P/prefill_ncu.err"
    summarise "$P/prefill_${W}_${PROMPT:-4096}.csv" "$P/summary_prefill_${W}_${PROMPT:-4096}.txt"
    if [ "${DETAIL:-0}" = 1 ]; then
      # Full sections (speed of light, pipes, warp states, instruction mix) of a few launches of
      # ${DETAIL_KERNEL:-pipe_gemm_kernel}: what bounds the GEMM (issue, tensor pipe, shared memory).
      T1=$(date +%s)
      timeout 240 ncu --clock-control none --cache-control none \
        --kernel-name regex:"${DETAIL_KERNEL:-pipe_gemm_kernel}" --launch-skip ${DETAIL_SKIP:-0} \
        --launch-count ${DETAIL_COUNT:-8} --set full --import-source no \
        --export /tmp/ncu_detail --force-overwrite \
        $K bench --synthetic $W --prefill ${PROMPT:-4096} --prefill-runs 1 --out /tmp/benchres \
        > "$P/detail_bench.log" 2> "$P/detail_ncu.err"
      echo "ncu detail: rc=$? in $(( $(date +%s) - T1 )) s"
      ncu --import /tmp/ncu_detail.ncu-rep --page details > "$P/detail_${W}_${PROMPT:-4096}.txt" 2>> "$P/detail_ncu.err"
      # Warp stall reasons per launch (cycles per issued instruction), from the raw metrics.
      ncu --import /tmp/ncu_detail.ncu-rep --page raw --csv 2>> "$P/detail_ncu.err" | python3 -c '
import csv, sys
rows = list(csv.reader(sys.stdin))
h = rows[0]
cols = [i for i, c in enumerate(h) if "issue_stalled" in c and "not_issued" not in c]
ni = h.index("Kernel Name"); gi = h.index("Grid Size") if "Grid Size" in h else None
for r in rows[2:]:
    vals = []
    for i in cols:
        try: vals.append((float(r[i].replace(",", "")), h[i]))
        except ValueError: pass
    vals.sort(reverse=True)
    print(r[ni][:60], r[gi] if gi is not None else "")
    for v, n in vals[:16]: print(f"   {v:8.3f}  {n}")
' > "$P/stalls_${W}_${PROMPT:-4096}.txt"
      tail -3 "$P/detail_ncu.err"
    fi
  fi
  tail -3 "$P/${part}_ncu.err"
done
