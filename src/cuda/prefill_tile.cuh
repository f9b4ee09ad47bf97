// What the prefill GEMM kernels share around their main loops (device code: include from .cu
// files only): the rows of a block's tile (dense or grouped) and the epilogue store of one pair of
// adjacent output columns (row scatter, row scale, bf16 or fp32 output, residual add); used by
// the Reg (prefill_gemm.cu) and Pipe (prefill_pipe.cu) kernels.
#pragma once
#ifndef __CUDACC__
#error "prefill_tile.cuh is device code: include it from .cu files only"
#endif
#include "cuda/prefill.h"
#include "cuda/prefill_mma.h"

namespace kestrel::cuda {

// The group of tile `tile` in a prefix of tiles per group (off [groups + 1], tile < off[groups]):
// the largest g with off[g] <= tile, a group with tiles.
__device__ __forceinline__ int group_of_tile(const int* off, int groups, int tile) {
  int lo = 0, hi = groups - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (off[mid] <= tile) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// Grouped tile `tile` of the tile_off prefix: rows [m0, m_end) of group grp; false past the last.
__device__ __forceinline__ bool group_tile_rows(const PrefillGemmArgs& p, int bm, int tile, int64_t& m0,
                                                int64_t& m_end, int64_t& grp) {
  if (tile >= p.tile_off[p.groups]) return false;
  const int g = group_of_tile(p.tile_off, p.groups, tile);
  grp = g;
  m0 = p.group_off[g] + int64_t(tile - p.tile_off[g]) * bm;
  m_end = p.group_off[g + 1];
  return true;
}

// This block's tile: rows [m0, m_end) of BM-row dense tiles, or (grouped) tile blockIdx.y of the
// groups' tiles, of group grp; false when a grouped tile lies past the last one.
__device__ __forceinline__ bool tile_rows(const PrefillGemmArgs& p, int bm, int64_t& m0, int64_t& m_end,
                                          int64_t& grp) {
  grp = 0;
  if (p.groups == 0) {
    m0 = int64_t(blockIdx.y) * bm;
    m_end = p.M;
    return true;
  }
  return group_tile_rows(p, bm, int(blockIdx.y), m0, m_end, grp);
}

// Output row m (before the scatter), columns col, col + 1 (those < N).
__device__ __forceinline__ void store_pair(const PrefillGemmArgs& p, int64_t m, int64_t col, float v0,
                                           float v1) {
  const int64_t crow = p.c_rows ? int64_t(p.c_rows[m]) : m;
  if (p.row_scale) {
    const float sc = p.row_scale[crow];
    v0 *= sc;
    v1 *= sc;
  }
  const bool vec2 = (p.ldc & 1) == 0;
  if (p.C16) {
    uint16_t* c16 = p.C16 + crow * p.ldc;
    if (col + 1 < p.N && vec2) {
      *reinterpret_cast<uint32_t*>(c16 + col) = pf::pack_bf16(v0, v1);
    } else {
      if (col < p.N) c16[col] = __bfloat16_as_ushort(__float2bfloat16_rn(v0));
      if (col + 1 < p.N) c16[col + 1] = __bfloat16_as_ushort(__float2bfloat16_rn(v1));
    }
    return;
  }
  float* c = p.C + crow * p.ldc;
  const bool residual = p.epi == GemmEpi::Residual;
  if (col + 1 < p.N && vec2) {
    float2* q = reinterpret_cast<float2*>(c + col);
    if (residual) {
      const float2 o = *q;
      v0 += o.x;
      v1 += o.y;
    }
    *q = make_float2(v0, v1);
  } else {
    if (col < p.N) c[col] = residual ? c[col] + v0 : v0;
    if (col + 1 < p.N) c[col + 1] = residual ? c[col + 1] + v1 : v1;
  }
}

}  // namespace kestrel::cuda
