// Gated DeltaNet decode (model-spec §3.4 steps 4-7) for T <= 8 consecutive tokens: L2-norm of q/k,
// beta and g, then the fp32 state update and output. The conv + SiLU ran in the projection GEMV's
// epilogue and the gated RMSNorm runs in the out_proj GEMV's prologue, so this kernel touches only
// the 2 MiB state per layer: each warp owns 4 state columns (one dv index each, 128 dk values,
// 4 per lane) in registers across the T tokens, so the state is read and written once.
// State layout: fp32 [Hv, dv, dk] (column i of head j contiguous over dk: coalesced float4).
#include "cuda/common.cuh"

namespace kestrel::cuda {

namespace {

constexpr int kCols = 4;                     // state columns per warp
constexpr int kWarpsPerBlock = 8;
constexpr int kColsPerBlock = kCols * kWarpsPerBlock;  // 32

__global__ void __launch_bounds__(256) gdn_decode_kernel(const __grid_constant__ GdnDecodeArgs a, int early) {
  constexpr int dk = 128, dv = 128;
  const int j = blockIdx.x;  // v-head
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hk = j / (a.Hv / a.Hk);
  const float A = expf(a.A_log[j]);
  const float dtb = a.dt_bias[j];
  const float qscale = 1.f / sqrtf(float(dk));
  // The state was last written by this layer's step of the previous token, two or more launches
  // back: its loads go out before the wait (common.cuh), in flight while in_proj finishes.
  const int i0 = blockIdx.y * kColsPerBlock + warp * kCols;
  float4 S[kCols];
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    S[c] = reinterpret_cast<const float4*>(a.state + (size_t(j) * dv + i0 + c) * dk)[lane];
  if (early) pdl_launch_dependents();  // (gdn_early_trigger, kernels.h)
  pdl_wait();

  for (int t = 0; t < a.T; ++t) {
    const float* ut = a.u + size_t(t) * a.ldu;
    float4 q = reinterpret_cast<const float4*>(ut + hk * dk)[lane];
    float4 k = reinterpret_cast<const float4*>(ut + a.Hk * dk + hk * dk)[lane];
    const float qs = warp_sum(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w);
    const float ks = warp_sum(k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w);
    const float qi = 1.f / sqrtf(qs + 1e-6f) * qscale, ki = 1.f / sqrtf(ks + 1e-6f);
    q.x *= qi; q.y *= qi; q.z *= qi; q.w *= qi;
    k.x *= ki; k.y *= ki; k.z *= ki; k.w *= ki;
    const float beta = sigmoid_f(a.b[size_t(t) * a.ldb + j]);
    const float g = -A * softplus_f(a.a[size_t(t) * a.lda + j] + dtb);
    const float decay = expf(g);
    const float* vt = ut + 2 * a.Hk * dk + size_t(j) * dv;
    // The 4 columns' reductions interleaved (independent shuffles in flight, not 8 chains).
    float mem[kCols], vv[kCols], o[kCols];
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float4& s = S[c];
      vv[c] = vt[i0 + c];
      s.x *= decay; s.y *= decay; s.z *= decay; s.w *= decay;
      mem[c] = s.x * k.x + s.y * k.y + s.z * k.z + s.w * k.w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int c = 0; c < kCols; ++c) mem[c] += __shfl_xor_sync(0xffffffffu, mem[c], off);
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      float4& s = S[c];
      const float delta = (vv[c] - mem[c]) * beta;
      s.x += k.x * delta; s.y += k.y * delta; s.z += k.z * delta; s.w += k.w * delta;
      o[c] = s.x * q.x + s.y * q.y + s.z * q.z + s.w * q.w;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1)
#pragma unroll
      for (int c = 0; c < kCols; ++c) o[c] += __shfl_xor_sync(0xffffffffu, o[c], off);
    if (lane < kCols) {
      float ov = o[0];
#pragma unroll
      for (int c = 1; c < kCols; ++c) ov = lane == c ? o[c] : ov;
      a.o[size_t(t) * a.Hv * dv + size_t(j) * dv + i0 + lane] = ov;
    }
  }
  pdl_launch_dependents();  // what is left is the state's store
#pragma unroll
  for (int c = 0; c < kCols; ++c)
    reinterpret_cast<float4*>(a.state + (size_t(j) * dv + i0 + c) * dk)[lane] = S[c];
}

}  // namespace

void gdn_decode_launch(const GdnDecodeArgs& a, cudaStream_t s) {
  const dim3 grid(a.Hv, a.dv / kColsPerBlock);
  launch_pdl(gdn_decode_kernel, grid, dim3(256), 0, s, a, gdn_early_trigger() ? 1 : 0);
}

}  // namespace kestrel::cuda
