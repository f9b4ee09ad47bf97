// The division of an L2 prefetch range among the blocks of a launch (src/cuda/prefetch.h; plain
// C++, so it is tested here on the CPU): every part lies in the 16-byte aligned interior of the
// range, the parts are consecutive and disjoint, and together they cover the interior exactly.
#include "cuda/prefetch.h"

#include <gtest/gtest.h>

#include <random>

namespace kestrel::cuda {
namespace {

void check_parts(uint64_t p, uint64_t bytes, uint64_t parts) {
  const uint64_t a0 = (p + 15) / 16 * 16, a1 = (p + bytes) / 16 * 16;
  const uint64_t interior = a1 > a0 ? a1 - a0 : 0;
  const uint64_t cap = parts ? ((interior / 16 + parts - 1) / parts) * 16 : 0;
  uint64_t next = a0, covered = 0;
  for (uint64_t i = 0; i < parts; ++i) {
    const ByteSpan s = prefetch_part(p, bytes, i, parts);
    if (s.begin == s.end) continue;  // empty parts carry no address
    ASSERT_EQ(s.begin % 16, 0u);
    ASSERT_EQ(s.end % 16, 0u);
    ASSERT_GE(s.begin, p);
    ASSERT_LE(s.end, p + bytes) << "part " << i << " of " << parts << " leaves the range";
    ASSERT_EQ(s.begin, next) << "part " << i << " of " << parts << " is not consecutive";
    ASSERT_LE(s.end - s.begin, cap);
    next = s.end;
    covered += s.end - s.begin;
  }
  EXPECT_EQ(covered, interior) << "p " << p << " bytes " << bytes << " parts " << parts;
}

TEST(PrefetchPart, CoversTheAlignedInteriorExactly) {
  std::mt19937_64 rng(7);
  for (int it = 0; it < 4000; ++it) {
    const uint64_t p = 0x7f0000000000ull + (rng() % 4096);
    const uint64_t bytes = it % 3 == 0 ? rng() % 64 : rng() % (64ull << 20);
    const uint64_t parts = 1 + rng() % 600;
    check_parts(p, bytes, parts);
  }
}

TEST(PrefetchPart, EdgeCases) {
  // Nothing aligned inside: no part.
  for (uint64_t i = 0; i < 4; ++i) {
    const ByteSpan s = prefetch_part(0x1001, 20, i, 4);
    EXPECT_EQ(s.begin, s.end);
  }
  EXPECT_EQ(prefetch_part(0x1000, 0, 0, 1).end, 0u);
  EXPECT_EQ(prefetch_part(0x1000, 4096, 1, 1).end, 0u);  // part >= parts
  EXPECT_EQ(prefetch_part(0x1000, 4096, 0, 0).end, 0u);  // no parts
  // One part: the whole aligned range.
  const ByteSpan one = prefetch_part(0x1000, 4096, 0, 1);
  EXPECT_EQ(one.begin, 0x1000u);
  EXPECT_EQ(one.end, 0x2000u);
  // More parts than 16-byte units: the first units get one each, the rest are empty.
  check_parts(0x1000, 64, 528);
  EXPECT_EQ(prefetch_part(0x1000, 64, 3, 528).begin, 0x1030u);
  EXPECT_EQ(prefetch_part(0x1000, 64, 4, 528).begin, prefetch_part(0x1000, 64, 4, 528).end);
  // A real case: a 13.5 MB input projection split over moe_down's 256 blocks.
  check_parts(0x7f1234560000ull, 13631488 + 12, 256);
}

}  // namespace
}  // namespace kestrel::cuda
