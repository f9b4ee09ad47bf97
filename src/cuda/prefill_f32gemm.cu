// Exact fp32 GEMM on CUDA cores for the prompt step's small products where a discrete choice
// follows (MoE router logits -> top-k; the last position's lm_head -> greedy argmax):
// C[m, n] = sum_k A[m, k] * W[n, k], W dequantised exactly (q * scale + bias in fp32, as
// Mat::row_f32 and the decode GEMV), fp32 accumulation. Not a throughput kernel: the router is
// T * E * hidden (4.3 GFLOP per layer at 8192 tokens), lm_head one row.
//
// Tiles 64 (A rows) x 64 (W rows) x 32 (k), 256 threads as 16 x 16, 4 x 4 outputs per thread;
// both tiles k-major in shared memory (row stride 65: conflict-free transposed stores).
#include "cuda/common.cuh"
#include "cuda/prefill_ops.h"

namespace kestrel::cuda {
namespace {

constexpr int TM = 64, TN = 64, TK = 32, TS = 65;

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
  __shared__ float As[TK][TS];
  __shared__ float Ws[TK][TS];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int64_t n0 = int64_t(blockIdx.x) * TN, m0 = int64_t(blockIdx.y) * TM;
  // Loader roles: row lr of the tile, k segment ls * 8 .. ls * 8 + 7.
  const int lr = tid / 4, ls = tid % 4;
  const int64_t am = m0 + lr, wn = n0 + lr;
  float acc[4][4] = {};
  for (int64_t k0 = 0; k0 < a.K; k0 += TK) {
    float av[8], wv[8];
    if (am < a.M) {
      const float4 p = *reinterpret_cast<const float4*>(a.A + am * a.lda + k0 + ls * 8);
      const float4 q = *reinterpret_cast<const float4*>(a.A + am * a.lda + k0 + ls * 8 + 4);
      av[0] = p.x; av[1] = p.y; av[2] = p.z; av[3] = p.w;
      av[4] = q.x; av[5] = q.y; av[6] = q.z; av[7] = q.w;
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) av[i] = 0.f;
    }
    if (wn < a.N) {
      load_w8<F>(a.W, wn, k0 + ls * 8, wv);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) wv[i] = 0.f;
    }
    __syncthreads();  // the previous tile's reads are done
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      As[ls * 8 + i][lr] = av[i];
      Ws[ls * 8 + i][lr] = wv[i];
    }
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < TK; ++k) {
      float x[4], y[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = As[k][ty + 16 * i];
#pragma unroll
      for (int j = 0; j < 4; ++j) y[j] = Ws[k][tx + 16 * j];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int64_t m = m0 + ty + 16 * i;
    if (m >= a.M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int64_t n = n0 + tx + 16 * j;
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
