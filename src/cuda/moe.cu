// MoE decode (model-spec §3.6) for one token, entirely on the GPU with no host synchronisation:
//   moe_gate_up: every block redoes the router softmax + top-k over the E logits in one warp
//     (cheaper than a launch), block 0 publishes (expert, weight) in ascending expert order, then
//     each warp computes gate and up rows of one (slot, i) and writes act = silu(g) * u.
//   moe_down: each block owns 8 output rows; its 16 half-warps share the (row, slot) dots of the
//     k experts and the shared expert (all loads of a half-warp issued together), then the rows are
//     combined in ascending expert order, the shared expert added with its sigmoid gate, and the
//     result added into the residual stream.
// The router, shared-expert gate/up and sigmoid gate logits come from one fused GEMV before.
#include "cuda/gemv_core.cuh"

#include <mutex>

namespace kestrel::cuda {

namespace {

constexpr int kMaxE = 512;
constexpr int kMaxK = 16;

// Softmax + top-k + renormalise by warp 0; results (ascending expert index) in idx_s / w_s.
__device__ void route(const float* logits, int E, int topk, int* idx_s, float* w_s) {
  const int lane = threadIdx.x & 31;
  constexpr int kPer = kMaxE / 32;
  float p[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? logits[e] : -INFINITY;
    mx = fmaxf(mx, p[i]);
  }
  mx = warp_max(mx);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - mx) : 0.f;
    sum += p[i];
  }
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kPer; ++i) p[i] = (lane + 32 * i) < E ? p[i] / sum : -1.f;
  int sel[kMaxK];
  float selp[kMaxK];
  float top = 0.f;
  for (int k = 0; k < topk; ++k) {
    float bv = -2.f;
    int bi = 0x7fffffff;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (p[i] > bv) { bv = p[i]; bi = lane + 32 * i; }  // ascending e per lane: first max kept
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
    }
    sel[k] = bi;
    selp[k] = bv;
    top += bv;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (lane + 32 * i == bi) p[i] = -1.f;
  }
  if (lane == 0) {
    // Ascending expert order (insertion sort of <= 16).
    for (int a = 1; a < topk; ++a)
      for (int b = a; b > 0 && sel[b] < sel[b - 1]; --b) {
        const int ti = sel[b]; sel[b] = sel[b - 1]; sel[b - 1] = ti;
        const float tp = selp[b]; selp[b] = selp[b - 1]; selp[b - 1] = tp;
      }
    for (int k = 0; k < topk; ++k) {
      idx_s[k] = sel[k];
      w_s[k] = selp[k] / top;
    }
  }
}

template <int K>
__global__ void __launch_bounds__(256) moe_gate_up_kernel(const __grid_constant__ MoeGateUpArgs a) {
  __shared__ float4 xs4[K / 4];
  __shared__ float xsum[K / 16];
  __shared__ int idx_s[kMaxK];
  __shared__ float w_s[kMaxK];
  float* xs = reinterpret_cast<float*>(xs4);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  pdl_launch_dependents();
  pdl_wait();
  if (warp == 0) route(a.logits, a.E, a.topk, idx_s, w_s);
  for (int k = tid; k < K; k += 256) smem_store_x(xs, xsum, K, 0, k, a.h[k]);
  __syncthreads();
  smem_sum16(xs, xsum, K, 1);
  if (blockIdx.x == 0 && tid < a.topk) {
    a.topk_idx[tid] = idx_s[tid];
    a.topk_w[tid] = w_s[tid];
  }
  __syncthreads();
  const int64_t task = int64_t(blockIdx.x) * 8 + warp;
  if (task >= int64_t(a.topk) * a.I) return;
  const int slot = int(task / a.I);
  const int64_t i = task % a.I;
  const int64_t row = int64_t(idx_s[slot]) * a.I + i;
  const SmemX X{xs, xsum, K};
  const DMat* w[2] = {&a.gate, &a.up};
  const int64_t rows[2] = {row, row};
  const SmemX Xs[2] = {X, X};
  float out[2];
  switch (a.gate.fmt) {
    case DFmt::Q4: multi_dot<DFmt::Q4, K, 32, 2>(w, rows, Xs, lane, out); break;
    case DFmt::Q8: multi_dot<DFmt::Q8, K, 32, 2>(w, rows, Xs, lane, out); break;
    default: multi_dot<DFmt::BF16, K, 32, 2>(w, rows, Xs, lane, out); break;
  }
  const float gsum = warp_sum(out[0]), usum = warp_sum(out[1]);
  if (lane == 0) a.act[size_t(slot) * a.I + i] = silu_f(gsum) * usum;
}

constexpr int kDownRows = 8;          // output rows per block
constexpr int kHalfWarps = 16;        // 256 threads / 16 lanes
constexpr int kTasksPerHalf = (kDownRows * (kMaxK + 1) + kHalfWarps - 1) / kHalfWarps;  // 9

template <DFmt F, int KI>
__global__ void __launch_bounds__(256) moe_down_kernel(const __grid_constant__ MoeDownArgs a) {
  // Activations: rows 0..topk-1 routed, row topk shared; each [KI] in the swizzled layout.
  __shared__ float4 xs4[(kMaxK + 1) * KI / 4];
  __shared__ float xsum[(kMaxK + 1) * KI / 16];
  __shared__ float res[kDownRows][kMaxK + 1];
  float* xs = reinterpret_cast<float*>(xs4);
  const int tid = threadIdx.x;
  const int nm = a.topk + 1;
  pdl_launch_dependents();
  pdl_wait();
  for (int i = tid; i < nm * KI; i += 256) {
    const int m = i / KI, k = i % KI;
    const float v = m < a.topk ? a.act[size_t(m) * KI + k] : silu_f(a.sg[k]) * a.su[k];
    smem_store_x(xs, xsum, KI, m, k, v);
  }
  __syncthreads();
  smem_sum16(xs, xsum, KI, nm);
  __syncthreads();
  const int hw = tid >> 4, li = tid & 15;
  const int r0 = blockIdx.x * kDownRows;
  const int ntasks = kDownRows * nm;
  // Tasks of this half-warp in passes of P (all loads of a pass in flight together; P keeps the
  // code registers of a pass at <= ~40).
  constexpr int P = F == DFmt::BF16 ? 3 : F == DFmt::Q8 ? 5 : 9;
#pragma unroll
  for (int base = 0; base < kTasksPerHalf; base += P) {
    const DMat* w[P];
    int64_t rows[P];
    SmemX X[P];
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
    float out[P];
    multi_dot<F, KI, 16, P>(w, rows, X, li, out);
#pragma unroll
    for (int t = 0; t < P; ++t) {
      const float v = group_sum<16>(out[t]);
      const int task = hw + kHalfWarps * (base + t);
      if (li == 0 && base + t < kTasksPerHalf && task < ntasks) res[task / nm][task % nm] = v;
    }
  }
  __syncthreads();
  if (tid < kDownRows) {
    float acc = 0.f;
    for (int m = 0; m < a.topk; ++m) acc += res[tid][m] * a.topk_w[m];
    acc += sigmoid_f(*a.sgate) * res[tid][a.topk];
    a.x[r0 + tid] += acc;
  }
}

}  // namespace

void moe_gate_up_launch(const MoeGateUpArgs& a, cudaStream_t s) {
  const int64_t tasks = int64_t(a.topk) * a.I;
  launch_pdl(moe_gate_up_kernel<2048>, dim3(int((tasks + 7) / 8)), dim3(256), 0, s, a);
}

void moe_down_launch(const MoeDownArgs& a, cudaStream_t s) {
  const int blocks = int(a.hidden / kDownRows);
  switch (a.down.fmt) {
    case DFmt::Q4: launch_pdl(moe_down_kernel<DFmt::Q4, 512>, dim3(blocks), dim3(256), 0, s, a); break;
    case DFmt::Q8: launch_pdl(moe_down_kernel<DFmt::Q8, 512>, dim3(blocks), dim3(256), 0, s, a); break;
    default: launch_pdl(moe_down_kernel<DFmt::BF16, 512>, dim3(blocks), dim3(256), 0, s, a); break;
  }
}

}  // namespace kestrel::cuda
