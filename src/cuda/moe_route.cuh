// MoE routing of one token by one warp (model-spec §3.6): fp32 softmax over the E router logits,
// top-k (largest first, the lower expert index on ties, as the CPU oracle), renormalised weights;
// the k selections are written in ascending expert order (the reference's accumulation order).
// Two versions with the same selection (ties and NaN included) and the same weights up to the
// softmax sum's order: moe_route_warp (one warp) and moe_route_block (256 threads, one expert per
// thread, ranks by counting). Used by the decode router GEMV's RouteTail and the routing kernel
// (gemv.cu) and by moe_gate_up when it routes for itself (moe.cu).
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

// Routing by the 256 threads of a block (thread t: experts t and t + 256): block max and sum,
// then the selection by ranks: an expert's rank is the number of experts ahead of it (a greater
// key, or an equal key and a lower index), and the k experts of rank < k are the selection.
// Only candidates are ranked: when at least k of the 8 warps hold experts, every selected expert
// is >= T, the least of the warps' largest keys (those are >= k distinct experts >= T), so the
// experts below T are left out and the few candidates are compacted into shared memory and ranked
// among themselves (the model's E = 256, k = 8: typically 8-40 candidates instead of 256).
// The selection's weights are summed in rank order (the oracle's selection order) and written in
// ascending expert order. Call with every thread of a 256-thread block (barriers); idx_out /
// w_out may be shared or global memory.
constexpr int kRouteBlockThreads = 256;
__device__ __forceinline__ void moe_route_block(const float* logits, int E, int topk, int* idx_out,
                                                float* w_out) {
  constexpr int kPer = kRouteMaxE / kRouteBlockThreads;
  constexpr int kW = kRouteBlockThreads / 32;
  // Candidate c: key << 32 | ~expert (a greater packed value is ahead).
  __shared__ unsigned long long cand[kRouteMaxE];
  __shared__ float red[2][kW];
  __shared__ uint32_t wmax[kW], wcnt[kW][kPer];
  __shared__ float sel_p[kRouteMaxK];
  __shared__ int sel_e[kRouteMaxK];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  float p[kPer];
  float lmx = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid + i * kRouteBlockThreads;
    p[i] = e < E ? __ldcg(logits + e) : -INFINITY;
    lmx = fmaxf(lmx, p[i]);
  }
  lmx = ord2f(__reduce_max_sync(0xffffffffu, f2ord(lmx)));
  if (lane == 0) red[0][warp] = lmx;
  __syncthreads();
  float mx = red[0][0];
#pragma unroll
  for (int w = 1; w < kW; ++w) mx = fmaxf(mx, red[0][w]);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    p[i] = tid + i * kRouteBlockThreads < E ? expf(p[i] - mx) : 0.f;
    s += p[i];
  }
  s = warp_sum(s);
  if (lane == 0) red[1][warp] = s;
  __syncthreads();
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kW; ++w) sum += red[1][w];
  uint32_t key[kPer];
  uint32_t kmax = 0u;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int e = tid + i * kRouteBlockThreads;
    p[i] /= sum;
    key[i] = e >= E ? 0u : p[i] == p[i] ? __float_as_uint(p[i]) + 2u : 1u;  // 0: padding, 1: NaN
    kmax = max(kmax, key[i]);
  }
  // The threshold: the least of the largest keys of the warps that hold experts (warp w holds
  // one iff 32 w < E), when there are at least k of them; else no pruning (T = 0).
  const int warps_with = min(kW, (E + 31) / 32);
  kmax = __reduce_max_sync(0xffffffffu, kmax);
  if (lane == 0) wmax[warp] = kmax;
  __syncthreads();
  uint32_t T = 0u;
  if (warps_with >= topk) {
    T = wmax[0];
    for (int w = 1; w < warps_with; ++w) T = min(T, wmax[w]);
  }
  // Compaction: candidate slots in (i, warp, lane) order.
  bool is_c[kPer];
  uint32_t bal[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    is_c[i] = tid + i * kRouteBlockThreads < E && key[i] >= T;
    bal[i] = __ballot_sync(0xffffffffu, is_c[i]);
    if (lane == 0) wcnt[warp][i] = __popc(bal[i]);
  }
  __syncthreads();
  int n = 0, slot[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    slot[i] = n + __popc(bal[i] & ((1u << lane) - 1u));
    for (int w = 0; w < kW; ++w) {
      const int c = int(wcnt[w][i]);
      slot[i] += w < warp ? c : 0;
      n += c;
    }
  }
  unsigned long long pk[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    pk[i] = (static_cast<unsigned long long>(key[i]) << 32) | (0xffffffffu - uint32_t(tid + i * kRouteBlockThreads));
    if (is_c[i]) cand[slot[i]] = pk[i];
  }
  __syncthreads();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    if (!is_c[i]) continue;
    int ahead = 0;
    for (int c = 0; c < n; ++c) ahead += cand[c] > pk[i];
    if (ahead < topk) {
      sel_p[ahead] = p[i];
      sel_e[ahead] = tid + i * kRouteBlockThreads;
    }
  }
  __syncthreads();
  if (tid < topk) {
    float top = 0.f;
    for (int r = 0; r < topk; ++r) top += sel_p[r];
    const int me = sel_e[tid];
    int pos = 0;
    for (int r = 0; r < topk; ++r) pos += sel_e[r] < me;
    idx_out[pos] = me;
    w_out[pos] = sel_p[tid] / top;
  }
}

// Either version, for a block of 256 threads (all must call: the block version has barriers).
__device__ __forceinline__ void moe_route_any(RouteAlgo algo, const float* logits, int E, int topk,
                                              int* idx_out, float* w_out) {
  if (algo == RouteAlgo::Block)
    moe_route_block(logits, E, topk, idx_out, w_out);
  else if (threadIdx.x < 32)
    moe_route_warp(logits, E, topk, idx_out, w_out);
}

}  // namespace kestrel::cuda
