// MoE routing of one token by one warp (model-spec §3.6): fp32 softmax over the E router logits,
// top-k (largest first, the lower expert index on ties, as the CPU oracle), renormalised weights;
// the k selections are written in ascending expert order (the reference's accumulation order).
// Used by the decode router GEMV's RouteTail (gemv.cu).
#pragma once
#include "cuda/common.cuh"

namespace kestrel::cuda {

constexpr int kRouteMaxE = 512;
constexpr int kRouteMaxK = 16;

// Call with the 32 lanes of one warp. logits are read through L2 (__ldcg): they were written by
// other blocks of the same launch.
__device__ __forceinline__ void moe_route_warp(const float* logits, int E, int topk, int* idx_out,
                                               float* w_out) {
  const int lane = threadIdx.x & 31;
  constexpr int kPer = kRouteMaxE / 32;
  float p[kPer];
  float mx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? __ldcg(logits + e) : -INFINITY;
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
  int sel[kRouteMaxK];
  float selp[kRouteMaxK];
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
    if (bi >= E) bi = k;  // NaN logits select nothing: keep the index in range (garbage, no fault)
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
      idx_out[k] = sel[k];
      w_out[k] = selp[k] / top;
    }
  }
}

}  // namespace kestrel::cuda
