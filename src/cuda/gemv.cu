// GEMV family: y[M, N] = prologue(x)[M, K] * W^T for up to kMaxGemvSegs matrices in one launch
// (fused projections: GDN qkv|z|b|a, attention q+gate|k|v, router|shared expert), M <= 8.
// Prologues fold the preceding norm into the kernel (every block normalises the activation rows
// itself: 8-16 KB re-read from L2 instead of one more launch); epilogues fold the residual add,
// the GDN causal conv + SiLU, and the lm_head argmax.
#include "cuda/gemv_core.cuh"

#include <mutex>

namespace kestrel::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Stages the activation rows (after the prologue's norm) into shared memory, swizzled, with the
// 16-element block sums, and optionally writes them to x_out. Ends with a barrier.
template <int K>
__device__ __forceinline__ void stage_x(const GemvArgs& a, float* xs, float* xsum, float* red,
                                        float* inv_s) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int M = a.M;
  if (a.pro == Prologue::GatedRmsNorm) {
    const int G = a.norm_group;  // 128: one warp per group, 4 values per lane
    const int ngroups = M * (K / G);
    for (int gi = warp; gi < ngroups; gi += kWarps) {
      const int m = gi / (K / G), g0 = (gi % (K / G)) * G;
      float v[4], ss = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        v[j] = a.x[size_t(m) * a.ldx + g0 + lane * 4 + j];
        ss += v[j] * v[j];
      }
      ss = warp_sum(ss);
      const float inv = 1.f / sqrtf(ss / float(G) + a.eps);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int k = g0 + lane * 4 + j;
        const float zz = a.z[size_t(m) * a.ldz + k];
        const float y = (a.norm_w[lane * 4 + j] * (v[j] * inv)) * silu_f(zz);
        smem_store_x(xs, xsum, K, m, k, y);
      }
    }
  } else {
    for (int m = 0; m < M; ++m) {
      float ss = 0.f;
      for (int k = tid; k < K; k += kThreads) {
        const float v = a.x[size_t(m) * a.ldx + k];
        ss += v * v;
        smem_store_x(xs, xsum, K, m, k, v);
      }
      if (a.pro == Prologue::RmsNorm) {
        ss = block_sum(ss, red);
        if (tid == 0) inv_s[m] = 1.f / sqrtf(ss / float(K) + a.eps);
      }
    }
    if (a.pro == Prologue::RmsNorm) {
      __syncthreads();
      for (int m = 0; m < M; ++m)
        for (int k = tid; k < K; k += kThreads) {
          const int idx = m * K + swz(k >> 2) * 4 + (k & 3);
          xs[idx] = xs[idx] * inv_s[m] * a.norm_w[k];
        }
    }
  }
  __syncthreads();
  smem_sum16(xs, xsum, K, M);
  if (a.x_out != nullptr && blockIdx.x == 0)
    for (int i = tid; i < M * K; i += kThreads) {
      const int m = i / K, k = i % K;
      a.x_out[i] = xs[m * K + swz(k >> 2) * 4 + (k & 3)];
    }
  __syncthreads();

}

template <int K, int MM>
__global__ void __launch_bounds__(kThreads) gemv_kernel(const __grid_constant__ GemvArgs a, int64_t total_rows) {
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  float* xsum = xs + size_t(a.M) * K;
  __shared__ float red[32];
  __shared__ float inv_s[kMaxGemvRows];
  __shared__ unsigned long long best_s[kWarps][kMaxGemvRows];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int M = a.M;
  pdl_launch_dependents();
  // Weights do not depend on the previous kernel: start this warp's first row towards L2.
  {
    int64_t r = int64_t(blockIdx.x) * kWarps + warp;
    if (r < total_rows) {
      int s = 0;
      while (r >= a.seg[s].w.rows) r -= a.seg[s++].w.rows;
      const DMat& w = a.seg[s].w;
      const size_t rb = w.fmt == DFmt::BF16 ? size_t(K) * 2 : w.fmt == DFmt::Q8 ? size_t(K) : size_t(K) / 2;
      const char* p = static_cast<const char*>(w.data) + size_t(r) * rb;
      for (size_t off = size_t(lane) * 128; off < rb; off += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" ::"l"(p + off));
    }
  }
  pdl_wait();

  stage_x<K>(a, xs, xsum, red, inv_s);

  // ---- rows: one warp per weight row ----
  const SmemX X{xs, xsum, K};
  unsigned long long best[MM];
#pragma unroll
  for (int m = 0; m < MM; ++m) best[m] = 0ull;
  bool any_logits = false;
  for (int64_t r = int64_t(blockIdx.x) * kWarps + warp; r < total_rows;
       r += int64_t(gridDim.x) * kWarps) {
    int s = 0;
    int64_t lr = r;
    while (lr >= a.seg[s].w.rows) lr -= a.seg[s++].w.rows;
    const GemvSeg& sg = a.seg[s];
    float acc[MM];
#pragma unroll
    for (int m = 0; m < MM; ++m) acc[m] = 0.f;
    row_dot_any<K, 32, MM>(sg.w, lr, X, M, lane, acc);
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
  }
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
}


// ---- v2 (M = 1, one format for all segments): each warp holds R rows' loads in flight, and the
// first group's weight loads are issued before waiting on the previous kernel and before staging
// the activations (weights never depend on earlier kernels), so the staging latency and, with
// PDL, the previous kernel's tail overlap the weight stream. R = max(1, 8 / chunks per lane).
template <DFmt F, int K>
constexpr int kRowsPerWarp = (8 / (K / Fmt<F>::kEpc / 32)) > 0 ? (8 / (K / Fmt<F>::kEpc / 32)) : 1;

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

template <DFmt F, int K>
__global__ void __launch_bounds__(kThreads) gemv_rows_kernel(const __grid_constant__ GemvArgs a,
                                                             int64_t total_rows) {
  constexpr int kChunks = K / Fmt<F>::kEpc;
  constexpr int NCH = kChunks / 32;
  constexpr int R = kRowsPerWarp<F, K>;
  constexpr int kGroups = K / 64;
  constexpr int kCPG = 64 / Fmt<F>::kEpc;
  extern __shared__ float4 smem4[];
  float* xs = reinterpret_cast<float*>(smem4);
  float* xsum = xs + K;
  __shared__ float red[32];
  __shared__ float inv_s[kMaxGemvRows];
  __shared__ unsigned long long best_s[kWarps];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nw = int64_t(gridDim.x) * kWarps;
  int64_t base = int64_t(blockIdx.x) * kWarps + warp;

  uint4 q[R][NCH];
  float sc[R][NCH], bi[R][NCH];
  int segi[R];
  int64_t lrow[R];
  auto issue = [&](int64_t b) {
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int64_t r = b + j * nw;
      segi[j] = -1;
      lrow[j] = 0;
      if (r < total_rows) {
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
  };

  pdl_launch_dependents();
  issue(base);
  pdl_wait();
  stage_x<K>(a, xs, xsum, red, inv_s);

  const SmemX X{xs, xsum, K};
  unsigned long long best = 0ull;
  while (true) {
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
    base += nw * R;
    if (base >= total_rows) break;
    issue(base);
  }
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
}

template <DFmt F, int K>
void launch_rows(const GemvArgs& a, int64_t total, cudaStream_t s) {
  constexpr int R = kRowsPerWarp<F, K>;
  const size_t smem = size_t(K) * 4 + size_t(K / 16) * 4;
  const int64_t want = (total + kWarps * R - 1) / (kWarps * R);
  const int blocks = int(std::min<int64_t>(want, int64_t(num_sms()) * 4));
  launch_pdl(gemv_rows_kernel<F, K>, dim3(blocks), dim3(kThreads), smem, s, a, total);
}

template <int K>
bool try_launch_rows(const GemvArgs& a, int64_t total, cudaStream_t s) {
  if (a.M != 1 || gemv_version() != 2) return false;
  for (int i = 1; i < a.nseg; ++i)
    if (a.seg[i].w.fmt != a.seg[0].w.fmt) return false;  // v2 is one format per launch
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
  launch_pdl(gemv_kernel<K, MM>, dim3(blocks), dim3(kThreads), smem, s, a, total);
}

// Decode (M = 1) gets its own instantiation: the M <= 8 one holds 8 accumulators per lane.
template <int K>
void launch_gemv(const GemvArgs& a, int64_t total, cudaStream_t s) {
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
}

void gemv_init() {
  static std::once_flag once;
  std::call_once(once, [] {
    set_smem_limit<512>();
    set_smem_limit<2048>();
    set_smem_limit<4096>();
  });
}

void gemv_launch(const GemvArgs& a, int64_t total, cudaStream_t s) {
  switch (a.K) {
    case 512: launch_gemv<512>(a, total, s); break;
    case 2048: launch_gemv<2048>(a, total, s); break;
    default: launch_gemv<4096>(a, total, s); break;
  }
}

}  // namespace kestrel::cuda
