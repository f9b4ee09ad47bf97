// Exact fp32 GEMM on CUDA cores for the prompt step's small products where a discrete choice
// follows (the MoE router logits -> top-k; the last position's lm_head is the decode GEMV):
// C[m, n] = sum_k A[m, k] * W[n, k], W dequantised exactly (q * scale + bias in fp32, as
// Mat::row_f32 and the decode GEMV), fp32 accumulation. Not a throughput kernel: the router is
// T * E * hidden (4.3 GFLOP per layer at 8192 tokens).
//
// Tiles 128 (A rows) x 64 (W rows) x 32 (k), 256 threads as 16 x 16, 8 x 4 outputs per thread
// read as float4 from k-major tiles (3 shared loads per 32 FMA; 4 x 4 scalar-read outputs were
// bound by their 8 loads per 16 FMA); the next k-tile is loaded into registers while this one is
// multiplied. Each output is one fmaf chain in ascending k, as before.
#include "cuda/common.cuh"
#include "cuda/prefill_ops.h"

namespace kestrel::cuda {
namespace {

constexpr int TM = 128, TN = 64, TK = 32, TSA = TM + 4, TSW = TN + 4;

template <DFmt F>
__device__ __forceinline__ void load_w8(const DMat& w, int64_t row, int64_t k, float (&v)[8]) {
  if constexpr (F == DFmt::BF16) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.data) +
                                                         row * w.cols + k));
    const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(u[i] << 16);
      v[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
    }
  } else {
    const int64_t g = row * (w.cols / 64) + k / 64;
    const float sc = bf16_bits_to_f32(__ldg(w.scales + g)), bi = bf16_bits_to_f32(__ldg(w.biases + g));
    const uint32_t* codes = static_cast<const uint32_t*>(w.data);
    if constexpr (F == DFmt::Q4) {
      const uint32_t q = __ldg(codes + (row * w.cols + k) / 8);
#pragma unroll
      for (int i = 0; i < 8; ++i) v[i] = sc * float((q >> (4 * i)) & 15u) + bi;
    } else {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(codes + (row * w.cols + k) / 4));
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = sc * float((q.x >> (8 * i)) & 255u) + bi;
        v[4 + i] = sc * float((q.y >> (8 * i)) & 255u) + bi;
      }
    }
  }
}

template <DFmt F>
__global__ void __launch_bounds__(256) gemm_f32_kernel(const PrefillGemmF32Args a) {
  __shared__ __align__(16) float As[TK][TSA];
  __shared__ __align__(16) float Ws[TK][TSW];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t n0 = int64_t(blockIdx.x) * TN, m0 = int64_t(blockIdx.y) * TM;
  // Loader roles: A row tid / 2, k 16 (tid % 2) .. + 15; W row tid / 4, k 8 (tid % 4) .. + 7.
  const int ar = tid / 2, ak = 16 * (tid % 2), wr = tid / 4, wk = 8 * (tid % 4);
  const int64_t am = m0 + ar, wn = n0 + wr;
  float av[16], wv[8];
  auto load = [&](int64_t k0) {
    if (am < a.M) {
      const float4* src = reinterpret_cast<const float4*>(a.A + am * a.lda + k0 + ak);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float4 p = src[i];
        av[4 * i] = p.x, av[4 * i + 1] = p.y, av[4 * i + 2] = p.z, av[4 * i + 3] = p.w;
      }
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) av[i] = 0.f;
    }
    if (wn < a.N) {
      load_w8<F>(a.W, wn, k0 + wk, wv);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) wv[i] = 0.f;
    }
  };
  float acc[8][4] = {};
  load(0);
  for (int64_t k0 = 0; k0 < a.K; k0 += TK) {
    __syncthreads();  // the previous tile's reads are done
#pragma unroll
    for (int i = 0; i < 16; ++i) As[ak + i][ar] = av[i];
#pragma unroll
    for (int i = 0; i < 8; ++i) Ws[wk + i][wr] = wv[i];
    __syncthreads();
    if (k0 + TK < a.K) load(k0 + TK);  // in flight during this tile's products
#pragma unroll 8
    for (int k = 0; k < TK; ++k) {
      const float4 x0 = *reinterpret_cast<const float4*>(&As[k][4 * ty]);
      const float4 x1 = *reinterpret_cast<const float4*>(&As[k][64 + 4 * ty]);
      const float4 y4 = *reinterpret_cast<const float4*>(&Ws[k][4 * tx]);
      const float x[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
      const float y[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t m = m0 + (i < 4 ? 4 * ty + i : 64 + 4 * ty + i - 4);
    if (m >= a.M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + 4 * tx + j;
      if (n < a.N) a.C[m * a.ldc + n] = acc[i][j];
    }
  }
}

}  // namespace

void prefill_gemm_f32_launch(const PrefillGemmF32Args& a, cudaStream_t s) {
  const dim3 grid(unsigned((a.N + TN - 1) / TN), unsigned((a.M + TM - 1) / TM));
  switch (a.W.fmt) {
    case DFmt::BF16: gemm_f32_kernel<DFmt::BF16><<<grid, 256, 0, s>>>(a); break;
    case DFmt::Q4: gemm_f32_kernel<DFmt::Q4><<<grid, 256, 0, s>>>(a); break;
    case DFmt::Q8: gemm_f32_kernel<DFmt::Q8><<<grid, 256, 0, s>>>(a); break;
  }
  KCUDA_LAUNCH("prefill_gemm_f32");
}

}  // namespace kestrel::cuda
