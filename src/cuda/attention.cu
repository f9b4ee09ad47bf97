// Gated attention decode (model-spec §3.5) for one token, split over the context (flash decoding).
// Block = (split, kv head): its 8 warps are the 8 query heads of the kv head, so each K/V tile is
// read from memory once for all 8 heads. Per 32-position tile: K and V go to shared memory, lane p
// of warp h scores position p for head h, an online softmax runs per warp, then lane l accumulates
// dims 8l..8l+7 of P.V. A second kernel merges the splits and applies the sigmoid output gate.
// q/k RMSNorm and partial NeoX RoPE are applied here; the split owning the new position writes
// its k/v (bf16) to the cache before reading.
#include "cuda/common.cuh"

#include <algorithm>

namespace kestrel::cuda {

namespace {

constexpr int D = 256;
constexpr int kGroup = 8;            // query heads per kv head
constexpr int kKStride = D / 2 + 1;  // u32 words per K row in shared memory (padded: no conflicts)

__device__ __forceinline__ int chunk_for(int len, int nsplit) {
  int c = (len + nsplit - 1) / nsplit;
  c = (c + kAttnTile - 1) / kAttnTile * kAttnTile;
  return c < kAttnTile ? kAttnTile : c;
}

// Normalises (RMS, effective weight w) and ropes one head held as 8 dims per lane (d = 8*lane+e).
__device__ __forceinline__ void norm_rope(float (&x)[8], const float* w, float eps, int pos,
                                          float theta, int rot) {
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(D) + eps);
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = x[e] * inv * w[lane * 8 + e];
  const int half = rot / 2;            // 32
  const int pl = half / 8;             // lane offset of the partner dims (4)
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, x[e], pl);
    const int d = lane * 8 + e;
    if (d < rot) {
      const int i = d % half;
      const float inv_freq = 1.f / powf(theta, float(2 * i) / float(rot));
      const float ang = float(pos) * inv_freq;
      const float c = cosf(ang), s = sinf(ang);
      x[e] = d < half ? x[e] * c - partner * s : x[e] * c + partner * s;
    }
  }
}

__device__ __forceinline__ uint16_t f2bf(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

__global__ void __launch_bounds__(256) attn_split_kernel(const __grid_constant__ AttnDecodeArgs a) {
  __shared__ uint32_t Ks[kAttnTile * kKStride];
  __shared__ uint4 Vs[kAttnTile * (D / 8)];
  __shared__ float qs[kGroup * D];
  const int sp = blockIdx.x, g = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  pdl_launch_dependents();
  pdl_wait();
  const int pos = *a.pos, len = pos + 1;
  const int chunk = chunk_for(len, a.nsplit);
  const int s0 = sp * chunk;
  if (s0 >= len) return;
  const int s1 = min(s0 + chunk, len);
  const int Hkv = a.kv_heads;
  const float theta = float(a.rope_theta);

  // Query of head h = g*8 + warp: norm + rope, pre-scaled by D^-1/2.
  const int h = g * kGroup + warp;
  {
    float x[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = a.qg[size_t(h) * 2 * D + lane * 8 + e];
    norm_rope(x, a.q_norm, a.eps, pos, theta, a.rotary_dim);
#pragma unroll
    for (int e = 0; e < 8; ++e) qs[warp * D + lane * 8 + e] = x[e] * (1.f / 16.f);
  }
  // The split that owns the new position appends its k (normed, roped) and v.
  if (pos >= s0 && pos < s1) {
    if (warp == 0) {
      float x[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) x[e] = a.k[size_t(g) * D + lane * 8 + e];
      norm_rope(x, a.k_norm, a.eps, pos, theta, a.rotary_dim);
#pragma unroll
      for (int e = 0; e < 8; ++e) a.kcache[(size_t(pos) * Hkv + g) * D + lane * 8 + e] = f2bf(x[e]);
    } else if (warp == 1) {
#pragma unroll
      for (int e = 0; e < 8; ++e)
        a.vcache[(size_t(pos) * Hkv + g) * D + lane * 8 + e] = f2bf(a.v[size_t(g) * D + lane * 8 + e]);
    }
  }
  __syncthreads();

  float m_run = -INFINITY, l_run = 0.f, acc[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] = 0.f;
  const float* q = qs + warp * D;

  for (int t0 = s0; t0 < s1; t0 += kAttnTile) {
    // Load K and V tiles: 32 rows x 32 16-byte pieces each, 4 pieces per thread per tensor.
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = tid + 256 * i, row = piece >> 5, col = piece & 31;
      uint4 kv = make_uint4(0, 0, 0, 0), vv = make_uint4(0, 0, 0, 0);
      if (t0 + row < s1) {
        const size_t off = (size_t(t0 + row) * Hkv + g) * D + col * 8;
        kv = *reinterpret_cast<const uint4*>(a.kcache + off);
        vv = *reinterpret_cast<const uint4*>(a.vcache + off);
      }
      uint32_t* kd = Ks + row * kKStride + col * 4;
      kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
      Vs[row * (D / 8) + col] = vv;
    }
    __syncthreads();
    // Scores: lane = position.
    float s = 0.f;
    const uint32_t* kr = Ks + lane * kKStride;
#pragma unroll 8
    for (int wd = 0; wd < D / 2; ++wd) {
      const uint32_t kw = kr[wd];
      const float2 qq = reinterpret_cast<const float2*>(q)[wd];
      s = fmaf(qq.x, __uint_as_float(kw << 16), s);
      s = fmaf(qq.y, __uint_as_float(kw & 0xffff0000u), s);
    }
    if (t0 + lane >= s1) s = -INFINITY;
    const float mt = warp_max(s);
    const float m_new = fmaxf(m_run, mt);
    const float corr = expf(m_run - m_new);
    const float p = expf(s - m_new);
    l_run = l_run * corr + warp_sum(p);
    m_run = m_new;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= corr;
    const int n = min(kAttnTile, s1 - t0);
    for (int jj = 0; jj < n; ++jj) {
      const float pj = __shfl_sync(0xffffffffu, p, jj);
      const uint4 vv = Vs[jj * (D / 8) + lane];
      acc[0] = fmaf(pj, __uint_as_float(vv.x << 16), acc[0]);
      acc[1] = fmaf(pj, __uint_as_float(vv.x & 0xffff0000u), acc[1]);
      acc[2] = fmaf(pj, __uint_as_float(vv.y << 16), acc[2]);
      acc[3] = fmaf(pj, __uint_as_float(vv.y & 0xffff0000u), acc[3]);
      acc[4] = fmaf(pj, __uint_as_float(vv.z << 16), acc[4]);
      acc[5] = fmaf(pj, __uint_as_float(vv.z & 0xffff0000u), acc[5]);
      acc[6] = fmaf(pj, __uint_as_float(vv.w << 16), acc[6]);
      acc[7] = fmaf(pj, __uint_as_float(vv.w & 0xffff0000u), acc[7]);
    }
    __syncthreads();
  }
  float* out = a.partial + (size_t(h) * a.nsplit + sp) * (D + 2);
#pragma unroll
  for (int e = 0; e < 8; ++e) out[lane * 8 + e] = acc[e];
  if (lane == 0) {
    out[D] = m_run;
    out[D + 1] = l_run;
  }
}

__global__ void __launch_bounds__(256) attn_combine_kernel(const __grid_constant__ AttnDecodeArgs a) {
  const int h = blockIdx.x, d = threadIdx.x;
  pdl_launch_dependents();
  pdl_wait();
  const int len = *a.pos + 1;
  const int chunk = chunk_for(len, a.nsplit);
  const int nvalid = (len + chunk - 1) / chunk;
  const float* base = a.partial + size_t(h) * a.nsplit * (D + 2);
  float M = -INFINITY;
  for (int s = 0; s < nvalid; ++s) M = fmaxf(M, base[size_t(s) * (D + 2) + D]);
  float num = 0.f, den = 0.f;
  for (int s = 0; s < nvalid; ++s) {
    const float* p = base + size_t(s) * (D + 2);
    const float w = expf(p[D] - M);
    num += w * p[d];
    den += w * p[D + 1];
  }
  const float gate = a.qg[size_t(h) * 2 * D + D + d];
  a.out[size_t(h) * D + d] = num / den * sigmoid_f(gate);
}

}  // namespace

int attn_nsplit(int64_t capacity) {
  const int64_t n = (capacity + kAttnMinChunk - 1) / kAttnMinChunk;
  return int(std::clamp<int64_t>(n, 1, kAttnMaxSplits));
}

void attn_decode_launch(const AttnDecodeArgs& a, cudaStream_t s) {
  launch_pdl(attn_split_kernel, dim3(a.nsplit, a.kv_heads), dim3(256), 0, s, a);
  launch_pdl(attn_combine_kernel, dim3(a.heads), dim3(D), 0, s, a);
}

}  // namespace kestrel::cuda
