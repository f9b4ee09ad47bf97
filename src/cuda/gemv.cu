// GEMV family: y[M, N] = prologue(x)[M, K] * W^T for up to kMaxGemvSegs matrices in one launch
// (fused projections: GDN qkv|z|b|a, attention q+gate|k|v, router|shared expert), M <= 8.
// Prologues fold the preceding norm into the kernel (every block normalises the activation rows
// itself: 8-16 KB re-read from L2 instead of one more launch); epilogues fold the residual add,
// the GDN causal conv + SiLU, and the lm_head argmax.
#include "cuda/gemv_core.cuh"
#include "cuda/mma_dot.cuh"
#include "cuda/moe_route.cuh"
#include "cuda/tma.cuh"

#include <algorithm>
#include <mutex>

namespace kestrel::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ float4 ld4(const float* p) { return *reinterpret_cast<const float4*>(p); }

// The barrier of the NT threads that stage x: the whole block, or (kNamed) the first NT threads
// of a block that has other warps too (route 5's producer and epilogue warps), on named barrier 1.
template <bool kNamed, int NT>
__device__ __forceinline__ void stage_sync() {
  if constexpr (kNamed)
    asm volatile("bar.sync 1, %0;" ::"n"(NT) : "memory");
  else
    __syncthreads();
}
template <bool kNamed, int NT>
__device__ __forceinline__ float stage_block_sum(float v, float* red) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  stage_sync<kNamed, NT>();
  if (l == 0) red[w] = v;
  stage_sync<kNamed, NT>();
  return warp_sum(l < NT / 32 ? red[l] : 0.f);
}

// Stages the activation rows (after the prologue's norm) into shared memory, swizzled, with the
// 16-element block sums, and optionally writes them to x_out. Ends with a barrier.
// Every thread issues all of its float4 loads of a row (or of 4 norm groups) before it uses any,
// so the staging costs one memory latency, not one per element (measured: the element-serial
// loop was ~40% of a small GEMV's time).
// (NT: the staging threads, threads 0..NT-1 of the block.)
template <int K, bool kNamed = false, int NT = kThreads>
__device__ __forceinline__ void stage_x(const GemvArgs& a, float* xs, float* xsum, float* red) {
  constexpr int kThreads = NT, kWarps = NT / 32;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int M = a.M;
  constexpr int F4 = K / 4;  // float4 slots per row
  if (a.pro == Prologue::GatedRmsNorm) {
    // One warp per 128-element norm group (lane: one float4 of x and of z), 4 groups per pass.
    constexpr int G = 128;
    constexpr int gpr = K / G;
    const int ngroups = M * gpr;
    const float4 nw = ld4(a.norm_w + lane * 4);
    for (int g0 = warp; g0 < ngroups; g0 += 4 * kWarps) {
      float4 v[4], z[4];
      float ss[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int gi = g0 + j * kWarps;
        v[j] = z[j] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (gi < ngroups) {
          const int m = gi / gpr, col = (gi % gpr) * G + lane * 4;
          v[j] = ld4(a.x + size_t(m) * a.ldx + col);
          z[j] = ld4(a.z + size_t(m) * a.ldz + col);
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) ss[j] = v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
#pragma unroll
        for (int j = 0; j < 4; ++j) ss[j] += __shfl_xor_sync(0xffffffffu, ss[j], o);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int gi = g0 + j * kWarps;  // warp-uniform
        if (gi < ngroups) {
          const int m = gi / gpr, col = (gi % gpr) * G + lane * 4;
          const float inv = 1.f / sqrtf(ss[j] / float(G) + a.eps);
          float4 y;
          y.x = (nw.x * (v[j].x * inv)) * silu_f(z[j].x);
          y.y = (nw.y * (v[j].y * inv)) * silu_f(z[j].y);
          y.z = (nw.z * (v[j].z * inv)) * silu_f(z[j].z);
          y.w = (nw.w * (v[j].w * inv)) * silu_f(z[j].w);
          smem_store4(xs, xsum, K, m, col / 4, y);
        }
      }
    }
  } else {
    constexpr int NV = (F4 + kThreads - 1) / kThreads;  // float4 per thread and row
    // The norm weights' loads go out with the first row's (not after its reduction).
    float4 nwv[NV];
    if (a.pro == Prologue::RmsNorm) {
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int sl = tid + i * kThreads;
        nwv[i] = sl < F4 ? ld4(a.norm_w + 4 * sl) : make_float4(0.f, 0.f, 0.f, 0.f);
      }
    }
    for (int m = 0; m < M; ++m) {
      float4 v[NV];
      float ss = 0.f;
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int sl = tid + i * kThreads;
        v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if (sl < F4) v[i] = ld4(a.x + size_t(m) * a.ldx + 4 * sl);
        ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
      }
      if (a.pro == Prologue::RmsNorm) {
        ss = stage_block_sum<kNamed, NT>(ss, red);
        const float inv = 1.f / sqrtf(ss / float(K) + a.eps);
#pragma unroll
        for (int i = 0; i < NV; ++i) {
          const int sl = tid + i * kThreads;
          if (sl < F4) {
            const float4 w = nwv[i];
            v[i].x = v[i].x * inv * w.x;
            v[i].y = v[i].y * inv * w.y;
            v[i].z = v[i].z * inv * w.z;
            v[i].w = v[i].w * inv * w.w;
          }
        }
      }
#pragma unroll
      for (int i = 0; i < NV; ++i) {
        const int sl = tid + i * kThreads;  // sl < F4 is warp-uniform (F4 % 32 == 0)
        if (sl < F4) smem_store4(xs, xsum, K, m, sl, v[i]);
      }
    }
  }
  stage_sync<kNamed, NT>();
  if (a.x_out != nullptr && blockIdx.x == 0)
    for (int i = tid; i < M * F4; i += kThreads) {
      const int m = i / F4, sl = i % F4;
      reinterpret_cast<float4*>(a.x_out)[size_t(m) * F4 + sl] =
          reinterpret_cast<const float4*>(xs + size_t(m) * K)[swz(sl)];
    }
}

// MoE routing by the last block of a launch to finish (RouteTail): all blocks' router logits
// are in memory by then (each block fences before it counts itself done).
__device__ __forceinline__ void route_tail(const RouteTail& r) {
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    last = atomicAdd(r.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  moe_route_any(r.algo, r.logits, r.E, r.topk, r.idx, r.w);
  if (threadIdx.x == 0) *r.counter = 0u;
}

// One warp (RouteAlgo::Warp) or one block of kRouteBlockThreads. (The explicit branch, not
// moe_route_any: this is the code measured at 2074b07/9266193; moe_route_any compiles to other SASS.)
__global__ void __launch_bounds__(kRouteBlockThreads) decode_route_kernel(const __grid_constant__ DecodeRouteArgs a) {
  pdl_launch_dependents();
  pdl_wait();
  if (a.algo == RouteAlgo::Block)
    moe_route_block(a.logits, a.E, a.topk, a.idx, a.w);
  else
    moe_route_warp(a.logits, a.E, a.topk, a.idx, a.w);
}

// Rows per warp gemv_kernel prefetches into L2 before it waits on the previous kernel.
constexpr int kPrefetchRows = 4;

// gemv_kernel's first row of each warp in registers (M = 1, q4 rows; gemv_preload). Its K = 512
// instantiation never preloads (16 chunks per row do not divide among 32 lanes): the 1024 only
// gives the unused type a valid shape.
template <int K, int MM, bool PRE>
constexpr bool kPreload = PRE && MM == 1 && kFits<DFmt::Q4, K, 32>;
template <int K, int MM, bool PRE>
using PreloadRow = RowLoads<DFmt::Q4, kPreload<K, MM, PRE> ? K : 1024, 32, 1>;

// PRE (gemv_preload, M = 1 only): the warp's first row, when it is q4, is loaded into registers
// before the wait on the previous kernel, so that after the staging its dot starts at once
// (out_proj, o_proj and the router launch have one row per warp; bench/NOTES.md v14). Its own
// instantiation (94 registers at K 4096 against 92, 76 at K 2048 against 64), so that PRE = false
// compiles to the kernel measured before v14. (The row is peeled off the loop: inside it, its
// registers stayed live across every row, 163 at K 4096.)
template <int K, int MM, bool PRE = false>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const __grid_constant__ GemvArgs a,
                                                                    int64_t total_rows) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  float* xsum = xs + size_t(a.M) * K;
  __shared__ float red[32];
  __shared__ unsigned long long best_s[kWarps][kMaxGemvRows];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int M = a.M;
  PreloadRow<K, MM, PRE> P;
  P.on[0] = false;
  if constexpr (kPreload<K, MM, PRE>) {
    const int64_t r = int64_t(blockIdx.x) * kWarps + warp;
    if (r < total_rows) {
      int s = 0;
      int64_t lr = r;
      while (lr >= a.seg[s].w.rows) lr -= a.seg[s++].w.rows;
      const DMat* pw[1] = {a.seg[s].w.fmt == DFmt::Q4 ? &a.seg[s].w : nullptr};
      const int64_t pr[1] = {lr};
      P.issue(pw, pr, lane);
    }
  }
  // Weights do not depend on the previous kernel: start this warp's first kPrefetchRows rows
  // (codes, and the scales and biases of the quantized ones) towards L2 while x is staged. (Was
  // the first row's codes only: out_proj, 2,048 rows of K 4096 over 1,056 warps, then waited on
  // DRAM for its second row and every row's scales; bench/NOTES.md v13.) A preloaded row is
  // in flight already.
  for (int i = kPreload<K, MM, PRE> && P.on[0] ? 1 : 0; i < kPrefetchRows; ++i) {
    int64_t r = (int64_t(blockIdx.x) + int64_t(i) * gridDim.x) * kWarps + warp;
    if (r >= total_rows) break;
    int s = 0;
    while (r >= a.seg[s].w.rows) r -= a.seg[s++].w.rows;
    const DMat& w = a.seg[s].w;
    const size_t rb = w.fmt == DFmt::BF16 ? size_t(K) * 2 : w.fmt == DFmt::Q8 ? size_t(K) : size_t(K) / 2;
    const char* p = static_cast<const char*>(w.data) + size_t(r) * rb;
    for (size_t off = size_t(lane) * 128; off < rb; off += 32 * 128)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
    if (w.fmt != DFmt::BF16 && lane < 4) {  // the row's scales (lanes 0, 1) and biases (2, 3):
      const int ng = K / w.group;           // 64 or 128 bytes, one or two lines: first and last
      const uint16_t* q = ((lane >> 1) == 0 ? w.scales : w.biases) + size_t(r) * ng + ((lane & 1) ? ng - 1 : 0);
      asm volatile("prefetch.global.L2 [%0];" ::"l"(q));
    }
  }
  pdl_wait();

  stage_x<K>(a, xs, xsum, red);

  // ---- rows: one warp per weight row ----
  const SmemX X{xs, xsum, K};
  unsigned long long best[MM];
#pragma unroll
  for (int m = 0; m < MM; ++m) best[m] = 0ull;
  bool any_logits = false;
  // One row: its dot (from the preloaded registers when `preloaded`, a constant at both calls)
  // and its epilogue. The preloaded row is peeled off the loop so its registers die with it.
  const auto do_row = [&](int64_t r, bool preloaded) {
    int s = 0;
    int64_t lr = r;
    while (lr >= a.seg[s].w.rows) lr -= a.seg[s++].w.rows;
    const GemvSeg& sg = a.seg[s];
    float acc[MM];
#pragma unroll
    for (int m = 0; m < MM; ++m) acc[m] = 0.f;
    if constexpr (kPreload<K, MM, PRE>) {
      if (preloaded) {  // the same chunk order as row_dot: the same sums
        const SmemX Xp[1] = {X};
        float o[1];
        P.dot(Xp, lane, o);
        acc[0] = o[0];
      }
    }
    if (!preloaded) row_dot_any<K, 32, MM>(sg.w, lr, X, M, lane, acc);
#pragma unroll
    for (int m = 0; m < MM; ++m)
      if (m < M) acc[m] = warp_sum(acc[m]);
    if (lane == 0) {
      switch (sg.epi) {
        case Epilogue::Store:
#pragma unroll
          for (int m = 0; m < MM; ++m)
            if (m < M) sg.y[size_t(m) * sg.ldy + lr] = acc[m];
          break;
        case Epilogue::Residual:
#pragma unroll
          for (int m = 0; m < MM; ++m)
            if (m < M) sg.y[size_t(m) * sg.ldy + lr] += acc[m];
          break;
        case Epilogue::ConvSilu: {
          float* st = sg.conv_state + lr * 3;
          const float* cw = sg.conv_w + lr * 4;
          float s0 = st[0], s1 = st[1], s2 = st[2];
#pragma unroll
          for (int m = 0; m < MM; ++m)
            if (m < M) {
              const float xt = acc[m];
              float c = cw[3] * xt;
              c += cw[0] * s0;
              c += cw[1] * s1;
              c += cw[2] * s2;
              sg.y[size_t(m) * sg.ldy + lr] = silu_f(c);
              s0 = s1;
              s1 = s2;
              s2 = xt;
            }
          st[0] = s0;
          st[1] = s1;
          st[2] = s2;
          break;
        }
        case Epilogue::Logits:
#pragma unroll
          for (int m = 0; m < MM; ++m)
            if (m < M) {
              sg.y[size_t(m) * sg.ldy + lr] = acc[m];
              if (sg.argmax != nullptr && (sg.argmax_rows == 0 || lr < sg.argmax_rows)) {
                const unsigned long long key = pack_argmax(acc[m], uint32_t(lr));
                best[m] = key > best[m] ? key : best[m];
                any_logits = true;
              }
            }
          break;
      }
    }
  };
  int64_t r0 = int64_t(blockIdx.x) * kWarps + warp;
  if constexpr (kPreload<K, MM, PRE>) {
    if (P.on[0]) {
      do_row(r0, true);
      r0 += int64_t(gridDim.x) * kWarps;
    }
  }
  for (int64_t r = r0; r < total_rows; r += int64_t(gridDim.x) * kWarps) do_row(r, false);
  pdl_launch_dependents();  // this block's rows are done (common.cuh: where the trigger goes)
  // Block-level argmax, then one atomic per block and row (a device-wide atomic per weight row
  // would serialise 248K updates on one address).
  const GemvSeg* ls = nullptr;
  for (int s = 0; s < a.nseg; ++s)
    if (a.seg[s].epi == Epilogue::Logits && a.seg[s].argmax != nullptr) ls = &a.seg[s];
  if (ls != nullptr) {
    if (lane == 0) {
#pragma unroll
      for (int m = 0; m < MM; ++m)
        if (m < M) best_s[warp][m] = best[m];
    }
    __syncthreads();
    if (tid < M) {
      unsigned long long b = 0ull;
      for (int w = 0; w < kWarps; ++w) b = best_s[w][tid] > b ? best_s[w][tid] : b;
      if (b != 0ull) atomicMax(ls->argmax + tid, b);
    }
  }
  (void)any_logits;
  if (a.route.logits != nullptr) route_tail(a.route);
}


// ---- v2 (M = 1, one format for all segments): each warp streams its rows in groups of R with two
// groups in flight (the next group's loads are issued before the current one is reduced), and
// the first group's loads are issued before waiting on the previous kernel and before staging
// the activations (weights never depend on earlier kernels). R = max(1, 4 / chunks per lane).
// The grid is capped at what is resident at once, so every block's first loads go out together.
template <DFmt F, int K>
constexpr int kRowsPerWarp = (4 / (K / Fmt<F>::kEpc / 32)) > 0 ? (4 / (K / Fmt<F>::kEpc / 32)) : 1;

__device__ __forceinline__ void epilogue1(const GemvSeg& sg, int64_t lr, float v,
                                          unsigned long long& best) {
  switch (sg.epi) {
    case Epilogue::Store: sg.y[lr] = v; break;
    case Epilogue::Residual: sg.y[lr] += v; break;
    case Epilogue::ConvSilu: {
      float* st = sg.conv_state + lr * 3;
      const float* cw = sg.conv_w + lr * 4;
      const float s0 = st[0], s1 = st[1], s2 = st[2];
      float c = cw[3] * v;
      c += cw[0] * s0;
      c += cw[1] * s1;
      c += cw[2] * s2;
      sg.y[lr] = silu_f(c);
      st[0] = s1;
      st[1] = s2;
      st[2] = v;
      break;
    }
    case Epilogue::Logits:
      sg.y[lr] = v;
      if (sg.argmax != nullptr && (sg.argmax_rows == 0 || lr < sg.argmax_rows)) {
        const unsigned long long key = pack_argmax(v, uint32_t(lr));
        best = key > best ? key : best;
      }
      break;
  }
}

// R rows of one warp: their loads (issue) and their dots + epilogues (finish).
template <DFmt F, int K, int R>
struct RowGroup {
  static constexpr int kChunks = K / Fmt<F>::kEpc;
  static constexpr int NCH = kChunks / 32;
  static constexpr int kGroups = K / 64;
  static constexpr int kCPG = 64 / Fmt<F>::kEpc;
  uint4 q[R][NCH];
  float sc[R][NCH], bi[R][NCH];
  int segi[R];
  int64_t lrow[R];
  __device__ __forceinline__ void issue(const GemvArgs& a, int64_t b, int64_t nw, int64_t total, int lane) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t r = b + j * nw;
      segi[j] = -1;
      lrow[j] = 0;
      if (r < total) {
        int s = 0;
        int64_t lr = r;
        while (lr >= a.seg[s].w.rows) lr -= a.seg[s++].w.rows;
        segi[j] = s;
        lrow[j] = lr;
        const DMat& w = a.seg[s].w;
        const uint4* p = reinterpret_cast<const uint4*>(w.data) + size_t(lr) * kChunks;
#pragma unroll
        for (int i = 0; i < NCH; ++i) q[j][i] = __ldg(p + lane + 32 * i);
        if constexpr (F != DFmt::BF16) {
#pragma unroll
          for (int i = 0; i < NCH; ++i) {
            const int g = (lane + 32 * i) / kCPG;
            sc[j][i] = bf16_bits_to_f32(__ldg(w.scales + size_t(lr) * kGroups + g));
            bi[j][i] = bf16_bits_to_f32(__ldg(w.biases + size_t(lr) * kGroups + g));
          }
        }
      }
    }
  }
  __device__ __forceinline__ void finish(const GemvArgs& a, const SmemX& X, int lane,
                                         unsigned long long& best) const {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      if (segi[j] < 0) continue;  // warp-uniform
      float acc[1] = {0.f};
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        if constexpr (F == DFmt::BF16)
          chunk_dot<F, 1>(q[j][i], 0.f, 0.f, lane + 32 * i, X, 1, acc);
        else
          chunk_dot<F, 1>(q[j][i], sc[j][i], bi[j][i], lane + 32 * i, X, 1, acc);
      }
      const float v = warp_sum(acc[0]);
      if (lane == 0) epilogue1(a.seg[segi[j]], lrow[j], v, best);
    }
  }
};

template <DFmt F, int K>
__global__ void __launch_bounds__(kThreads) gemv_rows_kernel(const __grid_constant__ GemvArgs a,
                                                             int64_t total_rows) {
  constexpr int R = kRowsPerWarp<F, K>;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  float* xsum = xs + K;
  __shared__ float red[32];
  __shared__ unsigned long long best_s[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nw = int64_t(gridDim.x) * kWarps;
  const int64_t step = nw * R;  // rows covered by one group of every warp
  const int64_t base = int64_t(blockIdx.x) * kWarps + warp;

  RowGroup<F, K, R> A, B;
  A.issue(a, base, nw, total_rows, lane);
  pdl_wait();
  stage_x<K>(a, xs, xsum, red);

  const SmemX X{xs, xsum, K};
  unsigned long long best = 0ull;
  for (int64_t b = base; b < total_rows; b += 2 * step) {
    if (b + step < total_rows) B.issue(a, b + step, nw, total_rows, lane);
    A.finish(a, X, lane, best);
    if (b + step >= total_rows) break;
    if (b + 2 * step < total_rows) A.issue(a, b + 2 * step, nw, total_rows, lane);
    B.finish(a, X, lane, best);
  }
  pdl_launch_dependents();
  bool logits = false;
  for (int s = 0; s < a.nseg; ++s)
    if (a.seg[s].epi == Epilogue::Logits && a.seg[s].argmax != nullptr) logits = true;
  if (logits) {
    if (lane == 0) best_s[warp] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
      unsigned long long b = 0ull;
      for (int w = 0; w < kWarps; ++w) b = best_s[w] > b ? best_s[w] : b;
      unsigned long long* dst = nullptr;
      for (int s = 0; s < a.nseg; ++s)
        if (a.seg[s].epi == Epilogue::Logits && a.seg[s].argmax != nullptr) dst = a.seg[s].argmax;
      if (b != 0ull) atomicMax(dst, b);
    }
  }
  if (a.route.logits != nullptr) route_tail(a.route);
}

// One warp of a tile-wise kernel (v3, v5): the warp's argmax keys (one per lane, 0 where none)
// reduced and published with one atomicMax, when the launch has a Logits segment with an argmax.
// Called by all 32 lanes of the warp.
__device__ __forceinline__ void publish_argmax(const GemvArgs& a, unsigned long long best, int lane) {
  unsigned long long* dst = nullptr;
  for (int s = 0; s < a.nseg; ++s)
    if (a.seg[s].epi == Epilogue::Logits && a.seg[s].argmax != nullptr) dst = a.seg[s].argmax;
  if (dst == nullptr) return;  // uniform across the warp
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long other = __shfl_xor_sync(0xffffffffu, best, o);
    best = other > best ? other : best;
  }
  if (lane == 0 && best != 0ull) atomicMax(dst, best);
}

// ---- v3 (M = 1, every segment q4, K = 2048 or 4096): the dot products on the tensor cores
// (mma_dot.cuh). Why: the v1 dot core spends ~4 instructions per weight (unpack, fp16 -> fp32,
// FFMA, shared loads), so a decode GEMV is bound by instruction issue, not by DRAM (lm_head: 1,881
// rows per SM x ~400 warp instructions per row / 4 schedulers = 95 us of issue at 1.98 GHz against
// 115 us measured and 72 us of DRAM; the stall samples show not_selected as the top reason).
// A block (8 warps) takes 16-row tiles; warp w the w-th eighth of K (4 or 8 groups, all its loads
// issued at once, the next tile's before this one's reduction), the 8 partial sums reduced in
// shared memory, the epilogues as v2.
template <int K>
struct MmaSmem {
  MmaB<K> b;
  float part[2][kWarps][kMmaTileRows];
};

// Blocks per SM the register budget is held to (the most without spills: 3 for K = 2048, 2 for 4096).
template <int K>
constexpr int kMmaMinBlocks = K == 2048 ? 3 : 2;

template <int K>
__global__ void __launch_bounds__(kThreads, kMmaMinBlocks<K>) gemv_mma_kernel(const __grid_constant__ GemvArgs a,
                                                            int64_t total_rows) {
  constexpr int NG = K / 64 / kWarps;  // groups per warp
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  float* xsum = xs + K;
  __shared__ float red[32];
  __shared__ MmaSmem<K> sm;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t = lane & 3, g = lane >> 2;
  const int64_t ntiles = (total_rows + kMmaTileRows - 1) / kMmaTileRows;
  const int G0 = warp * NG;
  // This lane's two rows (g, g + 8 of a tile): the words of its quarter of each of the warp's
  // groups, and those groups' scales and biases (NG consecutive bf16 each).
  uint2 q[2][NG];
  uint32_t scw[2][NG / 2], biw[2][NG / 2];
  const auto load_tile = [&](int64_t tile) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t r = tile * kMmaTileRows + g + 8 * h;
#pragma unroll
      for (int j = 0; j < NG; ++j) q[h][j] = make_uint2(0u, 0u);
#pragma unroll
      for (int j = 0; j < NG / 2; ++j) scw[h][j] = biw[h][j] = 0u;
      if (r < total_rows) {
        int s = 0;
        int64_t lr = r;
        while (lr >= a.seg[s].w.rows) lr -= a.seg[s++].w.rows;
        mma_load_row<K, NG>(a.seg[s].w, lr, G0, t, q[h], scw[h], biw[h]);
      }
    }
  };
  // The first tile's weights do not depend on the previous kernel: their loads go out first and
  // are in flight during the staging and the B layout.
  if (int64_t(blockIdx.x) < ntiles) load_tile(blockIdx.x);
  pdl_wait();
  stage_x<K>(a, xs, xsum, red);  // ends with a barrier
  mma_build_b<K>(sm.b, xs, xsum, kThreads);
  __syncthreads();

  unsigned long long best = 0ull;
  int buf = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, buf ^= 1) {
    float acc[2] = {0.f, 0.f};
    mma_tile_dot<K, NG>(q, scw, biw, sm.b, G0, lane, acc);
    // The registers are free: the next tile's loads go out before this tile's reduction and epilogue.
    if (tile + gridDim.x < ntiles) load_tile(tile + gridDim.x);
#pragma unroll
    for (int h = 0; h < 2; ++h) acc[h] = group_sum<4>(acc[h]);
    if (t == 0) {
      sm.part[buf][warp][g] = acc[0];
      sm.part[buf][warp][g + 8] = acc[1];
    }
    __syncthreads();  // (the other buffer is free: the barrier of the previous tile has passed)
    if (tid < kMmaTileRows) {
      const int64_t r = tile * kMmaTileRows + tid;
      if (r < total_rows) {
        float v = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) v += sm.part[buf][w][tid];
        int s = 0;
        int64_t lr = r;
        while (lr >= a.seg[s].w.rows) lr -= a.seg[s++].w.rows;
        epilogue1(a.seg[s], lr, v, best);
      }
    }
  }
  pdl_launch_dependents();
  if (warp == 0) publish_argmax(a, best, lane);  // the keys are in threads 0..15
  if (a.route.logits != nullptr) route_tail(a.route);
}

// ---- v5 (M = 1, every segment q4, K = 2048 or 4096): the weights streamed into shared memory by
// bulk copies (tma.cuh), the dot products on the tensor cores as v3, the warps specialised.
// Why (bench/NOTES.md v13): in v1-v3 a warp's bytes in flight are its registers, and each round
// trip (issue, wait, dot, reduce) leaves DRAM idle in between, so the projections of 2-14 MB reach
// 0.6-1.3 TB/s. Here the producer warp requests the block's first kStages 16-row tiles the moment
// the block starts, before anything waits on the previous kernel; the tiles land in a ring of
// shared-memory stages, each completing its `full` mbarrier. The 16 consumer warps stage x, then
// take the tiles in order: each its sixteenth of K on the tensor cores, the partial sums into the
// stage's slot of `part`, then an arrival on the stage's `done` mbarrier; they never wait for each
// other after the staging. The epilogue warp waits on `done`, reduces the partials, frees the stage
// (`empty`) and runs the epilogue; the producer waits on `empty` and refills the stage with the
// block's next tile. (Measured at 7ef04c4+ with the producer and the epilogue in one warp and 8
// consumers: the epilogue warp spent ~1,450 cycles per tile, ~700 of them issuing the copies,
// and the consumers' dot ~1,440; bench/NOTES.md v13.)
// A tile is 16 rows of one segment (segments are tiled separately: no tile straddles two
// matrices), copied as one block of codes plus one of scales and one of biases: measured on the
// H200 (gemv_probe stream_variants), a copy per row costs ~56 cycles of issue each and held
// lm_head at 116 us without any dot (70.8 with one copy per tile, 4.04 TB/s), while the 8-way
// bank conflicts of the unpadded rows cost the dot ~5 %. Block b takes the tiles b, b + grid, ...
constexpr int kStreamConsumers = 8;                       // consumer warps
constexpr int kStreamCThreads = 32 * kStreamConsumers;    // consumer threads (they stage x)
constexpr int kStreamThreads = kStreamCThreads + 64;      // + producer warp + epilogue warp
template <int K>
struct StreamCfg {
  static constexpr int kStages = K == 2048 ? 4 : 2;
  static constexpr int kRowBytes = K / 2;
  static constexpr int kGroups = K / 64;
  static constexpr int kWBytes = kMmaTileRows * kRowBytes;
  static constexpr int kSBytes = kMmaTileRows * kGroups * 2;  // one tile's scales (its biases: the same)
  static constexpr int kStageBytes = kWBytes + 2 * kSBytes;
  // Dynamic shared memory: barriers (full, done, empty), stages, x (swizzled) and its 16-sums, the
  // B fragments, the partial sums of each stage's tile.
  static constexpr size_t kBarOff = 0;
  static constexpr size_t kStageOff = 128;
  static constexpr size_t kXsOff = kStageOff + size_t(kStages) * kStageBytes;
  static constexpr size_t kXsumOff = kXsOff + size_t(K) * 4;
  static constexpr size_t kBOff = kXsumOff + size_t(K / 16) * 4;
  static constexpr size_t kPartOff = kBOff + sizeof(MmaB<K>);
  static constexpr size_t kSmem = kPartOff + sizeof(float) * kStages * kStreamConsumers * kMmaTileRows;
  static_assert(3 * kStages * 8 <= 128, "barriers");
  static_assert(kStageBytes % 16 == 0 && kXsOff % 16 == 0 && kBOff % 16 == 0 && kPartOff % 16 == 0, "alignment");
};

// Tile `tile` of the launch's segment-wise tiling: its segment, first row and row count.
struct StreamTile {
  int seg;
  int64_t r0;
  int n;
};
__device__ __forceinline__ StreamTile stream_tile(const GemvArgs& a, int64_t tile) {
  int s = 0;
  for (;;) {
    const int64_t nt = (a.seg[s].w.rows + kMmaTileRows - 1) / kMmaTileRows;
    if (tile < nt || s + 1 == a.nseg) break;
    tile -= nt;
    ++s;
  }
  const int64_t r0 = tile * kMmaTileRows;
  const int64_t left = a.seg[s].w.rows - r0;
  return StreamTile{s, r0, int(left < kMmaTileRows ? left : int64_t(kMmaTileRows))};
}

// Probe-only variants of the kernel (tools/device/gemv_probe.cu; production uses 0):
// kStreamNoDot skips the dot products (the pipeline's own ceiling), kStreamTrace records clock64
// stamps of every block into g_stream_trace.
constexpr int kStreamNoDot = 2, kStreamTrace = 4, kStreamNoHint = 8;
constexpr int kTraceSlots = 32;
__device__ long long* g_stream_trace = nullptr;

// One thread (the producer's lane 0): requests tile `tile` into `stage`.
template <int K, int FL = 0>
__device__ __forceinline__ void stream_issue(const GemvArgs& a, int64_t tile, char* stage, uint64_t* full,
                                             uint64_t policy) {
  using C = StreamCfg<K>;
  const StreamTile tl = stream_tile(a, tile);
  const DMat& w = a.seg[tl.seg].w;
  const uint32_t n = uint32_t(tl.n);
  mbar_arrive_expect_tx(full, n * (C::kRowBytes + 4 * C::kGroups));
  if constexpr ((FL & kStreamNoHint) != 0) {
    bulk_copy_nohint(stage, static_cast<const char*>(w.data) + size_t(tl.r0) * C::kRowBytes, n * C::kRowBytes, full);
    bulk_copy_nohint(stage + C::kWBytes, w.scales + size_t(tl.r0) * C::kGroups, n * C::kGroups * 2, full);
    bulk_copy_nohint(stage + C::kWBytes + C::kSBytes, w.biases + size_t(tl.r0) * C::kGroups, n * C::kGroups * 2, full);
  } else {
    bulk_copy(stage, static_cast<const char*>(w.data) + size_t(tl.r0) * C::kRowBytes, n * C::kRowBytes, full, policy);
    bulk_copy(stage + C::kWBytes, w.scales + size_t(tl.r0) * C::kGroups, n * C::kGroups * 2, full, policy);
    bulk_copy(stage + C::kWBytes + C::kSBytes, w.biases + size_t(tl.r0) * C::kGroups, n * C::kGroups * 2, full, policy);
  }
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

template <int K, int FL = 0>
__global__ void __launch_bounds__(kStreamThreads, 1) gemv_stream_kernel(const __grid_constant__ GemvArgs a,
                                                                        int64_t ntiles) {
  using C = StreamCfg<K>;
  constexpr int S = C::kStages;
  constexpr int NC = kStreamConsumers;
  constexpr int NG = K / 64 / NC;  // groups per consumer warp
  constexpr bool kTr = (FL & kStreamTrace) != 0;
  extern __shared__ __align__(128) char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + C::kBarOff);
  uint64_t* done = full + S;
  uint64_t* empty = done + S;
  char* stages = smem + C::kStageOff;
  float* xs = reinterpret_cast<float*>(smem + C::kXsOff);
  float* xsum = reinterpret_cast<float*>(smem + C::kXsumOff);
  MmaB<K>& mb = *reinterpret_cast<MmaB<K>*>(smem + C::kBOff);
  float(*part)[NC][kMmaTileRows] = reinterpret_cast<float(*)[NC][kMmaTileRows]>(smem + C::kPartOff);
  __shared__ float red[32];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  long long* tr = kTr ? g_stream_trace + size_t(blockIdx.x) * kTraceSlots : nullptr;
  if constexpr (kTr) if (tid == 0) tr[0] = clock64();
  const int64_t mine = (ntiles - blockIdx.x + gridDim.x - 1) / gridDim.x;  // tiles of this block

  if (warp == NC) {
    // ---- producer warp
    if (lane == 0) {
      for (int i = 0; i < S; ++i) {
        mbar_init(&full[i], 1);
        mbar_init(&done[i], kStreamCThreads);  // every consumer thread arrives
        mbar_init(&empty[i], 32);              // every epilogue thread arrives
      }
      mbar_fence_init();
    }
    __syncwarp();
    // The others use the barriers after named barrier 2 (this warp only arrives at it).
    asm volatile("bar.arrive 2, %0;" ::"n"(kStreamThreads) : "memory");
    if (lane != 0) return;
    const uint64_t policy = l2_evict_first();
    // The weights do not depend on the previous kernel: every stage's request goes out first.
    for (int k = 0; k < S && k < mine; ++k)
      stream_issue<K, FL>(a, blockIdx.x + int64_t(k) * gridDim.x, stages + size_t(k) * C::kStageBytes, &full[k], policy);
    if constexpr (kTr) tr[1] = clock64();
    for (int64_t k = 0; k + S < mine; ++k) {
      const int st = int(k % S);
      mbar_wait(&empty[st], uint32_t((k / S) & 1));
      stream_issue<K, FL>(a, blockIdx.x + (k + S) * gridDim.x, stages + size_t(st) * C::kStageBytes, &full[st], policy);
    }
    return;
  }
  asm volatile("bar.sync 2, %0;" ::"n"(kStreamThreads) : "memory");

  if (warp == NC + 1) {
    // ---- epilogue warp
    pdl_wait();  // the epilogues read and write what earlier kernels use
    unsigned long long best = 0ull;
    for (int64_t k = 0; k < mine; ++k) {
      const int st = int(k % S);
      const StreamTile tl = stream_tile(a, blockIdx.x + k * gridDim.x);
      mbar_wait(&done[st], uint32_t((k / S) & 1));
      if constexpr (kTr) if (lane == 0 && k < 9) tr[4 + 3 * k] = clock64();
      float v = 0.f;
      if (lane < tl.n) {
#pragma unroll
        for (int w = 0; w < NC; ++w) v += part[st][w][lane];
      }
      mbar_arrive(&empty[st]);  // after this thread's reads of part[st]
      if (lane < tl.n) epilogue1(a.seg[tl.seg], tl.r0 + lane, v, best);
      if constexpr (kTr) if (lane == 0 && k < 9) tr[5 + 3 * k] = clock64();
    }
    if constexpr (kTr) if (lane == 0) tr[30] = clock64(), tr[31] = mine;
    pdl_launch_dependents();  // every tile of this block is done
    publish_argmax(a, best, lane);  // the keys are in lanes 0..15
    return;
  }

  // ---- consumer warps
  const int t = lane & 3, g = lane >> 2;
  pdl_wait();
  stage_x<K, true, kStreamCThreads>(a, xs, xsum, red);  // ends with the consumers' barrier
  mma_build_b<K>(mb, xs, xsum, kStreamCThreads);
  stage_sync<true, kStreamCThreads>();
  if constexpr (kTr) if (tid == 0) tr[2] = clock64();
  const int G0 = warp * NG;
  for (int64_t k = 0; k < mine; ++k) {
    const int st = int(k % S);
    const char* sp = stages + size_t(st) * C::kStageBytes;
    mbar_wait(&full[st], uint32_t((k / S) & 1));
    if constexpr (kTr) if (tid == 0 && k < 9) tr[3 + 3 * k] = clock64();
    uint2 q[2][NG];
    uint32_t scw[2][NG / 2], biw[2][NG / 2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = g + 8 * h;  // rows >= the tile's count hold stale bytes: their sums are never used
      const char* rowp = sp + r * C::kRowBytes;
#pragma unroll
      for (int j = 0; j < NG; ++j) q[h][j] = *reinterpret_cast<const uint2*>(rowp + (G0 + j) * 32 + 8 * t);
      const uint32_t* sw = reinterpret_cast<const uint32_t*>(sp + C::kWBytes + r * C::kGroups * 2 + G0 * 2);
      const uint32_t* bw = reinterpret_cast<const uint32_t*>(sp + C::kWBytes + C::kSBytes + r * C::kGroups * 2 + G0 * 2);
#pragma unroll
      for (int j = 0; j < NG / 2; ++j) {
        scw[h][j] = sw[j];
        biw[h][j] = bw[j];
      }
    }
    float acc[2] = {0.f, 0.f};
    if constexpr ((FL & kStreamNoDot) == 0) {
      mma_tile_dot<K, NG>(q, scw, biw, mb, G0, lane, acc);
    } else {
      acc[0] = float(q[0][0].x & 1u);  // keeps the loads
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) acc[h] = group_sum<4>(acc[h]);
    if (t == 0) {
      part[st][warp][g] = acc[0];
      part[st][warp][g + 8] = acc[1];
    }
    mbar_arrive(&done[st]);  // after this thread's reads of the stage and writes of part
  }
}

// Blocks of gemv_rows_kernel<F, K> resident at once on the whole GPU (occupancy API; first
// called from gemv_init, outside any graph capture).
template <DFmt F, int K>
int resident_blocks() {
  static const int n = [] {
    int per_sm = 0;
    const size_t smem = size_t(K) * 4 + size_t(K / 16) * 4;
    KCUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_rows_kernel<F, K>, kThreads, smem));
    return std::max(1, per_sm) * num_sms();
  }();
  return n;
}

template <DFmt F, int K>
void launch_rows(const GemvArgs& a, int64_t total, cudaStream_t s) {
  constexpr int R = kRowsPerWarp<F, K>;
  const size_t smem = size_t(K) * 4 + size_t(K / 16) * 4;
  const int64_t want = (total + kWarps * R - 1) / (kWarps * R);
  const int blocks = int(std::min<int64_t>(want, resident_blocks<F, K>()));
  launch_pdl(gemv_rows_kernel<F, K>, dim3(blocks), dim3(kThreads), smem, s, a, total);
}

// Route 2 takes every M = 1 launch of one weight format; route 1 the bf16 ones: measured on the
// H200 at 821cf56, the bf16 model decodes at 378.3 / 369.0 tok/s (ctx 0 / 4K) on route 2 against
// 356.3 / 347.9 on route 1's one-row kernel, and 390.2 / 377.6 against 356.7 / 346.0 with PDL
// (bench/NOTES.md v13; for q4 launches route 2 measured slower, v2).
template <int K>
bool try_launch_rows(const GemvArgs& a, int64_t total, cudaStream_t s) {
  const int v = gemv_version();
  if (a.M != 1 || (v != 2 && v != 1)) return false;
  for (int i = 1; i < a.nseg; ++i)
    if (a.seg[i].w.fmt != a.seg[0].w.fmt) return false;  // v2 is one format per launch
  if (v == 1 && a.seg[0].w.fmt != DFmt::BF16) return false;
  switch (a.seg[0].w.fmt) {
    case DFmt::Q4:
      if constexpr ((K / 32) % 32 == 0) { launch_rows<DFmt::Q4, K>(a, total, s); return true; }
      return false;
    case DFmt::Q8:
      if constexpr ((K / 16) % 32 == 0) { launch_rows<DFmt::Q8, K>(a, total, s); return true; }
      return false;
    default: launch_rows<DFmt::BF16, K>(a, total, s); return true;
  }
}

template <int K, int MM>
void launch_gemv_mm(const GemvArgs& a, int64_t total, cudaStream_t s) {
  const size_t smem = size_t(a.M) * K * 4 + size_t(a.M) * (K / 16) * 4;
  const int64_t want = (total + kWarps - 1) / kWarps;
  const int blocks = int(std::min<int64_t>(want, int64_t(num_sms()) * 4));
  if constexpr (kPreload<K, MM, true>) {
    if (gemv_preload()) {
      launch_pdl(gemv_kernel<K, MM, true>, dim3(blocks), dim3(kThreads), smem, s, a, total);
      return;
    }
  }
  launch_pdl(gemv_kernel<K, MM>, dim3(blocks), dim3(kThreads), smem, s, a, total);
}

// Blocks of gemv_mma_kernel<K> resident at once (occupancy API; first called from gemv_init).
template <int K>
int mma_resident_blocks() {
  static const int n = [] {
    int per_sm = 0;
    KCUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_mma_kernel<K>, kThreads,
                                                        size_t(K) * 4 + size_t(K / 16) * 4));
    return std::max(1, per_sm) * num_sms();
  }();
  return n;
}

// Route 3 takes M = 1 launches whose segments are all q4 with 8-byte aligned rows, scales and
// biases (every decode projection of a q4 checkpoint but the router's, whose rows are q8).
// Route 1 takes the same kernel for such launches of >= kMmaRowsV1 rows (lm_head): measured on
// the H200 at 2074b07, lm_head 121.9 us against 137.2 on the v1 kernel, while the projections of
// 2K-4K rows are slower on it (out_proj 8.2 against 7.7 us at a1ba571: one load round trip per
// 16-row tile and block, with few tiles per block; bench/NOTES.md v10). It also takes the K = 2048
// launches of >= kMmaRowsK2048 rows (GDN in_proj 12,352 rows, attention q+gate|k|v 9,216): 11.65
// against 12.2 us per in_proj (a1ba571), end to end q4 ctx 0 529.1 against 525.9 tok/s (0ebcc86,
// measured as the candidate route 4; bench/NOTES.md v12). Where those launches are 16-byte aligned
// (every q4 checkpoint's), route 1's streamed kernel (below) takes them first.
constexpr int64_t kMmaRowsV1 = 65536;
constexpr int64_t kMmaRowsK2048 = 8192;
template <int K>
bool try_launch_mma(const GemvArgs& a, int64_t total, cudaStream_t s) {
  if constexpr (K != 2048 && K != 4096) {
    return false;
  } else {
    const int v = gemv_version();
    const bool take = v == 3 || (v == 1 && (total >= kMmaRowsV1 || (K == 2048 && total >= kMmaRowsK2048)));
    if (a.M != 1 || !take) return false;
    for (int i = 0; i < a.nseg; ++i) {
      const DMat& w = a.seg[i].w;
      if (w.fmt != DFmt::Q4 || !w.aligned8()) return false;
    }
    const int64_t tiles = (total + kMmaTileRows - 1) / kMmaTileRows;
    const int blocks = int(std::min<int64_t>(tiles, mma_resident_blocks<K>()));
    launch_pdl(gemv_mma_kernel<K>, dim3(blocks), dim3(kThreads), size_t(K) * 4 + size_t(K / 16) * 4, s, a, total);
    return true;
  }
}

// Route 5 takes M = 1 launches whose segments are all q4 with 16-byte aligned codes, scales and
// biases (the bulk copies' alignment), K = 2048 or 4096. Blocks per SM: gemv_stream_blocks_per_sm()
// (1 leaves room for the next kernel's blocks under PDL), at most what fits.
// Route 1 (the default) takes the same kernel for the launches it wins, measured on the H200 at
// 0605c3d (gemv_probe, us per launch, route 1's kernel against this one at 1 | 2 blocks per SM):
// GDN in_proj (K 2048, 12,352 rows) 11.80 against 8.50 | 9.29; lm_head (248,320 rows, argmax)
// 118.9 against 90.9 | 85.3; out_proj (K 4096, 2,048 rows) 7.81 against 8.03 | 7.97, so route 1
// keeps its own kernel for that one. Hence: K = 2048 launches of >= kMmaRowsK2048 rows at 1 block
// per SM (GDN in_proj, attention q+gate|k|v), launches of >= kMmaRowsV1 rows at 2 (lm_head).
template <int K>
int64_t stream_tiles(const GemvArgs& a) {
  int64_t n = 0;
  for (int i = 0; i < a.nseg; ++i) n += (a.seg[i].w.rows + kMmaTileRows - 1) / kMmaTileRows;
  return n;
}
template <int K>
int stream_fit_per_sm() {
  static const int n = [] {
    int per_sm = 0;
    KCUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, gemv_stream_kernel<K>, kStreamThreads,
                                                        StreamCfg<K>::kSmem));
    return std::max(1, per_sm);
  }();
  return n;
}
// Blocks per SM route `v` runs the stream kernel at for a launch of `total` rows, 0 where it does
// not take it.
template <int K>
int stream_blocks_per_sm(int v, int64_t total) {
  if (v == 5) return gemv_stream_blocks_per_sm();
  if (v != 1) return 0;
  if (total >= kMmaRowsV1) return 2;
  if (K == 2048 && total >= kMmaRowsK2048) return 1;
  return 0;
}
template <int K>
bool try_launch_stream(const GemvArgs& a, int64_t total, cudaStream_t s) {
  if constexpr (K != 2048 && K != 4096) {
    return false;
  } else {
    // (The routing tail needs the whole block's barrier: the router launch is never all-q4.)
    const int want = stream_blocks_per_sm<K>(gemv_version(), total);
    if (a.M != 1 || want == 0 || a.route.logits != nullptr) return false;
    for (int i = 0; i < a.nseg; ++i) {
      const DMat& w = a.seg[i].w;
      if (w.fmt != DFmt::Q4 || !w.aligned16()) return false;
    }
    const int64_t tiles = stream_tiles<K>(a);
    const int per_sm = std::min(stream_fit_per_sm<K>(), want);
    const int blocks = int(std::min<int64_t>(tiles, int64_t(num_sms()) * per_sm));
    // (Unpinned, under PDL: 557.7 against 609.4 tok/s at ctx 0, 798dac4; bench/NOTES.md v13.)
    const size_t smem = pinned_smem(reinterpret_cast<const void*>(gemv_stream_kernel<K>), StreamCfg<K>::kSmem, per_sm);
    launch_pdl(gemv_stream_kernel<K>, dim3(blocks), dim3(kStreamThreads), smem, s, a, tiles);
    return true;
  }
}

// Decode (M = 1) gets its own instantiation: the M <= 8 one holds 8 accumulators per lane.
template <int K>
void launch_gemv(const GemvArgs& a, int64_t total, cudaStream_t s) {
  if (try_launch_stream<K>(a, total, s)) return;
  if (try_launch_mma<K>(a, total, s)) return;
  if (try_launch_rows<K>(a, total, s)) return;
  if (a.M == 1)
    launch_gemv_mm<K, 1>(a, total, s);
  else
    launch_gemv_mm<K, kMaxGemvRows>(a, total, s);
}

}  // namespace

template <int K>
void set_smem_limit() {
  KCUDA(cudaFuncSetAttribute(gemv_kernel<K, kMaxGemvRows>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(kMaxGemvRows * K * 4 + kMaxGemvRows * (K / 16) * 4)));
  KCUDA(cudaFuncSetAttribute(gemv_kernel<K, 1>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             int(K * 4 + (K / 16) * 4)));
  if constexpr (kPreload<K, 1, true>)
    KCUDA(cudaFuncSetAttribute(gemv_kernel<K, 1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(K * 4 + (K / 16) * 4)));
}

void gemv_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem_limit<512>();
    set_smem_limit<2048>();
    set_smem_limit<4096>();
    (void)resident_blocks<DFmt::BF16, 512>();
    (void)resident_blocks<DFmt::Q8, 512>();
    (void)resident_blocks<DFmt::BF16, 2048>();
    (void)resident_blocks<DFmt::Q8, 2048>();
    (void)resident_blocks<DFmt::Q4, 2048>();
    (void)resident_blocks<DFmt::BF16, 4096>();
    (void)resident_blocks<DFmt::Q8, 4096>();
    (void)resident_blocks<DFmt::Q4, 4096>();
    (void)mma_resident_blocks<2048>();
    (void)mma_resident_blocks<4096>();
    KCUDA(cudaFuncSetAttribute(gemv_stream_kernel<2048>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(StreamCfg<2048>::kSmem)));
    KCUDA(cudaFuncSetAttribute(gemv_stream_kernel<4096>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(StreamCfg<4096>::kSmem)));
    (void)stream_fit_per_sm<2048>();
    (void)stream_fit_per_sm<4096>();
  });
}

void decode_route_launch(const DecodeRouteArgs& a, cudaStream_t s) {
  launch_pdl(decode_route_kernel, dim3(1), dim3(a.algo == RouteAlgo::Block ? kRouteBlockThreads : 32), 0, s, a);
}

void gemv_launch(const GemvArgs& a, int64_t total, cudaStream_t s) {
  switch (a.K) {
    case 512: launch_gemv<512>(a, total, s); break;
    case 2048: launch_gemv<2048>(a, total, s); break;
    default: launch_gemv<4096>(a, total, s); break;
  }
}

}  // namespace kestrel::cuda
