// How an L2 prefetch range (kernels.h: L2Prefetch, ExpertPrefetch) is divided among the blocks of
// the launch that issues it. Plain C++ shared by the device code (prefetch.cuh) and the CPU tests.
// A block's part is cut from the 16-byte aligned interior of the range and never leaves it (a
// range's unaligned head and tail, < 16 bytes each, are left to the reader).
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define KESTREL_HD __host__ __device__
#else
#define KESTREL_HD
#endif

namespace kestrel::cuda {

struct ByteSpan {
  uint64_t begin = 0, end = 0;  // addresses, [begin, end), both multiples of 16
};

// Part `part` of `parts` (0 <= part < parts) of the aligned interior of [p, p + bytes): the
// parts are consecutive and disjoint and together cover the interior; each is at most
// ceil(units / parts) 16-byte units (the trailing parts may be shorter or empty).
KESTREL_HD inline ByteSpan prefetch_part(uint64_t p, uint64_t bytes, uint64_t part, uint64_t parts) {
  const uint64_t a0 = (p + 15) & ~uint64_t(15);
  const uint64_t a1 = (p + bytes) & ~uint64_t(15);
  if (bytes == 0 || a1 <= a0 || parts == 0 || part >= parts) return {};
  const uint64_t units = (a1 - a0) / 16;
  const uint64_t per = (units + parts - 1) / parts;
  uint64_t s = per * part, e = s + per;
  if (s > units) s = units;
  if (e > units) e = units;
  return {a0 + 16 * s, a0 + 16 * e};
}

}  // namespace kestrel::cuda
