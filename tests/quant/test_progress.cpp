// The load progress bar (non-terminal output: one line per 10%) and the resident-memory probe.
#include "quant/progress.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

namespace kestrel {
namespace {

TEST(Progress, NonTerminalPrintsALineEveryTenPercent) {
  std::FILE* f = std::tmpfile();
  ASSERT_NE(f, nullptr);
  const auto bar = quant::progress_bar("loading", f);
  for (size_t d = 0; d <= 1000; d += 7) bar({d, 1000});
  bar({1000, 1000});
  std::rewind(f);
  std::string text;
  char buf[256];
  while (std::fgets(buf, sizeof buf, f)) text += buf;
  std::fclose(f);
  int lines = 0;
  for (char c : text) lines += c == '\n';
  EXPECT_EQ(lines, 10) << text;
  EXPECT_NE(text.find("loading: 100% (0.00 / 0.00 GB)"), std::string::npos) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos);
}

TEST(Progress, ResidentBytesGrowsWithTouchedMemory) {
  const size_t before = quant::resident_bytes();
  ASSERT_GT(before, 0u);
  std::vector<char> v(size_t(32) << 20, 1);  // 32 MiB, touched
  const size_t after = quant::resident_bytes();
  EXPECT_GE(after, before + (size_t(24) << 20)) << before << " -> " << after;
  EXPECT_EQ(v[12345], 1);
}

}  // namespace
}  // namespace kestrel
