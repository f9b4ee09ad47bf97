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
  __shared__ __align__(16) float qs[kGroup * D];
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

  // K and V tiles: 32 rows x 32 16-byte pieces each, 4 pieces per thread per tensor. The next
  // tile's loads are in flight while the current one is scored.
  uint4 kreg[4], vreg[4];
  auto load_tile = [&](int t0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = tid + 256 * i, row = piece >> 5, col = piece & 31;
      kreg[i] = vreg[i] = make_uint4(0, 0, 0, 0);
      if (t0 + row < s1) {
        const size_t off = (size_t(t0 + row) * Hkv + g) * D + col * 8;
        kreg[i] = *reinterpret_cast<const uint4*>(a.kcache + off);
        vreg[i] = *reinterpret_cast<const uint4*>(a.vcache + off);
      }
    }
  };
  load_tile(s0);
  for (int t0 = s0; t0 < s1; t0 += kAttnTile) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int piece = tid + 256 * i, row = piece >> 5, col = piece & 31;
      uint32_t* kd = Ks + row * kKStride + col * 4;
      kd[0] = kreg[i].x; kd[1] = kreg[i].y; kd[2] = kreg[i].z; kd[3] = kreg[i].w;
      Vs[row * (D / 8) + col] = vreg[i];
    }
    __syncthreads();
    if (t0 + kAttnTile < s1) load_tile(t0 + kAttnTile);
    // Scores: lane = position; four independent partial sums (the dependent FMA chain was the
    // critical path of the tile).
    float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
    const uint32_t* kr = Ks + lane * kKStride;
#pragma unroll 8
    for (int wd = 0; wd < D / 2; wd += 2) {
      const uint32_t k0 = kr[wd], k1 = kr[wd + 1];
      const float4 qq = reinterpret_cast<const float4*>(q)[wd / 2];
      p0 = fmaf(qq.x, __uint_as_float(k0 << 16), p0);
      p1 = fmaf(qq.y, __uint_as_float(k0 & 0xffff0000u), p1);
      p2 = fmaf(qq.z, __uint_as_float(k1 << 16), p2);
      p3 = fmaf(qq.w, __uint_as_float(k1 & 0xffff0000u), p3);
    }
    float s = (p0 + p1) + (p2 + p3);
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

// Merge of the splits: block = (head, 32-dim slice), lane = dim; warp w sums splits w, w+8, ...
// (independent loads in flight; the single-thread-per-dim loop over up to 512 splits was 90 us at
// 32K context, measured), after every block has found the max and the softmax weights.
constexpr int kCombineDims = 32;
__global__ void __launch_bounds__(256) attn_combine_kernel(const __grid_constant__ AttnDecodeArgs a) {
  __shared__ float wts[kAttnMaxSplits];
  __shared__ float red[32];
  __shared__ float part[8][kCombineDims];
  const int h = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int d = blockIdx.y * kCombineDims + lane;
  pdl_launch_dependents();
  pdl_wait();
  const int len = *a.pos + 1;
  const int chunk = chunk_for(len, a.nsplit);
  const int nvalid = (len + chunk - 1) / chunk;
  const float* base = a.partial + size_t(h) * a.nsplit * (D + 2);
  float mx = -INFINITY;
  for (int s = tid; s < nvalid; s += 256) mx = fmaxf(mx, base[size_t(s) * (D + 2) + D]);
  mx = warp_max(mx);
  if (lane == 0) red[warp] = mx;
  __syncthreads();
  float M = red[0];
#pragma unroll
  for (int w = 1; w < 8; ++w) M = fmaxf(M, red[w]);
  float den = 0.f;
  for (int s = tid; s < nvalid; s += 256) {
    const float* p = base + size_t(s) * (D + 2);
    const float w = expf(p[D] - M);
    wts[s] = w;
    den += w * p[D + 1];
  }
  den = block_sum(den, red);  // its barriers also publish wts
  float num = 0.f;
#pragma unroll 4
  for (int s = warp; s < nvalid; s += 8) num += wts[s] * base[size_t(s) * (D + 2) + d];
  part[warp][lane] = num;
  __syncthreads();
  if (warp == 0) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += part[w][lane];
    const float gate = a.qg[size_t(h) * 2 * D + D + d];
    a.out[size_t(h) * D + d] = t / den * sigmoid_f(gate);
  }
}

}  // namespace

int attn_nsplit(int64_t capacity) {
  const int64_t n = (capacity + kAttnMinChunk - 1) / kAttnMinChunk;
  return int(std::clamp<int64_t>(n, 1, kAttnMaxSplits));
}

void attn_decode_launch(const AttnDecodeArgs& a, cudaStream_t s) {
  launch_pdl(attn_split_kernel, dim3(a.nsplit, a.kv_heads), dim3(256), 0, s, a);
  launch_pdl(attn_combine_kernel, dim3(a.heads, D / kCombineDims), dim3(256), 0, s, a);
}

}  // namespace kestrel::cuda
