// Multi-token RMSNorms of the prompt step: the [T, hidden] norm in front of every mixer, MoE and
// lm_head (one block per row), and the GDN gated RMSNorm per v-head (one warp per row of dv).
// Same formulas and operation order as cpu::rmsnorm / cpu::gated_rmsnorm (fp32 sum of squares
// here, double there: ~1e-7 relative). fp32 and/or bf16 outputs (bf16 feeds the tensor-core GEMMs,
// which round their A operand to bf16 anyway).
#include "cuda/common.cuh"
#include "cuda/prefill_mma.h"
#include "cuda/prefill_ops.h"

namespace kestrel::cuda {
namespace {

constexpr int kNormThreads = 256;

__device__ __forceinline__ uint2 pack4_bf16(float a, float b, float c, float d) {
  const uint32_t lo = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(a))) |
                      (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(b))) << 16);
  const uint32_t hi = uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(c))) |
                      (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(d))) << 16);
  return make_uint2(lo, hi);
}

// One block per row.
__global__ void __launch_bounds__(kNormThreads) rmsnorm_rows_kernel(const PrefillRmsNormArgs a) {
  __shared__ float red[32];
  const int64_t t = blockIdx.x;
  const float* x = a.x + t * a.ldx;
  float ss = 0.f;
  for (int64_t i = int64_t(threadIdx.x) * 4; i < a.n; i += int64_t(kNormThreads) * 4) {
    const float4 v = *reinterpret_cast<const float4*>(x + i);
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  ss = block_sum(ss, red);
  const float inv = 1.f / sqrtf(ss / float(a.n) + a.eps);
  for (int64_t i = int64_t(threadIdx.x) * 4; i < a.n; i += int64_t(kNormThreads) * 4) {
    const float4 v = *reinterpret_cast<const float4*>(x + i);
    const float4 w = *reinterpret_cast<const float4*>(a.w + i);
    const float4 r = make_float4(v.x * inv * w.x, v.y * inv * w.y, v.z * inv * w.z, v.w * inv * w.w);
    if (a.y) *reinterpret_cast<float4*>(a.y + t * a.ldy + i) = r;
    if (a.y16) *reinterpret_cast<uint2*>(a.y16 + t * a.ldy16 + i) = pack4_bf16(r.x, r.y, r.z, r.w);
  }
}

// One warp per row of n (8 rows per block).
__global__ void __launch_bounds__(256) gated_norm_kernel(const PrefillGatedNormArgs a) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t r = int64_t(blockIdx.x) * 8 + warp;
  if (r >= a.rows) return;
  const float* o = a.o + r * a.n;
  const float* z = a.z_heads ? a.z + (r / a.z_heads) * a.ldz + (r % a.z_heads) * a.n : a.z + r * a.n;
  float ss = 0.f;
  for (int64_t i = int64_t(lane) * 4; i < a.n; i += 128) {
    const float4 v = *reinterpret_cast<const float4*>(o + i);
    ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
  }
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(a.n) + a.eps);
  for (int64_t i = int64_t(lane) * 4; i < a.n; i += 128) {
    const float4 v = *reinterpret_cast<const float4*>(o + i);
    const float4 g = *reinterpret_cast<const float4*>(z + i);
    const float4 w = *reinterpret_cast<const float4*>(a.w + i);
    const float4 y = make_float4((w.x * (v.x * inv)) * silu_f(g.x), (w.y * (v.y * inv)) * silu_f(g.y),
                                 (w.z * (v.z * inv)) * silu_f(g.z), (w.w * (v.w * inv)) * silu_f(g.w));
    if (a.y) *reinterpret_cast<float4*>(a.y + r * a.n + i) = y;
    if (a.y16) *reinterpret_cast<uint2*>(a.y16 + r * a.n + i) = pack4_bf16(y.x, y.y, y.z, y.w);
    if (a.hi) {
      // The Pipe split's layout (prefill_pipe.cu, pipe_split_kernel): element e = 32 G + 8 t + j of
      // the flattened y is half j / 4 of word 16 G + 4 (j % 4) + t. This lane holds j = 4 (lane % 2)
      // .. + 3 of t = (lane % 8) / 2; with its partner's four, the even lane writes words m = 0, 1
      // and the odd lane m = 2, 3.
      const int64_t e = r * a.n + i;
      const float4 q = make_float4(__shfl_xor_sync(0xffffffffu, y.x, 1), __shfl_xor_sync(0xffffffffu, y.y, 1),
                                   __shfl_xor_sync(0xffffffffu, y.z, 1), __shfl_xor_sync(0xffffffffu, y.w, 1));
      const bool odd = lane & 1;
      const float f0 = odd ? q.z : y.x, s0 = odd ? y.z : q.x;  // word m0 = 2 odd: (j = m0, j = m0 + 4)
      const float f1 = odd ? q.w : y.y, s1 = odd ? y.w : q.y;  // word m0 + 1
      const int64_t w0 = 16 * (e / 32) + 4 * (odd ? 2 : 0) + (e % 32) / 8;
      uint32_t* hi = reinterpret_cast<uint32_t*>(a.hi);
      const uint32_t h0 = pf::pack_bf16(f0, s0), h1 = pf::pack_bf16(f1, s1);
      hi[w0] = h0;
      hi[w0 + 4] = h1;
      if (a.lo) {
        uint32_t* lo = reinterpret_cast<uint32_t*>(a.lo);
        lo[w0] = pf::pack_bf16(f0 - pf::bf16_lo(h0), s0 - pf::bf16_hi(h0));
        lo[w0 + 4] = pf::pack_bf16(f1 - pf::bf16_lo(h1), s1 - pf::bf16_hi(h1));
        float part = (y.x + y.y) + (y.z + y.w);  // the 16 lanes of a 64-group
        part += __shfl_xor_sync(0xffffffffu, part, 1);
        part += __shfl_xor_sync(0xffffffffu, part, 2);
        part += __shfl_xor_sync(0xffffffffu, part, 4);
        part += __shfl_xor_sync(0xffffffffu, part, 8);
        if ((lane & 15) == 0) a.sum[e / 64] = part;
      }
    }
  }
}

}  // namespace

void prefill_rmsnorm_launch(const PrefillRmsNormArgs& a, cudaStream_t s) {
  rmsnorm_rows_kernel<<<unsigned(a.T), kNormThreads, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_rmsnorm");
}

void prefill_gated_norm_launch(const PrefillGatedNormArgs& a, cudaStream_t s) {
  gated_norm_kernel<<<unsigned((a.rows + 7) / 8), 256, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_gated_norm");
}

}  // namespace kestrel::cuda
