// The dot-product core shared by the GEMV and MoE kernels: a group of TPR lanes computes one
// weight row against up to kMaxGemvRows activation rows held in shared memory.
//
// Layout choices (why):
// * Each lane reads whole 16-byte chunks of the row (coalesced across the group): 8 bf16, 16 q8
//   codes or 32 q4 codes per chunk; all of a lane's chunks are loaded before any arithmetic, so
//   several loads are in flight per lane.
// * Activations live in shared memory as fp32 in 16-byte slots, swizzled (slot s of a row sits
//   at s ^ ((s >> 3) & 7)): the lanes of a quarter-warp then hit distinct banks for every format.
// * Affine dequantisation without per-element int->float conversion: a LOP3 builds the fp16 pair
//   (1024 + q0, 1024 + q1) from the codes, one HSUB2 removes the 1024 exactly, and the pair
//   converts exactly to fp32. Per chunk, w.x = scale * sum_j q_j x_j + bias * sum_j x_j, with the
//   activation block sums computed once per block. (A first version kept the 1024 offset and removed
//   it with the block sums: 2.5e-5 relative error from cancellation; measured, replaced.)
#pragma once
#include "cuda/common.cuh"

namespace kestrel::cuda {

__device__ __forceinline__ int swz(int s) { return s ^ ((s >> 3) & 7); }

// Elements per 16-byte chunk.
template <DFmt F>
struct Fmt;
template <>
struct Fmt<DFmt::BF16> {
  static constexpr int kEpc = 8;
};
template <>
struct Fmt<DFmt::Q8> {
  static constexpr int kEpc = 16;
};
template <>
struct Fmt<DFmt::Q4> {
  static constexpr int kEpc = 32;
};

// Shared-memory activations: xs fp32 [M][K] in swizzled slots; xsum fp32 [M][K/16] (sums of
// each 16-element block, for affine formats).
struct SmemX {
  const float* xs;
  const float* xsum;
  int K;
  __device__ __forceinline__ float4 slot(int m, int s) const {
    return reinterpret_cast<const float4*>(xs + size_t(m) * K)[swz(s)];
  }
  __device__ __forceinline__ float sum16(int m, int b) const { return xsum[size_t(m) * (K / 16) + b]; }
};

// (bits | 0x6400 per half) is the fp16 pair (1024 + q0, 1024 + q1); subtracting 1024 in fp16 is
// exact (q < 1024), so the codes reach fp32 exactly with no int->float conversion.
__device__ __forceinline__ float2 h2f(uint32_t v) {
  const __half2 h = __hsub2(*reinterpret_cast<__half2*>(&v), __float2half2_rn(1024.f));
  return __half22float2(h);
}

// acc[m] += dot(row chunk c, x[m]) for m < M. `c` is the chunk index within the row.
template <DFmt F, int MM>
__device__ __forceinline__ void chunk_dot(const uint4& q, float scale, float bias, int c,
                                          const SmemX& X, int M, float (&acc)[MM]) {
  const uint32_t w[4] = {q.x, q.y, q.z, q.w};
  if constexpr (F == DFmt::BF16) {
    float f[8];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      f[2 * k] = __uint_as_float(w[k] << 16);
      f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
#pragma unroll
    for (int m = 0; m < MM; ++m) {
      if (m < M) {
        const float4 a = X.slot(m, 2 * c), b = X.slot(m, 2 * c + 1);
        float s = acc[m];
        s = fmaf(f[0], a.x, s); s = fmaf(f[1], a.y, s); s = fmaf(f[2], a.z, s); s = fmaf(f[3], a.w, s);
        s = fmaf(f[4], b.x, s); s = fmaf(f[5], b.y, s); s = fmaf(f[6], b.z, s); s = fmaf(f[7], b.w, s);
        acc[m] = s;
      }
    }
  } else if constexpr (F == DFmt::Q8) {
    // word k: elements 4k..4k+3 (byte j = element 4k+j).
    float f[16];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 e02 = h2f((w[k] & 0x00ff00ffu) | 0x64006400u);
      const float2 e13 = h2f(((w[k] >> 8) & 0x00ff00ffu) | 0x64006400u);
      f[4 * k + 0] = e02.x; f[4 * k + 1] = e13.x; f[4 * k + 2] = e02.y; f[4 * k + 3] = e13.y;
    }
#pragma unroll
    for (int m = 0; m < MM; ++m) {
      if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const float4 a = X.slot(m, 4 * c + k);
          s = fmaf(f[4 * k], a.x, s); s = fmaf(f[4 * k + 1], a.y, s);
          s = fmaf(f[4 * k + 2], a.z, s); s = fmaf(f[4 * k + 3], a.w, s);
        }
        const float xsum = X.sum16(m, c);
        acc[m] += scale * s + bias * xsum;
      }
    }
  } else {
    // Q4, word k: elements 8k..8k+7, nibble j = element 8k+j. Shift sh picks nibbles sh and 4+sh.
    float f[32];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int sh = 0; sh < 4; ++sh) {
        const float2 e = h2f(((w[k] >> (4 * sh)) & 0x000f000fu) | 0x64006400u);
        f[8 * k + sh] = e.x;
        f[8 * k + 4 + sh] = e.y;
      }
    }
#pragma unroll
    for (int m = 0; m < MM; ++m) {
      if (m < M) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const float4 a = X.slot(m, 8 * c + k);
          s = fmaf(f[4 * k], a.x, s); s = fmaf(f[4 * k + 1], a.y, s);
          s = fmaf(f[4 * k + 2], a.z, s); s = fmaf(f[4 * k + 3], a.w, s);
        }
        const float xsum = X.sum16(m, 2 * c) + X.sum16(m, 2 * c + 1);
        acc[m] += scale * s + bias * xsum;
      }
    }
  }
}

// One row, all chunks of this lane (lane index li within a group of TPR lanes), K compile-time.
template <DFmt F, int K, int TPR, int MM>
__device__ __forceinline__ void row_dot(const DMat& w, int64_t row, const SmemX& X, int M, int li,
                                        float (&acc)[MM]) {
  constexpr int kChunks = K / Fmt<F>::kEpc;
  static_assert(kChunks % TPR == 0, "chunks per row must divide among the lanes");
  constexpr int NCH = kChunks / TPR;
  const uint4* base = reinterpret_cast<const uint4*>(w.data) + size_t(row) * kChunks;
  uint4 q[NCH];
  float sc[NCH], bi[NCH];
#pragma unroll
  for (int i = 0; i < NCH; ++i) q[i] = __ldg(base + li + TPR * i);
  if constexpr (F != DFmt::BF16) {
    constexpr int kGroups = K / 64;
    constexpr int kChunksPerGroup = 64 / Fmt<F>::kEpc;
#pragma unroll
    for (int i = 0; i < NCH; ++i) {
      const int g = (li + TPR * i) / kChunksPerGroup;
      sc[i] = bf16_bits_to_f32(__ldg(w.scales + size_t(row) * kGroups + g));
      bi[i] = bf16_bits_to_f32(__ldg(w.biases + size_t(row) * kGroups + g));
    }
  }
#pragma unroll
  for (int i = 0; i < NCH; ++i) {
    if constexpr (F == DFmt::BF16)
      chunk_dot<F, MM>(q[i], 0.f, 0.f, li + TPR * i, X, M, acc);
    else
      chunk_dot<F, MM>(q[i], sc[i], bi[i], li + TPR * i, X, M, acc);
  }
}

// Runtime format switch (warp-uniform).
// (Formats whose chunk count does not divide among TPR lanes are refused by the launchers.)
template <DFmt F, int K, int TPR>
constexpr bool kFits = (K / Fmt<F>::kEpc) % TPR == 0;
template <int K, int TPR, int MM>
__device__ __forceinline__ void row_dot_any(const DMat& w, int64_t row, const SmemX& X, int M,
                                            int li, float (&acc)[MM]) {
  if (w.fmt == DFmt::Q4) {
    if constexpr (kFits<DFmt::Q4, K, TPR>) row_dot<DFmt::Q4, K, TPR, MM>(w, row, X, M, li, acc);
  } else if (w.fmt == DFmt::Q8) {
    if constexpr (kFits<DFmt::Q8, K, TPR>) row_dot<DFmt::Q8, K, TPR, MM>(w, row, X, M, li, acc);
  } else {
    if constexpr (kFits<DFmt::BF16, K, TPR>) row_dot<DFmt::BF16, K, TPR, MM>(w, row, X, M, li, acc);
  }
}

// NR independent single-row dots (M = 1 each) with every load issued before any arithmetic:
// row r uses weight row pointer base[r] (nullptr = inactive, result 0) and activations X[r].
// Returns this lane's partial sums (the caller reduces over its TPR-lane group).
template <DFmt F, int K, int TPR, int NR>
__device__ __forceinline__ void multi_dot(const DMat* const (&w)[NR], const int64_t (&row)[NR],
                                          const SmemX (&X)[NR], int li, float (&out)[NR]) {
  constexpr int kChunks = K / Fmt<F>::kEpc;
  static_assert(kChunks % TPR == 0, "chunks per row must divide among the lanes");
  constexpr int NCH = kChunks / TPR;
  uint4 q[NR][NCH];
  float sc[NR][NCH], bi[NR][NCH];
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    if (w[r] == nullptr) continue;
    const uint4* base = reinterpret_cast<const uint4*>(w[r]->data) + size_t(row[r]) * kChunks;
#pragma unroll
    for (int i = 0; i < NCH; ++i) q[r][i] = __ldg(base + li + TPR * i);
    if constexpr (F != DFmt::BF16) {
      constexpr int kGroups = K / 64;
      constexpr int kChunksPerGroup = 64 / Fmt<F>::kEpc;
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        const int g = (li + TPR * i) / kChunksPerGroup;
        sc[r][i] = bf16_bits_to_f32(__ldg(w[r]->scales + size_t(row[r]) * kGroups + g));
        bi[r][i] = bf16_bits_to_f32(__ldg(w[r]->biases + size_t(row[r]) * kGroups + g));
      }
    }
  }
#pragma unroll
  for (int r = 0; r < NR; ++r) {
    float acc[1] = {0.f};
    if (w[r] != nullptr) {
#pragma unroll
      for (int i = 0; i < NCH; ++i) {
        if constexpr (F == DFmt::BF16)
          chunk_dot<F, 1>(q[r][i], 0.f, 0.f, li + TPR * i, X[r], 1, acc);
        else
          chunk_dot<F, 1>(q[r][i], sc[r][i], bi[r][i], li + TPR * i, X[r], 1, acc);
      }
    }
    out[r] = acc[0];
  }
}

// multi_dot in two halves, so that the weight loads can be issued before the activations are
// staged (weights never depend on the previous kernel): RowLoads::issue starts every load of NR
// rows, RowLoads::dot consumes them. Same numerics as multi_dot.
template <DFmt F, int K, int TPR, int NR>
struct RowLoads {
  static constexpr int kChunks = K / Fmt<F>::kEpc;
  static_assert(kChunks % TPR == 0, "chunks per row must divide among the lanes");
  static constexpr int NCH = kChunks / TPR;
  uint4 q[NR][NCH];
  float sc[NR][NCH], bi[NR][NCH];
  bool on[NR];
  __device__ __forceinline__ void issue(const DMat* const (&w)[NR], const int64_t (&row)[NR], int li) {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      on[r] = w[r] != nullptr;
      if (!on[r]) continue;
      const uint4* base = reinterpret_cast<const uint4*>(w[r]->data) + size_t(row[r]) * kChunks;
#pragma unroll
      for (int i = 0; i < NCH; ++i) q[r][i] = __ldg(base + li + TPR * i);
      if constexpr (F != DFmt::BF16) {
        constexpr int kGroups = K / 64;
        constexpr int kChunksPerGroup = 64 / Fmt<F>::kEpc;
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
          const int g = (li + TPR * i) / kChunksPerGroup;
          sc[r][i] = bf16_bits_to_f32(__ldg(w[r]->scales + size_t(row[r]) * kGroups + g));
          bi[r][i] = bf16_bits_to_f32(__ldg(w[r]->biases + size_t(row[r]) * kGroups + g));
        }
      }
    }
  }
  // out[r] = this lane's partial dot of row r with X[r] (0 for inactive rows).
  __device__ __forceinline__ void dot(const SmemX (&X)[NR], int li, float (&out)[NR]) const {
#pragma unroll
    for (int r = 0; r < NR; ++r) {
      float acc[1] = {0.f};
      if (on[r]) {
#pragma unroll
        for (int i = 0; i < NCH; ++i) {
          if constexpr (F == DFmt::BF16)
            chunk_dot<F, 1>(q[r][i], 0.f, 0.f, li + TPR * i, X[r], 1, acc);
          else
            chunk_dot<F, 1>(q[r][i], sc[r][i], bi[r][i], li + TPR * i, X[r], 1, acc);
        }
      }
      out[r] = acc[0];
    }
  }
};

// Stores 4 consecutive activations (elements 4s..4s+3 of row m, s = slot) into the swizzled
// layout, and, when the 4 lanes l, l^1, l^2, l^3 (l % 4 == 0) hold the 4 slots of one 16-element
// block, that block's sum. Every lane of the warp must call it (shuffles).
__device__ __forceinline__ void smem_store4(float* xs, float* xsum, int K, int m, int s, float4 v) {
  reinterpret_cast<float4*>(xs + size_t(m) * K)[swz(s)] = v;
  const float t = group_sum<4>((v.x + v.y) + (v.z + v.w));
  if ((threadIdx.x & 3) == 0) xsum[size_t(m) * (K / 16) + (s >> 2)] = t;
}

// Writes fp32 rows x[m][0..K) into the swizzled shared layout and the 16-element sums.
// Call with all threads of the block; followed by __syncthreads() by the caller.
__device__ __forceinline__ void smem_store_x(float* xs, float* xsum, int K, int m, int k, float v) {
  const int s = k >> 2;
  xs[size_t(m) * K + swz(s) * 4 + (k & 3)] = v;
  (void)xsum;
}
// After xs is complete (synchronised), computes xsum[m][b] for all m < M, b < K/16.
__device__ __forceinline__ void smem_sum16(const float* xs, float* xsum, int K, int M) {
  const int nb = K / 16;
  for (int i = threadIdx.x; i < M * nb; i += blockDim.x) {
    const int m = i / nb, b = i % nb;
    const float4* row = reinterpret_cast<const float4*>(xs + size_t(m) * K);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float4 v = row[swz(4 * b + j)];
      s += (v.x + v.y) + (v.z + v.w);
    }
    xsum[i] = s;
  }
}

__device__ __forceinline__ unsigned long long pack_argmax(float v, uint32_t row) {
  uint32_t u = __float_as_uint(v);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - row);
}

}  // namespace kestrel::cuda
