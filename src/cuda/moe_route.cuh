// MoE routing of one token by one warp (model-spec §3.6): fp32 softmax over the E router logits,
// top-k (largest first, the lower expert index on ties, as the CPU oracle), renormalised weights;
// the k selections are written in ascending expert order (the reference's accumulation order).
// Used by the decode router GEMV's RouteTail (gemv.cu).
//
// It runs as the serial tail of a launch, so it is built for latency: lane l holds the P =
// ceil(E/32) consecutive experts l*P.. (a lower lane holds lower indices, so "lowest lane among
// the equal maxima" is the oracle's tie-break); each of the k rounds is a local max, one redux.sync
// and one ballot; the ascending output order comes from each lane's selection mask and a prefix
// count, with no sort. (The first version scanned experts lane + 32 i with two 5-step shuffle
// reductions per round and insertion-sorted runtime-indexed arrays in local memory on lane 0.)
#pragma once
#include "cuda/common.cuh"

namespace kestrel::cuda {

constexpr int kRouteMaxE = 512;
constexpr int kRouteMaxK = 16;

// An order-preserving u32 image of a float (for redux.sync max).
__device__ __forceinline__ uint32_t f2ord(float f) {
  const uint32_t u = __float_as_uint(f);
  return u & 0x80000000u ? ~u : u | 0x80000000u;
}
__device__ __forceinline__ float ord2f(uint32_t u) {
  return __uint_as_float(u & 0x80000000u ? u & 0x7fffffffu : ~u);
}

// Call with the 32 lanes of one warp. logits are read through L2 (__ldcg): they were written by
// other blocks of the same launch.
__device__ __forceinline__ void moe_route_warp(const float* logits, int E, int topk, int* idx_out,
                                               float* w_out) {
  const int lane = threadIdx.x & 31;
  constexpr int kPer = kRouteMaxE / 32;
  const int P = (E + 31) / 32;
  const int e0 = lane * P;
  float p[kPer];
  float lmx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const bool in = i < P && e0 + i < E;
    p[i] = in ? __ldcg(logits + e0 + i) : -INFINITY;
    lmx = fmaxf(lmx, p[i]);
  }
  const float mx = ord2f(__reduce_max_sync(0xffffffffu, f2ord(lmx)));
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] = i < P && e0 + i < E ? expf(p[i] - mx) : 0.f;
    sum += p[i];
  }
  sum = warp_sum(sum);
  // Selection keys: probability bits + 2 (p in [0, 1]: order-preserving as u32), 1 for a NaN
  // (selectable only after every number: keeps k selections in range), 0 for padding or selected.
  uint32_t key[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] /= sum;
    key[i] = !(i < P && e0 + i < E) ? 0u : p[i] == p[i] ? __float_as_uint(p[i]) + 2u : 1u;
  }
  uint32_t mine = 0u;  // bit i: expert e0 + i selected
  float top = 0.f;
  for (int k = 0; k < topk; ++k) {
    uint32_t lk = key[0];
#pragma unroll
    for (int i = 1; i < kPer; ++i) lk = max(lk, key[i]);
    const uint32_t m = __reduce_max_sync(0xffffffffu, lk);
    const int win = __ffs(__ballot_sync(0xffffffffu, lk == m)) - 1;
    top += m >= 2u ? __uint_as_float(m - 2u) : 0.f;  // selection order, as the oracle sums
    if (lane == win) {
      int bi = 0;
#pragma unroll
      for (int i = kPer - 1; i >= 0; --i)
        if (key[i] == m) bi = i;  // the lowest index among this lane's maxima
#pragma unroll
      for (int i = 0; i < kPer; ++i)
        if (i == bi) key[i] = 0u;
      mine |= 1u << bi;
    }
  }
  // Rank of each selection in ascending expert order: selections of lower lanes, then lower bits.
  const int cnt = __popc(mine);
  int before = cnt;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int t = __shfl_up_sync(0xffffffffu, before, o);
    if (lane >= o) before += t;
  }
  before -= cnt;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (mine >> i & 1u) {
      idx_out[before] = e0 + i;
      w_out[before] = p[i] / top;
      ++before;
    }
}

}  // namespace kestrel::cuda
