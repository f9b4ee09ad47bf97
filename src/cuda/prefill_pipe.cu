// Pipelined prefill GEMM (the Pipe kernel of PrefillGemmKernel; prefill.h): the Split route's
// numbers (fp32 A as bf16 hi + lo, Q4 weights as exact integers folded in per affine group) with
// every operand staged by cp.async into a 4-stage shared-memory ring, so the loads of three
// k-tiles are in flight while the tensor cores work on the fourth, and with A split once per
// activation (prefill_pipe_split) instead of once per column block.
//
// Why (bench/PREFILL_NOTES.md, v4): the register-staged kernel of prefill_gemm.cu is bound by its
// staging (global -> registers -> convert -> shared, one tile ahead), not by its MMAs; it also
// converts each A tile once per column block (64 times for an 8192-wide projection).
//
// Layout. A is split by prefill_pipe_split into two bf16 planes [rows, K] whose k order is
// permuted within each 32 (below) plus the fp32 sums of A over each 64-group. W is copied raw:
// Q4 codes (16 bytes = 32 k of one row) or bf16. A Q4 row's 16 bytes give each thread of a quad
// one 32-bit word of 8 codes (ldmatrix), k = 8t .. 8t+7 for thread t; the word becomes four
// bf16x2 registers R_j = (code j, code j+4) by mask, or and one bf16x2 subtract (128 + q - 128,
// exact), and R_{2s}, R_{2s+1} are the B fragment (b0, b1) of the k16-slice s of those 32 k. The
// MMA pairs B position k' of slice s with A position k', so A is stored with
//   A_perm[32c + 16s + k'] = A[32c + 8t + 2s + (k' >= 8) + 4e],  t = (k' & 7) >> 1, e = k' & 1,
// and a bf16 W row is read as 16 bytes per thread and permuted the same way with two byte
// permutes per register pair. The reduction over k does not care about its order.
//
// Tiles: 128 x 128 x 64, 8 warps as 4 (rows) x 2 (columns), warp tile 32 x 64 (A fragments
// reused over 8 column tiles: the split A is twice the bytes of W's bf16). Q4 keeps the k-tile's
// integer products apart and folds them in as acc += s P per W row and k-tile; the biases' share,
// sum_g b[n, g] sum(A)[m, g], is a small MMA GEMM over the K / 64 groups before the main loop
// (sums split hi + lo). Each thread converts the 16 Q4 bytes it copied into exact bf16 integers in
// the B fragments' order once per block (one tile ahead, into a double buffer), so the warps read
// B with ldmatrix instead of each converting its 64 columns (4 warps share a column half). The
// scales come in chunks of 8 k-tiles (16 bytes per row), so K % 512 == 0.
#include "cuda/common.cuh"
#include "cuda/prefill.h"
#include "cuda/prefill_mma.h"
#include "cuda/prefill_tile.cuh"
#include "cuda/tma.cuh"
#include "cuda/wgmma.cuh"

#include <algorithm>
#include <mutex>
#include <type_traits>
#include <utility>

namespace kestrel::cuda {
namespace {

constexpr int BM = 128, BN = 128, BK = 64, kStages = 4, kThreads = 256;
constexpr int kChunkTiles = 8;  // k-tiles per chunk of Q4 scales

// Shared memory (bytes): per stage A hi, A lo (128 rows x 128 B) and W (128 rows x 32 B Q4 or
// 128 B bf16); then, Q4 only, two buffers of converted W tiles (bf16 [BN][64], the MMA's order,
// swizzled as A) and two chunk buffers of scales (bf16 [BN][8]).
template <DFmt F>
struct PipeLayout {
  static constexpr int kWRow = F == DFmt::Q4 ? 32 : 128;
  static constexpr int kA = BM * 128, kW = BN * kWRow;
  static constexpr int kStage = 2 * kA + kW;
  static constexpr int kB16 = kStages * kStage;        // [2][BN][128 B]
  static constexpr int kScales = kB16 + 2 * BN * 128;  // [2][BN][8] bf16
  static constexpr int kBytes = F == DFmt::Q4 ? kScales + 2 * BN * 16 : kStages * kStage;
};

// Byte offset of 16-byte chunk c of row r (XOR swizzles: conflict-free ldmatrix / 16-byte reads).
__device__ __forceinline__ int a_off(int r, int c) { return wg::sw128_off(r, c); }
__device__ __forceinline__ int wq_off(int r, int c) { return r * 32 + ((c ^ ((r >> 2) & 1)) << 4); }
__device__ __forceinline__ int wb_off(int r, int c) {
  return r * 128 + ((c ^ (((r & 1) << 2) | ((r >> 1) & 3))) << 4);
}

// R_j of a word of 8 Q4 codes: (code j, code j + 4) as exact bf16 integers.
__device__ __forceinline__ uint32_t q4_pair(uint32_t w, int j) {
  const uint32_t x = ((w >> (4 * j)) & 0x000f000fu) | 0x43004300u;  // bf16 128 + q
  uint32_t r;
  asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(r) : "r"(x), "r"(0x43004300u));
  return r;
}

// Row of the split A for tile row r of a tile starting at row m0 (gathered for the experts);
// ok = false (and row 0) past the group's last row m_end.
__device__ __forceinline__ int64_t pipe_a_row(const PrefillGemmArgs& p, int64_t m0, int64_t m_end, int r,
                                              bool& ok) {
  const int64_t m = m0 + r;
  ok = m < m_end;
  if (!ok) return 0;
  return p.a_rows ? int64_t(p.a_rows[m] / p.a_div) : m;
}

// A weight row: W, or W2 (the up of SiLU), its row in group grp's [N] rows, and whether output
// column col exists.
struct PipeWRow {
  const DMat* m;
  int64_t row;
  bool ok;
};
__device__ __forceinline__ PipeWRow pipe_w_row(const PrefillGemmArgs& p, int64_t grp, int64_t col, bool up) {
  const bool ok = col < p.N;
  return {up ? &p.W2 : &p.W, grp * p.N + (ok ? col : 0), ok};
}

// This thread's copies of the split A's k-tiles into a stage (hi at the stage's start, lo BM * 128
// bytes on): tile rows (tid >> 3) + 32 i for i < NR (a tile of 32 NR rows), 16-byte chunk tid & 7,
// zeros past the group's rows.
template <int NR>
struct PipeACopies {
  const uint8_t* hi;
  const uint8_t* lo;
  int64_t src[NR];
  bool ok[NR];
  uint32_t soff;  // the shared-memory offset of row tid >> 3's chunk (row + 32 i: + 4096 i)
  __device__ PipeACopies(const PrefillGemmArgs& p, int64_t m0, int64_t m_end, int tid)
      : hi(reinterpret_cast<const uint8_t*>(p.pipe.hi)),
        lo(reinterpret_cast<const uint8_t*>(p.pipe.lo)),
        soff(uint32_t(a_off(tid >> 3, tid & 7))) {
#pragma unroll
    for (int i = 0; i < NR; ++i) src[i] = pipe_a_row(p, m0, m_end, (tid >> 3) + 32 * i, ok[i]) * p.K + 8 * (tid & 7);
  }
  __device__ __forceinline__ void load(uint32_t stage, int kt) const {
    // (members read into registers first: each cp.async's "memory" clobber would reload them)
    const uint8_t *h = hi, *l = lo;
    const uint32_t st = stage + soff;
    int64_t sr[NR];
    bool k[NR];
#pragma unroll
    for (int i = 0; i < NR; ++i) sr[i] = src[i], k[i] = ok[i];
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const size_t off = size_t(sr[i] + int64_t(kt) * BK) * 2;
      pf::cp_async16(st + uint32_t(4096 * i), h + off, k[i]);
      pf::cp_async16(st + uint32_t(BM * 128 + 4096 * i), l + off, k[i]);
    }
  }
};
// The biases' share of the Q4 fold, sum_g b[n, g] sum(A)[m, g], as a small MMA GEMM over the
// K / 64 groups (padded to 16), run while a kernel's first tiles load: the sums split hi + lo like
// A, the bf16 biases exact, so the products are those of the per-tile fold up to accumulation
// order. acc[i][nt] is the m16n8 fragment of rows rbase(i) + g (+ 8) and columns 64 half(i) + 8 nt
// + 2 t (+ 1); a_row(r, ok) and w_row(r) map tile rows to the split A's rows and to weight rows.
template <class RBase, class Half, class ARow, class WRowOf>
__device__ __forceinline__ void pipe_bias_share(const PrefillGemmArgs& p, float (&acc)[2][8][4], int64_t KG, int g,
                                                int t, RBase rbase, Half half, ARow a_row, WRowOf w_row) {
  const float* sum = p.pipe.sum;
  for (int k0 = 0; k0 < KG; k0 += 16) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      uint32_t sh[4], sl[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t kk = k0 + 2 * t + 8 * (q >> 1);
        bool ok;
        const int64_t srow = a_row(rbase(i) + g + 8 * (q & 1), ok) * KG;
        float2 v = make_float2(0.f, 0.f);
        if (ok && kk < KG) v = *reinterpret_cast<const float2*>(sum + srow + kk);
        sh[q] = pf::pack_bf16(v.x, v.y);
        sl[q] = pf::pack_bf16(v.x - pf::bf16_lo(sh[q]), v.y - pf::bf16_hi(sh[q]));
      }
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const PipeWRow w = w_row(64 * half(i) + 8 * nt + g);
        const uint16_t* brow = w.m->biases + w.row * KG;
        const int64_t kk = k0 + 2 * t;
        const uint32_t b0 = w.ok && kk < KG ? *reinterpret_cast<const uint32_t*>(brow + kk) : 0u;
        const uint32_t b1 = w.ok && kk + 8 < KG ? *reinterpret_cast<const uint32_t*>(brow + kk + 8) : 0u;
        pf::mma_bf16(acc[i][nt], sh, b0, b1);
        pf::mma_bf16(acc[i][nt], sl, b0, b1);
      }
    }
  }
}

// WG = false: mma.sync, 8 warps as 4 (rows) x 2 (columns) of 32 x 64; WG = true (Q4 only): wgmma,
// 2 warpgroups of 64 rows x 128 columns. acc[i][nt][4] is, per thread, the m16n8 fragment of
// rows RB(i) + g + 8 h and columns 64 half(i) + 8 nt + 2 t + e (SiLU: 32 half(i) + ... of the
// gate, nt < 4, and the up, nt + 4, of the same outputs), with
//   mma.sync: RB(i) = 32 wm + 16 i, half(i) = wn;   wgmma: RB(i) = 64 wg + 16 (warp % 4), half(i) = i.
template <DFmt F, bool SILU, bool WG>
__global__ void __launch_bounds__(kThreads, 1) pipe_gemm_kernel(const PrefillGemmArgs p) {
  using L = PipeLayout<F>;
  constexpr bool QW = F == DFmt::Q4;
  static_assert(QW || !WG, "the wgmma kernel takes Q4 weights");
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // wgmma's swizzled tiles need 1024-byte aligned bases (the launch adds the slack).
  uint8_t* smem = smem_raw + ((1024 - (pf::smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t sbase = pf::smem_u32(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wm = warp >> 1, wn = warp & 1, wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  auto rbase = [&](int i) { return WG ? 64 * wg + 16 * (warp & 3) : 32 * wm + 16 * i; };
  auto half = [&](int i) { return WG ? i : wn; };

  int64_t m0, m_end, grp;
  if (!tile_rows(p, BM, m0, m_end, grp)) return;
  const int64_t K = p.K, KG = K / 64;
  const int KT = int(KG);
  auto a_row = [&](int r, bool& ok) { return pipe_a_row(p, m0, m_end, r, ok); };
  using WRow = PipeWRow;
  auto w_row = [&](int r) -> WRow {  // weight row of shared W row r
    int64_t col;
    bool up = false;
    if constexpr (SILU) {  // column half r >> 6: rows +0 .. +31 gate, +32 .. +63 up of 32 outputs
      const int within = r & 63;
      col = int64_t(blockIdx.x) * 64 + 32 * (r >> 6) + (within & 31);
      up = within >= 32;
    } else {
      col = int64_t(blockIdx.x) * BN + r;
    }
    return pipe_w_row(p, grp, col, up);
  };

  // This thread's copies of each k-tile: A as PipeACopies; W: Q4 row tid >> 1 chunk tid & 1,
  // bf16 rows (tid >> 3) + 32 i chunk tid & 7.
  const PipeACopies<4> acp(p, m0, m_end, tid);
  constexpr int WN = QW ? 1 : 4;
  const uint8_t* w_src[WN];
  bool w_ok[WN];
#pragma unroll
  for (int i = 0; i < WN; ++i) {
    const int r = QW ? tid >> 1 : (tid >> 3) + 32 * i;
    const int c = QW ? tid & 1 : tid & 7;
    const WRow w = w_row(r);
    w_ok[i] = w.ok;
    w_src[i] = static_cast<const uint8_t*>(w.m->data) + w.row * (QW ? K / 2 : K * 2) + 16 * c;
  }
  // Q4 scale chunks: threads tid < 128 copy row tid's.
  const uint16_t* sc_src = nullptr;
  bool sc_ok = false;
  if constexpr (QW) {
    if (tid < BN) {
      const WRow w = w_row(tid);
      sc_ok = w.ok;
      sc_src = w.m->scales + w.row * KG;
    }
  }
  auto load_a = [&](int kt) { acp.load(sbase + uint32_t((kt % kStages) * L::kStage), kt); };
  auto load_w = [&](int kt) {
    const uint32_t st = sbase + uint32_t((kt % kStages) * L::kStage + 2 * L::kA);
#pragma unroll
    for (int i = 0; i < WN; ++i) {
      const int r = QW ? tid >> 1 : (tid >> 3) + 32 * i;
      const int off = QW ? wq_off(r, tid & 1) : wb_off(r, tid & 7);
      pf::cp_async16(st + off, w_src[i] + size_t(kt) * (QW ? 32 : 128), w_ok[i]);
    }
    if constexpr (QW) {
      if (kt % kChunkTiles == 0 && tid < BN)
        pf::cp_async16(sbase + uint32_t(L::kScales + ((kt / kChunkTiles) & 1) * BN * 16 + tid * 16),
                       sc_src + kt, sc_ok);
    }
  };
  // Q4: this thread's 16 bytes of W tile kt (32 codes of row tid >> 1, k 32 (tid & 1) ..) as exact
  // bf16 integers into converted buffer kt & 1, in A's permuted k order: chunk 4 cc + j of a row
  // holds R_j of the 4 words (one per thread of a quad), i.e. position 32 cc + 8 j + 2 t' + e holds
  // k = 32 cc + 8 t' + j + 4 e, as A_perm. So the buffer is a plain K-major operand (wgmma) and one
  // ldmatrix.x4 gives a column tile's (b0, b1) of both k16-slices of 32 k (mma.sync).
  auto convert_w = [&](int kt) {
    const int r = tid >> 1, cc = tid & 1;
    const uint4 u = *reinterpret_cast<const uint4*>(smem + (kt % kStages) * L::kStage + 2 * L::kA +
                                                    wq_off(r, cc));
    uint8_t* dst = smem + L::kB16 + (kt & 1) * BN * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j)
      *reinterpret_cast<uint4*>(dst + a_off(r, 4 * cc + j)) =
          make_uint4(q4_pair(u.x, j), q4_pair(u.y, j), q4_pair(u.z, j), q4_pair(u.w, j));
  };

  // mma.sync: a warp whose rows all lie past the tile's last row (a group's partial last tile)
  // only copies and converts: its MMAs would multiply zeros into rows nobody stores. (wgmma
  // issues regardless; see the main loop.)
  const bool warp_live = m0 + 32 * wm < m_end;
  float acc[2][8][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[i][j][e] = 0.f;

  if constexpr (QW) {
    load_w(0);  // group P: W tile 0; then group j = A tile j + W tile j + 1 (W runs one ahead)
    pf::cp_async_commit();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_a(s);
    if (s + int(QW) < KT) load_w(s + int(QW));
    pf::cp_async_commit();
  }
  if constexpr (QW) {
    pipe_bias_share(p, acc, KG, g, t, rbase, half, a_row, w_row);
    pf::cp_async_wait<kStages - 1>();  // group P (W tile 0) has landed for this thread
    convert_w(0);
  }
  float tq[2][8][4];  // Q4: a k-tile's integer products (bf16 W: unused, eliminated)
  // acc += s * (q . A) of k-tile k, per W row (column); the biases' share came first.
  auto fold = [&](int k) {
    const uint16_t* ss =
        reinterpret_cast<const uint16_t*>(smem + L::kScales) + ((k / kChunkTiles) & 1) * BN * 8;
    const int ci = k % kChunkTiles;
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float cs = bf16_bits_to_f32(ss[(64 * half(i) + 8 * nt + 2 * t + e) * 8 + ci]);
#pragma unroll
          for (int h = 0; h < 2; ++h)
            acc[i][nt][2 * h + e] = fmaf(cs, tq[i][nt][2 * h + e], acc[i][nt][2 * h + e]);
        }
  };
  for (int kt = 0; kt < KT; ++kt) {
    pf::cp_async_wait<kStages - 2>();  // A tile kt (and, Q4, W tile kt + 1) of this thread landed
    if constexpr (WG) wg::fence_proxy_async();  // ... and, with its conversion, is wgmma's to read
    __syncthreads();  // ... for every thread; tile kt - 1's buffers (and converted W) are free
    {
      const int j = kt + kStages - 1;
      if (j < KT) load_a(j);
      if (j + int(QW) < KT) load_w(j + int(QW));
      pf::cp_async_commit();
    }
    const uint8_t* st = smem + (kt % kStages) * L::kStage;
    const uint8_t* sw = QW ? smem + L::kB16 + (kt & 1) * BN * 128 : st + 2 * L::kA;
    if constexpr (WG) {
      // 4 k16 steps x (hi, lo) of 64 x 128, issued before this thread converts tile kt + 1.
      // Ping-pong: warpgroup 0 issues k-tile kt's wgmma right after the barrier and folds them
      // once they are done; warpgroup 1 first folds k-tile kt - 1 (waited for before the
      // barrier), then issues kt. So one warpgroup's fold runs under the other's wgmma and the
      // tensor cores do not idle through the folds; the single product set suffices because
      // warpgroup 1's fold of kt - 1 precedes its issue of kt. Every warpgroup issues, live or
      // not: a branch around wgmma makes ptxas serialise the kernel's wgmma (C7518), which costs
      // far more than a dead warpgroup's zero products.
      if (wg == 1 && kt > 0) fold(kt - 1);
      auto& d = reinterpret_cast<float(&)[16][4]>(tq);
      wg::fence();
      const uint32_t a_hi = pf::smem_u32(st) + uint32_t(wg * 64 * 128);
      const uint32_t b = pf::smem_u32(sw);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wg::mma_m64n128k16_bf16(d, wg::desc_sw128(a_hi + 32 * ks), wg::desc_sw128(b + 32 * ks), ks > 0);
        wg::mma_m64n128k16_bf16(d, wg::desc_sw128(a_hi + L::kA + 32 * ks), wg::desc_sw128(b + 32 * ks),
                                true);
      }
      wg::commit();
      if (kt + 1 < KT) convert_w(kt + 1);
      wg::wait<0>();  // (before the next barrier, which frees this k-tile's buffers)
      if (wg == 0) fold(kt);
    } else {
      if constexpr (QW) {
        if (kt + 1 < KT) convert_w(kt + 1);
      }
      if (!warp_live) continue;  // (after the barrier, the copies and the conversion)
      const uint8_t* sa = st;
      const uint8_t* sl = st + L::kA;
      float(&dst)[2][8][4] = QW ? tq : acc;
#pragma unroll
      for (int cc = 0; cc < 2; ++cc) {  // 32 k (16 bytes of a Q4 row)
        uint32_t bq[8][4];  // per column tile: (b0, b1) of k16-slice 2 cc, then of 2 cc + 1
        if constexpr (QW) {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
            pf::ldsm_x4(bq[nt], sw + a_off(wn * 64 + 8 * nt + (lane & 7), 4 * cc + (lane >> 3)));
        } else {
#pragma unroll
          for (int nt = 0; nt < 8; ++nt) {
            const int r = wn * 64 + 8 * nt + g;
            const uint4 u = *reinterpret_cast<const uint4*>(sw + wb_off(r, 4 * cc + t));
            bq[nt][0] = __byte_perm(u.x, u.z, 0x5410);  // (e0, e4)
            bq[nt][1] = __byte_perm(u.x, u.z, 0x7632);  // (e1, e5)
            bq[nt][2] = __byte_perm(u.y, u.w, 0x5410);  // (e2, e6)
            bq[nt][3] = __byte_perm(u.y, u.w, 0x7632);  // (e3, e7)
          }
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
          const int ks = 2 * cc + s;
          uint32_t ah[2][4], al[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt) {
            const int r = wm * 32 + 16 * mt + (lane & 15), c = 2 * ks + (lane >> 4);
            pf::ldsm_x4(ah[mt], sa + a_off(r, c));
            pf::ldsm_x4(al[mt], sl + a_off(r, c));
          }
#pragma unroll
          for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int mt = 0; mt < 2; ++mt) {
              if (QW && ks == 0) pf::mma_bf16_zc(dst[mt][nt], ah[mt], bq[nt][2 * s], bq[nt][2 * s + 1]);
              else pf::mma_bf16(dst[mt][nt], ah[mt], bq[nt][2 * s], bq[nt][2 * s + 1]);
              pf::mma_bf16(dst[mt][nt], al[mt], bq[nt][2 * s], bq[nt][2 * s + 1]);
            }
        }
      }
    }
    if constexpr (QW && !WG) fold(kt);
  }
  if constexpr (WG) {
    if (wg == 1) fold(KT - 1);  // (its group was waited for in the last iteration)
  }
  pf::cp_async_wait<0>();  // (only empty groups can be outstanding; leave none behind)

  // Epilogue (SiLU: nt < 4 the gate and nt + 4 the up of the same 32 outputs of the half).
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + rbase(i) + g + 8 * h;
      if (m >= m_end) continue;
      constexpr int NTO = SILU ? 4 : 8;
#pragma unroll
      for (int nt = 0; nt < NTO; ++nt) {
        if constexpr (SILU) {
          const int64_t col = int64_t(blockIdx.x) * 64 + half(i) * 32 + nt * 8 + 2 * t;
          store_pair(p, m, col, silu_f(acc[i][nt][2 * h]) * acc[i][nt + 4][2 * h],
                     silu_f(acc[i][nt][2 * h + 1]) * acc[i][nt + 4][2 * h + 1]);
        } else {
          const int64_t col = int64_t(blockIdx.x) * BN + half(i) * 64 + nt * 8 + 2 * t;
          store_pair(p, m, col, acc[i][nt][2 * h], acc[i][nt][2 * h + 1]);
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Dequantising kernel (PipeMma::Dq): A as its bf16 hi plane only and the weights as bf16 in shared
// memory (Q4: bf16(q s + b), one rounding of the exact value, by fma.rn.bf16x2; bf16 weights as
// they are), so that wgmma accumulates a tile's whole K in fp32 registers: no integer products
// kept apart, no per-k-tile fold or wait, no biases' GEMM, one wgmma per k16 step instead of two.
// The numbers are those of a bf16 x bf16 GEMM with fp32 accumulation (MLX's own quantized matmul
// on bf16 activations, and every bf16 engine's), ~2^-9 relative per operand instead of the Split
// route's ~2^-16 (tests: PrefillPipe.Dq*, bound 6e-3 per GEMM). That is not enough end to end: on
// the random real-width models the prompt logits land up to 0.32 (relative L2) from the fp32
// oracle, against a bound of 1e-2 (expert choices and argmaxes flip 40 layers deep), so this
// kernel is opt-in and never a default (bench/PREFILL_NOTES.md v13).
//
// Why (bench/PREFILL_NOTES.md, v8 and v13): the three exact Q4 wgmma kernels above all sit at ~40 %
// tensor pipe; what they share is the split A (two wgmma per k16 step) and the fold, which makes
// each k-tile wait for its own wgmma group before the next can accumulate.
//
// Pipeline (one __syncthreads per k-tile, as the wgmma kernel): A tile j and W tile j + 1 are copied
// by cp.async into stage j % kDqStages, kDqStages - 2 tiles ahead; each thread converts the W bytes
// it copied itself (tile kt + 1, during tile kt's wgmma) into converted buffer (kt + 1) % 3 in A's
// permuted k order; wgmma.wait_group 1 after each issue, so one k-tile's group is in flight through
// the barrier and the next k-tile's copies and conversion. A stage and a converted buffer are
// rewritten two k-tiles after their wgmma was issued, when every thread has waited for it.
// ---------------------------------------------------------------------------------------------
// Tiles of 128 rows x NB weight rows (NB = 128: two warpgroups of m64n128; NB = 256, Q4 only:
// m64n256, 128 accumulators per thread, A's copies shared by twice the columns).
// X (PipeMma::Pp, Q4 and 128-wide only): the exact numbers in the same pipeline (below).
template <DFmt F, int NB, bool X = false>
struct DqLayout {
  static constexpr bool kQ4 = F == DFmt::Q4;
  static_assert(NB == 128 || (NB == 256 && kQ4), "bf16 weights: 128-column tiles");
  static_assert(!X || (kQ4 && NB == 128), "the exact product sets: Q4, 128-wide tiles");
  static constexpr int kStages = X ? 4 : !kQ4 ? 5 : NB == 128 ? 6 : 4;
  static constexpr int kA = BM * 128, kW = NB * (kQ4 ? 32 : 128);
  static constexpr int kStage = (X ? 2 : 1) * kA + kW;  // A hi (X: and lo), raw W (Q4 codes or bf16)
  static constexpr int kConv = kStages * kStage;        // [3][NB][128 B] bf16 W in A's k order
  static constexpr int kChunk = kConv + 3 * NB * 128;   // Q4: [2 chunks][scales, biases][NB][8] bf16
  static constexpr int kBytes = kQ4 ? kChunk + 2 * 2 * NB * 16 : kChunk;
  static_assert(kA % 1024 == 0 && kStage % 1024 == 0 && kConv % 1024 == 0, "wgmma tiles 1024-aligned");
  static_assert(kBytes + 1024 <= 227 * 1024, "shared memory");
};

__device__ __forceinline__ uint32_t fma_bf16x2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

//
// X (PipeMma::Pp): the Split route's exact numbers in this pipeline. A as both planes (hi, lo), the
// Q4 codes converted to exact bf16 integers (no scale), each k-tile's integer products into one
// of two product sets (k-tile parity) and folded in as acc += s P once wait_group 1 says they are
// done, i.e. while the next k-tile's wgmma run; the biases' share (sum_g b sum(A)) a small MMA
// GEMM first, as the wgmma kernel. 192 accumulator registers.
template <DFmt F, bool SILU, int NB, bool X = false>
__global__ void __launch_bounds__(kThreads, 1) pipe_dq_kernel(const PrefillGemmArgs p) {
  using L = DqLayout<F, NB, X>;
  constexpr bool QW = L::kQ4;
  constexpr int S = L::kStages;
  constexpr int NR = NB / 128;  // W rows per thread: wr + 128 i
  constexpr int NJ = NB / 8;    // accumulator column tiles
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (pf::smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t sbase = pf::smem_u32(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;

  int64_t m0, m_end, grp;
  if (!tile_rows(p, BM, m0, m_end, grp)) return;
  const int64_t K = p.K, KG = K / 64;
  const int KT = int(KG);
  // Weight row of shared W row r. SiLU: each 64 rows are 32 gates then the 32 ups of the same
  // outputs (as the wgmma kernel), so a block computes NB / 2 outputs.
  auto w_row = [&](int r) -> PipeWRow {
    int64_t col;
    bool up = false;
    if constexpr (SILU) {
      const int within = r & 63;
      col = int64_t(blockIdx.x) * (NB / 2) + 32 * (r >> 6) + (within & 31);
      up = within >= 32;
    } else {
      col = int64_t(blockIdx.x) * NB + r;
    }
    return pipe_w_row(p, grp, col, up);
  };

  // Copies: A hi rows (tid >> 3) + 32 i, chunk tid & 7 (PipeACopies, hi plane only); W: Q4 rows
  // wr + 128 i half wc (16 bytes each), bf16 row wr chunks 4 wc .. + 3 (64 bytes), so that each
  // thread converts exactly the bytes it copied.
  const PipeACopies<4> acp(p, m0, m_end, tid);
  const int wr = tid >> 1, wc = tid & 1;
  const uint8_t* w_src[NR];
  bool w_ok[NR];
#pragma unroll
  for (int i = 0; i < NR; ++i) {
    const PipeWRow w = w_row(wr + 128 * i);
    w_ok[i] = w.ok;
    w_src[i] = static_cast<const uint8_t*>(w.m->data) + w.row * (QW ? K / 2 : K * 2) + (QW ? 16 : 64) * wc;
  }
  // Q4: copy c = tid + 256 i of a scale chunk is the 8 scales (c < NB) or biases of row c % NB.
  const uint16_t* sb_src[NR];
  bool sb_ok[NR];
  if constexpr (QW) {
#pragma unroll
    for (int i = 0; i < NR; ++i) {
      const int c = tid + 256 * i;
      const PipeWRow ws = w_row(c % NB);
      sb_ok[i] = ws.ok;
      sb_src[i] = (c < NB ? ws.m->scales : ws.m->biases) + ws.row * KG;
    }
  }
  auto stage = [&](int kt) { return sbase + uint32_t((kt % S) * L::kStage); };
  auto load_a = [&](int kt) {
    if constexpr (X) {
      acp.load(stage(kt), kt);  // hi, then lo kA bytes on
    } else {
      const uint8_t* h = acp.hi;
      const uint32_t st = stage(kt) + acp.soff;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        pf::cp_async16(st + uint32_t(4096 * i), h + size_t(acp.src[i] + int64_t(kt) * BK) * 2, acp.ok[i]);
    }
  };
  constexpr int kWOff = (X ? 2 : 1) * L::kA;  // the raw W's offset in a stage
  auto load_w = [&](int kt) {
    const uint32_t st = stage(kt) + uint32_t(kWOff);
    if constexpr (QW) {
#pragma unroll
      for (int i = 0; i < NR; ++i) pf::cp_async16(st + uint32_t(wq_off(wr + 128 * i, wc)), w_src[i] + size_t(kt) * 32, w_ok[i]);
      if (kt % kChunkTiles == 0) {
#pragma unroll
        for (int i = 0; i < NR; ++i)
          pf::cp_async16(sbase + uint32_t(L::kChunk + ((kt / kChunkTiles) & 1) * 2 * NB * 16 + (tid + 256 * i) * 16),
                         sb_src[i] + kt, sb_ok[i]);
      }
    } else {
#pragma unroll
      for (int c = 0; c < 4; ++c)
        pf::cp_async16(st + uint32_t(a_off(wr, 4 * wc + c)), w_src[0] + size_t(kt) * 128 + 16 * c, w_ok[0]);
    }
  };
  // W tile kt (raw, in stage kt % S) -> converted buffer kt % 3: position 32 cc + 8 j + 2 t' + e of a
  // row holds k = 32 cc + 8 t' + j + 4 e (A's permuted order; see the file's head), chunk 4 cc + j.
  auto convert_w = [&](int kt) {
    const uint8_t* raw = smem + (kt % S) * L::kStage + kWOff;
    uint8_t* dst = smem + L::kConv + (kt % 3) * NB * 128;
    if constexpr (X) {  // exact integers, as the wgmma kernel's conversion
      const uint4 u = *reinterpret_cast<const uint4*>(raw + wq_off(wr, wc));
#pragma unroll
      for (int j = 0; j < 4; ++j)
        *reinterpret_cast<uint4*>(dst + a_off(wr, 4 * wc + j)) =
            make_uint4(q4_pair(u.x, j), q4_pair(u.y, j), q4_pair(u.z, j), q4_pair(u.w, j));
    } else if constexpr (QW) {
      const uint16_t* ch = reinterpret_cast<const uint16_t*>(smem + L::kChunk) + ((kt / kChunkTiles) & 1) * 2 * NB * 8;
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const int r = wr + 128 * i;
        const uint4 u = *reinterpret_cast<const uint4*>(raw + wq_off(r, wc));
        const uint32_t s = ch[r * 8 + kt % kChunkTiles], b = ch[(NB + r) * 8 + kt % kChunkTiles];
        const uint32_t s2 = s | (s << 16), b2 = b | (b << 16);
#pragma unroll
        for (int j = 0; j < 4; ++j)
          *reinterpret_cast<uint4*>(dst + a_off(r, 4 * wc + j)) =
              make_uint4(fma_bf16x2(q4_pair(u.x, j), s2, b2), fma_bf16x2(q4_pair(u.y, j), s2, b2),
                         fma_bf16x2(q4_pair(u.z, j), s2, b2), fma_bf16x2(q4_pair(u.w, j), s2, b2));
      }
    } else {
      uint4 u[4];  // k 32 wc + 8 t' .. + 7 for t' = 0..3
#pragma unroll
      for (int c = 0; c < 4; ++c) u[c] = *reinterpret_cast<const uint4*>(raw + a_off(wr, 4 * wc + c));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t sel = (j & 1) ? 0x7632u : 0x5410u;  // (element j, element j + 4) of each t'
        auto pick = [&](const uint4& v) {
          return j < 2 ? __byte_perm(v.x, v.z, sel) : __byte_perm(v.y, v.w, sel);
        };
        *reinterpret_cast<uint4*>(dst + a_off(wr, 4 * wc + j)) = make_uint4(pick(u[0]), pick(u[1]), pick(u[2]), pick(u[3]));
      }
    }
  };

  // acc[j][e]: row 64 wg + 16 (warp % 4) + g + 8 (e / 2), column 8 j + 2 t + e % 2.
  float acc[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
  float pr[X ? 2 : 1][X ? NJ : 1][4];  // X: the integer products of the k-tiles of each parity
  // X: acc += s * (q . A) of k-tile k from product set P, per W row (column).
  auto fold = [&](int k, float (&P)[NJ][4]) {
    const uint16_t* ss = reinterpret_cast<const uint16_t*>(smem + L::kChunk) + ((k / kChunkTiles) & 1) * 2 * NB * 8;
    const int ci = k % kChunkTiles;
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float cs = bf16_bits_to_f32(ss[(8 * j + 2 * t + e) * 8 + ci]);
#pragma unroll
        for (int h = 0; h < 2; ++h) acc[j][2 * h + e] = fmaf(cs, P[j][2 * h + e], acc[j][2 * h + e]);
      }
  };

  // Groups: P = W tile 0 (and its scale chunk), then group j = A tile j + W tile j + 1.
  load_w(0);
  pf::cp_async_commit();
#pragma unroll
  for (int s = 0; s < S - 2; ++s) {
    if (s < KT) load_a(s);
    if (s + 1 < KT) load_w(s + 1);
    pf::cp_async_commit();
  }
  if constexpr (X) {
    auto a_row = [&](int r, bool& ok) { return pipe_a_row(p, m0, m_end, r, ok); };
    pipe_bias_share(
        p, reinterpret_cast<float(&)[2][8][4]>(acc), KG, g, t, [&](int) { return 64 * wg + 16 * (warp & 3); },
        [](int i) { return i; }, a_row, w_row);
  }
  pf::cp_async_wait<S - 2>();  // group P landed for this thread ...
  __syncthreads();             // ... and for every thread (the scale chunk is other threads' copy)
  convert_w(0);
  // One k-tile; PAR = kt % kBlk (X: the product set is PAR % 2).
  constexpr int kBlk = X ? 4 : 2;
  auto step = [&](int kt, auto par) {
    constexpr int PAR = decltype(par)::value;  // kt % kBlk
    (void)PAR;
    pf::cp_async_wait<S - 3>();  // A tile kt and W tile kt + 1 of this thread landed
    wg::fence_proxy_async();     // its copies and conversion of W tile kt are wgmma's to read
    __syncthreads();             // ... for every thread; every wgmma group up to kt - 2 is done
    {
      const int j = kt + S - 2;  // into stage (kt - 2) % S (A) and W's part of stage (kt - 1) % S
      if (j < KT) load_a(j);
      if (j + 1 < KT) load_w(j + 1);
      pf::cp_async_commit();
    }
    // Every warpgroup issues, live or not (a branch around wgmma serialises them all: C7518).
    wg::fence();
    const uint32_t a = stage(kt) + uint32_t(wg * 64 * 128);
    const uint32_t b = sbase + uint32_t(L::kConv + (kt % 3) * NB * 128);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if constexpr (X) {
        auto& d = pr[PAR % 2];
        wg::mma_m64n128k16_bf16(d, wg::desc_sw128(a + 32 * ks), wg::desc_sw128(b + 32 * ks), ks > 0);
        wg::mma_m64n128k16_bf16(d, wg::desc_sw128(a + L::kA + 32 * ks), wg::desc_sw128(b + 32 * ks), true);
      } else if constexpr (NB == 256) {
        wg::mma_m64n256k16_bf16(acc, wg::desc_sw128(a + 32 * ks), wg::desc_sw128(b + 32 * ks));
      } else {
        wg::mma_m64n128k16_bf16(acc, wg::desc_sw128(a + 32 * ks), wg::desc_sw128(b + 32 * ks), true);
      }
    }
    wg::commit();
    // Into buffer (kt + 1) % 3, last read by k-tile kt - 2's wgmma (both warpgroups read every
    // buffer, so two buffers would need a second barrier per k-tile).
    if (kt + 1 < KT) convert_w(kt + 1);
    if constexpr (X) {
      if constexpr (PAR == kBlk - 1) wg::wait<0>();  // the block's last k-tile (see below)
      else wg::wait<1>();
      if constexpr (PAR > 0) {  // k-tile kt - 1's products are done (kt's run meanwhile)
        wg::fence_acc(pr[1 - PAR % 2]);
        fold(kt - 1, pr[1 - PAR % 2]);
      }
      if constexpr (PAR == kBlk - 1) {
        wg::fence_acc(pr[PAR % 2]);
        fold(kt, pr[PAR % 2]);
      }
    } else {
      wg::wait<1>();
    }
  };
  // Blocks of kBlk k-tiles (K % 512 == 0), unrolled: X's two product sets alternate by the
  // k-tile's parity (a compile-time index, so they stay in registers), and ptxas tracks which
  // wgmma group a fold reads only within straight-line code, so each block ends with
  // wait_group 0 (a loop-carried product set gives C7514: every wgmma serialised).
  for (int kb = 0; kb < KT; kb += kBlk) {
    [&]<int... I>(std::integer_sequence<int, I...>) {
      (step(kb + I, std::integral_constant<int, I>{}), ...);
    }(std::make_integer_sequence<int, kBlk>{});
  }
  wg::wait<0>();
  wg::fence_acc(acc);
  pf::cp_async_wait<0>();  // (only empty groups can be outstanding; leave none behind)

#pragma unroll
  for (int i = 0; i < NB / 64; ++i)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + 64 * wg + 16 * (warp & 3) + g + 8 * h;
      if (m >= m_end) continue;
      constexpr int NTO = SILU ? 4 : 8;
#pragma unroll
      for (int nt = 0; nt < NTO; ++nt) {
        const float* d = acc[8 * i + nt];
        if constexpr (SILU) {
          const float* u = acc[8 * i + nt + 4];
          const int64_t col = int64_t(blockIdx.x) * (NB / 2) + i * 32 + nt * 8 + 2 * t;
          store_pair(p, m, col, silu_f(d[2 * h]) * u[2 * h], silu_f(d[2 * h + 1]) * u[2 * h + 1]);
        } else {
          const int64_t col = int64_t(blockIdx.x) * NB + i * 64 + nt * 8 + 2 * t;
          store_pair(p, m, col, d[2 * h], d[2 * h + 1]);
        }
      }
    }
}

// ---------------------------------------------------------------------------------------------
// Transposed Q4 kernel (PipeMma::Rs): C^T = W X^T on wgmma with the weights as the register
// operand. The same numbers as the kernels above (A split hi + lo, Q4 codes exact integers, the
// fold acc += s P per 64-group, the biases' share as a small MMA GEMM first) up to accumulation
// order.
//
// Why (bench/PREFILL_NOTES.md, v8): the wgmma kernel above converts each W tile into a bf16 copy in
// shared memory (st.shared, a fence, a double buffer) and reads both operands of every wgmma from
// shared memory, ~148 KB of shared-memory traffic per k-tile against ~104 KB here; its fold loads
// 32 scales per thread and k-tile, because a thread's accumulators span 32 weight rows. With W as
// wgmma's A operand a thread's accumulators lie on 2 weight rows (2 scales per k-tile), and the
// codes go from the cp.async stage into the A fragments in registers.
//
// Tile: 128 weight rows (warpgroup wg rows 64 wg .. + 63, warp w of it 16 rows) x 128 tokens (the
// wgmma N). A thread's fragment rows are r0 = 64 wg + 16 (warp % 4) + lane / 4 and r0 + 8; with
// SiLU, r0 is the gate and r0 + 8 the up of the same output ((r0 / 16) * 8 + lane / 4 of the
// block's 64), so the epilogue has both in one thread. The A fragment of k16-slice 2 c + s holds
// R_{2s}, R_{2s+1} of word lane % 4 of 32-k chunk c of each row: the k order of A_perm (the split
// A, the B operand here, unchanged). Operands are staged as in pipe_gemm_kernel<Q4, *, true> (the
// same 4-stage ring, W one tile ahead), so its loaders are reused as they are.
struct RsLayout {
  static constexpr int kA = BM * 128, kW = BN * 32;
  static constexpr int kStage = 2 * kA + kW;
  static constexpr int kScales = kStages * kStage;  // [2][BN][8] bf16
  static constexpr int kBytes = kScales + 2 * BN * 16;
  static constexpr int kStageLd = BN + 4;  // epilogue: fp32 [BM tokens][BN + 4] (conflict-free)
  static_assert(BM * kStageLd * 4 <= kScales, "the epilogue's staging fits in the ring");
};

// The grouped tail tiles (PrefillGemmArgs::tail_off): tile blockIdx.y of them is the last rows of
// its group, the remainder of rows_g / BM when it is at most kRsTail rows (tile_off leaves those
// rows out: the BM-token launch skips them); false past the last tail.
constexpr int kRsTail = kPipeTailRows;
__device__ __forceinline__ bool tail_rows(const PrefillGemmArgs& p, int64_t& m0, int64_t& m_end, int64_t& grp) {
  const int tile = blockIdx.y;
  if (tile >= p.tail_off[p.groups]) return false;
  const int g = group_of_tile(p.tail_off, p.groups, tile);
  grp = g;
  m_end = p.group_off[g + 1];
  m0 = m_end - (m_end - p.group_off[g]) % BM;
  return true;
}

// NT: the tile's tokens (wgmma's N): BM, or kRsTail for the grouped tail tiles.
template <bool SILU, int NT>
__global__ void __launch_bounds__(kThreads, 1) pipe_rs_kernel(const PrefillGemmArgs p) {
  static_assert(NT == BM || NT == kRsTail, "a tile of BM tokens, or a tail tile");
  constexpr int NJ = NT / 8;  // accumulator fragments per thread: 8 tokens each
  using L = RsLayout;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (pf::smem_u32(smem_raw) & 1023)) & 1023);
  const uint32_t sbase = pf::smem_u32(smem);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, wg = warp >> 2;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = 64 * wg + 16 * (warp & 3) + g;  // this thread's weight rows: r0, r0 + 8

  int64_t m0, m_end, grp;
  if (!(NT == BM ? tile_rows(p, BM, m0, m_end, grp) : tail_rows(p, m0, m_end, grp))) return;
  const int64_t K = p.K, KG = K / 64;
  const int KT = int(KG);
  auto a_row = [&](int r, bool& ok) { return pipe_a_row(p, m0, m_end, r, ok); };  // tile token r
  using WRow = PipeWRow;
  auto w_row = [&](int r) -> WRow {  // weight row of tile row r
    int64_t col;
    bool up = false;
    if constexpr (SILU) {  // rows 16 q + 0..7: gates of outputs 8 q + 0..7; 16 q + 8..15: their ups
      col = int64_t(blockIdx.x) * 64 + (r >> 4) * 8 + (r & 7);
      up = (r & 8) != 0;
    } else {
      col = int64_t(blockIdx.x) * BN + r;
    }
    return pipe_w_row(p, grp, col, up);
  };

  // Copies, as pipe_gemm_kernel's Q4 path: A as PipeACopies, W row tid >> 1 chunk tid & 1, scale
  // chunks of row tid (tid < 128).
  const PipeACopies<NT / 32> acp(p, m0, m_end, tid);
  const WRow wr = w_row(tid >> 1);
  const bool w_ok = wr.ok;
  const uint8_t* w_src = static_cast<const uint8_t*>(wr.m->data) + wr.row * (K / 2) + 16 * (tid & 1);
  const uint16_t* sc_src = nullptr;
  bool sc_ok = false;
  if (tid < BN) {
    const WRow w = w_row(tid);
    sc_ok = w.ok;
    sc_src = w.m->scales + w.row * KG;
  }
  auto load_a = [&](int kt) { acp.load(sbase + uint32_t((kt % kStages) * L::kStage), kt); };
  auto load_w = [&](int kt) {
    const uint32_t st = sbase + uint32_t((kt % kStages) * L::kStage + 2 * L::kA);
    pf::cp_async16(st + wq_off(tid >> 1, tid & 1), w_src + size_t(kt) * 32, w_ok);
    if (kt % kChunkTiles == 0 && tid < BN)
      pf::cp_async16(sbase + uint32_t(L::kScales + ((kt / kChunkTiles) & 1) * BN * 16 + tid * 16), sc_src + kt,
                     sc_ok);
  };
  // The A fragments of W tile kt: words lane % 4 of both 32-k chunks of rows r0, r0 + 8.
  auto frags = [&](int kt, uint32_t (&f)[4][4]) {
    const uint8_t* sw = smem + (kt % kStages) * L::kStage + 2 * L::kA;
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const uint32_t w0 = *reinterpret_cast<const uint32_t*>(sw + wq_off(r0, c) + 4 * t);
      const uint32_t w1 = *reinterpret_cast<const uint32_t*>(sw + wq_off(r0 + 8, c) + 4 * t);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        f[2 * c + s][0] = q4_pair(w0, 2 * s);
        f[2 * c + s][1] = q4_pair(w1, 2 * s);
        f[2 * c + s][2] = q4_pair(w0, 2 * s + 1);
        f[2 * c + s][3] = q4_pair(w1, 2 * s + 1);
      }
    }
  };

  // acc[j][e]: weight row r0 + 8 (e / 2), token 8 j + 2 t + (e % 2) (wgmma's accumulator layout).
  float acc[NJ][4];
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;

  load_w(0);  // group P: W tile 0; then group j = A tile j + W tile j + 1 (W runs one ahead)
  pf::cp_async_commit();
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load_a(s);
    if (s + 1 < KT) load_w(s + 1);
    pf::cp_async_commit();
  }
  {
    // The biases' share, sum_g b[n, g] sum(A)[m, g], as an MMA over the K / 64 groups (padded to
    // 16) while the first tiles load: A = the bf16 biases of rows r0, r0 + 8 (exact), B = the
    // sums of the tokens split hi + lo.
    const float* sum = p.pipe.sum;
    const WRow wa = w_row(r0), wb = w_row(r0 + 8);
    const uint16_t* ba = wa.m->biases + wa.row * KG;
    const uint16_t* bb = wb.m->biases + wb.row * KG;
    for (int k0 = 0; k0 < KG; k0 += 16) {
      uint32_t ab[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int64_t kk = k0 + 2 * t + 8 * (q >> 1);
        const bool ok = (q & 1 ? wb.ok : wa.ok) && kk < KG;
        ab[q] = ok ? *reinterpret_cast<const uint32_t*>((q & 1 ? bb : ba) + kk) : 0u;
      }
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        bool ok;
        const int64_t srow = a_row(8 * j + g, ok) * KG;
        uint32_t bh[2], bl[2];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const int64_t kk = k0 + 2 * t + 8 * q;
          float2 v = make_float2(0.f, 0.f);
          if (ok && kk < KG) v = *reinterpret_cast<const float2*>(sum + srow + kk);
          bh[q] = pf::pack_bf16(v.x, v.y);
          bl[q] = pf::pack_bf16(v.x - pf::bf16_lo(bh[q]), v.y - pf::bf16_hi(bh[q]));
        }
        pf::mma_bf16(acc[j], ab, bh[0], bh[1]);
        pf::mma_bf16(acc[j], ab, bl[0], bl[1]);
      }
    }
  }
  float tq[NJ][4];  // a k-tile's integer products
  auto fold = [&](int k) {
    const uint16_t* ss =
        reinterpret_cast<const uint16_t*>(smem + L::kScales) + ((k / kChunkTiles) & 1) * BN * 8 + k % kChunkTiles;
    const float s0 = bf16_bits_to_f32(ss[r0 * 8]), s1 = bf16_bits_to_f32(ss[(r0 + 8) * 8]);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      acc[j][0] = fmaf(s0, tq[j][0], acc[j][0]);
      acc[j][1] = fmaf(s0, tq[j][1], acc[j][1]);
      acc[j][2] = fmaf(s1, tq[j][2], acc[j][2]);
      acc[j][3] = fmaf(s1, tq[j][3], acc[j][3]);
    }
  };
  uint32_t cf[4][4];  // the A fragments of the k-tile being multiplied
  pf::cp_async_wait<kStages - 1>();  // group P (W tile 0) has landed for this thread
  __syncthreads();
  frags(0, cf);
  for (int kt = 0; kt < KT; ++kt) {
    pf::cp_async_wait<kStages - 2>();  // A tile kt (and W tile kt + 1) of this thread landed
    wg::fence_proxy_async();           // ... and is wgmma's to read
    __syncthreads();                   // ... for every thread; tile kt - 1's buffers are free
    {
      const int j = kt + kStages - 1;
      if (j < KT) load_a(j);
      if (j + 1 < KT) load_w(j + 1);
      pf::cp_async_commit();
    }
    // Ping-pong as in pipe_gemm_kernel: warpgroup 1 folds k-tile kt - 1 before issuing kt,
    // warpgroup 0 folds kt after its wait, so one warpgroup's fold runs under the other's wgmma.
    if (wg == 1 && kt > 0) fold(kt - 1);
    const uint32_t b = sbase + uint32_t((kt % kStages) * L::kStage);
    wg::fence();
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      if constexpr (NT == BM) {
        wg::mma_m64n128k16_bf16_rs(tq, cf[ks], wg::desc_sw128(b + 32 * ks), ks > 0);
        wg::mma_m64n128k16_bf16_rs(tq, cf[ks], wg::desc_sw128(b + L::kA + 32 * ks), true);
      } else {
        wg::mma_m64n64k16_bf16_rs(tq, cf[ks], wg::desc_sw128(b + 32 * ks), ks > 0);
        wg::mma_m64n64k16_bf16_rs(tq, cf[ks], wg::desc_sw128(b + L::kA + 32 * ks), true);
      }
    }
    wg::commit();
    uint32_t nf[4][4];
    if (kt + 1 < KT) frags(kt + 1, nf);
    wg::wait<0>();
    // The wgmma read cf until the wait (writing it before is undefined, PTX ISA wgmma.mma_async):
    // this use keeps cf alive through the wait. Without it cf is dead after its last wgmma to the
    // compiler, which at 6e65da4 built nf in cf's PTX registers between commit and wait (NaNs).
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int q = 0; q < 4; ++q) asm volatile("" : "+r"(cf[ks][q]));
    if (wg == 0) fold(kt);
#pragma unroll
    for (int ks = 0; ks < 4; ++ks)
#pragma unroll
      for (int q = 0; q < 4; ++q) cf[ks][q] = nf[ks][q];
  }
  if (wg == 1) fold(KT - 1);
  pf::cp_async_wait<0>();
  __syncthreads();  // every wgmma and copy is done: the ring becomes the epilogue's staging

  // Stage the tile as fp32 [token][column] (SiLU: silu(gate) * up, 64 columns), then store rows of
  // consecutive columns (coalesced; store_pair does the epilogue's scatter, scale and residual).
  float* stg = reinterpret_cast<float*>(smem);
  constexpr int NC = SILU ? 64 : BN;  // output columns of the tile
#pragma unroll
  for (int j = 0; j < NJ; ++j)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 8 * j + 2 * t + e;
      if constexpr (SILU) {
        stg[m * L::kStageLd + (r0 >> 4) * 8 + g] = silu_f(acc[j][e]) * acc[j][2 + e];
      } else {
        stg[m * L::kStageLd + r0] = acc[j][e];
        stg[m * L::kStageLd + r0 + 8] = acc[j][2 + e];
      }
    }
  __syncthreads();
  const int64_t col0 = int64_t(blockIdx.x) * NC;
  for (int i = tid; i < NT * (NC / 2); i += kThreads) {
    const int m = i / (NC / 2), c = 2 * (i % (NC / 2));
    if (m0 + m >= m_end) break;  // (rows in order: every later i is past the end too)
    const float2 v = *reinterpret_cast<const float2*>(stg + m * L::kStageLd + c);
    store_pair(p, m0 + m, col0 + c, v.x, v.y);
  }
}

// ---------------------------------------------------------------------------------------------
// Warp-specialised Q4 kernel (PipeMma::Ws): the same numbers as the wgmma kernel above, with the
// block barrier per k-tile replaced by mbarriers between a producer warpgroup and two consumer
// warpgroups, so that the fold of a k-tile's products overlaps the next k-tile's wgmma.
//
// Why (bench/PREFILL_NOTES.md, v6): with one commit group per k-tile and a __syncthreads, the
// tensor cores idle while the warps fold (64 FFMA + 32 scale loads), convert and meet at the
// barrier; running a second group through column halves under the same barrier put the copies
// only 2 tiles ahead and the warps then waited for data.
//
// Roles (384 threads). Warpgroup 0 (setmaxnreg 40): warps 0-1 copy every operand of k-tile j
// (A hi, A lo, W codes; every 8 k-tiles the next 8 scales of each row) into stage j % 4 by
// cp.async as soon as the stage is free (each thread's copies complete on full[j % 4] through
// cp.async.mbarrier.arrive.noinc), so up to 4 k-tiles are in flight; warps 2-3 wait for each
// stage, convert its Q4 codes into converted buffer j % 3 (exact bf16 integers) with the rows'
// scales as fp32 beside it, and arrive on cfull. Warpgroups 1 and 2 (setmaxnreg 232) own 64 rows
// x 128 columns each: for k-tile kt they wait on full and cfull, issue 8 wgmma (4 k16 x hi, lo)
// into one of two product sets, then wait for k-tile kt - 1's group, release its stage (empty),
// fold its products with the scales and release its converted buffer (cfree). So one wgmma group
// is in flight during a fold. The grid is persistent: the same ring runs through every tile of
// the block, and the loaders fill it for the next tile during the consumers' epilogue.
// ---------------------------------------------------------------------------------------------
constexpr int kWsThreads = 384, kWsConv = 3;

struct WsLayout {
  static constexpr int kA = BM * 128, kW = BN * 32;
  static constexpr int kStage = 2 * kA + kW;                 // A hi, A lo, W codes (36 KB)
  static constexpr int kConv = kStages * kStage;             // [kWsConv][BN][128 B] converted W
  static constexpr int kScale = kConv + kWsConv * BN * 128;  // [kWsConv][BN] fp32 scales
  static constexpr int kChunk = kScale + kWsConv * BN * 4;   // [2][BN][8] bf16 scale chunks (8 k-tiles)
  static constexpr int kWPtr = kChunk + 2 * BN * 16;         // [2][BN] W row codes (nullptr: none)
  static constexpr int kSPtr = kWPtr + 2 * BN * 8;           // [2][BN] W row scales
  static constexpr int kARow = kSPtr + 2 * BN * 8;           // [2][BM] int32 row of the split A (-1: none)
  static constexpr int kBars = kARow + 2 * BM * 4;           // full[4], empty[4], cfull[3], cfree[3]
  static constexpr int kBytes = kBars + (2 * kStages + 2 * kWsConv) * 8;
  static_assert(kStage % 1024 == 0 && kA % 1024 == 0 && kConv % 1024 == 0, "wgmma tiles 1024-aligned");
};

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// Arrives on bar once this thread's earlier cp.async copies have landed (counts as one arrival).
__device__ __forceinline__ void cp_async_arrive(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// mbar_wait with the retry loop inside one asm block: a C++ loop around try_wait is a divergent
// path to ptxas, which then serialises every wgmma of the kernel (warning C7518).
__device__ __forceinline__ void mbar_wait_asm(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
// Keeps the compiler from moving reads of d above the wgmma wait that completes it.
__device__ __forceinline__ void fence_operand(float (&d)[16][4]) {
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e])::"memory");
}

template <bool SILU>
__global__ void __launch_bounds__(kWsThreads, 1) pipe_ws_kernel(const PrefillGemmArgs p, const int ntiles) {
  using L = WsLayout;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (pf::smem_u32(smem_raw) & 1023)) & 1023);
  int32_t* arow = reinterpret_cast<int32_t*>(smem + L::kARow);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + L::kBars);
  uint64_t* empty = full + kStages;
  uint64_t* cfull = empty + kStages;
  uint64_t* cfree = cfull + kWsConv;
  const float* scl = reinterpret_cast<const float*>(smem + L::kScale);
  const int tid = threadIdx.x;
  const int64_t K = p.K, KG = K / 64;
  const int KT = int(KG);  // a multiple of 8: K % 512 == 0
  const int gx = int(SILU ? (p.N + 63) / 64 : (p.N + BN - 1) / BN);

  // Tile `tile` (row-major over (row tile, column block), the column block fastest, as the grid of
  // the one-tile-per-block kernels): its rows, group and column block; false if empty.
  auto tile_of = [&](int tile, int64_t& m0, int64_t& m_end, int64_t& grp, int& bx) -> bool {
    bx = tile % gx;
    const int by = tile / gx;
    grp = 0;
    if (p.groups == 0) {
      m0 = int64_t(by) * BM;
      m_end = p.M;
      return m0 < p.M;
    }
    return group_tile_rows(p, BM, by, m0, m_end, grp);
  };
  // Weight row of converted row r of column block bx (SiLU: column half r >> 6, rows +0 .. +31
  // gate, +32 .. +63 up of 32 outputs); -1 past N.
  auto w_row = [&](int r, int bx, int64_t grp, const DMat*& m) -> int64_t {
    int64_t col;
    bool up = false;
    if constexpr (SILU) {
      const int within = r & 63;
      col = int64_t(bx) * 64 + 32 * (r >> 6) + (within & 31);
      up = within >= 32;
    } else {
      col = int64_t(bx) * BN + r;
    }
    m = up ? &p.W2 : &p.W;
    return col < p.N ? grp * p.N + col : -1;
  };
  auto a_row = [&](int64_t m, int64_t m_end) -> int32_t {  // row of the split A, -1: none
    return m < m_end ? int32_t(p.a_rows ? p.a_rows[m] / p.a_div : m) : -1;
  };

  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full + s, 64);    // one cp.async arrival per loader thread
      mbar_init(empty + s, 256);  // every consumer thread, after its wgmma of the tile
    }
    for (int c = 0; c < kWsConv; ++c) {
      mbar_init(cfull + c, 64);   // every converter thread, after its rows' conversion
      mbar_init(cfree + c, 256);  // every consumer thread, after its fold
    }
    mbar_fence_init();
  }
  __syncthreads();

  // Role by warpgroup, warp-uniform through the shuffle (as ptxas needs around wgmma).
  const int role = __shfl_sync(0xffffffffu, tid >> 7, 0);
  if (role == 0) {
    setmaxnreg_dec<40>();
    if (tid < 64) {
      // ---- loader warps: every operand of each k-tile, as soon as its stage is free ----
      const int lt = tid;
      const uint8_t* ahi = reinterpret_cast<const uint8_t*>(p.pipe.hi);
      const uint8_t* alo = reinterpret_cast<const uint8_t*>(p.pipe.lo);
      int done = 0;  // k-tiles of this block before the current tile (ring positions)
      for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        int64_t m0, m_end, grp;
        int bx;
        if (!tile_of(tile, m0, m_end, grp, bx)) continue;
        // This tile's row tables (double-buffered: a loader may still read the previous tile's).
        const int tb = (done / KT) & 1;
        int32_t* ar = arow + tb * BM;
        const uint8_t** wp = reinterpret_cast<const uint8_t**>(smem + L::kWPtr) + tb * BN;
        const uint16_t** sp = reinterpret_cast<const uint16_t**>(smem + L::kSPtr) + tb * BN;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          const int r = lt + 64 * i;
          ar[r] = a_row(m0 + r, m_end);
          const DMat* wm;
          const int64_t wr = w_row(r, bx, grp, wm);
          wp[r] = wr < 0 ? nullptr : static_cast<const uint8_t*>(wm->data) + wr * (K / 2);
          sp[r] = wr < 0 ? nullptr : wm->scales + wr * KG;
        }
        asm volatile("bar.sync 1, 64;\n" ::: "memory");  // (the two loader warps)
        for (int j = 0; j < KT; ++j) {
          const int gj = done + j, s = gj % kStages;
          if (gj >= kStages) mbar_wait_asm(empty + s, uint32_t((gj / kStages - 1) & 1));
          const uint32_t st = smem_addr(smem + s * L::kStage);
#pragma unroll 4  // (fully unrolled, the 40 registers spill)
          for (int i = 0; i < 16; ++i) {
            const int r = (lt >> 3) + 8 * i, c = lt & 7;
            const int32_t a = ar[r];
            const size_t off = (size_t(a < 0 ? 0 : a) * size_t(K) + size_t(j) * BK + 8 * c) * 2;
            pf::cp_async16(st + a_off(r, c), ahi + off, a >= 0);
            pf::cp_async16(st + L::kA + a_off(r, c), alo + off, a >= 0);
          }
#pragma unroll 1
          for (int i = 0; i < 4; ++i) {
            const int r = (lt >> 1) + 32 * i, c = lt & 1;
            const uint8_t* w = wp[r];
            pf::cp_async16(st + 2 * L::kA + wq_off(r, c), w ? w + size_t(j) * 32 + 16 * c : ahi, w != nullptr);
          }
          if (gj % kChunkTiles == 0) {  // the scales of the next 8 k-tiles (freed: see the notes)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
              const int r = lt + 64 * i;
              const uint16_t* sc = sp[r];
              pf::cp_async16(smem_addr(smem + L::kChunk + ((gj / kChunkTiles) & 1) * BN * 16 + r * 16),
                             sc ? sc + j : reinterpret_cast<const uint16_t*>(ahi), sc != nullptr);
            }
          }
          cp_async_arrive(full + s);
        }
        done += KT;
      }
    } else {
      // ---- converter warps: each k-tile's Q4 codes into exact bf16 integers (2 rows a thread) ----
      const int ct = tid - 64;
      int done = 0;
      for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        int64_t m0, m_end, grp;
        int bx;
        if (!tile_of(tile, m0, m_end, grp, bx)) continue;
        for (int c = 0; c < KT; ++c) {
          const int gc = done + c, s = gc % kStages, cb = gc % kWsConv;
          mbar_wait_asm(full + s, uint32_t((gc / kStages) & 1));
          if (gc >= kWsConv) mbar_wait_asm(cfree + cb, uint32_t((gc / kWsConv - 1) & 1));
          const uint8_t* src = smem + s * L::kStage + 2 * L::kA;
          uint8_t* dst = smem + L::kConv + cb * BN * 128;
          const uint16_t* chunk =
              reinterpret_cast<const uint16_t*>(smem + L::kChunk + ((gc / kChunkTiles) & 1) * BN * 16);
#pragma unroll
          for (int i = 0; i < 2; ++i) {
            const int r = ct + 64 * i;
#pragma unroll
            for (int cc = 0; cc < 2; ++cc) {
              const uint4 u = *reinterpret_cast<const uint4*>(src + wq_off(r, cc));
#pragma unroll
              for (int q = 0; q < 4; ++q)
                *reinterpret_cast<uint4*>(dst + a_off(r, 4 * cc + q)) =
                    make_uint4(q4_pair(u.x, q), q4_pair(u.y, q), q4_pair(u.z, q), q4_pair(u.w, q));
            }
            reinterpret_cast<float*>(smem + L::kScale)[cb * BN + r] =
                bf16_bits_to_f32(chunk[r * 8 + gc % kChunkTiles]);
          }
          // The stage's copies (complete: full was waited for) and the converted tile are read by
          // wgmma (the async proxy); cfull publishes both (the consumers fence again).
          wg::fence_proxy_async();
          mbar_arrive(cfull + cb);
        }
        done += KT;
      }
    }
    return;
  }

  // ---- consumer warpgroups: 64 rows x 128 columns each ----
  setmaxnreg_inc<232>();
  const int cw = role - 1, warp4 = (tid & 127) >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int rb = 64 * cw + 16 * warp4;  // this warp's 16 rows of the tile
  int done = 0;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    int64_t m0, m_end, grp;
    int bx;
    if (!tile_of(tile, m0, m_end, grp, bx)) continue;
    float acc[16][4];
    {
      // The biases' share of the fold, sum_g b[n, g] sum(A)[m, g], as in pipe_gemm_kernel
      // (columns 8 j + ...; dead rows have zero sums), while the producer fills the ring.
      const int32_t ar0 = a_row(m0 + rb + g, m_end), ar1 = a_row(m0 + rb + g + 8, m_end);
      const float* sum = p.pipe.sum;
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
      for (int k0 = 0; k0 < KG; k0 += 16) {
        uint32_t sh[4], sl[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          const int64_t kk = k0 + 2 * t + 8 * (q >> 1);
          const int32_t ar = (q & 1) ? ar1 : ar0;
          float2 v = make_float2(0.f, 0.f);
          if (ar >= 0 && kk < KG) v = *reinterpret_cast<const float2*>(sum + int64_t(ar) * KG + kk);
          sh[q] = pf::pack_bf16(v.x, v.y);
          sl[q] = pf::pack_bf16(v.x - pf::bf16_lo(sh[q]), v.y - pf::bf16_hi(sh[q]));
        }
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
          const DMat* wm;
          const int64_t wr = w_row(8 * nt + g, bx, grp, wm);
          const uint16_t* brow = wm->biases + (wr < 0 ? 0 : wr) * KG;
          const int64_t kk = k0 + 2 * t;
          const uint32_t b0 = wr >= 0 && kk < KG ? *reinterpret_cast<const uint32_t*>(brow + kk) : 0u;
          const uint32_t b1 = wr >= 0 && kk + 8 < KG ? *reinterpret_cast<const uint32_t*>(brow + kk + 8) : 0u;
          pf::mma_bf16(acc[nt], sh, b0, b1);
          pf::mma_bf16(acc[nt], sl, b0, b1);
        }
      }
    }
    float t0[16][4], t1[16][4];
    // Issues k-tile kt's 8 wgmma into d (one commit group), after its operands are published.
    auto issue = [&](float (&d)[16][4], int kt) {
      const int gk = done + kt;
      mbar_wait_asm(full + gk % kStages, uint32_t((gk / kStages) & 1));
      mbar_wait_asm(cfull + gk % kWsConv, uint32_t((gk / kWsConv) & 1));
      wg::fence_proxy_async();
      fence_operand(d);
      wg::fence();
      const uint32_t a = smem_addr(smem + (gk % kStages) * L::kStage) + uint32_t(cw * 64 * 128);
      const uint32_t b = smem_addr(smem + L::kConv + (gk % kWsConv) * BN * 128);
#pragma unroll
      for (int ks = 0; ks < 4; ++ks) {
        wg::mma_m64n128k16_bf16(d, wg::desc_sw128(a + 32 * ks), wg::desc_sw128(b + 32 * ks), ks > 0);
        wg::mma_m64n128k16_bf16(d, wg::desc_sw128(a + L::kA + 32 * ks), wg::desc_sw128(b + 32 * ks), true);
      }
      wg::commit();
    };
    // After k-tile kt's group is complete: release its stage, fold its products (acc += s P per
    // column), release its converted buffer.
    auto fold = [&](float (&d)[16][4], int kt) {
      const int gk = done + kt;
      mbar_arrive(empty + gk % kStages);
      fence_operand(d);
      const float* sc = scl + (gk % kWsConv) * BN;
#pragma unroll
      for (int nt = 0; nt < 16; ++nt) {
        const float2 cs = *reinterpret_cast<const float2*>(sc + 8 * nt + 2 * t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          acc[nt][2 * h] = fmaf(cs.x, d[nt][2 * h], acc[nt][2 * h]);
          acc[nt][2 * h + 1] = fmaf(cs.y, d[nt][2 * h + 1], acc[nt][2 * h + 1]);
        }
      }
      mbar_arrive(cfree + gk % kWsConv);
    };
    // Blocks of 8 k-tiles, each ending with every group retired: ptxas tracks the groups in
    // flight only within straight-line code, and a group still in flight across a loop's back
    // edge makes it serialise every wgmma of the kernel (C7514). So 7 of 8 folds overlap a group.
    for (int k0 = 0; k0 < KT; k0 += kChunkTiles) {
      issue(t0, k0);
#pragma unroll
      for (int u = 0; u < kChunkTiles; u += 2) {
        issue(t1, k0 + u + 1);
        wg::wait<1>();
        fold(t0, k0 + u);
        if (u + 2 < kChunkTiles) {
          issue(t0, k0 + u + 2);
          wg::wait<1>();
        } else {
          wg::wait<0>();
        }
        fold(t1, k0 + u + 1);
      }
    }
    done += KT;

    // Epilogue (SiLU: columns 64 i + 0 .. 31 of the tile are the gate and + 32 .. 63 the up of
    // the column half's 32 outputs), while the producer fills the ring for the next tile.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t m = m0 + rb + g + 8 * h;
      if (m >= m_end) continue;
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        constexpr int NTO = SILU ? 4 : 8;
#pragma unroll
        for (int nt = 0; nt < NTO; ++nt) {
          const float* a0 = acc[8 * i + nt];
          if constexpr (SILU) {
            const float* u = acc[8 * i + nt + 4];
            const int64_t col = int64_t(bx) * 64 + i * 32 + nt * 8 + 2 * t;
            store_pair(p, m, col, silu_f(a0[2 * h]) * u[2 * h], silu_f(a0[2 * h + 1]) * u[2 * h + 1]);
          } else {
            const int64_t col = int64_t(bx) * BN + i * 64 + nt * 8 + 2 * t;
            store_pair(p, m, col, a0[2 * h], a0[2 * h + 1]);
          }
        }
      }
    }
  }
}

// One thread per 8 k of a row (coalesced float4 loads), four per 32-k chunk: hi/lo planes in the
// permuted order, staged in shared memory so that each block stores its 4 KB of each plane as
// contiguous 16-byte words, and (8 threads) the fp32 sum of the row's 64-group.
// Chunk position o = 16 s + 8 h + 2 t + e holds k = 8 t + 2 s + h + 4 e: thread t of a chunk
// holds k 8 t .. 8 t + 7 and writes the pairs (e = 0, 1) of m = 2 s + h into word 4 m + t.
constexpr int kSplitThreads = 256;
__global__ void __launch_bounds__(kSplitThreads) pipe_split_kernel(const PipeSplitArgs a) {
  __shared__ uint32_t whi[kSplitThreads * 4], wlo[kSplitThreads * 4];
  const int tid = threadIdx.x;
  const int64_t per_row = a.K / 8, total = a.rows * per_row;
  const int64_t i = int64_t(blockIdx.x) * kSplitThreads + tid;
  const bool ok = i < total;
  const int64_t r = ok ? i / per_row : 0, c8 = ok ? i % per_row : 0;
  float x[8] = {};
  if (ok) {
    const float4* src = reinterpret_cast<const float4*>(a.A + r * a.lda + 8 * c8);
    const float4 v0 = src[0], v1 = src[1];
    x[0] = v0.x, x[1] = v0.y, x[2] = v0.z, x[3] = v0.w;
    x[4] = v1.x, x[5] = v1.y, x[6] = v1.z, x[7] = v1.w;
  }
  float part = ((x[0] + x[1]) + (x[2] + x[3])) + ((x[4] + x[5]) + (x[6] + x[7]));
  part += __shfl_xor_sync(0xffffffffu, part, 1);  // the 8 threads of a 64-group (K % 64 == 0:
  part += __shfl_xor_sync(0xffffffffu, part, 2);  // groups never straddle rows or warps)
  part += __shfl_xor_sync(0xffffffffu, part, 4);
  const int t = tid & 3, lc = tid >> 2;
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const uint32_t hv = pf::pack_bf16(x[m], x[m + 4]);
    whi[16 * lc + 4 * m + t] = hv;
    wlo[16 * lc + 4 * m + t] = pf::pack_bf16(x[m] - pf::bf16_lo(hv), x[m + 4] - pf::bf16_hi(hv));
  }
  if (ok && a.sum && (c8 & 7) == 0) a.sum[r * (a.K / 64) + c8 / 8] = part;
  __syncthreads();
  if (!ok) return;
  // Thread tid stores words 4 tid .. 4 tid + 3 (chunk lc, whose four threads are all in range).
  const int64_t w0 = int64_t(blockIdx.x) * kSplitThreads * 4;  // the block's first word
  reinterpret_cast<uint4*>(a.hi)[w0 / 4 + tid] = reinterpret_cast<const uint4*>(whi)[tid];
  if (a.lo) reinterpret_cast<uint4*>(a.lo)[w0 / 4 + tid] = reinterpret_cast<const uint4*>(wlo)[tid];
}

std::once_flag g_pipe_once;

template <DFmt F>
constexpr int kSmemBytes = PipeLayout<F>::kBytes + 1024;  // + the slack of the 1024-byte alignment

template <DFmt F, bool SILU, bool WG>
void launch(const PrefillGemmArgs& a, cudaStream_t s) {
  const unsigned gx = unsigned(SILU ? (a.N + 63) / 64 : (a.N + BN - 1) / BN);
  const unsigned gy = unsigned(a.groups > 0 ? a.max_tiles : (a.M + BM - 1) / BM);
  pipe_gemm_kernel<F, SILU, WG><<<dim3(gx, gy), kThreads, kSmemBytes<F>, s>>>(a);
  KCUDA_LAUNCH("prefill_pipe_gemm");
}

template <DFmt F, bool SILU, int NB, bool X = false>
void launch_dq(const PrefillGemmArgs& a, cudaStream_t s) {
  const unsigned gx = unsigned(SILU ? (a.N + NB / 2 - 1) / (NB / 2) : (a.N + NB - 1) / NB);
  const unsigned gy = unsigned(a.groups > 0 ? a.max_tiles : (a.M + BM - 1) / BM);
  pipe_dq_kernel<F, SILU, NB, X><<<dim3(gx, gy), kThreads, DqLayout<F, NB, X>::kBytes + 1024, s>>>(a);
  KCUDA_LAUNCH(X ? "prefill_pipe_pp_gemm" : "prefill_pipe_dq_gemm");
}
template <DFmt F, int NB>
void set_dq_smem() {
  const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
  KCUDA(cudaFuncSetAttribute(pipe_dq_kernel<F, false, NB>, attr, DqLayout<F, NB>::kBytes + 1024));
  KCUDA(cudaFuncSetAttribute(pipe_dq_kernel<F, true, NB>, attr, DqLayout<F, NB>::kBytes + 1024));
}

constexpr int kWsSmemBytes = WsLayout::kBytes + 1024;
constexpr int kRsSmemBytes = RsLayout::kBytes + 1024;

// Grouped with tail_off: the BM-token tiles, then the tail tiles (at most one per group).
template <bool SILU>
void launch_rs(const PrefillGemmArgs& a, cudaStream_t s) {
  const unsigned gx = unsigned(SILU ? (a.N + 63) / 64 : (a.N + BN - 1) / BN);
  const unsigned gy = unsigned(a.groups > 0 ? a.max_tiles : (a.M + BM - 1) / BM);
  pipe_rs_kernel<SILU, BM><<<dim3(gx, gy), kThreads, kRsSmemBytes, s>>>(a);
  KCUDA_LAUNCH("prefill_pipe_rs_gemm");
  if (a.groups > 0 && a.tail_off) {
    pipe_rs_kernel<SILU, kRsTail><<<dim3(gx, unsigned(a.groups)), kThreads, kRsSmemBytes, s>>>(a);
    KCUDA_LAUNCH("prefill_pipe_rs_gemm_tail");
  }
}

template <bool SILU>
void launch_ws(const PrefillGemmArgs& a, cudaStream_t s) {
  static const int sms = [] {
    int dev = 0, n = 0;
    KCUDA(cudaGetDevice(&dev));
    KCUDA(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev));
    return n;
  }();
  const int64_t gx = SILU ? (a.N + 63) / 64 : (a.N + BN - 1) / BN;
  const int64_t gy = a.groups > 0 ? a.max_tiles : (a.M + BM - 1) / BM;
  const int ntiles = int(gx * gy);  // (< 2^31: the caller's launches have at most 65535 row tiles)
  if (ntiles == 0) return;
  const int grid = prefill_pipe_ws_grid() == PipeWsGrid::Persistent ? std::min(ntiles, sms) : ntiles;
  pipe_ws_kernel<SILU><<<grid, kWsThreads, kWsSmemBytes, s>>>(a, ntiles);
  KCUDA_LAUNCH("prefill_pipe_ws_gemm");
}

}  // namespace

void prefill_pipe_init() {
  std::call_once(g_pipe_once, [] {
    const auto attr = cudaFuncAttributeMaxDynamicSharedMemorySize;
    KCUDA(cudaFuncSetAttribute(pipe_gemm_kernel<DFmt::Q4, false, false>, attr, kSmemBytes<DFmt::Q4>));
    KCUDA(cudaFuncSetAttribute(pipe_gemm_kernel<DFmt::Q4, true, false>, attr, kSmemBytes<DFmt::Q4>));
    KCUDA(cudaFuncSetAttribute(pipe_gemm_kernel<DFmt::Q4, false, true>, attr, kSmemBytes<DFmt::Q4>));
    KCUDA(cudaFuncSetAttribute(pipe_gemm_kernel<DFmt::Q4, true, true>, attr, kSmemBytes<DFmt::Q4>));
    KCUDA(cudaFuncSetAttribute(pipe_gemm_kernel<DFmt::BF16, false, false>, attr, kSmemBytes<DFmt::BF16>));
    KCUDA(cudaFuncSetAttribute(pipe_gemm_kernel<DFmt::BF16, true, false>, attr, kSmemBytes<DFmt::BF16>));
    set_dq_smem<DFmt::Q4, 128>();
    set_dq_smem<DFmt::Q4, 256>();
    set_dq_smem<DFmt::BF16, 128>();
    constexpr int pp_bytes = DqLayout<DFmt::Q4, 128, true>::kBytes + 1024;
    KCUDA(cudaFuncSetAttribute(pipe_dq_kernel<DFmt::Q4, false, 128, true>, attr, pp_bytes));
    KCUDA(cudaFuncSetAttribute(pipe_dq_kernel<DFmt::Q4, true, 128, true>, attr, pp_bytes));
    KCUDA(cudaFuncSetAttribute(pipe_ws_kernel<false>, attr, kWsSmemBytes));
    KCUDA(cudaFuncSetAttribute(pipe_ws_kernel<true>, attr, kWsSmemBytes));
    KCUDA(cudaFuncSetAttribute(pipe_rs_kernel<false, BM>, attr, kRsSmemBytes));
    KCUDA(cudaFuncSetAttribute(pipe_rs_kernel<true, BM>, attr, kRsSmemBytes));
    KCUDA(cudaFuncSetAttribute(pipe_rs_kernel<false, kRsTail>, attr, kRsSmemBytes));
    KCUDA(cudaFuncSetAttribute(pipe_rs_kernel<true, kRsTail>, attr, kRsSmemBytes));
  });
}

void prefill_pipe_gemm_launch(const PrefillGemmArgs& a, cudaStream_t s) {
  prefill_pipe_init();
  const bool silu = a.epi == GemmEpi::SiluMul;
  const PipeMma mma = pipe_mma_for(prefill_pipe_q4_mma(), a.K);
  if (mma == PipeMma::Dq) {  // both formats
    if (a.W.fmt != DFmt::Q4) silu ? launch_dq<DFmt::BF16, true, 128>(a, s) : launch_dq<DFmt::BF16, false, 128>(a, s);
    else if (prefill_pipe_dq_wide()) silu ? launch_dq<DFmt::Q4, true, 256>(a, s) : launch_dq<DFmt::Q4, false, 256>(a, s);
    else silu ? launch_dq<DFmt::Q4, true, 128>(a, s) : launch_dq<DFmt::Q4, false, 128>(a, s);
  } else if (a.W.fmt == DFmt::Q4) {
    switch (mma) {
      case PipeMma::Auto:       // (resolved above)
      case PipeMma::Dq: break;  // (above)
      case PipeMma::Pp:
        silu ? launch_dq<DFmt::Q4, true, 128, true>(a, s) : launch_dq<DFmt::Q4, false, 128, true>(a, s);
        break;
      case PipeMma::Ws: silu ? launch_ws<true>(a, s) : launch_ws<false>(a, s); break;
      case PipeMma::Rs: silu ? launch_rs<true>(a, s) : launch_rs<false>(a, s); break;
      case PipeMma::Wgmma: silu ? launch<DFmt::Q4, true, true>(a, s) : launch<DFmt::Q4, false, true>(a, s); break;
      case PipeMma::Sync: silu ? launch<DFmt::Q4, true, false>(a, s) : launch<DFmt::Q4, false, false>(a, s); break;
    }
  } else {
    silu ? launch<DFmt::BF16, true, false>(a, s) : launch<DFmt::BF16, false, false>(a, s);
  }
}

void prefill_pipe_split_launch(const PipeSplitArgs& a, cudaStream_t s) {
  const int64_t n = a.rows * (a.K / 8);
  pipe_split_kernel<<<unsigned((n + kSplitThreads - 1) / kSplitThreads), kSplitThreads, 0, s>>>(a);
  KCUDA_LAUNCH("prefill_pipe_split");
}

}  // namespace kestrel::cuda
