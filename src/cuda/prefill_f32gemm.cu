// Exact fp32 GEMMs for the prompt step's small products where a discrete choice follows (the MoE
// router logits -> top-k; the last position's lm_head is the decode GEMV): C[m, n] = sum_k A[m, k]
// W[n, k] with W dequantised exactly, fp32 accumulation. Two kernels (PrefillGemmF32Args::route):
//
// Tc (default): tensor cores, mma.sync m16n8k8 tf32. A = hi + lo, two tf32 (|a - hi - lo| ~2^-22
// |a|); W enters as its integer codes (q4, q8: exact in tf32) or its bf16 values (exact in tf32),
// so each product is exact and the sum is fp32: per group of 64 k, P = sum a q (both halves of a),
// then acc += scale P + bias sum(a), the affine form of sum a (scale q + bias). Relative error
// ~2^-22 per term against fp32's 2^-24: the fp32 kernel's numbers to summation-order level (the
// test bound is 1e-5 of the output scale, top-k included). Tiles 128 x 64 x 64, 8 warps of 32 x 32;
// the next k-tile is loaded into registers while this one is multiplied.
//
// Fma: CUDA cores. Tiles 128 (A rows) x 64 (W rows) x 32 (k), 256 threads as 16 x 16, 8 x 4
// outputs per thread read as float4 from k-major tiles (3 shared loads per 32 FMA; 4 x 4
// scalar-read outputs were bound by their 8 loads per 16 FMA); the next k-tile is loaded into
// registers while this one is multiplied. Each output is one fmaf chain in ascending k. The router
// on it: 185 us per 4K-token layer on an H100 (3.4 % of a 4K prompt; bench/PREFILL_NOTES.md v13).
#include "cuda/common.cuh"
#include "cuda/prefill_mma.h"
#include "cuda/prefill_ops.h"

#include <mutex>

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

// ------------------------------------------------------------------------------ tensor cores
namespace tc {
constexpr int BM = 128, BN = 64, BK = 64, LDS = BK + 4;  // row stride 68: fragment reads hit bank 4 g + t
struct Smem {
  float A[BM][LDS];  // fp32 A rows
  float W[BN][LDS];  // W codes (or bf16 values) as floats
  float S[BM];       // sum of the k-tile's A values per row (the bias term)
  float sc[BN], bi[BN];
};
constexpr int kSmem = int(sizeof(Smem));

// 16 consecutive values of W row `row` from k as floats: codes (q4, q8; scale, bias of the group
// returned) or bf16 values.
template <DFmt F>
__device__ __forceinline__ void load_w16(const DMat& w, int64_t row, int64_t k, float (&v)[16], float& sc,
                                         float& bi) {
  if constexpr (F == DFmt::BF16) {
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(w.data) + row * w.cols + k);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 q = __ldg(p + h);
      const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[8 * h + 2 * i] = __uint_as_float(u[i] << 16);
        v[8 * h + 2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
    }
    sc = bi = 0.f;
  } else {
    const int64_t g = row * (w.cols / 64) + k / 64;
    sc = bf16_bits_to_f32(__ldg(w.scales + g));
    bi = bf16_bits_to_f32(__ldg(w.biases + g));
    const uint8_t* codes = static_cast<const uint8_t*>(w.data);
    if constexpr (F == DFmt::Q4) {
      const uint2 q = __ldg(reinterpret_cast<const uint2*>(codes + (row * w.cols + k) / 2));
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = float((q.x >> (4 * i)) & 15u);
        v[8 + i] = float((q.y >> (4 * i)) & 15u);
      }
    } else {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(codes + row * w.cols + k));
      const uint32_t u[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) v[4 * j + i] = float((u[j] >> (8 * i)) & 255u);
    }
  }
}

template <DFmt F>
__global__ void __launch_bounds__(256) gemm_tc_kernel(const PrefillGemmF32Args a) {
  constexpr bool kAffine = F != DFmt::BF16;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
  const int wm = 32 * (warp & 3), wn = 32 * (warp >> 2);  // the warp's 32 x 32 block of the tile
  const int64_t n0 = int64_t(blockIdx.x) * BN, m0 = int64_t(blockIdx.y) * BM;
  // Loader roles: A row tid / 2, k 32 (tid % 2) .. + 31; W row tid / 4, k 16 (tid % 4) .. + 15.
  const int ar = tid >> 1, ak = 32 * (tid & 1), wr = tid >> 2, wk = 16 * (tid & 3);
  const int64_t am = m0 + ar, wrow = n0 + wr;
  float4 av[8];
  float wv[16], wsc = 0.f, wbi = 0.f;
  auto load = [&](int64_t k0) {
    if (am < a.M) {
      const float4* src = reinterpret_cast<const float4*>(a.A + am * a.lda + k0 + ak);
#pragma unroll
      for (int i = 0; i < 8; ++i) av[i] = src[i];
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) av[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    if (wrow < a.N) {
      load_w16<F>(a.W, wrow, k0 + wk, wv, wsc, wbi);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) wv[i] = 0.f;
      wsc = wbi = 0.f;
    }
  };
  float acc[2][4][4] = {};
  float P[2][4][4];
  load(0);
  for (int64_t k0 = 0; k0 < a.K; k0 += BK) {
    __syncthreads();  // the previous tile's reads are done
    float rs = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      *reinterpret_cast<float4*>(&sm.A[ar][ak + 4 * i]) = av[i];
      if constexpr (kAffine) rs += (av[i].x + av[i].y) + (av[i].z + av[i].w);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      *reinterpret_cast<float4*>(&sm.W[wr][wk + 4 * i]) =
          make_float4(wv[4 * i], wv[4 * i + 1], wv[4 * i + 2], wv[4 * i + 3]);
    if constexpr (kAffine) {
      rs += __shfl_xor_sync(0xffffffffu, rs, 1);
      if ((tid & 1) == 0) sm.S[ar] = rs;
      if ((tid & 3) == 0) sm.sc[wr] = wsc, sm.bi[wr] = wbi;
    }
    __syncthreads();
    if (k0 + BK < a.K) load(k0 + BK);  // in flight during this tile's products
    float (&D)[2][4][4] = kAffine ? P : acc;
    if constexpr (kAffine) {
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) P[i][j][e] = 0.f;
    }
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      uint32_t ah[2][4], al[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float* r = &sm.A[wm + 16 * i + g][kk + t];
        pf::split_tf32(r[0], ah[i][0], al[i][0]);
        pf::split_tf32(r[8 * LDS], ah[i][1], al[i][1]);
        pf::split_tf32(r[4], ah[i][2], al[i][2]);
        pf::split_tf32(r[8 * LDS + 4], ah[i][3], al[i][3]);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float* c = &sm.W[wn + 8 * j + g][kk + t];
        const uint32_t b0 = __float_as_uint(c[0]), b1 = __float_as_uint(c[4]);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          pf::mma_tf32(D[i][j], al[i], b0, b1);
          pf::mma_tf32(D[i][j], ah[i], b0, b1);
        }
      }
    }
    if constexpr (kAffine) {  // acc += scale P + bias sum(a) for this group of 64
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float s0 = sm.S[wm + 16 * i + g], s1 = sm.S[wm + 16 * i + g + 8];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = wn + 8 * j + 2 * t;
          const float c0 = sm.sc[c], c1 = sm.sc[c + 1], b0 = sm.bi[c], b1 = sm.bi[c + 1];
          acc[i][j][0] = fmaf(c0, P[i][j][0], fmaf(b0, s0, acc[i][j][0]));
          acc[i][j][1] = fmaf(c1, P[i][j][1], fmaf(b1, s0, acc[i][j][1]));
          acc[i][j][2] = fmaf(c0, P[i][j][2], fmaf(b0, s1, acc[i][j][2]));
          acc[i][j][3] = fmaf(c1, P[i][j][3], fmaf(b1, s1, acc[i][j][3]));
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + wm + 16 * i + g + 8 * h;
      if (m >= a.M) continue;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int64_t n = n0 + wn + 8 * j + 2 * t;
        if (n < a.N) a.C[m * a.ldc + n] = acc[i][j][2 * h];
        if (n + 1 < a.N) a.C[m * a.ldc + n + 1] = acc[i][j][2 * h + 1];
      }
    }
}
}  // namespace tc

}  // namespace

const char* f32gemm_route_name(F32GemmRoute r) { return r == F32GemmRoute::Tc ? "tc" : "fma"; }

void prefill_gemm_f32_launch(const PrefillGemmF32Args& a, cudaStream_t s) {
  if (a.route == F32GemmRoute::Tc) {
    static std::once_flag once;
    std::call_once(once, [] {
      KCUDA(cudaFuncSetAttribute(tc::gemm_tc_kernel<DFmt::BF16>, cudaFuncAttributeMaxDynamicSharedMemorySize, tc::kSmem));
      KCUDA(cudaFuncSetAttribute(tc::gemm_tc_kernel<DFmt::Q4>, cudaFuncAttributeMaxDynamicSharedMemorySize, tc::kSmem));
      KCUDA(cudaFuncSetAttribute(tc::gemm_tc_kernel<DFmt::Q8>, cudaFuncAttributeMaxDynamicSharedMemorySize, tc::kSmem));
    });
    const dim3 grid(unsigned((a.N + tc::BN - 1) / tc::BN), unsigned((a.M + tc::BM - 1) / tc::BM));
    switch (a.W.fmt) {
      case DFmt::BF16: tc::gemm_tc_kernel<DFmt::BF16><<<grid, 256, tc::kSmem, s>>>(a); break;
      case DFmt::Q4: tc::gemm_tc_kernel<DFmt::Q4><<<grid, 256, tc::kSmem, s>>>(a); break;
      case DFmt::Q8: tc::gemm_tc_kernel<DFmt::Q8><<<grid, 256, tc::kSmem, s>>>(a); break;
    }
    KCUDA_LAUNCH("prefill_gemm_f32 (tc)");
    return;
  }
  const dim3 grid(unsigned((a.N + TN - 1) / TN), unsigned((a.M + TM - 1) / TM));
  switch (a.W.fmt) {
    case DFmt::BF16: gemm_f32_kernel<DFmt::BF16><<<grid, 256, 0, s>>>(a); break;
    case DFmt::Q4: gemm_f32_kernel<DFmt::Q4><<<grid, 256, 0, s>>>(a); break;
    case DFmt::Q8: gemm_f32_kernel<DFmt::Q8><<<grid, 256, 0, s>>>(a); break;
  }
  KCUDA_LAUNCH("prefill_gemm_f32");
}

}  // namespace kestrel::cuda
