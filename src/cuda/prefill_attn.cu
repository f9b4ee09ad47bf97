// Causal flash attention for prefill (head dim 256, GQA), on tensor cores (mma.sync m16n8k16 bf16,
// fp32 accumulate, online softmax in fp32). q and the probabilities are fp32 numbers split into
// bf16 hi + lo parts, both multiplied (K and V are exact: the bf16 cache), so the result matches
// the fp32 oracle reading the same bf16 cache. By default (p_split = false) P is one bf16 plane,
// as in every flash attention (half the P V MMAs); p_split = true multiplies its lo part too.
// (q as one bf16 plane was measured and rejected: bench/PREFILL_NOTES.md v16.)
// Prep kernel: q/k RMSNorm + NeoX partial RoPE, q's two parts to a bf16 buffer, k and v appended
// to the bf16 KV cache in the decode layout [capacity, kv_heads, D]. Epilogue: 1/l and the sigmoid
// output gate.
//
// Block = 64 query rows of one head (4 warps x 16 rows, one warpgroup); key tiles of 32 staged in
// shared memory. Q K^T and P V on wgmma by default (qk_wgmma, pv_wgmma), else on mma.sync.
#include "cuda/common.cuh"
#include "cuda/prefill.h"
#include "cuda/prefill_mma.h"
#include "cuda/wgmma.cuh"

#include <mutex>

namespace kestrel::cuda {
namespace {

constexpr int D = 256;
constexpr int DP = D + 8;  // padded shared row (bf16)
constexpr int QT = 64, KT = 32;
constexpr int kThreads = 128;

struct AttnSmem {
  uint16_t q[QT][DP];
  uint16_t ql[QT][DP];
  uint16_t k[KT][DP];
  uint16_t v[KT][DP];
};
// The wgmma kernels (the default): Q's two planes and the K tile K-major in the 128-byte swizzle,
// per 64-wide d chunk (wg::sw128_off; 1024-byte aligned regions); V in the same swizzle (read
// MN-major by the P V wgmma) or padded as above (P V on mma.sync).
struct AttnWgSmem {
  uint8_t q[2][D / 64][QT * 128];
  uint8_t k[D / 64][KT * 128];
  union {
    uint8_t sw[D / 64][KT * 128];  // P V on wgmma: MN-major in the 128-byte swizzle, per d chunk
    uint16_t pad[KT][DP];          // P V on mma.sync: padded rows for ldmatrix.trans
  } v;
};
constexpr int kWgSmemBytes = int(sizeof(AttnWgSmem)) + 1024;  // + the 1024-byte alignment slack
using wg::sw128_off;

// One warp per row: q rows (T*H), then k rows (T*Hkv), then v rows (T*Hkv).
__global__ void __launch_bounds__(256) attn_prep_kernel(const PrefillAttnArgs a) {
  __shared__ float buf[8][D];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t row = int64_t(blockIdx.x) * 8 + warp;
  const int64_t nq = a.T * a.heads, nk = a.T * a.kv_heads;
  if (row >= nq + 2 * nk) return;
  const float* src;
  const float* w = nullptr;
  uint16_t* dst;
  uint16_t* dst_lo = nullptr;
  int64_t t;
  if (row < nq) {
    t = row / a.heads;
    const int h = int(row % a.heads);
    src = a.qg + t * (a.ld ? a.ld : int64_t(a.heads) * 2 * D) + int64_t(h) * 2 * D;
    w = a.q_norm;
    dst = a.qbuf + (t * a.heads + h) * D;
    dst_lo = dst + a.T * a.heads * D;
  } else if (row < nq + nk) {
    const int64_t r = row - nq;
    t = r / a.kv_heads;
    const int h = int(r % a.kv_heads);
    src = a.k + t * (a.ld ? a.ld : int64_t(a.kv_heads) * D) + int64_t(h) * D;
    w = a.k_norm;
    dst = a.kcache + ((a.pos0 + t) * a.kv_heads + h) * D;
  } else {
    const int64_t r = row - nq - nk;
    t = r / a.kv_heads;
    const int h = int(r % a.kv_heads);
    src = a.v + t * (a.ld ? a.ld : int64_t(a.kv_heads) * D) + int64_t(h) * D;
    dst = a.vcache + ((a.pos0 + t) * a.kv_heads + h) * D;
  }
  float x[8];
#pragma unroll
  for (int e = 0; e < 8; ++e) x[e] = src[8 * lane + e];
  if (w) {
    float ss = 0.f;
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += x[e] * x[e];
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss / float(D) + a.eps);
#pragma unroll
    for (int e = 0; e < 8; ++e) buf[warp][8 * lane + e] = x[e] * inv * w[8 * lane + e];
    __syncwarp();
    const int half = a.rotary_dim / 2;
    const float theta = float(a.rope_theta);
    const float p = float(a.pos0 + t);
    for (int i = lane; i < half; i += 32) {
      const float inv_freq = 1.f / powf(theta, float(2 * i) / float(a.rotary_dim));
      const float ang = p * inv_freq;
      const float c = cosf(ang), s = sinf(ang);
      const float x1 = buf[warp][i], x2 = buf[warp][i + half];
      buf[warp][i] = x1 * c - x2 * s;
      buf[warp][i + half] = x2 * c + x1 * s;
    }
    __syncwarp();
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = buf[warp][8 * lane + e];
  }
  uint4 o;
  o.x = pf::pack_bf16(x[0], x[1]);
  o.y = pf::pack_bf16(x[2], x[3]);
  o.z = pf::pack_bf16(x[4], x[5]);
  o.w = pf::pack_bf16(x[6], x[7]);
  reinterpret_cast<uint4*>(dst)[lane] = o;
  if (dst_lo) {
    uint4 l;
    l.x = pf::pack_bf16(x[0] - pf::bf16_lo(o.x), x[1] - pf::bf16_hi(o.x));
    l.y = pf::pack_bf16(x[2] - pf::bf16_lo(o.y), x[3] - pf::bf16_hi(o.y));
    l.z = pf::pack_bf16(x[4] - pf::bf16_lo(o.z), x[5] - pf::bf16_hi(o.z));
    l.w = pf::pack_bf16(x[6] - pf::bf16_lo(o.w), x[7] - pf::bf16_hi(o.w));
    reinterpret_cast<uint4*>(dst_lo)[lane] = l;
  }
}

// Shared by both flash kernels (score tiles in the m16n8 accumulator layout: s[n][e] is row
// lane / 4 + 8 (e / 2) of the warp's 16, key 8 n + 2 (lane % 4) + (e % 2) of the tile).
// -inf for the keys of row half hh past its query position.
template <int NT>
__device__ __forceinline__ void causal_mask(float (&s)[NT][4], int hh, int64_t kv0, int64_t qpos) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e)
      if (kv0 + n * 8 + 2 * (lane & 3) + e > qpos) s[n][2 * hh + e] = -INFINITY;
}
// One online-softmax step (base 2) of row half hh: s *= sl2, the new row max m, P = exp2(s - m)
// into p (which may be s), the row sum folded into l; returns the factor for o.
template <int NT>
__device__ __forceinline__ float softmax_half(float (&s)[NT][4], float (&p)[NT][4], int hh, float sl2, float& m,
                                              float& l) {
  float mx = -INFINITY;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float v = s[n][2 * hh + e] * sl2;
      s[n][2 * hh + e] = v;
      mx = fmaxf(mx, v);
    }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float mnew = fmaxf(m, mx);
  const float muse = mnew == -INFINITY ? 0.f : mnew;
  const float corr = exp2f(m - muse);
  m = mnew;
  float sum = 0.f;
#pragma unroll
  for (int n = 0; n < NT; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float v = exp2f(s[n][2 * hh + e] - muse);
      p[n][2 * hh + e] = v;
      sum += v;
    }
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  sum += __shfl_xor_sync(0xffffffffu, sum, 2);
  l = l * corr + sum;
  return corr;
}
// 16 bytes (dims 8 c8 .. + 7) of q's hi and lo planes for token t of head h (zero beyond T).
__device__ __forceinline__ void load_q16(const PrefillAttnArgs& a, int64_t t, int h, int c8, uint4& v, uint4& vl) {
  v = vl = make_uint4(0, 0, 0, 0);
  if (t < a.T) {
    v = reinterpret_cast<const uint4*>(a.qbuf + (t * a.heads + h) * D)[c8];
    vl = reinterpret_cast<const uint4*>(a.qbuf + (a.T + t) * a.heads * D + int64_t(h) * D)[c8];
  }
}
// Q's hi and lo planes for query rows q0 .. q0 + ROWS - 1 of head h (rows beyond T zero), K-major
// in the 128-byte swizzle per 64-wide d chunk.
template <int ROWS, int THREADS>
__device__ __forceinline__ void stage_q_sw128(const PrefillAttnArgs& a, int64_t q0, int h,
                                              uint8_t (&q)[2][D / 64][ROWS * 128]) {
  for (int i = threadIdx.x; i < ROWS * (D / 8); i += THREADS) {
    const int r = i / (D / 8), c8 = i % (D / 8);
    uint4 v, vl;
    load_q16(a, q0 + r, h, c8, v, vl);
    *reinterpret_cast<uint4*>(&q[0][c8 >> 3][sw128_off(r, c8 & 7)]) = v;
    *reinterpret_cast<uint4*>(&q[1][c8 >> 3][sw128_off(r, c8 & 7)]) = vl;
  }
}
// O += P V on wgmma for a KTILE-key V tile at vb (MN-major in the 128-byte swizzle per 64-wide d
// chunk), P from registers (its lo plane too when PS); committed, not waited for.
template <int KTILE, bool PS>
__device__ __forceinline__ void issue_pv_wgmma(float (&o)[32][4], const uint32_t (&af)[KTILE / 16][4],
                                               const uint32_t (&afl)[KTILE / 16][4], uint32_t vb) {
  wg::fence();  // (o was rescaled by ordinary code)
#pragma unroll
  for (int kk = 0; kk < KTILE / 16; ++kk)
#pragma unroll
    for (int dc = 0; dc < D / 64; ++dc) {
      const uint64_t db = wg::desc_sw128(vb + uint32_t(dc * KTILE * 128 + kk * 16 * 128));
      auto& od = reinterpret_cast<float(&)[8][4]>(o[8 * dc]);
      wg::mma_m64n64k16_bf16_rs<1>(od, af[kk], db, true);
      if constexpr (PS) wg::mma_m64n64k16_bf16_rs<1>(od, afl[kk], db, true);
    }
  wg::commit();
}
// Epilogue: o / l times the sigmoid output gate, for this thread's rows t and t + 8 of head h.
__device__ __forceinline__ void flash_store(const PrefillAttnArgs& a, const float (&o)[32][4], const float (&l)[2],
                                            int64_t t_first, int h) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int hh = 0; hh < 2; ++hh) {
    const int64_t t = t_first + 8 * hh;
    if (t >= a.T) continue;
    const float inv = 1.f / l[hh];
    float* out = a.out + t * (int64_t(a.heads) * D) + int64_t(h) * D;
    const float* gate = a.qg + t * (a.ld ? a.ld : int64_t(a.heads) * 2 * D) + int64_t(h) * 2 * D + D;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      const int d = n * 8 + 2 * (lane & 3);
      float v0 = o[n][2 * hh] * inv, v1 = o[n][2 * hh + 1] * inv;
      if (a.gated) {
        v0 *= sigmoid_f(gate[d]);
        v1 *= sigmoid_f(gate[d + 1]);
      }
      *reinterpret_cast<float2*>(out + d) = make_float2(v0, v1);
    }
  }
}

// PS: P V with the probabilities as bf16 hi + lo; else P as one bf16 plane (the default: the
// rounding every flash attention applies, ~2^-9 relative per weight, half the P V MMAs).
// WG: Q K^T as 32 wgmma m64n32k16 per key tile (the block's 4 warps are one warpgroup; the
// default), else 128 mma.sync per warp with ldmatrix operands. The S accumulator has the same
// per-thread layout either way (rows 16 warp + lane / 4 (+ 8), keys 8 n + 2 (lane % 4) (+ 1)).
// PVW (needs WG): P V as 8 wgmma m64n64k16 per key tile, P from registers (the S accumulator's
// layout is the A fragment's), V MN-major from shared memory; else mma.sync with ldmatrix.trans.
template <bool PS, bool WG, bool PVW>
__global__ void __launch_bounds__(kThreads) flash_kernel(const PrefillAttnArgs a) {
  static_assert(WG || !PVW, "P V on wgmma uses the wgmma layout of shared memory");
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint8_t* base = smem_raw;
  if constexpr (WG) base += (1024 - (pf::smem_u32(smem_raw) & 1023)) & 1023;
  AttnSmem& sm = *reinterpret_cast<AttnSmem*>(base);
  AttnWgSmem& sw = *reinterpret_cast<AttnWgSmem*>(base);
  uint16_t(*const vt)[DP] = WG ? sw.v.pad : sm.v;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int h = blockIdx.y, kvh = h / (a.heads / a.kv_heads);
  const int64_t q0 = int64_t(blockIdx.x) * QT;
  const int64_t nkeys = a.pos0 + a.T;
  const int64_t kstride = int64_t(a.kv_heads) * D;

  // Q tile (rows beyond T zero).
  if constexpr (WG) {
    stage_q_sw128<QT, kThreads>(a, q0, h, sw.q);
    wg::fence_proxy_async();  // (published by the loop's first barrier)
  } else {
    for (int i = tid; i < QT * (D / 8); i += kThreads) {
      const int r = i / (D / 8), c8 = i % (D / 8);
      uint4 v, vl;
      load_q16(a, q0 + r, h, c8, v, vl);
      *reinterpret_cast<uint4*>(&sm.q[r][8 * c8]) = v;
      *reinterpret_cast<uint4*>(&sm.ql[r][8 * c8]) = vl;
    }
  }

  float o[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f};
  const float sl2 = rsqrtf(float(D)) * 1.4426950408889634f;  // scale * log2(e)
  const int64_t qpos[2] = {a.pos0 + q0 + warp * 16 + (lane >> 2), a.pos0 + q0 + warp * 16 + (lane >> 2) + 8};
  const int64_t last_q = a.pos0 + min(q0 + QT, a.T) - 1;  // the block's last query position

  // K and V tiles arrive by cp.async, each one step ahead of its use: K of the next tile is copied
  // while this tile's softmax and P V run, V of the next tile while the next Q K^T runs (one
  // buffer each; keys beyond the sequence zero-filled).
  auto load_tile = [&](bool is_k, const uint16_t* cache, int64_t kv0) {
    for (int i = tid; i < KT * (D / 8); i += kThreads) {
      const int r = i / (D / 8), c8 = i % (D / 8);
      const int64_t kp = kv0 + r;
      const bool ok = kp < nkeys;
      void* dst = !is_k ? (PVW ? static_cast<void*>(&sw.v.sw[c8 >> 3][sw128_off(r, c8 & 7)])
                               : static_cast<void*>(&vt[r][8 * c8]))
                  : WG  ? static_cast<void*>(&sw.k[c8 >> 3][sw128_off(r, c8 & 7)])
                        : static_cast<void*>(&sm.k[r][8 * c8]);
      pf::cp_async16(dst, cache + (ok ? kp : 0) * kstride + int64_t(kvh) * D + 8 * c8, ok);
    }
    pf::cp_async_commit();
  };
  load_tile(true, a.kcache, 0);
  load_tile(false, a.vcache, 0);
  for (int64_t kv0 = 0; kv0 <= last_q; kv0 += KT) {
    const bool more = kv0 + KT <= last_q;
    pf::cp_async_wait<1>();  // this tile's K (its V may still be in flight)
    if constexpr (WG) wg::fence_proxy_async();  // ... and is wgmma's to read
    __syncthreads();         // ... for every thread (and Q staged on the first pass)
    // S = Q K^T (16 x 32 per warp).
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.f;
    if constexpr (WG) {
      const uint32_t qb = pf::smem_u32(&sw.q[0][0][0]), kb = pf::smem_u32(&sw.k[0][0]);
      wg::fence();
#pragma unroll
      for (int ck = 0; ck < D / 64; ++ck)
#pragma unroll
        for (int ks = 0; ks < 4; ++ks) {
          const uint64_t db = wg::desc_sw128(kb + uint32_t(ck * KT * 128 + 32 * ks));
          wg::mma_m64n32k16_bf16(s, wg::desc_sw128(qb + uint32_t(ck * QT * 128 + 32 * ks)), db, true);
          wg::mma_m64n32k16_bf16(s, wg::desc_sw128(qb + uint32_t((D / 64 + ck) * QT * 128 + 32 * ks)), db,
                                 true);
        }
      wg::commit();
      wg::wait<0>();
      wg::fence_acc(s);
    } else {
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t af[4], afl[4];
        pf::ldsm_x4(af, &sm.q[warp * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
        pf::ldsm_x4(afl, &sm.ql[warp * 16 + (lane & 15)][ks * 16 + (lane >> 4) * 8]);
#pragma unroll
        for (int np = 0; np < 2; ++np) {
          uint32_t r[4];
          pf::ldsm_x4(r, &sm.k[np * 16 + (lane & 7) + (lane >> 4) * 8][ks * 16 + ((lane >> 3) & 1) * 8]);
          pf::mma_bf16(s[2 * np], af, r[0], r[1]);
          pf::mma_bf16(s[2 * np + 1], af, r[2], r[3]);
          pf::mma_bf16(s[2 * np], afl, r[0], r[1]);
          pf::mma_bf16(s[2 * np + 1], afl, r[2], r[3]);
        }
      }
    }
    __syncthreads();  // every warp is done with this K tile
    if (more) load_tile(true, a.kcache, kv0 + KT);
    // Online softmax (base 2), causal mask. With one P plane, a row half of the accumulator is
    // rescaled only when some row of the warp has a new maximum (corr != 1; o * 1 is o, so
    // skipping it changes nothing); the split route rescales always (the branch costs it 52 bytes
    // of spills at 255 registers).
    float p[4][4];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      causal_mask<4>(s, hh, kv0, qpos[hh]);
      const float corr = softmax_half<4>(s, p, hh, sl2, mrow[hh], lrow[hh]);
      if (PS || __any_sync(0xffffffffu, corr != 1.f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[n][2 * hh] *= corr;
          o[n][2 * hh + 1] *= corr;
        }
      }
    }
    // O += P V (this tile's V landed: at most the next K is still in flight).
    if (more) pf::cp_async_wait<1>();
    else pf::cp_async_wait<0>();
    if constexpr (PVW) wg::fence_proxy_async();  // this thread's V copies are wgmma's to read
    __syncthreads();
    uint32_t af[KT / 16][4], afl[KT / 16][4];
#pragma unroll
    for (int kk = 0; kk < KT / 16; ++kk) {
      af[kk][0] = pf::pack_bf16(p[2 * kk][0], p[2 * kk][1]);
      af[kk][1] = pf::pack_bf16(p[2 * kk][2], p[2 * kk][3]);
      af[kk][2] = pf::pack_bf16(p[2 * kk + 1][0], p[2 * kk + 1][1]);
      af[kk][3] = pf::pack_bf16(p[2 * kk + 1][2], p[2 * kk + 1][3]);
      if constexpr (PS) {
        afl[kk][0] = pf::pack_bf16(p[2 * kk][0] - pf::bf16_lo(af[kk][0]), p[2 * kk][1] - pf::bf16_hi(af[kk][0]));
        afl[kk][1] = pf::pack_bf16(p[2 * kk][2] - pf::bf16_lo(af[kk][1]), p[2 * kk][3] - pf::bf16_hi(af[kk][1]));
        afl[kk][2] =
            pf::pack_bf16(p[2 * kk + 1][0] - pf::bf16_lo(af[kk][2]), p[2 * kk + 1][1] - pf::bf16_hi(af[kk][2]));
        afl[kk][3] =
            pf::pack_bf16(p[2 * kk + 1][2] - pf::bf16_lo(af[kk][3]), p[2 * kk + 1][3] - pf::bf16_hi(af[kk][3]));
      }
    }
    if constexpr (PVW) {
      issue_pv_wgmma<KT, PS>(o, af, afl, pf::smem_u32(&sw.v.sw[0][0]));
      wg::wait<0>();
      wg::fence_acc(o);
      // The P fragments are read by the wgmma until the wait: no write to them before it.
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          asm volatile("" : "+r"(af[kk][i]));
          if constexpr (PS) asm volatile("" : "+r"(afl[kk][i]));
        }
    } else {
#pragma unroll
      for (int kk = 0; kk < KT / 16; ++kk)
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
          uint32_t r[4];
          pf::ldsm_x4_t(r, &vt[kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8][dp * 16 + (lane >> 4) * 8]);
          pf::mma_bf16(o[2 * dp], af[kk], r[0], r[1]);
          pf::mma_bf16(o[2 * dp + 1], af[kk], r[2], r[3]);
          if constexpr (PS) {
            pf::mma_bf16(o[2 * dp], afl[kk], r[0], r[1]);
            pf::mma_bf16(o[2 * dp + 1], afl[kk], r[2], r[3]);
          }
        }
    }
    __syncthreads();  // every warp is done with this V tile
    if (more) load_tile(false, a.vcache, kv0 + KT);
  }
  flash_store(a, o, lrow, q0 + warp * 16 + (lane >> 2), h);
}

// The wide kernel (a.wide = 1 or 2, opt-in until measured): 128 query rows of one head per block,
// two warpgroups of 64 rows each sharing 64-key K and V tiles; P as one bf16 plane; Q K^T on wgmma m64n64k16 (both
// operands in shared memory), P V on wgmma m64n64k16 with P from registers. Per key tile each
// warpgroup issues Q K^T of the next tile ahead of P V of this one and runs the next tile's
// softmax while its P V is on the tensor pipe (o is rescaled once that group is done).
// Versus flash_kernel: twice the keys per wgmma (N = 64: the Q K^T steps stop being bound by A's
// shared-memory reads), half the K/V copies per query, half the barriers per key.
// KB2 (a.wide = 2): two K buffers (224 KB in all): the copy of K(j+2) goes out right after the
// barrier that publishes K(j+1) (a whole tile ahead instead of after the softmax's barrier), and
// the barrier that freed the one K buffer goes away.
constexpr int WQT = 128, WKT = 64, kWideThreads = 256;
template <bool KB2>
struct AttnWideSmem {
  uint8_t q[2][D / 64][WQT * 128];         // Q hi, lo: K-major in the 128-byte swizzle per 64-wide d chunk
  uint8_t k[KB2 ? 2 : 1][D / 64][WKT * 128];  // K tile(s), the same layout
  uint8_t v[D / 64][WKT * 128];            // V tile, read MN-major by the P V wgmma
};
template <bool KB2>
constexpr int kWideSmemBytes = int(sizeof(AttnWideSmem<KB2>)) + 1024;  // + the alignment slack
static_assert(kWideSmemBytes<true> <= 227 * 1024, "two K buffers exceed the opt-in shared memory");

template <bool KB2>
__global__ void __launch_bounds__(kWideThreads, 1) flash_wide_kernel(const PrefillAttnArgs a) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  AttnWideSmem<KB2>& sw = *reinterpret_cast<AttnWideSmem<KB2>*>(
      smem_raw + ((1024 - (pf::smem_u32(smem_raw) & 1023)) & 1023));
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wgi = warp >> 2, wl = warp & 3;  // warpgroup, warp within it
  const int h = blockIdx.y, kvh = h / (a.heads / a.kv_heads);
  // The longest blocks (the last queries: the most keys) first, so that the short ones fill the tail.
  const int64_t q0 = int64_t(gridDim.x - 1 - blockIdx.x) * WQT;
  const int64_t nkeys = a.pos0 + a.T;
  const int64_t kstride = int64_t(a.kv_heads) * D;

  stage_q_sw128<WQT, kWideThreads>(a, q0, h, sw.q);  // (rows beyond T zero)
  wg::fence_proxy_async();  // (published by the first barrier)

  float o[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.f;
  float s[8][4];
  uint32_t af[WKT / 16][4];
  float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.f, 0.f}, corr[2] = {1.f, 1.f};
  const float sl2 = rsqrtf(float(D)) * 1.4426950408889634f;  // scale * log2(e)
  const int64_t row0 = q0 + 64 * wgi + 16 * wl + (lane >> 2);  // this thread's rows: row0, row0 + 8
  const int64_t qpos[2] = {a.pos0 + row0, a.pos0 + row0 + 8};
  const int64_t last_q = a.pos0 + min(q0 + WQT, a.T) - 1;  // the block's last query position
  const int ntiles = int(last_q / WKT) + 1;
  const uint32_t qb = pf::smem_u32(&sw.q[0][0][0]) + uint32_t(wgi * 64 * 128);
  const uint32_t vb = pf::smem_u32(&sw.v[0][0]);
  // K tile j's buffer.
  auto kbuf = [](int j) { return KB2 ? (j & 1) : 0; };

  auto load_tile = [&](bool is_k, int64_t kv0, int buf) {
    const uint16_t* cache = is_k ? a.kcache : a.vcache;
    for (int i = tid; i < WKT * (D / 8); i += kWideThreads) {
      const int r = i / (D / 8), c8 = i % (D / 8);
      const int64_t kp = kv0 + r;
      const bool ok = kp < nkeys;
      uint8_t* dst = is_k ? &sw.k[buf][c8 >> 3][sw128_off(r, c8 & 7)] : &sw.v[c8 >> 3][sw128_off(r, c8 & 7)];
      pf::cp_async16(dst, cache + (ok ? kp : 0) * kstride + int64_t(kvh) * D + 8 * c8, ok);
    }
    pf::cp_async_commit();
  };
  // S = Q K^T of the staged K tile (issued and committed, not waited for).
  auto issue_qk = [&](int buf) {
    const uint32_t kb = pf::smem_u32(&sw.k[buf][0][0]);
    wg::fence();
#pragma unroll
    for (int ck = 0; ck < D / 64; ++ck)
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        const uint64_t db = wg::desc_sw128(kb + uint32_t(ck * WKT * 128 + 32 * ks));
        wg::mma_m64n64k16_bf16(s, wg::desc_sw128(qb + uint32_t(ck * WQT * 128 + 32 * ks)), db, ck + ks > 0);
        wg::mma_m64n64k16_bf16(s, wg::desc_sw128(qb + uint32_t((D / 64 + ck) * WQT * 128 + 32 * ks)), db, true);
      }
    wg::commit();
  };
  // Online softmax of S (base 2, causal mask) into P (in s), the row sums, and corr (o's factor).
  // The mask applies only where the tile's last key is past the warpgroup's first query.
  const int64_t wg_first = a.pos0 + q0 + 64 * wgi;
  auto softmax = [&](int64_t kv0) {
    const bool masked = kv0 + WKT - 1 > wg_first;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      if (masked) causal_mask<8>(s, hh, kv0, qpos[hh]);
      corr[hh] = softmax_half<8>(s, s, hh, sl2, mrow[hh], lrow[hh]);
    }
  };
  // o *= corr per row half, skipped when no row of the warp has a new maximum (o * 1 is o).
  auto rescale = [&] {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
      if (__any_sync(0xffffffffu, corr[hh] != 1.f)) {
#pragma unroll
        for (int n = 0; n < 32; ++n) {
          o[n][2 * hh] *= corr[hh];
          o[n][2 * hh + 1] *= corr[hh];
        }
      }
  };

  // Prologue: tile 0's K and V, its scores and softmax (o is zero: no rescale); tile 1's K (with
  // two buffers at once, else once every warpgroup is done with K 0). Either way the groups
  // pending after it are V(0), then K(1).
  load_tile(true, 0, 0);
  load_tile(false, 0, 0);
  if (KB2 && ntiles > 1) {
    load_tile(true, WKT, 1);
    pf::cp_async_wait<2>();
  } else {
    pf::cp_async_wait<1>();
  }
  wg::fence_proxy_async();
  __syncthreads();  // K 0 and Q visible
  issue_qk(0);
  wg::wait<0>();
  wg::fence_acc(s);
  if (!KB2) {
    __syncthreads();  // every warpgroup is done with K 0
    if (ntiles > 1) load_tile(true, WKT, 0);
  }
  softmax(0);

  // P (in s) as the bf16 A fragments of P V (before s takes the next tile's scores).
  auto pack_p = [&] {
#pragma unroll
    for (int kk = 0; kk < WKT / 16; ++kk) {
      af[kk][0] = pf::pack_bf16(s[2 * kk][0], s[2 * kk][1]);
      af[kk][1] = pf::pack_bf16(s[2 * kk][2], s[2 * kk][3]);
      af[kk][2] = pf::pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
      af[kk][3] = pf::pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
    }
  };
  auto issue_pv = [&] { issue_pv_wgmma<WKT, false>(o, af, af, vb); };
  // After P V's group is waited for: o is the compiler's again, and the P fragments may be rewritten.
  auto pv_done = [&] {
    wg::fence_acc(o);
#pragma unroll
    for (int kk = 0; kk < WKT / 16; ++kk)
#pragma unroll
      for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(af[kk][i]));
  };

  // Tile j < ntiles - 1: P(j) in s (softmaxed), o rescaled to its maximum; K(j+1) and V(j) in
  // flight or landed (committed in that order, except at j = 0: V(0) first).
  for (int j = 0; j + 1 < ntiles; ++j) {
    const int64_t kv1 = int64_t(j + 1) * WKT;
    const bool k_ahead = KB2 && j + 2 < ntiles;  // K(j+2) goes out before V(j) is waited for
    pack_p();
    if (j == 0) pf::cp_async_wait<0>();
    else pf::cp_async_wait<1>();
    wg::fence_proxy_async();
    __syncthreads();  // K(j+1) visible (and, with two buffers, every warpgroup done with K(j))
    issue_qk(kbuf(j + 1));  // S(j+1) = Q K(j+1)^T, ahead of P V of tile j
    if (k_ahead) {
      load_tile(true, kv1 + WKT, kbuf(j + 2));
      pf::cp_async_wait<1>();
    } else {
      pf::cp_async_wait<0>();
    }
    wg::fence_proxy_async();
    __syncthreads();  // V(j) visible
    issue_pv();
    wg::wait<1>();    // S(j+1) done (P V of tile j may still run)
    wg::fence_acc(s);
    if (!KB2) {
      __syncthreads();  // every warpgroup is done with K(j+1)
      if (j + 2 < ntiles) load_tile(true, kv1 + WKT, 0);
    }
    softmax(kv1);     // while P V of tile j is on the tensor pipe
    wg::wait<0>();
    pv_done();
    rescale();
    __syncthreads();  // every warpgroup is done with V(j)
    load_tile(false, kv1, 0);
  }
  // The last tile: P V only.
  pack_p();
  pf::cp_async_wait<0>();
  wg::fence_proxy_async();
  __syncthreads();
  issue_pv();
  wg::wait<0>();
  pv_done();
  flash_store(a, o, lrow, row0, h);
}

std::once_flag g_attn_once;

}  // namespace

template <bool PS, bool WG, bool PVW>
void flash_init_one() {
  KCUDA(cudaFuncSetAttribute(flash_kernel<PS, WG, PVW>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             WG ? kWgSmemBytes : int(sizeof(AttnSmem))));
}

void prefill_attn_init() {
  std::call_once(g_attn_once, [] {
    flash_init_one<true, false, false>();
    flash_init_one<false, false, false>();
    flash_init_one<true, true, false>();
    flash_init_one<false, true, false>();
    flash_init_one<true, true, true>();
    flash_init_one<false, true, true>();
    KCUDA(cudaFuncSetAttribute(flash_wide_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kWideSmemBytes<false>));
    KCUDA(cudaFuncSetAttribute(flash_wide_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               kWideSmemBytes<true>));
  });
}

void prefill_attn_prep_launch(const PrefillAttnArgs& a, cudaStream_t s) {
  const int64_t rows = a.T * (a.heads + 2 * a.kv_heads);
  attn_prep_kernel<<<unsigned((rows + 7) / 8), 256, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_attn prep");
}

void prefill_attn_launch(const PrefillAttnArgs& a, cudaStream_t s) {
  prefill_attn_init();
  const dim3 grid(unsigned((a.T + QT - 1) / QT), unsigned(a.heads));
  const size_t wg = kWgSmemBytes, sync = sizeof(AttnSmem);
  // (qk_wgmma = false runs P V on mma.sync too: the wgmma P V needs the wgmma layout.)
  if (a.wide) {
    // (One route: both products on wgmma, P one bf16 plane; prefill_attn checks it.)
    const dim3 wgrid(unsigned((a.T + WQT - 1) / WQT), unsigned(a.heads));
    if (a.wide == 2) flash_wide_kernel<true><<<wgrid, kWideThreads, kWideSmemBytes<true>, s>>>(a);
    else flash_wide_kernel<false><<<wgrid, kWideThreads, kWideSmemBytes<false>, s>>>(a);
  } else if (a.qk_wgmma && a.pv_wgmma) {
    if (a.p_split) flash_kernel<true, true, true><<<grid, kThreads, wg, s>>>(a);
    else flash_kernel<false, true, true><<<grid, kThreads, wg, s>>>(a);
  } else if (a.qk_wgmma) {
    if (a.p_split) flash_kernel<true, true, false><<<grid, kThreads, wg, s>>>(a);
    else flash_kernel<false, true, false><<<grid, kThreads, wg, s>>>(a);
  } else {
    if (a.p_split) flash_kernel<true, false, false><<<grid, kThreads, sync, s>>>(a);
    else flash_kernel<false, false, false><<<grid, kThreads, sync, s>>>(a);
  }
  KCUDA_LAUNCH("prefill_attn");
}

}  // namespace kestrel::cuda
