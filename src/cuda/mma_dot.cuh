// The tensor-core q4 dot core of the decode GEMV route 3 (gemv.cu) and of the q4 MoE gate/up
// on the tensor cores (moe.cu). Why and how (measured in bench/NOTES.md v10): the scalar dot core
// spends ~4 instructions per weight, so the decode GEMVs are bound by instruction issue; here one
// mma.sync m16n8k16 does 16 rows x 16 weights:
// * A = the q4 codes as exact bf16 (128 + q built by a LOP3 into the mantissa, 128 subtracted
//   exactly), B = the activation split exactly into three bf16 parts (hi + mid + lo carry its 24
//   bits) in columns 0-2, fp32 accumulation; each 64-element group's dot then gets its scale, and
//   bias x (the group's sum of x), as the scalar core.
// * The k order inside a group is permuted (lane t of a quad holds the group's elements
//   16t..16t+15 of its two rows, the nibbles of one word as the bf16 pairs (j, j + 4)), and the B
//   fragments are laid out once per block in shared memory in that same order (12 lanes x 8 bytes
//   per k-step: the other 20 lanes' B columns are zero), so that every weight load is a plain
//   8-byte load and every B fragment one 8-byte shared load.
// A tile is 16 rows: lane (g = lane / 4, t = lane % 4) holds rows g and g + 8.
#pragma once
#include "cuda/gemv_core.cuh"
#include "cuda/prefill_mma.h"

namespace kestrel::cuda {

constexpr int kMmaTileRows = 16;

// The B fragments of x (K elements) and the 64-element group sums.
template <int K>
struct MmaB {
  static constexpr int kSteps = K / 16;
  uint2 bt[kSteps * 12];  // [k-step][lane < 12]
  float gsum[K / 64];
};

// The bf16 pair (128 + q_j, 128 + q_{j+4}) of nibbles j, j + 4 of w (j < 4), minus 128: exact.
__device__ __forceinline__ uint32_t q4_pair_bf16(uint32_t w, int j) {
  uint32_t v = ((w >> (4 * j)) & 0x000f000fu) | 0x43004300u;
  __nv_bfloat162 h = *reinterpret_cast<__nv_bfloat162*>(&v);
  h = __hsub2(h, __floats2bfloat162_rn(128.f, 128.f));
  return *reinterpret_cast<uint32_t*>(&h);
}

// Part g (0 hi, 1 mid, 2 lo) of the exact three-way bf16 split of x.
__device__ __forceinline__ float split3(float x, int g) {
  const float hi = __bfloat162float(__float2bfloat16_rn(x));
  if (g == 0) return hi;
  const float r = x - hi;
  const float mid = __bfloat162float(__float2bfloat16_rn(r));
  return g == 1 ? mid : r - mid;
}

// Lays out B from x staged in the swizzled shared layout (xs, xsum of gemv_core.cuh); every
// thread of the block calls it (nthreads of them); the caller synchronises after.
// k-step ks = 4 G + s of group G, lane l < 12 (part l / 4, quad position l % 4):
// {x[e], x[e + 4]}, {x[e + 1], x[e + 5]}, e = 64 G + 16 (l % 4) + 8 (s / 2) + 2 (s % 2).
// One thread per (k-step, quad position): its 4 elements split once, the 3 parts' entries written.
template <int K>
__device__ __forceinline__ void mma_build_b(MmaB<K>& b, const float* xs, const float* xsum, int nthreads) {
  const int tid = threadIdx.x;
  const auto xat = [&](int k) { return xs[swz(k >> 2) * 4 + (k & 3)]; };
  for (int i = tid; i < MmaB<K>::kSteps * 4; i += nthreads) {
    const int ks = i >> 2, qp = i & 3;
    const int e = 64 * (ks >> 2) + 16 * qp + 8 * ((ks & 3) >> 1) + 2 * (ks & 1);
    const int ei[4] = {e, e + 4, e + 1, e + 5};
    float pv[3][4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
#pragma unroll
      for (int part = 0; part < 3; ++part) pv[part][k] = split3(xat(ei[k]), part);
#pragma unroll
    for (int part = 0; part < 3; ++part)
      b.bt[ks * 12 + 4 * part + qp] =
          make_uint2(pf::pack_bf16(pv[part][0], pv[part][1]), pf::pack_bf16(pv[part][2], pv[part][3]));
  }
  for (int G = tid; G < K / 64; G += nthreads)
    b.gsum[G] = (xsum[4 * G] + xsum[4 * G + 1]) + (xsum[4 * G + 2] + xsum[4 * G + 3]);
}

// One q4 row's part for this lane: the words of its quarter of NG consecutive groups from G0,
// and those groups' scales and biases (NG consecutive bf16 each, read as NG / 2 words).
template <int K, int NG>
__device__ __forceinline__ void mma_load_row(const DMat& w, int64_t row, int G0, int t, uint2 (&q)[NG],
                                             uint32_t (&scw)[NG / 2], uint32_t (&biw)[NG / 2]) {
  constexpr int kGroups = K / 64;
  const char* rowp = static_cast<const char*>(w.data) + size_t(row) * (K / 2);
#pragma unroll
  for (int j = 0; j < NG; ++j) q[j] = __ldg(reinterpret_cast<const uint2*>(rowp + (G0 + j) * 32 + 8 * t));
  const uint32_t* sp = reinterpret_cast<const uint32_t*>(w.scales + size_t(row) * kGroups + G0);
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(w.biases + size_t(row) * kGroups + G0);
#pragma unroll
  for (int j = 0; j < NG / 2; ++j) {
    scw[j] = __ldg(sp + j);
    biw[j] = __ldg(bp + j);
  }
}

// acc[h] += this lane's share of the dot of row (g + 8 h) over the NG groups from G0 (sum it over
// the quad: group_sum<4>). Every lane of the warp calls it (mma.sync).
template <int K, int NG>
__device__ __forceinline__ void mma_tile_dot(const uint2 (&q)[2][NG], const uint32_t (&scw)[2][NG / 2],
                                             const uint32_t (&biw)[2][NG / 2], const MmaB<K>& b, int G0,
                                             int lane, float (&acc)[2]) {
  const int t = lane & 3;
#pragma unroll
  for (int j = 0; j < NG; ++j) {
    const int G = G0 + j;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int st = 0; st < 4; ++st) {
      const uint2 bf = lane < 12 ? b.bt[(4 * G + st) * 12 + lane] : make_uint2(0u, 0u);
      const uint32_t w0 = st < 2 ? q[0][j].x : q[0][j].y, w1 = st < 2 ? q[1][j].x : q[1][j].y;
      const int j0 = 2 * (st & 1);
      const uint32_t A[4] = {q4_pair_bf16(w0, j0), q4_pair_bf16(w1, j0), q4_pair_bf16(w0, j0 + 1),
                             q4_pair_bf16(w1, j0 + 1)};
      pf::mma_bf16(c, A, bf.x, bf.y);
    }
    // Columns 0-2 (t = 0: hi, mid; t = 1: lo) hold the group's dot; the other columns are 0.
    const float gs = t == 0 ? b.gsum[G] : 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t sw = scw[h][j >> 1], bw = biw[h][j >> 1];
      const float sc = __uint_as_float(j & 1 ? sw & 0xffff0000u : sw << 16);
      const float bi = __uint_as_float(j & 1 ? bw & 0xffff0000u : bw << 16);
      acc[h] += sc * (c[2 * h] + c[2 * h + 1]) + bi * gs;
    }
  }
}

}  // namespace kestrel::cuda
