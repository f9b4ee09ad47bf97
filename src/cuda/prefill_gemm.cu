// Prefill GEMM with the weight dequantised while staging (BF16 / affine Q4 / Q8, MLX layout), on
// tensor cores (mma.sync m16n8k16 bf16, fp32 accumulate); the grouped (MoE) variant; GPU routing
// (softmax, top-k, renormalise, deterministic counting sort by expert); the combine.
//
// Tiles: BM x 128 x 64 (BM = 64 or 128), 8 warps as 2 (rows) x 4 (columns), double-buffered shared
// memory fed through registers: the next k-tile's global loads are in flight while the tensor cores
// work on the current one. One k-tile is one affine group (64), so a W row's scale and bias are
// one pair per tile; no dequantised copy of W exists anywhere in global memory.
//
// Precision (the CPU oracle computes in fp32). A Q4/Q8 weight is staged as its exact integer q; per
// k-tile (one affine group) the products P = sum_k q A are accumulated apart and folded in as
// acc += s P + b sum_k A, with the row sums of A taken in fp32 while staging. An fp32 A takes one
// of two routes (PrefillAPrec, chosen by the caller):
//   Split: two bf16 planes, hi = bf16(a) and lo = bf16(a - hi) (a = hi + lo to about 2^-17
//          relative), both through the tensor cores: the only rounding left is fp32 accumulation
//          order, at twice the MMAs and shared-memory reads;
//   F16:   one fp16 plane (2^-11 relative, 8x finer than bf16) with W staged as fp16 (integers
//          exact; bf16 weights exact down to 2^-14): one MMA per tile, and 128-row tiles for every
//          format. Elements beyond the fp16 range are clamped and reported through range_flag.
#include "cuda/common.cuh"
#include "cuda/prefill.h"
#include "cuda/prefill_mma.h"
#include "cuda/prefill_tile.cuh"

#include <cstdio>
#include <cstdlib>
#include <mutex>

namespace kestrel::cuda {
namespace {

constexpr int BN = 128, BK = 64, SK = BK + 8;  // padded shared row (bf16): conflict-free ldmatrix
constexpr int kThreads = 256;

template <int BM>
struct GemmSmem {
  uint16_t a[2][BM][SK];   // A hi (or the bf16 A)
  uint16_t al[2][BM][SK];  // A lo (fp32 A only)
  uint16_t b[2][BN][SK];   // W (bf16), or q as exact bf16 integers (Q4/Q8)
  float ws[2][BN], wb[2][BN];  // Q4/Q8: the k-tile's scale and bias of each staged W row
  float asum[2][BM];           // Q4/Q8: the k-tile's sum of A of each row (fp32)
};

template <DFmt F>
struct BStage {
  // 32 consecutive elements of one W row: BF16 64 B, Q8 32 B, Q4 16 B.
  uint4 v[F == DFmt::BF16 ? 4 : F == DFmt::Q8 ? 2 : 1];
  float s, b;
};

template <DFmt F>
__device__ __forceinline__ void b_load(BStage<F>& st, const uint8_t* row, const uint16_t* srow,
                                       const uint16_t* brow, int kt, int half, bool valid) {
  constexpr int NV = F == DFmt::BF16 ? 4 : F == DFmt::Q8 ? 2 : 1;
  if (!valid) {
#pragma unroll
    for (int i = 0; i < NV; ++i) st.v[i] = make_uint4(0, 0, 0, 0);
    st.s = 0.f;
    st.b = 0.f;
    return;
  }
  constexpr int bytes_per_tile = F == DFmt::BF16 ? 128 : F == DFmt::Q8 ? 64 : 32;
  const uint4* p = reinterpret_cast<const uint4*>(row + size_t(kt) * bytes_per_tile) + half * NV;
#pragma unroll
  for (int i = 0; i < NV; ++i) st.v[i] = __ldg(p + i);
  if constexpr (F != DFmt::BF16) {
    st.s = bf16_bits_to_f32(__ldg(srow + kt));
    st.b = bf16_bits_to_f32(__ldg(brow + kt));
  }
}

// Stores the staged W elements as bf16 (H = false) or fp16 (H = true) operands.
template <DFmt F, bool H>
__device__ __forceinline__ void b_store(const BStage<F>& st, uint16_t* dst) {
  uint4* d = reinterpret_cast<uint4*>(dst);
  auto pack = [](float lo, float hi) { return H ? pf::pack_f16(lo, hi) : pf::pack_bf16(lo, hi); };
  if constexpr (F == DFmt::BF16) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if constexpr (H) {  // bf16 -> fp16: exact for 2^-14 <= |w| <= 65504
        const uint32_t w[4] = {st.v[i].x, st.v[i].y, st.v[i].z, st.v[i].w};
        uint32_t o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) o[j] = pf::pack_f16(pf::bf16_lo(w[j]), pf::bf16_hi(w[j]));
        d[i] = make_uint4(o[0], o[1], o[2], o[3]);
      } else {
        d[i] = st.v[i];
      }
    }
  } else if constexpr (F == DFmt::Q4) {
    const uint32_t w[4] = {st.v[0].x, st.v[0].y, st.v[0].z, st.v[0].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // word i: elements 8i..8i+7, low nibble first
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float q0 = float((w[i] >> (8 * j)) & 15u), q1 = float((w[i] >> (8 * j + 4)) & 15u);
        o[j] = pack(q0, q1);  // exact
      }
      d[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  } else {  // Q8: word i: elements 4i..4i+3, low byte first
    const uint32_t w[8] = {st.v[0].x, st.v[0].y, st.v[0].z, st.v[0].w,
                           st.v[1].x, st.v[1].y, st.v[1].z, st.v[1].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint32_t x = w[2 * i + j];
        o[2 * j] = pack(float(x & 255u), float((x >> 8) & 255u));  // exact integers
        o[2 * j + 1] = pack(float((x >> 16) & 255u), float(x >> 24));
      }
      d[i] = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

// A operand modes: fp32 A as bf16 hi + lo (Split), bf16 A given (A16), fp32 A as fp16 (F16).
constexpr int kASplit = 0, kA16 = 1, kAF16 = 2;

template <int BM, DFmt F, bool SILU, int AM>
__global__ void __launch_bounds__(kThreads, 1) gemm_kernel(const PrefillGemmArgs p) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<GemmSmem<BM>*>(smem_raw);
  constexpr bool A16 = AM == kA16, H = AM == kAF16, SPLIT = AM == kASplit;
  constexpr int MT = BM / 32;        // m16 tiles per warp (a warp covers BM/2 rows)
  // A loads per thread per k-tile: float4 (fp32 A) or uint4 of 8 bf16 (A16).
  constexpr int AR = A16 ? BM * 8 / kThreads : BM * 16 / kThreads;
  constexpr int ASH = A16 ? 3 : 4;  // log2 of the loads per A row
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 2, wn = warp & 3;

  int64_t m0, m_end, grp;
  if (!tile_rows(p, BM, m0, m_end, grp)) return;
  const int64_t K = p.K;
  const int KT = int(K / BK);

  // A rows of this thread (byte pointers to its 16 bytes of k-tile 0).
  const uint8_t* arow[AR];
  const int ac = tid & ((1 << ASH) - 1);
#pragma unroll
  for (int i = 0; i < AR; ++i) {
    const int r = (tid >> ASH) + (kThreads >> ASH) * i;
    const int64_t m = m0 + r;
    if (m < m_end) {
      const int64_t ar = p.a_rows ? int64_t(p.a_rows[m] / p.a_div) : m;
      arow[i] = A16 ? reinterpret_cast<const uint8_t*>(p.A16 + ar * p.lda + 8 * ac)
                    : reinterpret_cast<const uint8_t*>(p.A + ar * p.lda + 4 * ac);
    } else {
      arow[i] = nullptr;
    }
  }
  // W row of this thread: shared row br, half bh (32 elements of each k-tile).
  const int br = tid >> 1, bh = tid & 1;
  const uint8_t* wrow;
  const uint16_t *srow = nullptr, *brow = nullptr;
  bool bvalid;
  {
    int64_t col;
    bool up = false;
    if constexpr (SILU) {
      const int within = br & 31;
      col = int64_t(blockIdx.x) * 64 + 16 * (br >> 5) + (within & 15);
      up = within >= 16;
    } else {
      col = int64_t(blockIdx.x) * BN + br;
    }
    bvalid = col < p.N;
    const int64_t wr = grp * p.N + (bvalid ? col : 0);
    const size_t rb = F == DFmt::BF16 ? size_t(K) * 2 : F == DFmt::Q8 ? size_t(K) : size_t(K) / 2;
    wrow = static_cast<const uint8_t*>(up ? p.W2.data : p.W.data) + size_t(wr) * rb;
    if constexpr (F != DFmt::BF16) {
      srow = (up ? p.W2.scales : p.W.scales) + wr * (K / 64);
      brow = (up ? p.W2.biases : p.W.biases) + wr * (K / 64);
    }
  }

  uint4 areg[AR];  // fp32 A: a float4's bits
  BStage<F> breg;
  constexpr size_t a_tile_bytes = A16 ? BK * 2 : BK * 4;
  // W streams from HBM (experts, large projections): ask L2 for the tile kPrefetch ahead, so the
  // register loads of the next tile wait on L2 rather than on DRAM.
  constexpr int kPrefetch = 3;
  constexpr int w_tile_bytes = F == DFmt::BF16 ? 128 : F == DFmt::Q8 ? 64 : 32;
  auto load_tile = [&](int kt) {
    if (bvalid && bh == 0 && kt + kPrefetch < KT)
      asm volatile("prefetch.global.L2 [%0];" ::"l"(wrow + size_t(kt + kPrefetch) * w_tile_bytes));
#pragma unroll
    for (int i = 0; i < AR; ++i)
      areg[i] = arow[i] ? __ldg(reinterpret_cast<const uint4*>(arow[i] + size_t(kt) * a_tile_bytes))
                        : make_uint4(0, 0, 0, 0);
    b_load<F>(breg, wrow, srow, brow, kt, bh, bvalid);
  };
  constexpr bool QW = F != DFmt::BF16;
  bool out_of_range = false;  // F16: an A element beyond the fp16 range was clamped
  auto store_tile = [&](int buf) {
#pragma unroll
    for (int i = 0; i < AR; ++i) {
      const int r = (tid >> ASH) + (kThreads >> ASH) * i;
      float part;
      if constexpr (A16) {
        *reinterpret_cast<uint4*>(&sm.a[buf][r][8 * ac]) = areg[i];
        if constexpr (QW) {
          const uint32_t w[4] = {areg[i].x, areg[i].y, areg[i].z, areg[i].w};
          part = 0.f;
#pragma unroll
          for (int j = 0; j < 4; ++j) part += pf::bf16_lo(w[j]) + pf::bf16_hi(w[j]);
        }
      } else if constexpr (H) {
        float x[4] = {__uint_as_float(areg[i].x), __uint_as_float(areg[i].y),
                      __uint_as_float(areg[i].z), __uint_as_float(areg[i].w)};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          if (fabsf(x[j]) > p.f16_limit) {  // false for NaN: NaN stays NaN
            x[j] = copysignf(p.f16_limit, x[j]);
            out_of_range = true;
          }
        *reinterpret_cast<uint2*>(&sm.a[buf][r][4 * ac]) =
            make_uint2(pf::pack_f16(x[0], x[1]), pf::pack_f16(x[2], x[3]));
        if constexpr (QW) part = (x[0] + x[1]) + (x[2] + x[3]);
      } else {
        const float x0 = __uint_as_float(areg[i].x), x1 = __uint_as_float(areg[i].y);
        const float x2 = __uint_as_float(areg[i].z), x3 = __uint_as_float(areg[i].w);
        const uint32_t h01 = pf::pack_bf16(x0, x1), h23 = pf::pack_bf16(x2, x3);
        const uint32_t l01 = pf::pack_bf16(x0 - pf::bf16_lo(h01), x1 - pf::bf16_hi(h01));
        const uint32_t l23 = pf::pack_bf16(x2 - pf::bf16_lo(h23), x3 - pf::bf16_hi(h23));
        *reinterpret_cast<uint2*>(&sm.a[buf][r][4 * ac]) = make_uint2(h01, h23);
        *reinterpret_cast<uint2*>(&sm.al[buf][r][4 * ac]) = make_uint2(l01, l23);
        if constexpr (QW) part = (x0 + x1) + (x2 + x3);
      }
      if constexpr (QW) {  // the row's sum over the k-tile: its 1 << ASH threads are adjacent lanes
#pragma unroll
        for (int o = 1; o < (1 << ASH); o <<= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
        if (ac == 0) sm.asum[buf][r] = part;
      }
    }
    b_store<F, H>(breg, &sm.b[buf][br][32 * bh]);
    if constexpr (QW) {
      if (bh == 0) {
        sm.ws[buf][br] = breg.s;
        sm.wb[buf][br] = breg.b;
      }
    }
  };

  float acc[MT][4][4];
#pragma unroll
  for (int i = 0; i < MT; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  load_tile(0);
  store_tile(0);
  __syncthreads();
  for (int kt = 0; kt < KT; ++kt) {
    const int buf = kt & 1;
    if (kt + 1 < KT) load_tile(kt + 1);
    // Q4/Q8: this k-tile's integer products apart (folded in with the scale and bias below);
    // bf16 weights accumulate straight into acc (tq unused, eliminated).
    float tq[MT][4][4];
    if constexpr (QW) {
#pragma unroll
      for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) tq[i][j][e] = 0.f;
    }
    float(&dst)[MT][4][4] = QW ? tq : acc;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ++ks) {
      uint32_t af[MT][4], afl[SPLIT ? MT : 1][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int ar = wm * (BM / 2) + mt * 16 + (lane & 15), acol = ks * 16 + (lane >> 4) * 8;
        pf::ldsm_x4(af[mt], &sm.a[buf][ar][acol]);
        if constexpr (SPLIT) pf::ldsm_x4(afl[mt], &sm.al[buf][ar][acol]);
      }
      uint32_t bfr[4][2];
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t r[4];
        pf::ldsm_x4(r, &sm.b[buf][wn * 32 + np * 16 + (lane & 7) + (lane >> 4) * 8]
                             [ks * 16 + ((lane >> 3) & 1) * 8]);
        bfr[2 * np][0] = r[0];
        bfr[2 * np][1] = r[1];
        bfr[2 * np + 1][0] = r[2];
        bfr[2 * np + 1][1] = r[3];
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt) {
          if constexpr (H) pf::mma_f16(dst[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
          else pf::mma_bf16(dst[mt][nt], af[mt], bfr[nt][0], bfr[nt][1]);
          if constexpr (SPLIT) pf::mma_bf16(dst[mt][nt], afl[mt], bfr[nt][0], bfr[nt][1]);
        }
    }
    if constexpr (QW) {  // acc += s * (q . A) + b * sum(A), per W row (column) and A row
      float cs[4][2], cb[4][2], rs[MT][2];
#pragma unroll
      for (int nt = 0; nt < 4; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int n = wn * 32 + nt * 8 + 2 * (lane & 3) + e;
          cs[nt][e] = sm.ws[buf][n];
          cb[nt][e] = sm.wb[buf][n];
        }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) rs[mt][hh] = sm.asum[buf][wm * (BM / 2) + mt * 16 + (lane >> 2) + 8 * hh];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e)
            acc[mt][nt][e] = fmaf(cs[nt][e & 1], tq[mt][nt][e], fmaf(cb[nt][e & 1], rs[mt][e >> 1], acc[mt][nt][e]));
    }
    if (kt + 1 < KT) store_tile(buf ^ 1);
    __syncthreads();
  }

  if constexpr (H) {  // one flag write per block (every thread reaches this barrier)
    if (__syncthreads_or(out_of_range) && tid == 0) atomicOr(p.range_flag, 1u);
  }

  // Epilogue.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
      const int64_t m = m0 + wm * (BM / 2) + mt * 16 + (lane >> 2) + 8 * hh;
      if (m >= m_end) continue;
      constexpr int NTO = SILU ? 2 : 4;
#pragma unroll
      for (int nt = 0; nt < NTO; ++nt) {
        if constexpr (SILU) {
          const int64_t col = int64_t(blockIdx.x) * 64 + wn * 16 + nt * 8 + 2 * (lane & 3);
          store_pair(p, m, col, silu_f(acc[mt][nt][2 * hh]) * acc[mt][nt + 2][2 * hh],
                     silu_f(acc[mt][nt][2 * hh + 1]) * acc[mt][nt + 2][2 * hh + 1]);
        } else {
          const int64_t col = int64_t(blockIdx.x) * BN + wn * 32 + nt * 8 + 2 * (lane & 3);
          store_pair(p, m, col, acc[mt][nt][2 * hh], acc[mt][nt][2 * hh + 1]);
        }
      }
    }
}

// The instantiated (tile, format, A mode) combinations: 128-row tiles of Q4/Q8 weights only with
// the F16 route (the Split route's second A plane and the fold's accumulators exceed the registers).
template <int BM, DFmt F, int AM>
constexpr bool kGemmVariant = BM == 64 || F == DFmt::BF16 || AM == kAF16;

int a_mode(const PrefillGemmArgs& a) {
  return a.A16 ? kA16 : a.aprec == PrefillAPrec::F16 ? kAF16 : kASplit;
}

template <int BM, DFmt F, bool SILU, int AM>
void launch_am(const PrefillGemmArgs& a, cudaStream_t s) {
  if constexpr (kGemmVariant<BM, F, AM>) {
    const unsigned gx = unsigned(SILU ? (a.N + 63) / 64 : (a.N + BN - 1) / BN);
    const unsigned gy = unsigned(a.groups > 0 ? a.max_tiles : (a.M + BM - 1) / BM);
    gemm_kernel<BM, F, SILU, AM><<<dim3(gx, gy), kThreads, sizeof(GemmSmem<BM>), s>>>(a);
    KCUDA_LAUNCH("prefill_gemm");
  } else {
    std::fprintf(stderr, "prefill_gemm: %d-row tiles of a quantised W need the F16 route\n", BM);
    std::abort();  // unreachable: prefill_gemm_launch picks the tile from the same rule
  }
}

template <int BM, DFmt F, bool SILU>
void launch_one(const PrefillGemmArgs& a, cudaStream_t s) {
  switch (a_mode(a)) {
    case kA16: launch_am<BM, F, SILU, kA16>(a, s); break;
    case kAF16: launch_am<BM, F, SILU, kAF16>(a, s); break;
    default: launch_am<BM, F, SILU, kASplit>(a, s); break;
  }
}

template <int BM, DFmt F, int AM>
void set_attrs_am() {
  if constexpr (kGemmVariant<BM, F, AM>) {
    const int sb = int(sizeof(GemmSmem<BM>));
    const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    KCUDA(cudaFuncSetAttribute(gemm_kernel<BM, F, false, AM>, attr, sb));
    KCUDA(cudaFuncSetAttribute(gemm_kernel<BM, F, true, AM>, attr, sb));
  }
}
template <int BM, DFmt F>
void set_attrs() {
  set_attrs_am<BM, F, kASplit>();
  set_attrs_am<BM, F, kA16>();
  set_attrs_am<BM, F, kAF16>();
}

std::once_flag g_gemm_once;

template <int BM>
void dispatch_bm(const PrefillGemmArgs& a, cudaStream_t s) {
  const bool silu = a.epi == GemmEpi::SiluMul;
  switch (a.W.fmt) {
    case DFmt::BF16:
      silu ? launch_one<BM, DFmt::BF16, true>(a, s) : launch_one<BM, DFmt::BF16, false>(a, s);
      break;
    case DFmt::Q4:
      silu ? launch_one<BM, DFmt::Q4, true>(a, s) : launch_one<BM, DFmt::Q4, false>(a, s);
      break;
    case DFmt::Q8:
      silu ? launch_one<BM, DFmt::Q8, true>(a, s) : launch_one<BM, DFmt::Q8, false>(a, s);
      break;
  }
}

// ---------------------------------------------------------------------------------------------
// Routing: one warp per token; the token's E logits in shared memory.
constexpr int kRouteWarps = 8;
constexpr int kRouteMaxE = 1024;

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, o);
    const int oi = __shfl_xor_sync(0xffffffffu, i, o);
    if (ov > v || (ov == v && oi < i)) {
      v = ov;
      i = oi;
    }
  }
}

__global__ void __launch_bounds__(kRouteWarps * 32) route_topk_kernel(const MoeRouteArgs a) {
  __shared__ float sp[kRouteWarps][kRouteMaxE];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = int64_t(blockIdx.x) * kRouteWarps + warp;
  if (t >= a.T) return;
  const int E = a.E;
  float* p = sp[warp];
  const float* l = a.logits + t * E;
  float mx = -INFINITY;
  for (int e = lane; e < E; e += 32) {
    const float v = l[e];
    p[e] = v;
    mx = fmaxf(mx, v);
  }
  mx = warp_max(mx);
  float sum = 0.f;
  for (int e = lane; e < E; e += 32) {
    const float v = expf(p[e] - mx);
    p[e] = v;
    sum += v;
  }
  sum = warp_sum(sum);
  const float inv = 1.f / sum;
  for (int e = lane; e < E; e += 32) p[e] *= inv;
  __syncwarp();
  int sel[16];
  float selw[16];
  float top = 0.f;
  for (int k = 0; k < a.topk; ++k) {
    float bv = -1.f;
    int bi = 0x7fffffff;
    for (int e = lane; e < E; e += 32) {
      const float v = p[e];
      if (v > bv) {  // strided ascending scan: the first of equal values is the lowest index
        bv = v;
        bi = e;
      }
    }
    warp_argmax(bv, bi);
    sel[k < 16 ? k : 15] = bi;
    selw[k < 16 ? k : 15] = bv;
    top += bv;
    __syncwarp();
    if (lane == (bi & 31)) p[bi] = -2.f;  // taken
    __syncwarp();
  }
  if (lane == 0) {
    // Ascending expert order (insertion sort of <= 16 entries).
    for (int i = 1; i < a.topk; ++i) {
      const int e = sel[i];
      const float w = selw[i];
      int j = i - 1;
      while (j >= 0 && sel[j] > e) {
        sel[j + 1] = sel[j];
        selw[j + 1] = selw[j];
        --j;
      }
      sel[j + 1] = e;
      selw[j + 1] = w;
    }
    for (int i = 0; i < a.topk; ++i) {
      a.topk_idx[t * a.topk + i] = sel[i];
      a.topk_w[t * a.topk + i] = selw[i] / top;
    }
  }
}

// One block per expert: count (pass 0) or scatter in ascending slot order (pass 1).
constexpr int kSortThreads = 1024;
__global__ void __launch_bounds__(kSortThreads) route_sort_kernel(const MoeRouteArgs a, int pass) {
  __shared__ int wsum[32];
  __shared__ int base;
  const int e = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t n = a.T * a.topk;
  if (threadIdx.x == 0) base = pass ? a.group_off[e] : 0;
  __syncthreads();
  for (int64_t s0 = 0; s0 < n; s0 += kSortThreads) {
    const int64_t s = s0 + threadIdx.x;
    const bool hit = s < n && a.topk_idx[s] == e;
    const unsigned bal = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) wsum[warp] = __popc(bal);
    __syncthreads();
    if (warp == 0) {  // exclusive scan of the 32 warp counts
      const int v = wsum[lane];
      int incl = v;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += u;
      }
      wsum[lane] = incl - v;
    }
    __syncthreads();
    const int pos = base + wsum[warp] + __popc(bal & ((1u << lane) - 1u));
    if (hit && pass) a.sorted[pos] = int(s);
    __syncthreads();
    if (threadIdx.x == kSortThreads - 1) base = pos + (hit ? 1 : 0);
    __syncthreads();
  }
  if (threadIdx.x == 0 && !pass) a.counts[e] = base;
}

// Exclusive prefix of counts and of their tiles (one block).
// With tail_rows: a remainder c % bm of 1 .. tail_rows rows is a tail tile (tail_off), not a tile.
__global__ void route_scan_kernel(const MoeRouteArgs a) {
  if (threadIdx.x != 0) return;
  int off = 0, toff = 0, tail = 0;
  for (int e = 0; e < a.E; ++e) {
    a.group_off[e] = off;
    a.tile_off[e] = toff;
    if (a.tail_off) a.tail_off[e] = tail;
    const int c = a.counts[e], rem = c % a.bm;
    const bool is_tail = rem > 0 && rem <= a.tail_rows;
    off += c;
    toff += c / a.bm + (rem > 0 && !is_tail ? 1 : 0);
    tail += is_tail ? 1 : 0;
  }
  a.group_off[a.E] = off;
  a.tile_off[a.E] = toff;
  if (a.tail_off) a.tail_off[a.E] = tail;
}

__global__ void combine_kernel(const MoeCombineArgs a) {
  const int64_t h4 = a.hidden / 4;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.T * h4) return;
  const int64_t t = i / h4, c = (i % h4) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int r = 0; r < a.topk; ++r) {
    const float4 v = *reinterpret_cast<const float4*>(a.slot_out + (t * a.topk + r) * a.hidden + c);
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  if (a.shared) {
    const float g = a.sgate ? sigmoid_f(a.sgate[t]) : 1.f;
    const float4 v = *reinterpret_cast<const float4*>(a.shared + t * a.hidden + c);
    acc.x += g * v.x;
    acc.y += g * v.y;
    acc.z += g * v.z;
    acc.w += g * v.w;
  }
  float4* o = reinterpret_cast<float4*>(a.out + t * a.hidden + c);
  if (a.accumulate) {
    const float4 v = *o;
    acc.x += v.x;
    acc.y += v.y;
    acc.z += v.z;
    acc.w += v.w;
  }
  *o = acc;
}

__global__ void to_bf16_kernel(const float* x, int64_t rows, int64_t cols, int64_t ldx, uint16_t* out,
                               int64_t ldo) {
  const int64_t c8 = cols / 8;
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= rows * c8) return;
  const int64_t r = i / c8, c = (i % c8) * 8;
  const float4 a = *reinterpret_cast<const float4*>(x + r * ldx + c);
  const float4 b = *reinterpret_cast<const float4*>(x + r * ldx + c + 4);
  *reinterpret_cast<uint4*>(out + r * ldo + c) =
      make_uint4(pf::pack_bf16(a.x, a.y), pf::pack_bf16(a.z, a.w), pf::pack_bf16(b.x, b.y),
                 pf::pack_bf16(b.z, b.w));
}

}  // namespace

void prefill_to_bf16_launch(const float* x, int64_t rows, int64_t cols, int64_t ldx, uint16_t* out,
                            int64_t ldo, cudaStream_t s) {
  const int64_t n = rows * (cols / 8);
  to_bf16_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(x, rows, cols, ldx, out, ldo);
  KCUDA_LAUNCH("prefill_to_bf16");
}

void prefill_gemm_init() {
  std::call_once(g_gemm_once, [] {
    set_attrs<64, DFmt::BF16>();
    set_attrs<64, DFmt::Q4>();
    set_attrs<64, DFmt::Q8>();
    set_attrs<128, DFmt::BF16>();
    set_attrs<128, DFmt::Q4>();
    set_attrs<128, DFmt::Q8>();
  });
}

void prefill_gemm_launch(const PrefillGemmArgs& a, cudaStream_t s) {
  prefill_gemm_init();
  if (a.groups > 0) {
    if (a.group_bm == 128) dispatch_bm<128>(a, s);
    else dispatch_bm<64>(a, s);
    return;
  }
  // Dense: 128-row tiles when they still fill the machine, else 64.
  const int64_t ncols = a.epi == GemmEpi::SiluMul ? (a.N + 63) / 64 : (a.N + BN - 1) / BN;
  // Q4/Q8 keep a second accumulator set per k-tile: 128-row tiles only on the F16 route (registers).
  const bool tile128 = a.W.fmt == DFmt::BF16 || a_mode(a) == kAF16;
  const bool big = tile128 && a.M > 64 && ncols * ((a.M + 127) / 128) >= num_sms();
  if (big) dispatch_bm<128>(a, s);
  else dispatch_bm<64>(a, s);
}

void moe_route_launch(const MoeRouteArgs& a, cudaStream_t s) {
  route_topk_kernel<<<unsigned((a.T + kRouteWarps - 1) / kRouteWarps), kRouteWarps * 32, 0, s>>>(a);
  KCUDA_LAUNCH("moe_route topk");
  route_sort_kernel<<<unsigned(a.E), kSortThreads, 0, s>>>(a, 0);
  KCUDA_LAUNCH("moe_route count");
  route_scan_kernel<<<1, 32, 0, s>>>(a);
  KCUDA_LAUNCH("moe_route scan");
  route_sort_kernel<<<unsigned(a.E), kSortThreads, 0, s>>>(a, 1);
  KCUDA_LAUNCH("moe_route scatter");
}

void moe_combine_launch(const MoeCombineArgs& a, cudaStream_t s) {
  const int64_t n = a.T * (a.hidden / 4);
  combine_kernel<<<unsigned((n + 255) / 256), 256, 0, s>>>(a);
  KCUDA_LAUNCH("moe_combine");
}

namespace {

// Splits a [rows, K] (lda) into b for the Pipe kernel (b.elems >= rows * K, checked by moe_prefill).
// hi_only: the hi plane alone (every GEMM on it runs on the Dq kernel).
PipeA split_into(const MoePrefillScratch::PipeBuf& b, const float* a, int64_t rows, int64_t K,
                 int64_t lda, bool hi_only, cudaStream_t s) {
  PipeSplitArgs sp;
  sp.A = a;
  sp.rows = rows;
  sp.K = K;
  sp.lda = lda;
  sp.hi = b.hi;
  sp.lo = hi_only ? nullptr : b.lo;
  sp.sum = hi_only ? nullptr : b.sum;
  prefill_pipe_split_launch(sp, s);
  return PipeA{sp.hi, sp.lo, sp.sum, rows, K};
}

// The block's GEMM of fp32 A (rows of lda, or the split pa when the Pipe kernel takes W).
void block_gemm(PrefillGemmArgs g, const MoePrefillScratch& sc, const float* a, int64_t lda,
                const PipeA* pa, cudaStream_t s) {
  g.aprec = sc.aprec;
  g.range_flag = sc.range_flag;
  g.f16_limit = sc.f16_limit;
  if (pa != nullptr && prefill_pipe_supports(g.W.fmt, g.K)) {
    g.pipe = *pa;
    prefill_pipe_gemm_launch(g, s);
  } else {
    g.A = a;
    g.lda = lda;
    prefill_gemm_launch(g, s);
  }
}

}  // namespace

void moe_prefill_launch(const MoePrefillWeights& w, const float* h, int64_t T,
                        const MoePrefillScratch& sc, float* out, bool accumulate, cudaStream_t s) {
  const int64_t slots = T * w.topk;
  const bool pipe = sc.kernel == PrefillGemmKernel::Pipe;
  // Pipe: the routed experts there only if gate|up and down both qualify (they share the tiles).
  const bool pipe_routed = pipe && prefill_pipe_supports(w.gate.fmt, w.hidden) &&
                           prefill_pipe_supports(w.down.fmt, w.I);
  PipeA ph;
  const bool dq = pipe && prefill_pipe_q4_mma() == PipeMma::Dq;
  if (pipe) ph = split_into(sc.pipe[0], h, T, w.hidden, w.hidden, dq, s);
  const PipeA* phv = pipe ? &ph : nullptr;
  // Router logits (unless the caller computed them).
  if (!sc.router_logits_given) {
    PrefillGemmArgs g;
    g.M = T;
    g.N = w.E;
    g.K = w.hidden;
    g.W = w.router;
    g.C = sc.logits;
    g.ldc = w.E;
    // Dq: on the Reg kernel's Split route (the experts chosen must not depend on the GEMM's route)
    block_gemm(g, sc, h, w.hidden, dq ? nullptr : phv, s);
  }
  MoeRouteArgs r;
  r.logits = sc.logits;
  r.T = T;
  r.E = w.E;
  r.topk = w.topk;
  r.topk_idx = sc.topk_idx;
  r.topk_w = sc.topk_w;
  r.counts = sc.counts;
  r.group_off = sc.group_off;
  r.tile_off = sc.tile_off;
  r.sorted = sc.sorted;
  const int bm = pipe_routed ? kPipeBM
                 : sc.moe_bm != 0 ? sc.moe_bm
                 : sc.aprec == PrefillAPrec::F16 ? 128
                                                 : kPrefillBM;
  r.bm = bm;
  // The Rs kernel's tail tiles: both expert GEMMs Q4 on it (they share the tiles).
  const bool tails = sc.tail_off && pipe_routed && w.gate.fmt == DFmt::Q4 && w.down.fmt == DFmt::Q4 &&
                     prefill_pipe_q4_mma() == PipeMma::Rs && prefill_pipe_rs_tail();
  r.tail_off = sc.tail_off;
  r.tail_rows = tails ? kPipeTailRows : 0;
  moe_route_launch(r, s);
  // Routed experts: act[p] = silu(gate_e h_t) * (up_e h_t) for sorted position p (slot t*k+r).
  const int max_tiles = moe_max_tiles(T, w.topk, w.E, bm);
  PrefillGemmArgs gu;
  gu.M = slots;
  gu.N = w.I;
  gu.K = w.hidden;
  gu.a_rows = sc.sorted;
  gu.a_div = w.topk;
  gu.W = w.gate;
  gu.W2 = w.up;
  gu.epi = GemmEpi::SiluMul;
  gu.C = sc.act;
  gu.ldc = w.I;
  gu.groups = w.E;
  gu.group_off = sc.group_off;
  gu.tile_off = sc.tile_off;
  gu.max_tiles = max_tiles;
  gu.group_bm = bm;
  gu.tail_off = tails ? sc.tail_off : nullptr;
  block_gemm(gu, sc, h, w.hidden, pipe_routed ? phv : nullptr, s);
  // Shared expert gate|up and its gate logit (they read h, whose split pipe[0] holds until the
  // shared expert's own activation replaces it below).
  const bool has_shared = w.shared_down.valid();
  if (has_shared) {
    PrefillGemmArgs sg;
    sg.M = T;
    sg.N = w.Is;
    sg.K = w.hidden;
    sg.W = w.shared_gate;
    sg.W2 = w.shared_up;
    sg.epi = GemmEpi::SiluMul;
    sg.C = sc.sact;
    sg.ldc = w.Is;
    block_gemm(sg, sc, h, w.hidden, phv, s);
    if (w.shared_expert_gate.valid()) {
      PrefillGemmArgs sgt;
      sgt.M = T;
      sgt.N = 1;
      sgt.K = w.hidden;
      sgt.W = w.shared_expert_gate;
      sgt.C = sc.sgate;
      sgt.ldc = 1;
      block_gemm(sgt, sc, h, w.hidden, phv, s);
    }
  }
  // slot_out[slot] = w_slot * down_e act[p].
  PipeA pact;
  if (pipe_routed) pact = split_into(sc.pipe[1], sc.act, slots, w.I, w.I, dq, s);
  PrefillGemmArgs dn;
  dn.M = slots;
  dn.N = w.hidden;
  dn.K = w.I;
  dn.W = w.down;
  dn.C = sc.slot_out;
  dn.ldc = w.hidden;
  dn.c_rows = sc.sorted;
  dn.row_scale = sc.topk_w;
  dn.groups = w.E;
  dn.group_off = sc.group_off;
  dn.tile_off = sc.tile_off;
  dn.max_tiles = max_tiles;
  dn.group_bm = bm;
  dn.tail_off = tails ? sc.tail_off : nullptr;
  block_gemm(dn, sc, sc.act, w.I, pipe_routed ? &pact : nullptr, s);
  if (has_shared) {
    PipeA psact;
    const bool pipe_sd = pipe && prefill_pipe_supports(w.shared_down.fmt, w.Is);
    if (pipe_sd) psact = split_into(sc.pipe[0], sc.sact, T, w.Is, w.Is, dq, s);
    PrefillGemmArgs sd;
    sd.M = T;
    sd.N = w.hidden;
    sd.K = w.Is;
    sd.W = w.shared_down;
    sd.C = sc.shared;
    sd.ldc = w.hidden;
    block_gemm(sd, sc, sc.sact, w.Is, pipe_sd ? &psact : nullptr, s);
  }
  MoeCombineArgs c;
  c.T = T;
  c.hidden = w.hidden;
  c.topk = w.topk;
  c.slot_out = sc.slot_out;
  c.shared = has_shared ? sc.shared : nullptr;
  c.sgate = has_shared && w.shared_expert_gate.valid() ? sc.sgate : nullptr;
  c.out = out;
  c.accumulate = accumulate;
  moe_combine_launch(c, s);
}

}  // namespace kestrel::cuda
