// Gated attention decode (model-spec §3.5) for one token, split over the context (flash decoding).
// Block = (split, kv head): its 8 warps serve the 8 query heads of the kv head, so each K/V tile is
// read from memory once for all 8 heads. Per 32-position tile the scores and P.V run on the tensor
// cores (mma.sync m16n8k16; the 16 rows are the 8 heads' q, then P, as bf16 hi in rows 0-7 and lo in
// rows 8-15, so both products keep fp32-level accuracy against the bf16 cache) with an online
// softmax in fp32 per head. A second kernel merges the splits and applies the sigmoid output gate.
// q/k RMSNorm and partial NeoX RoPE are applied here; the split owning the new position writes
// its k/v (bf16) to the cache and uses them directly (it does not read them back).
// (An earlier split kernel did both products on the CUDA cores, lane = position: issue-bound at
// long contexts, ~2,000 instructions per warp and tile, 167 us per layer at 128K; the tensor-core
// kernel replaced it at +25 % end to end at 128K, bench/NOTES.md v15.)
#include "cuda/common.cuh"
#include "cuda/prefill_mma.h"

#include <algorithm>
#include <mutex>

namespace kestrel::cuda {

namespace {

constexpr int D = 256;
constexpr int kGroup = 8;            // query heads per kv head
constexpr int kRot = 64;             // rotary dims (the launcher checks): 32 frequencies, one per lane

__device__ __forceinline__ int chunk_for(int len, int nsplit) {
  int c = (len + nsplit - 1) / nsplit;
  c = (c + kAttnTile - 1) / kAttnTile * kAttnTile;
  return c < kAttnTile ? kAttnTile : c;
}

// RMS-normalises (effective weight w0|w1 = dims 8l..8l+7) and ropes one head held as 8 dims per
// lane (d = 8*lane+e; lanes 0..7 hold the roped dims). Lane i holds cos/sin of frequency i; dim d
// uses frequency d % 32 = 8*(lane & 3) + e.
__device__ __forceinline__ void norm_rope(float (&x)[8], const float4 w0, const float4 w1, float eps,
                                          float cs, float sn) {
  const int lane = threadIdx.x & 31;
  float ss = 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
  ss = warp_sum(ss);
  const float inv = 1.f / sqrtf(ss / float(D) + eps);
  const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = x[e] * inv * w[e];
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    const float partner = __shfl_xor_sync(0xffffffffu, x[e], kRot / 16);  // dim d +- 32
    const float c = __shfl_sync(0xffffffffu, cs, 8 * (lane & 3) + e);
    const float s = __shfl_sync(0xffffffffu, sn, 8 * (lane & 3) + e);
    if (lane < kRot / 8) x[e] = lane < kRot / 16 ? x[e] * c - partner * s : x[e] * c + partner * s;
  }
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16;
}
__device__ __forceinline__ uint4 pack_bf16x8(const float (&x)[8]) {
  return make_uint4(pack_bf16(x[0], x[1]), pack_bf16(x[2], x[3]), pack_bf16(x[4], x[5]),
                    pack_bf16(x[6], x[7]));
}
__device__ __forceinline__ void ld8(float (&x)[8], const float* p) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w; x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// The split kernel. Block (split, kv head); the split's 32-position K/V tiles are loaded into
// registers one tile ahead (row r of a tile by warp r % 8, lane c holding dims 8c..8c+7), stored to
// shared memory, then three phases between barriers:
//   A  S = Q K^T: warp w takes positions 8 (w & 3) .. +7 over dims 128 (w >> 2) .. +127 (8 mma;
//      the A fragments of Q are loaded once), writing its 16 x 8 partial to sS[w >> 2].
//   B  softmax: warp h takes head h: lane = position, s = both dim halves of rows h (q hi) and
//      h + 8 (q lo); the online max/sum in fp32 as before; P to sP as bf16 hi (row h) and lo
//      (row h + 8), the rescale factor to sCorr.
//   C  O += P V: warp w takes dims 32 w .. +31 (8 mma over the tile's 32 positions); rows h and
//      h + 8 of O are head h's hi and lo parts, summed at the end.
// K and V tiles are double-buffered in shared memory, so the next tile's stores need no barrier
// of their own: the previous user of that buffer (two tiles back) finished before this tile's
// first barrier.
// Latency, not bandwidth, bounds the kernel at short contexts (a few blocks of one or two tiles),
// so the serial chain is kept to: pos load -> first K/V tile loads (both before pdl_wait) -> q
// load -> q and new k norm + rope while the tile flies -> tile loop. The rope angles are one sincosf
// per lane (32 frequencies), shuffled to the dims; the first version inlined powf+sinf+cosf for
// each of 8 dims twice: 105 KB of code (27 us per launch at 100 positions, measured), cold in the
// instruction cache on every launch.
// The new position's k/v row does not go through the cache: the warp whose lanes load that row's
// pieces (row r of a tile is loaded by warp r % 8, lane c holding dims 8c..8c+7, the layout of
// norm_rope) computes it, writes it to the cache, keeps it in its lanes' slots of knew/vnew and
// substitutes it in its own tile registers when the tile of pos comes.
constexpr int kRowP = D + 8;  // bf16 per K/V/Q row in shared memory (528 bytes: ldmatrix conflict-free)
constexpr int kSP = 40;       // S (fp32) and P (bf16) row stride
struct AttnSplitSmem {
  uint16_t k[2][kAttnTile][kRowP];
  uint16_t v[2][kAttnTile][kRowP];
  uint16_t q[16][kRowP];
  float s[2][16][kSP];
  uint16_t p[16][kSP];
  float corr[kGroup];
  uint4 knew[D / 8], vnew[D / 8];
};
constexpr int kSplitSmemBytes = int(sizeof(AttnSplitSmem));

__global__ void __launch_bounds__(256, 2) attn_split_kernel(const __grid_constant__ AttnDecodeArgs a) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  AttnSplitSmem& sm = *reinterpret_cast<AttnSplitSmem*>(smem_raw);
  const int sp = blockIdx.x, g = blockIdx.y;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const float4 qw0 = reinterpret_cast<const float4*>(a.q_norm)[2 * lane];
  const float4 qw1 = reinterpret_cast<const float4*>(a.q_norm)[2 * lane + 1];
  const float inv_freq = 1.f / powf(float(a.rope_theta), float(2 * lane) / float(kRot));
  if (warp == 0 && lane < D * 4 / 128)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(a.k_norm + lane * 32));
  const int pos = *a.pos, len = pos + 1;  // (two or more launches back: before the wait)
  const int chunk = chunk_for(len, a.nsplit);
  const int s0 = sp * chunk;
  if (s0 >= len) return;
  const int s1 = min(s0 + chunk, len);
  const int Hkv = a.kv_heads;
  const int s_cached = min(s1, pos);
  const bool new_row = pos < s1 && warp == (pos & 7);
  const int new_t0 = pos & ~(kAttnTile - 1), new_i = (pos & (kAttnTile - 1)) >> 3;

  uint4 kreg[4], vreg[4];
  auto load_tile = [&](int t0) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int row = 8 * i + warp;
      kreg[i] = vreg[i] = make_uint4(0, 0, 0, 0);
      if (t0 + row < s_cached) {
        const size_t off = (size_t(t0 + row) * Hkv + g) * D + lane * 8;
        kreg[i] = *reinterpret_cast<const uint4*>(a.kcache + off);
        vreg[i] = *reinterpret_cast<const uint4*>(a.vcache + off);
      }
    }
  };
  load_tile(s0);
  pdl_wait();  // q, and the new k and v, come from the projection just before
  float sn, cs;
  sincosf(float(pos) * inv_freq, &sn, &cs);
  {
    float x[8];
    ld8(x, a.qg + size_t(g * kGroup + warp) * 2 * D + lane * 8);
    norm_rope(x, qw0, qw1, a.eps, cs, sn);
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] *= 1.f / 16.f;  // D^-1/2, exact
    const uint4 hi = pack_bf16x8(x);
    float r[8];
    const uint32_t hw[4] = {hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      r[2 * e] = x[2 * e] - pf::bf16_lo(hw[e]);
      r[2 * e + 1] = x[2 * e + 1] - pf::bf16_hi(hw[e]);
    }
    *reinterpret_cast<uint4*>(&sm.q[warp][lane * 8]) = hi;
    *reinterpret_cast<uint4*>(&sm.q[warp + kGroup][lane * 8]) = pack_bf16x8(r);
  }
  if (new_row) {
    float kx[8], vx[8];
    ld8(kx, a.k + size_t(g) * D + lane * 8);
    ld8(vx, a.v + size_t(g) * D + lane * 8);
    norm_rope(kx, reinterpret_cast<const float4*>(a.k_norm)[2 * lane],
              reinterpret_cast<const float4*>(a.k_norm)[2 * lane + 1], a.eps, cs, sn);
    const uint4 kb = pack_bf16x8(kx), vb = pack_bf16x8(vx);
    const size_t off = (size_t(pos) * Hkv + g) * D + lane * 8;
    *reinterpret_cast<uint4*>(a.kcache + off) = kb;
    *reinterpret_cast<uint4*>(a.vcache + off) = vb;
    sm.knew[lane] = kb;  // read back by this same lane: no barrier
    sm.vnew[lane] = vb;
  }
  __syncthreads();  // Q staged
  const int nb = warp & 3, half = warp >> 2;
  uint32_t qa[8][4];  // this warp's dim half of Q (hi rows 0-7, lo rows 8-15)
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) pf::ldsm_x4(qa[ks], &sm.q[lane & 15][half * 128 + ks * 16 + (lane >> 4) * 8]);

  float m_run = -INFINITY, l_run = 0.f;  // head `warp` (phase B's owner)
  float o[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[j][e] = 0.f;
  int buf = 0;
  for (int t0 = s0; t0 < s1; t0 += kAttnTile, buf ^= 1) {
    if (new_row && t0 == new_t0) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        if (i == new_i) { kreg[i] = sm.knew[lane]; vreg[i] = sm.vnew[lane]; }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      *reinterpret_cast<uint4*>(&sm.k[buf][8 * i + warp][lane * 8]) = kreg[i];
      *reinterpret_cast<uint4*>(&sm.v[buf][8 * i + warp][lane * 8]) = vreg[i];
    }
    __syncthreads();
    if (t0 + kAttnTile < s1) load_tile(t0 + kAttnTile);
    // A: scores of positions 8 nb .. +7 over this warp's dim half (two chains).
    {
      float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int k2 = 0; k2 < 4; ++k2) {
        uint32_t r[4];
        pf::ldsm_x4(r, &sm.k[buf][8 * nb + (lane & 7)][half * 128 + k2 * 32 + (lane >> 3) * 8]);
        pf::mma_bf16(sa, qa[2 * k2], r[0], r[1]);
        pf::mma_bf16(sb, qa[2 * k2 + 1], r[2], r[3]);
      }
      const int row = lane >> 2, col = 8 * nb + 2 * (lane & 3);
      *reinterpret_cast<float2*>(&sm.s[half][row][col]) = make_float2(sa[0] + sb[0], sa[1] + sb[1]);
      *reinterpret_cast<float2*>(&sm.s[half][row + 8][col]) = make_float2(sa[2] + sb[2], sa[3] + sb[3]);
    }
    __syncthreads();
    // B: head `warp`, lane = position.
    {
      const int hh = warp;
      float sc = (sm.s[0][hh][lane] + sm.s[1][hh][lane]) + (sm.s[0][hh + 8][lane] + sm.s[1][hh + 8][lane]);
      if (t0 + lane >= s1) sc = -INFINITY;
      const float m_new = fmaxf(m_run, warp_max(sc));
      const float corr = expf(m_run - m_new);
      const float p = expf(sc - m_new);
      l_run = l_run * corr + warp_sum(p);
      m_run = m_new;
      const __nv_bfloat16 ph = __float2bfloat16_rn(p);
      sm.p[hh][lane] = __bfloat16_as_ushort(ph);
      sm.p[hh + 8][lane] = __bfloat16_as_ushort(__float2bfloat16_rn(p - __bfloat162float(ph)));
      if (lane == 0) sm.corr[hh] = corr;
    }
    __syncthreads();
    // C: dims 32 warp .. +31.
    {
      uint32_t pa[2][4];
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) pf::ldsm_x4(pa[kk], &sm.p[lane & 15][kk * 16 + (lane >> 4) * 8]);
      const float cr = sm.corr[lane >> 2];  // rows lane/4 and lane/4 + 8: both head lane/4
#pragma unroll
      for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) o[j][e] *= cr;
#pragma unroll
      for (int dp = 0; dp < 2; ++dp)
#pragma unroll
        for (int kk = 0; kk < 2; ++kk) {
          uint32_t r[4];
          pf::ldsm_x4_t(r, &sm.v[buf][kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8]
                                  [32 * warp + dp * 16 + (lane >> 4) * 8]);
          pf::mma_bf16(o[2 * dp], pa[kk], r[0], r[1]);
          pf::mma_bf16(o[2 * dp + 1], pa[kk], r[2], r[3]);
        }
    }
  }
  pdl_launch_dependents();  // the tiles are done; what is left is this split's store
  const int hd = g * kGroup + (lane >> 2);
  float* out = a.partial + (size_t(hd) * a.nsplit + sp) * (D + 2);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int d = 32 * warp + 8 * j + 2 * (lane & 3);
    *reinterpret_cast<float2*>(out + d) = make_float2(o[j][0] + o[j][2], o[j][1] + o[j][3]);
  }
  if (lane == 0) {
    float* ow = a.partial + (size_t(g * kGroup + warp) * a.nsplit + sp) * (D + 2);
    ow[D] = m_run;
    ow[D + 1] = l_run;
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
  pdl_wait();
  const int len = *a.pos + 1;
  const float gate = warp == 0 ? a.qg[size_t(h) * 2 * D + D + d] : 0.f;  // in flight with pos
  const int chunk = chunk_for(len, a.nsplit);
  const int nvalid = (len + chunk - 1) / chunk;
  const float* base = a.partial + size_t(h) * a.nsplit * (D + 2);
  // This warp's first split of the weighted sum, loaded with the maxima (after the barriers it
  // was one more round trip).
  const float v0 = warp < nvalid ? base[size_t(warp) * (D + 2) + d] : 0.f;
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
  float num = warp < nvalid ? wts[warp] * v0 : 0.f;
#pragma unroll 4
  for (int s = warp + 8; s < nvalid; s += 8) num += wts[s] * base[size_t(s) * (D + 2) + d];
  part[warp][lane] = num;
  pdl_launch_dependents();
  __syncthreads();
  if (warp == 0) {
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < 8; ++w) t += part[w][lane];
    a.out[size_t(h) * D + d] = t / den * sigmoid_f(gate);
  }
}

}  // namespace

int attn_nsplit(int64_t capacity) {
  const int64_t n = (capacity + kAttnMinChunk - 1) / kAttnMinChunk;
  return int(std::clamp<int64_t>(n, 1, kAttnMaxSplits));
}

void attn_decode_launch(const AttnDecodeArgs& a, cudaStream_t s) {
  static std::once_flag once;
  std::call_once(once, [] {
    KCUDA(cudaFuncSetAttribute(attn_split_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kSplitSmemBytes));
  });
  launch_pdl(attn_split_kernel, dim3(a.nsplit, a.kv_heads), dim3(256), size_t(kSplitSmemBytes), s, a);
  launch_pdl(attn_combine_kernel, dim3(a.heads, D / kCombineDims), dim3(256), 0, s, a);
}

}  // namespace kestrel::cuda
