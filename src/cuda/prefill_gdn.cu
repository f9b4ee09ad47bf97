// Gated DeltaNet prefill: causal conv1d + SiLU over T tokens (conv window carried in the decode
// layout), then the chunked (WY) delta rule, chunk 64, fp32 state carried between chunks in the
// decode layout [Hv, dv, dk].
//
// One block per (v-head, 32-column slice of dv): the columns of the state evolve independently
// given k, beta and g, so the 128 x 32 state slice stays in shared memory for the whole prompt and
// the chunks run in order inside the block. Per chunk (64 tokens, C = chunk positions):
//   A_ij = beta_i (k_i . k_j) exp(G_i - G_j) (j < i),  P_ij = (q_i . k_j) exp(G_i - G_j) (j <= i)
//   [W | U] = (I + A)^-1 [k_beta exp(G) | v_beta]      (forward substitution, one column per thread)
//   V' = U - W S;  O = exp(G) (q S) + P V';  S = exp(G_63) S + (k exp(G_63 - G))^T V'
// fp32 throughout (the reference's precision for the delta rule).
#include "cuda/common.cuh"
#include "cuda/prefill.h"

#include <mutex>

namespace kestrel::cuda {
namespace {

constexpr int C = kGdnChunk;  // 64
constexpr int DK = 128, DVS = 32, NSL = 128 / DVS;
constexpr int KP = DK + 4;  // padded row of K/Q (float4-aligned)
constexpr int AP = C + 1;
constexpr int XW = DK + DVS;  // solve columns: W (128) | U (32)
constexpr int kThreads = 256;

struct GdnSmem {
  float k[C][KP];
  float q[C][KP];
  float A[C][AP];
  float P[C][AP];
  float X[C][XW];
  float S[DK][DVS];
  float vp[C][DVS];
  float v[C][DVS];
  float beta[C], G[C], eG[C], kdec[C];
};

__global__ void __launch_bounds__(kThreads) gdn_chunk_kernel(const PrefillGdnArgs a) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  GdnSmem& sm = *reinterpret_cast<GdnSmem*>(smem_raw);
  const int j = blockIdx.x, sl = blockIdx.y;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int hk = j / (a.Hv / a.Hk);
  const float qscale = rsqrtf(float(DK));
  const float Aexp = expf(a.A_log[j]), dtb = a.dt_bias[j];
  float* state = a.state + size_t(j) * 128 * DK;  // [dv][dk]

  // Load the state slice: S[r][c] = state[sl*32 + c][r].
  for (int i = tid; i < DK * DVS; i += kThreads) {
    const int c = i / DK, r = i % DK;
    sm.S[r][c] = state[size_t(sl * DVS + c) * DK + r];
  }

  const int64_t nchunks = (a.T + C - 1) / C;
  for (int64_t ch = 0; ch < nchunks; ++ch) {
    const int64_t t0 = ch * C;
    // 1. Tokens: k, q L2-normalised (q scaled), v slice, beta, g.
    for (int i = warp; i < C; i += kThreads / 32) {
      const int64_t t = t0 + i;
      if (t < a.T) {
        const float* ut = a.u + t * a.ldu;
        float4 kv = reinterpret_cast<const float4*>(ut + a.Hk * DK + hk * DK)[lane];
        float4 qv = reinterpret_cast<const float4*>(ut + hk * DK)[lane];
        const float kss = warp_sum(kv.x * kv.x + kv.y * kv.y + kv.z * kv.z + kv.w * kv.w);
        const float qss = warp_sum(qv.x * qv.x + qv.y * qv.y + qv.z * qv.z + qv.w * qv.w);
        const float ki = 1.f / sqrtf(kss + 1e-6f), qi = 1.f / sqrtf(qss + 1e-6f) * qscale;
        kv.x *= ki, kv.y *= ki, kv.z *= ki, kv.w *= ki;
        qv.x *= qi, qv.y *= qi, qv.z *= qi, qv.w *= qi;
        *reinterpret_cast<float4*>(&sm.k[i][4 * lane]) = kv;
        *reinterpret_cast<float4*>(&sm.q[i][4 * lane]) = qv;
        sm.v[i][lane] = ut[2 * a.Hk * DK + j * 128 + sl * DVS + lane];
        if (lane == 0) {
          sm.beta[i] = sigmoid_f(a.b[t * a.ldb + j]);
          sm.G[i] = -Aexp * softplus_f(a.a[t * a.lda + j] + dtb);
        }
      } else {
        const float4 z = make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(&sm.k[i][4 * lane]) = z;
        *reinterpret_cast<float4*>(&sm.q[i][4 * lane]) = z;
        sm.v[i][lane] = 0.f;
        if (lane == 0) {
          sm.beta[i] = 0.f;
          sm.G[i] = 0.f;
        }
      }
    }
    __syncthreads();
    // 2. Inclusive cumsum of g (sequential, as the reference), decay factors.
    if (tid == 0) {
      float acc = 0.f;
      for (int i = 0; i < C; ++i) {
        acc += sm.G[i];
        sm.G[i] = acc;
      }
    }
    __syncthreads();
    if (tid < C) {
      sm.eG[tid] = expf(sm.G[tid]);
      sm.kdec[tid] = expf(sm.G[C - 1] - sm.G[tid]);
    }
    // 3. A, P (lower parts) and the right-hand sides.
    {
      const int i = tid >> 2;
      const float Gi = sm.G[i], bi = sm.beta[i];
      const float4* ki = reinterpret_cast<const float4*>(sm.k[i]);
      const float4* qi = reinterpret_cast<const float4*>(sm.q[i]);
      for (int jj = 0; jj < C / 4; ++jj) {
        const int jx = (tid & 3) + 4 * jj;
        float av = 0.f, pv = 0.f;
        if (jx <= i) {
          const float4* kj = reinterpret_cast<const float4*>(sm.k[jx]);
          float dkk = 0.f, dqk = 0.f;
#pragma unroll 8
          for (int r = 0; r < DK / 4; ++r) {
            const float4 x = kj[r], y = ki[r], z = qi[r];
            dkk += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
            dqk += x.x * z.x + x.y * z.y + x.z * z.z + x.w * z.w;
          }
          const float d = expf(Gi - sm.G[jx]);
          pv = dqk * d;
          if (jx < i) av = bi * dkk * d;
        }
        sm.A[i][jx] = av;
        sm.P[i][jx] = pv;
      }
    }
    __syncthreads();
    for (int x = tid; x < C * XW; x += kThreads) {
      const int i = x / XW, c = x % XW;
      sm.X[i][c] = c < DK ? sm.k[i][c] * sm.beta[i] * sm.eG[i] : sm.v[i][c - DK] * sm.beta[i];
    }
    __syncthreads();
    // 4. Forward substitution: X_i -= sum_{j<i} A_ij X_j, one column per thread, in registers.
    if (tid < XW) {
      float x[C];
#pragma unroll
      for (int i = 0; i < C; ++i) {
        float s0 = sm.X[i][tid], s1 = 0.f;
#pragma unroll
        for (int jj = 0; jj < i; ++jj) {
          if (jj & 1) s1 -= sm.A[i][jj] * x[jj];
          else s0 -= sm.A[i][jj] * x[jj];
        }
        x[i] = s0 + s1;
        sm.X[i][tid] = x[i];
      }
    }
    __syncthreads();
    // 5. V' = U - W S (64 x 32): thread column c, rows i0..i0+7.
    const int c = tid & 31, i0 = (tid >> 5) * 8;
    {
      float acc[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = sm.X[i0 + e][DK + c];
      for (int r = 0; r < DK; ++r) {
        const float s = sm.S[r][c];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] -= sm.X[i0 + e][r] * s;
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) sm.vp[i0 + e][c] = acc[e];
    }
    __syncthreads();
    // 6. O = exp(G) (q S) + P V'.
    {
      float acc[8], acc2[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] = acc2[e] = 0.f;
      for (int r = 0; r < DK; ++r) {
        const float s = sm.S[r][c];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] += sm.q[i0 + e][r] * s;
      }
      for (int jx = 0; jx < i0 + 8; ++jx) {
        const float v = sm.vp[jx][c];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc2[e] += sm.P[i0 + e][jx] * v;  // P is 0 above the diagonal
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int64_t t = t0 + i0 + e;
        if (t < a.T) a.o[t * (int64_t(a.Hv) * 128) + j * 128 + sl * DVS + c] = sm.eG[i0 + e] * acc[e] + acc2[e];
      }
    }
    __syncthreads();
    // 7. S = exp(G_63) S + (k exp(G_63 - G))^T V': thread column c, rows r0..r0+15.
    {
      const int r0 = (tid >> 5) * 16;
      const float eL = sm.eG[C - 1];
      float acc[16];
#pragma unroll
      for (int e = 0; e < 16; ++e) acc[e] = sm.S[r0 + e][c] * eL;
      for (int i = 0; i < C; ++i) {
        const float v = sm.vp[i][c] * sm.kdec[i];
#pragma unroll
        for (int e = 0; e < 16; ++e) acc[e] += sm.k[i][r0 + e] * v;
      }
#pragma unroll
      for (int e = 0; e < 16; ++e) sm.S[r0 + e][c] = acc[e];
    }
    __syncthreads();
  }
  for (int i = tid; i < DK * DVS; i += kThreads) {
    const int c = i / DK, r = i % DK;
    state[size_t(sl * DVS + c) * DK + r] = sm.S[r][c];
  }
}

__global__ void conv_kernel(const PrefillConvArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.T * a.C) return;
  const int64_t t = i / a.C, c = i % a.C;
  const float* w = a.w + c * 4;
  float acc = w[3] * a.x[t * a.ldx + c];
#pragma unroll
  for (int j = 0; j < 3; ++j) {
    const int64_t src = t - 3 + j;
    const float xv = src >= 0 ? a.x[src * a.ldx + c] : a.state[c * 3 + (src + 3)];
    acc += w[j] * xv;
  }
  a.u[t * a.C + c] = silu_f(acc);
}

__global__ void conv_state_kernel(const PrefillConvArgs a) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= a.C) return;
  float* st = a.state + c * 3;
  for (int i = 0; i < 3; ++i) {
    const int64_t pos = a.T - 3 + i;
    st[i] = pos >= 0 ? a.x[pos * a.ldx + c] : st[a.T + i];
  }
}

std::once_flag g_gdn_once;

}  // namespace

void prefill_gdn_init() {
  std::call_once(g_gdn_once, [] {
    KCUDA(cudaFuncSetAttribute(gdn_chunk_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               int(sizeof(GdnSmem))));
  });
}

void prefill_gdn_launch(const PrefillGdnArgs& a, cudaStream_t s) {
  prefill_gdn_init();
  gdn_chunk_kernel<<<dim3(unsigned(a.Hv), NSL), kThreads, sizeof(GdnSmem), s>>>(a);
  KCUDA_LAUNCH("prefill_gdn");
}

void prefill_conv_launch(const PrefillConvArgs& a, cudaStream_t s) {
  const int64_t n = a.T * a.C;
  conv_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_conv");
  conv_state_kernel<<<unsigned((a.C + 255) / 256), 256, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_conv state");
}

}  // namespace kestrel::cuda
