// Device side of the decode step's L2 prefetch (kernels.h: L2Prefetch, ExpertPrefetch): every
// thread of each block issues prefetch.global.L2 for lines of the block's part of each range.
// Plain per-thread prefetches, not cp.async.bulk.prefetch: measured on the H200 (5ac9531), a
// block's bulk prefetches are processed one after another (~0.16 us each for 32 KB, ~0.3 us for
// small ones), and the kernel that issues them does not finish before they do: gdn_decode with 12
// small ranges per block went from 4.5 to 7.5 us, one block prefetching 13.5 MB took 66 us.
// A line prefetch is one load-pipe instruction with no destination: the issuing warp neither waits
// for it nor depends on it; it only warms L2 for a later kernel.
#pragma once
#include "cuda/common.cuh"
#include "cuda/prefetch.h"

namespace kestrel::cuda {

constexpr uint64_t kL2Line = 128;

__device__ __forceinline__ void prefetch_line_l2(uint64_t addr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(addr));
}

// Every line of span s, thread t of nt taking every nt-th line (consecutive addresses differ by
// one line, so each line that meets [begin, end) is touched).
__device__ __forceinline__ void prefetch_span(ByteSpan s, int t, int nt) {
  for (uint64_t a = s.begin + uint64_t(t) * kL2Line; a < s.end; a += uint64_t(nt) * kL2Line) prefetch_line_l2(a);
}

// This block's part of every range (blocks numbered linearly over the whole grid). Call with
// every thread of the block (a few instructions per thread).
__device__ __forceinline__ void l2_prefetch(const L2Prefetch& pf) {
  if (pf.n == 0) return;
  const uint64_t parts = uint64_t(gridDim.x) * gridDim.y * gridDim.z;
  const uint64_t part = blockIdx.x + uint64_t(gridDim.x) * (blockIdx.y + uint64_t(gridDim.y) * blockIdx.z);
  const int nt = int(blockDim.x * blockDim.y * blockDim.z);
  const int t = int(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  for (int i = 0; i < pf.n; ++i)
    prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(pf.ptr[i]), pf.bytes[i], part, parts), t, nt);
}

__device__ __forceinline__ uint64_t dmat_row_bytes(const DMat& w) {
  return w.fmt == DFmt::BF16 ? uint64_t(w.cols) * 2 : w.fmt == DFmt::Q8 ? uint64_t(w.cols) : uint64_t(w.cols) / 2;
}

// Part `part` of `parts` of rows [row0, row0 + nrows) of w (codes, and scales and biases for
// the affine formats), thread t of nt.
__device__ __forceinline__ void prefetch_rows(const DMat& w, int64_t row0, int64_t nrows, uint64_t part,
                                              uint64_t parts, int t, int nt) {
  const uint64_t rb = dmat_row_bytes(w);
  prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(w.data) + uint64_t(row0) * rb, uint64_t(nrows) * rb,
                              part, parts),
                t, nt);
  if (w.fmt != DFmt::BF16) {
    const uint64_t gb = uint64_t(w.cols / w.group) * 2;  // bf16 scales (or biases) per row
    prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(w.scales) + uint64_t(row0) * gb, uint64_t(nrows) * gb,
                                part, parts),
                  t, nt);
    prefetch_span(prefetch_part(reinterpret_cast<uint64_t>(w.biases) + uint64_t(row0) * gb, uint64_t(nrows) * gb,
                                part, parts),
                  t, nt);
  }
}

// This block's part of the selected experts' rows, experts idx[0..k) (device memory written
// before this kernel); call with every thread of a 1-D block.
__device__ __forceinline__ void prefetch_experts(const ExpertPrefetch& pf, const int* idx, int k) {
  for (int j = 0; j < k; ++j) {
    const int e = idx[j];
    for (int m = 0; m < pf.nw; ++m)
      prefetch_rows(pf.w[m], int64_t(e) * pf.rows_per, pf.rows_per, blockIdx.x, gridDim.x, threadIdx.x,
                    blockDim.x);
  }
}

}  // namespace kestrel::cuda
