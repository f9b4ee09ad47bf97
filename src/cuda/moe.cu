// MoE decode (model-spec §3.6) for one token, entirely on the GPU with no host synchronisation.
// The routing ran at the end of the router GEMV (RouteTail: its last block); then
//   moe_gate_up: each warp computes the gate and up rows of 1-2 (slot, i) tasks and writes
//     act = silu(g) * u; the expert rows' loads are issued before h is staged.
//   moe_down: each block owns 8 output rows; its 16 half-warps share the (row, slot) dots of the
//     k experts and the shared expert (the first pass's loads are issued before the activations
//     are staged), then the rows are combined in ascending expert order, the shared expert added
//     with its sigmoid gate, and the result added into the residual stream.
//   moe_experts: both in one launch (the gate/up blocks first, then the down blocks, which issue
//     their expert rows' loads and wait on a completion count of the gate/up blocks instead of a
//     kernel boundary).
// The router, shared-expert gate/up and sigmoid gate logits come from that fused GEMV before.
#include "cuda/gemv_core.cuh"
#include "cuda/mma_dot.cuh"
#include "cuda/moe_route.cuh"

#include <algorithm>

namespace kestrel::cuda {

namespace {

constexpr int kMaxK = 16;

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }
// The shared expert's activation silu(g) * u, 4 elements.
__device__ __forceinline__ float4 silu_mul4(float4 g, float4 u) {
  return make_float4(silu_f(g.x) * u.x, silu_f(g.y) * u.y, silu_f(g.z) * u.z, silu_f(g.w) * u.w);
}

// RoutePlace::GateUp: every block of a gate/up launch (256 threads) routes for itself into
// sidx / sw (the same selection in each); block vb 0 also writes it for moe_down. Returns the
// selection to read: sidx then, else a.topk_idx (routed before the launch).
__device__ __forceinline__ const int* gate_up_selection(const MoeGateUpArgs& a, int vb, int* sidx, float* sw) {
  if (a.logits == nullptr) return a.topk_idx;
  moe_route_any(a.algo, a.logits, int(a.E), a.topk, sidx, sw);
  __syncthreads();
  if (vb == 0 && threadIdx.x < unsigned(a.topk)) {
    a.route_idx[threadIdx.x] = sidx[threadIdx.x];
    a.route_w[threadIdx.x] = sw[threadIdx.x];
  }
  if (vb == 0 && a.sel_ready != nullptr) {  // block-uniform
    // The selection's writers, then one release by thread 0 (cumulative over the barrier): a
    // moe_down block that acquires the flag sees the selection (SelRead::Flag).
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(a.sel_ready), "r"(1u) : "memory");
    }
  }
  return sidx;
}

// Tasks per warp: 2 for q4 (4 weight rows of 2 chunks per lane in flight), 1 otherwise.
template <DFmt F>
constexpr int kGuTasks = F == DFmt::Q4 ? 2 : 1;

// In the fused launch (moe_experts_kernel) a q4 warp takes 4 tasks, so that its 128 gate/up
// blocks and 128 down blocks of 16 rows are all resident at once (2 per SM): the down blocks' weight
// loads then overlap the gate/up blocks instead of waiting for a free slot.
template <DFmt F>
constexpr int kFusedGuTasks = F == DFmt::Q4 ? 4 : F == DFmt::Q8 ? 2 : 1;
constexpr int kFusedDownRows = kMoeFusedDownRows;

__host__ __device__ constexpr int gate_up_blocks(int64_t tasks, int tw) { return int((tasks + 8 * tw - 1) / (8 * tw)); }

// Block vb of moe_gate_up (a 1-D grid of gate_up_blocks(topk * I, TW) blocks of 256 threads).
template <DFmt F, int TW>
__device__ __forceinline__ void gate_up_block(const MoeGateUpArgs& a, int vb) {
  constexpr int K = 2048;
  __shared__ float4 xs4[K / 4];
  __shared__ float xsum[K / 16];
  float* xs = reinterpret_cast<float*>(xs4);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float4 h0 = ld4(a.h + 4 * tid), h1 = ld4(a.h + 4 * (tid + 256));
  __shared__ int sidx[kMaxK];
  __shared__ float sw[kMaxK];
  const int* topk_idx = gate_up_selection(a, vb, sidx, sw);
  const int64_t ntask = int64_t(a.topk) * a.I;
  const int64_t t0 = (int64_t(vb) * 8 + warp) * TW;
  const DMat* w[2 * TW];
  int64_t rows[2 * TW];
#pragma unroll
  for (int j = 0; j < TW; ++j) {
    const int64_t t = t0 + j;
    w[2 * j] = w[2 * j + 1] = nullptr;
    rows[2 * j] = rows[2 * j + 1] = 0;
    if (t < ntask) {
      // 32-bit division (tasks <= 16 * I): the 64-bit one is a ~70-instruction call ahead of the
      // topk_idx load that every weight load waits on.
      const int slot = int(t) / int(a.I);
      const int64_t row = int64_t(topk_idx[slot]) * a.I + (int(t) - slot * int(a.I));
      w[2 * j] = &a.gate;
      w[2 * j + 1] = &a.up;
      rows[2 * j] = rows[2 * j + 1] = row;
    }
  }
  RowLoads<F, K, 32, 2 * TW> L;
  L.issue(w, rows, lane);
  smem_store4(xs, xsum, K, 0, tid, h0);
  smem_store4(xs, xsum, K, 0, tid + 256, h1);
  __syncthreads();
  const SmemX X{xs, xsum, K};
  SmemX Xs[2 * TW];
#pragma unroll
  for (int j = 0; j < 2 * TW; ++j) Xs[j] = X;
  float out[2 * TW];
  L.dot(Xs, lane, out);
#pragma unroll
  for (int j = 0; j < TW; ++j) {
    const float g = warp_sum(out[2 * j]), u = warp_sum(out[2 * j + 1]);
    const int64_t t = t0 + j;
    if (lane == 0 && t < ntask) a.act[t] = silu_f(g) * u;  // act[slot * I + i] == act[t]
  }
}

template <DFmt F>
__global__ void __launch_bounds__(256) moe_gate_up_kernel(const __grid_constant__ MoeGateUpArgs a) {
  pdl_wait();
  gate_up_block<F, kGuTasks<F>>(a, blockIdx.x);  // (the trigger: at exit)
}

// moe_gate_up with q4 experts on the tensor cores (mma_dot.cuh; the default, KESTREL_MOE_MMA=0
// for the scalar kernel; 7.0 against 9.0 us per launch in moe_probe at 4aabe9a): a tile is 8
// intermediate units i of one slot, its 16 rows the 8 gate rows (g) and the 8 up rows (g + 8);
// warp w takes the w-th eighth of the hidden size (4 groups), the 8 partial sums are reduced in
// shared memory and threads 0..7 write act = silu(gate) * up. The first tile's loads go out before
// h is staged, each later tile's before the previous tile's reduction.
constexpr int kGuMmaRows = kMmaTileRows / 2;  // intermediate units per tile
// D (moe_gate_up_depth): tiles whose loads a block keeps in flight. D = 1 issues a tile's loads
// after the previous tile's dot, so a block with two tiles (the launch's 512 tiles over 264
// blocks) waits on DRAM twice in a row; D = 2 issues the second tile's loads with the first's
// (two register sets: __launch_bounds__ then holds 2 blocks per SM, which is the grid anyway).
template <int D>
__global__ void __launch_bounds__(256, D == 1 ? 3 : 2) moe_gate_up_mma_kernel(const __grid_constant__ MoeGateUpArgs a) {
  static_assert(D == 1 || D == 2, "tiles in flight: 1 or 2");
  constexpr int K = 2048, NG = K / 64 / 8;
  __shared__ float4 xs4[K / 4];
  __shared__ float xsum[K / 16];
  __shared__ MmaB<K> B;
  __shared__ float part[2][8][kMmaTileRows];
  __shared__ int sidx[kMaxK];
  __shared__ float sw[kMaxK];
  float* xs = reinterpret_cast<float*>(xs4);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = lane & 3, g = lane >> 2;
  pdl_wait();
  const float4 h0 = ld4(a.h + 4 * tid), h1 = ld4(a.h + 4 * (tid + 256));
  const int* topk_idx = gate_up_selection(a, int(blockIdx.x), sidx, sw);
  // (After the wait and, in block 0, after the selection is published: common.cuh's rule for
  // what a successor may read early holds, and moe_down's flag is set before it can launch.)
  if (a.trigger_early) pdl_launch_dependents();
  const int per_slot = int(a.I) / kGuMmaRows;
  const int ntiles = a.topk * per_slot;
  const int G0 = warp * NG;
  const int grid = int(gridDim.x);
  struct Tile {  // one tile's gate (0) and up (1) rows of this lane
    uint2 q[2][NG];
    uint32_t scw[2][NG / 2], biw[2][NG / 2];
  };
  const auto load_tile = [&](int tile, Tile& T) {
    const int slot = tile / per_slot;
    const int64_t row = int64_t(topk_idx[slot]) * a.I + (tile - slot * per_slot) * kGuMmaRows + g;
    mma_load_row<K, NG>(a.gate, row, G0, t, T.q[0], T.scw[0], T.biw[0]);
    mma_load_row<K, NG>(a.up, row, G0, t, T.q[1], T.scw[1], T.biw[1]);
  };
  // The dot of `tile` from T, the next load into T (tile + D * grid) before the reduction, then
  // the reduction through part[buf] and act = silu(gate) * up.
  const auto run_tile = [&](int tile, Tile& T, int buf) {
    float acc[2] = {0.f, 0.f};
    mma_tile_dot<K, NG>(T.q, T.scw, T.biw, B, G0, lane, acc);
    if (tile + D * grid < ntiles) load_tile(tile + D * grid, T);
#pragma unroll
    for (int h = 0; h < 2; ++h) acc[h] = group_sum<4>(acc[h]);
    if (t == 0) {
      part[buf][warp][g] = acc[0];
      part[buf][warp][g + 8] = acc[1];
    }
    __syncthreads();
    if (tid < kGuMmaRows) {
      float gv = 0.f, uv = 0.f;
#pragma unroll
      for (int w = 0; w < 8; ++w) {
        gv += part[buf][w][tid];
        uv += part[buf][w][tid + 8];
      }
      const int slot = tile / per_slot;
      a.act[int64_t(slot) * a.I + (tile - slot * per_slot) * kGuMmaRows + tid] = silu_f(gv) * uv;
    }
  };
  Tile T0, T1;
  const int first = int(blockIdx.x);
  if (first < ntiles) load_tile(first, T0);
  if (D == 2 && first + grid < ntiles) load_tile(first + grid, T1);
  smem_store4(xs, xsum, K, 0, tid, h0);
  smem_store4(xs, xsum, K, 0, tid + 256, h1);
  __syncthreads();
  mma_build_b<K>(B, xs, xsum, 256);
  __syncthreads();
  if constexpr (D == 1) {
    int buf = 0;
    for (int tile = first; tile < ntiles; tile += grid, buf ^= 1) run_tile(tile, T0, buf);
  } else {
    // Tiles alternate between the two register sets (named, so no dynamic register indexing).
    for (int tile = first; tile < ntiles; tile += 2 * grid) {
      run_tile(tile, T0, 0);
      if (tile + grid >= ntiles) break;
      run_tile(tile + grid, T1, 1);
    }
  }
  pdl_launch_dependents();  // (at the end unless trigger_early: these blocks fill the GPU; common.cuh)
}

// Dependencies between the two parts of the fused launch (moe_experts_kernel): the gate/up blocks
// publish (every thread's writes fenced, then one count per block), the down blocks wait for the
// count of all of them after issuing their first weight loads.
__device__ __forceinline__ void publish(unsigned* ready) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(ready, 1u);
}
// Thread 0 spins (acquire loads) until *ready >= target, then a block barrier. Traps after ~2 s:
// a dependency that can never be met (a launch with too few blocks resident) fails the launch
// instead of hanging the GPU.
__device__ __forceinline__ void wait_ready(const unsigned* ready, unsigned target) {
  if (threadIdx.x == 0) {
    const long long t0 = clock64();
    for (;;) {
      unsigned v;
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ready) : "memory");
      if (v >= target) break;
      __nanosleep(32);
      if (clock64() - t0 > (1ll << 32)) __trap();
    }
  }
  __syncthreads();
}
// The last of n waiting blocks resets both counters for the next launch (every waiter has passed
// its wait by then; the next launch starts after this one ends).
__device__ __forceinline__ void retire(unsigned* ready, unsigned* passed, unsigned n) {
  if (threadIdx.x == 0 && atomicAdd(passed, 1u) == n - 1) {
    *ready = 0u;
    *passed = 0u;
  }
}

constexpr int kDownRows = 8;          // output rows per block (the two-launch route)
constexpr int kHalfWarps = 16;        // 256 threads / 16 lanes

// Block vb of moe_down (hidden / ROWS blocks of 256 threads). The routed activations are read
// through L2 (__ldcg): with ready != nullptr they come from blocks of the same launch, and the
// block waits for *ready >= target after its first pass of weight loads is in flight.
template <DFmt F, int KI, int ROWS>
__device__ __forceinline__ void down_block(const MoeDownArgs& a, int vb, const unsigned* ready, unsigned target) {
  constexpr int kDownRows = ROWS;
  constexpr int kTasksPerHalf = (kDownRows * (kMaxK + 1) + kHalfWarps - 1) / kHalfWarps;  // 9 for 8 rows
  // Activations: rows 0..topk-1 routed, row topk shared; each [KI] in the swizzled layout.
  __shared__ float4 xs4[(kMaxK + 1) * KI / 4];
  __shared__ float xsum[(kMaxK + 1) * KI / 16];
  __shared__ float res[kDownRows][kMaxK + 1];
  __shared__ float wts[kMaxK];
  float* xs = reinterpret_cast<float*>(xs4);
  const int tid = threadIdx.x;
  const int nm = a.topk + 1;
  const int hw = tid >> 4, li = tid & 15;
  const int r0 = vb * kDownRows;
  const int ntasks = kDownRows * nm;
  // Tasks of this half-warp in passes of P (all loads of a pass in flight together; P keeps the
  // code registers of a pass at <= ~40).
  constexpr int P = F == DFmt::BF16 ? 3 : F == DFmt::Q8 ? 5 : 9;
  auto task_rows = [&](int base, const DMat* (&w)[P], int64_t (&rows)[P], SmemX (&X)[P]) {
#pragma unroll
    for (int t = 0; t < P; ++t) {
      const int task = hw + kHalfWarps * (base + t);
      w[t] = nullptr;
      rows[t] = 0;
      X[t] = SmemX{xs, xsum, KI};
      if (base + t < kTasksPerHalf && task < ntasks) {
        const int rr = task / nm, m = task % nm;
        X[t] = SmemX{xs + size_t(m) * KI, xsum + size_t(m) * (KI / 16), KI};
        if (m < a.topk) {
          w[t] = &a.down;
          rows[t] = int64_t(a.topk_idx[m]) * a.hidden + r0 + rr;
        } else {
          w[t] = &a.shared_down;
          rows[t] = r0 + rr;
        }
      }
    }
  };
  auto finish = [&](int base, const RowLoads<F, KI, 16, P>& L, const SmemX (&X)[P]) {
    float out[P];
    L.dot(X, li, out);
#pragma unroll
    for (int t = 0; t < P; ++t) {
      const float v = group_sum<16>(out[t]);
      const int task = hw + kHalfWarps * (base + t);
      if (li == 0 && base + t < kTasksPerHalf && task < ntasks) res[task / nm][task % nm] = v;
    }
  };
  // The routing weights, the shared gate and this block's residual rows are loaded now, with
  // topk_idx (the final combine used to load topk_w in its loop: one dependent round trip per
  // expert at the very end).
  float wk = 0.f, xr = 0.f, sgt = 0.f;
  if (tid < a.topk) wk = a.topk_w[tid];
  if (tid < kDownRows) {
    xr = a.x[r0 + tid];
    sgt = *a.sgate;
  }
  // First pass: expert rows' loads in flight while the activations are staged (their loads
  // overlap the expert rows' round trip).
  const DMat* w0[P];
  int64_t rows0[P];
  SmemX X0[P];
  task_rows(0, w0, rows0, X0);
  RowLoads<F, KI, 16, P> L0;
  L0.issue(w0, rows0, li);
  if (ready != nullptr) wait_ready(ready, target);
  {
    constexpr int F4 = KI / 4;  // float4 per activation row
    const int nf = nm * F4;
    for (int base = 0; base < nf; base += 5 * 256) {
      float4 v[5];
#pragma unroll
      for (int i = 0; i < 5; ++i) {
        const int f = base + tid + 256 * i, m = f / F4, c = f % F4;  // m warp-uniform
        if (f < nf) {
          if (m < a.topk) {
            v[i] = __ldcg(reinterpret_cast<const float4*>(a.act + size_t(m) * KI + 4 * c));
          } else {
            v[i] = silu_mul4(ld4(a.sg + 4 * c), ld4(a.su + 4 * c));
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 5; ++i) {
        const int f = base + tid + 256 * i;
        if (f < nf) smem_store4(xs, xsum, KI, f / F4, f % F4, v[i]);
      }
    }
  }
  if (tid < a.topk) wts[tid] = wk;
  __syncthreads();
  finish(0, L0, X0);
#pragma unroll
  for (int base = P; base < kTasksPerHalf; base += P) {
    const DMat* w[P];
    int64_t rows[P];
    SmemX X[P];
    task_rows(base, w, rows, X);
    RowLoads<F, KI, 16, P> L;
    L.issue(w, rows, li);
    finish(base, L, X);
  }
  __syncthreads();
  if (tid < kDownRows) {
    float acc = 0.f;
    for (int m = 0; m < a.topk; ++m) acc += res[tid][m] * wts[m];
    acc += sigmoid_f(sgt) * res[tid][a.topk];
    a.x[r0 + tid] = xr + acc;
  }
}

template <DFmt F, int KI>
__global__ void __launch_bounds__(256, 2) moe_down_kernel(const __grid_constant__ MoeDownArgs a) {
  pdl_wait();
  down_block<F, KI, kDownRows>(a, blockIdx.x, nullptr, 0u);  // (the trigger: at exit)
}

// moe_down with q4 experts on the tensor cores (the default for top-k <= 8; 6.2 against 9.7 us): a block owns 16
// output rows (one tile) and has one warp per expert slot plus one for the shared expert
// (kDownMmaWarps); warp m loads its expert's 16 rows x 512 (all 8 groups at once), stages its own
// activation row straight into its B fragments (lane l holds the 8-element blocks l and l + 32),
// and the combine is the scalar route's (ascending experts, then the gated shared expert).
// With an early selection read (a.sel, SelRead) every warp's rows, the shared expert's and the
// routed experts', are loaded before the wait on the previous kernel (weights, and a selection
// written earlier than the previous launch or flagged by its block 0; bench/NOTES.md v14).
constexpr int kDownMmaMaxK = 8;
constexpr int kDownMmaWarps = kDownMmaMaxK + 1;
__global__ void __launch_bounds__(32 * kDownMmaWarps) moe_down_mma_kernel(const __grid_constant__ MoeDownArgs a) {
  constexpr int KI = 512, NG = KI / 64;
  __shared__ MmaB<KI> B[kDownMmaWarps];
  __shared__ float res[kDownMmaWarps][kMmaTileRows];
  __shared__ float wts[kDownMmaMaxK];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = lane & 3, g = lane >> 2;
  const int nm = a.topk + 1;
  const int64_t r0 = int64_t(blockIdx.x) * kMmaTileRows;
  const bool shared = warp == a.topk;
  const bool early = a.sel != SelRead::AfterWait;
  uint2 q[2][NG];
  uint32_t scw[2][NG / 2], biw[2][NG / 2];
  const auto load_rows = [&] {
    const DMat& w = shared ? a.shared_down : a.down;
    // (Through L2, __ldcg: an early read must not hit a line an earlier kernel left in this SM's L1.)
    const int64_t base = shared ? r0 : int64_t(__ldcg(a.topk_idx + warp)) * a.hidden + r0;
#pragma unroll
    for (int h = 0; h < 2; ++h) mma_load_row<KI, NG>(w, base + g + 8 * h, 0, t, q[h], scw[h], biw[h]);
  };
  if (a.sel == SelRead::Flag) wait_ready(a.sel_ready, 1u);  // block-uniform (it has a barrier)
  float wk = 0.f;
  const auto load_selected = [&] {  // this warp's rows and thread tid's routing weight
    if (tid < a.topk) wk = __ldcg(a.topk_w + tid);
    if (warp < nm) load_rows();  // warp-uniform
  };
  if (early) load_selected();
  pdl_wait();
  if (a.sel == SelRead::Flag) retire(a.sel_ready, a.sel_ready + 1, gridDim.x);
  if (!early) load_selected();
  float xr = 0.f, sgt = 0.f;
  if (tid < kMmaTileRows) {
    xr = a.x[r0 + tid];
    sgt = *a.sgate;
  }
  if (warp < nm) {  // warp-uniform
    // This warp's activation: 8-element blocks j = lane and lane + 32 (block j: group j / 8,
    // quad position (j / 2) % 4, k-steps 4 G + 2 (j % 2) + {0, 1}; see mma_build_b).
    MmaB<KI>& b = B[warp];
    float bs[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = lane + 32 * i;
      float v[8];
      float4 lo, hi;
      if (shared) {
        lo = silu_mul4(ld4(a.sg + 8 * j), ld4(a.su + 8 * j));
        hi = silu_mul4(ld4(a.sg + 8 * j + 4), ld4(a.su + 8 * j + 4));
      } else {
        lo = __ldcg(reinterpret_cast<const float4*>(a.act + size_t(warp) * KI + 8 * j));
        hi = __ldcg(reinterpret_cast<const float4*>(a.act + size_t(warp) * KI + 8 * j + 4));
      }
      v[0] = lo.x; v[1] = lo.y; v[2] = lo.z; v[3] = lo.w;
      v[4] = hi.x; v[5] = hi.y; v[6] = hi.z; v[7] = hi.w;
      const int G = j >> 3, qp = (j >> 1) & 3;
#pragma unroll
      for (int sb = 0; sb < 2; ++sb) {
        const int ks = 4 * G + 2 * (j & 1) + sb;
        const float e4[4] = {v[2 * sb], v[2 * sb + 4], v[2 * sb + 1], v[2 * sb + 5]};
#pragma unroll
        for (int part = 0; part < 3; ++part)
          b.bt[ks * 12 + 4 * part + qp] = make_uint2(pf::pack_bf16(split3(e4[0], part), split3(e4[1], part)),
                                                     pf::pack_bf16(split3(e4[2], part), split3(e4[3], part)));
      }
      bs[i] = ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
    }
    // Group sums: group G is blocks 8G..8G+7, i.e. lanes 8G..8G+7 (G < 4) of bs[0] and
    // lanes 8(G-4).. of bs[1].
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float gsm = group_sum<8>(bs[i]);
      if ((lane & 7) == 0) b.gsum[(lane >> 3) + 4 * i] = gsm;
    }
    __syncwarp();
    float acc[2] = {0.f, 0.f};
    mma_tile_dot<KI, NG>(q, scw, biw, b, 0, lane, acc);
#pragma unroll
    for (int h = 0; h < 2; ++h) acc[h] = group_sum<4>(acc[h]);
    if (t == 0) {
      res[warp][g] = acc[0];
      res[warp][g + 8] = acc[1];
    }
  }
  if (tid < a.topk) wts[tid] = wk;
  pdl_launch_dependents();  // the dots are done; what is left is the combine
  __syncthreads();
  if (tid < kMmaTileRows) {
    float acc = 0.f;
    for (int m = 0; m < a.topk; ++m) acc += res[m][tid] * wts[m];
    acc += sigmoid_f(sgt) * res[a.topk][tid];
    a.x[r0 + tid] = xr + acc;
  }
}

// moe_gate_up and moe_down in one launch: the first blocks are gate/up blocks, the rest down
// blocks, which issue their expert rows' loads, then wait for every gate/up block. The
// producers have the lower block indices, and the launcher requires more resident blocks than
// down blocks, so some gate/up block can always run: the waits always end.
template <DFmt F>
__global__ void __launch_bounds__(256, 2) moe_experts_kernel(const __grid_constant__ MoeExpertsArgs a) {
  // No trigger: the blocks' waits on each other need them all resident, so the next kernel's
  // blocks may start only as these exit.
  pdl_wait();
  const int ngu = gate_up_blocks(int64_t(a.gu.topk) * a.gu.I, kFusedGuTasks<F>);
  if (int(blockIdx.x) < ngu) {
    gate_up_block<F, kFusedGuTasks<F>>(a.gu, blockIdx.x);
    publish(a.counters);
  } else {
    down_block<F, 512, kFusedDownRows>(a.dn, int(blockIdx.x) - ngu, a.counters, unsigned(ngu));
    retire(a.counters, a.counters + 1, gridDim.x - unsigned(ngu));
  }
}

}  // namespace

namespace {
// Blocks of moe_gate_up_mma_kernel<D> resident at once (occupancy API; cached on first use; 3 per
// SM for D = 1 and 2 for D = 2 on the H200, held there by __launch_bounds__).
template <int D>
int gate_up_mma_resident_d() {
  static const int n = [] {
    int per_sm = 0;
    KCUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_gate_up_mma_kernel<D>, 256, 0));
    return std::max(1, per_sm) * num_sms();
  }();
  return n;
}
template <int D>
void launch_gate_up_mma(const MoeGateUpArgs& a, cudaStream_t s) {
  // At most 2 blocks per SM: for the 512 tiles of top-8 x 512, 264 blocks took 6.69 us per
  // launch in moe_probe against 7.00 for all 396 resident (whose 116 second tiles form a short
  // second wave) and 7.59 for one block per tile (0ebcc86).
  const int tiles = int(int64_t(a.topk) * a.I / kGuMmaRows);
  const int grid = std::min({tiles, 2 * num_sms(), gate_up_mma_resident_d<D>()});
  launch_pdl(moe_gate_up_mma_kernel<D>, dim3(grid), dim3(256),
             pinned_smem(reinterpret_cast<const void*>(moe_gate_up_mma_kernel<D>), 0, 2), s, a);
}
}  // namespace

int gate_up_mma_resident() { return moe_gate_up_depth() == 2 ? gate_up_mma_resident_d<2>() : gate_up_mma_resident_d<1>(); }

void moe_gate_up_launch(const MoeGateUpArgs& a, cudaStream_t s) {
  const int64_t tasks = int64_t(a.topk) * a.I;
  if (a.gate.fmt == DFmt::Q4 && moe_mma_enabled()) {
    if (moe_gate_up_depth() == 2)
      launch_gate_up_mma<2>(a, s);
    else
      launch_gate_up_mma<1>(a, s);
    return;
  }
  switch (a.gate.fmt) {
    case DFmt::Q4: launch_pdl(moe_gate_up_kernel<DFmt::Q4>, dim3(gate_up_blocks(tasks, kGuTasks<DFmt::Q4>)), dim3(256), 0, s, a); break;
    case DFmt::Q8: launch_pdl(moe_gate_up_kernel<DFmt::Q8>, dim3(gate_up_blocks(tasks, kGuTasks<DFmt::Q8>)), dim3(256), 0, s, a); break;
    default: launch_pdl(moe_gate_up_kernel<DFmt::BF16>, dim3(gate_up_blocks(tasks, kGuTasks<DFmt::BF16>)), dim3(256), 0, s, a); break;
  }
}

void moe_down_launch(const MoeDownArgs& a, cudaStream_t s) {
  if (moe_down_takes_mma(a)) {
    static_assert(kDownMmaMaxK == 8, "moe_down_takes_mma (launchers.cpp) admits top-k <= 8");
    launch_pdl(moe_down_mma_kernel, dim3(unsigned(a.hidden / kMmaTileRows)), dim3(32 * kDownMmaWarps),
               pinned_smem(reinterpret_cast<const void*>(moe_down_mma_kernel), 0, 1), s, a);
    return;
  }
  const int blocks = int(a.hidden / kDownRows);
  switch (a.down.fmt) {
    case DFmt::Q4: launch_pdl(moe_down_kernel<DFmt::Q4, 512>, dim3(blocks), dim3(256), 0, s, a); break;
    case DFmt::Q8: launch_pdl(moe_down_kernel<DFmt::Q8, 512>, dim3(blocks), dim3(256), 0, s, a); break;
    default: launch_pdl(moe_down_kernel<DFmt::BF16, 512>, dim3(blocks), dim3(256), 0, s, a); break;
  }
}

namespace {
template <DFmt F>
int experts_resident() {
  static const int n = [] {
    int per_sm = 0;
    KCUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, moe_experts_kernel<F>, 256, 0));
    return per_sm * num_sms();
  }();
  return n;
}
template <DFmt F>
void launch_experts(const MoeExpertsArgs& a, cudaStream_t s) {
  const int ngu = gate_up_blocks(int64_t(a.gu.topk) * a.gu.I, kFusedGuTasks<F>);
  const int ndn = int(a.dn.hidden / kFusedDownRows);
  launch_pdl(moe_experts_kernel<F>, dim3(unsigned(ngu + ndn)), dim3(256), 0, s, a);
}
}  // namespace

int moe_experts_resident(DFmt f) {
  switch (f) {
    case DFmt::Q4: return experts_resident<DFmt::Q4>();
    case DFmt::Q8: return experts_resident<DFmt::Q8>();
    default: return experts_resident<DFmt::BF16>();
  }
}

void moe_experts_launch(const MoeExpertsArgs& a, cudaStream_t s) {
  switch (a.gu.gate.fmt) {
    case DFmt::Q4: launch_experts<DFmt::Q4>(a, s); break;
    case DFmt::Q8: launch_experts<DFmt::Q8>(a, s); break;
    default: launch_experts<DFmt::BF16>(a, s); break;
  }
}

}  // namespace kestrel::cuda
