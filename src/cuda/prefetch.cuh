// Device side of the decode step's L2 prefetch (kernels.h: L2Prefetch, ExpertPrefetch): the lanes
// of one warp of each block issue cp.async.bulk.prefetch.L2 for the block's part of every range.
// The instruction is asynchronous and changes no memory, so the issuing kernel neither waits for
// it nor depends on it; it only warms L2 for a later kernel.
#pragma once
#include "cuda/common.cuh"
#include "cuda/prefetch.h"

namespace kestrel::cuda {

__device__ __forceinline__ void bulk_prefetch_l2(uint64_t addr, uint32_t bytes) {
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(addr), "r"(bytes) : "memory");
}

// Issues span s in pieces of <= kPrefetchPiece bytes, lane `lane` of `lanes` taking every
// lanes-th piece.
__device__ __forceinline__ void prefetch_span(ByteSpan s, int lane, int lanes) {
  for (uint64_t a = s.begin + uint64_t(lane) * kPrefetchPiece; a < s.end; a += uint64_t(lanes) * kPrefetchPiece) {
    const uint64_t n = s.end - a < kPrefetchPiece ? s.end - a : kPrefetchPiece;
    bulk_prefetch_l2(a, uint32_t(n));
  }
}

// This block's part of every range (blocks numbered linearly over the whole grid); call from one
// warp (lane = threadIdx.x & 31).
__device__ __forceinline__ void l2_prefetch_warp(const L2Prefetch& pf, int lane) {
  const uint64_t parts = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
  const uint64_t part = blockIdx.x + uint64_t(gridDim.x) * (blockIdx.y + uint64_t(gridDim.y) * blockIdx.z);
  for (int i = 0; i < pf.n; ++i)
    prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(pf.ptr[i]), pf.bytes[i], part, parts), lane, 32);
}
// Call with every thread of the block: warp 0 issues (a handful of instructions per lane).
__device__ __forceinline__ void l2_prefetch(const L2Prefetch& pf) {
  if (pf.n > 0 && threadIdx.x < 32) l2_prefetch_warp(pf, threadIdx.x);
}

__device__ __forceinline__ uint64_t dmat_row_bytes(const DMat& w) {
  return w.fmt == DFmt::BF16 ? uint64_t(w.cols) * 2 : w.fmt == DFmt::Q8 ? uint64_t(w.cols) : uint64_t(w.cols) / 2;
}

// Part `part` of `parts` of rows [row0, row0 + nrows) of w (codes, and scales and biases for
// the affine formats), issued by lane `lane` of `lanes`.
__device__ __forceinline__ void prefetch_rows(const DMat& w, int64_t row0, int64_t nrows, uint64_t part,
                                              uint64_t parts, int lane, int lanes) {
  const uint64_t rb = dmat_row_bytes(w);
  prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(w.data) + uint64_t(row0) * rb, uint64_t(nrows) * rb,
                              part, parts),
                lane, lanes);
  if (w.fmt != DFmt::BF16) {
    const uint64_t gb = uint64_t(w.cols / w.group) * 2;  // bf16 scales (or biases) per row
    prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(w.scales) + uint64_t(row0) * gb, uint64_t(nrows) * gb,
                                part, parts),
                  lane, lanes);
    prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(w.biases) + uint64_t(row0) * gb, uint64_t(nrows) * gb,
                                part, parts),
                  lane, lanes);
  }
}

// Part `part` of `parts` of the selected experts' rows: experts idx[0..k) (device memory,
// written before this point and visible to the calling warp).
__device__ __forceinline__ void prefetch_experts(const ExpertPrefetch& pf, const int* idx, int k, uint64_t part,
                                                 uint64_t parts, int lane) {
  for (int j = 0; j < k; ++j) {
    const int e = idx[j];
    for (int m = 0; m < pf.nw; ++m)
      prefetch_rows(pf.w[m], int64_t(e) * pf.rows_per, pf.rows_per, part, parts, lane, 32);
  }
}

}  // namespace kestrel::cuda
