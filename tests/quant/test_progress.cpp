// The load progress bar (non-terminal output: one line per 10%) and the resident-memory probe.
#include "quant/progress.h"

#include "core/safetensors.h"

#include <filesystem>
#include <fstream>
#include <unistd.h>

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

TEST(Progress, ReleasedFilePagesLeaveTheResidentSetAndStayReadable) {
  const auto path = std::filesystem::temp_directory_path() / ("kestrel-quant-pages-" + std::to_string(getpid()));
  const size_t n = size_t(32) << 20;
  {
    std::vector<char> data(n);
    for (size_t i = 0; i < n; ++i) data[i] = char(i * 131 % 251);
    std::ofstream(path, std::ios::binary).write(data.data(), std::streamsize(n));
  }
  {
    MappedFile f(path);
    ASSERT_EQ(f.size(), n);
    uint64_t sum = 0;
    for (size_t i = 0; i < n; i += 64) sum += f.data()[i];
    const size_t touched = quant::resident_bytes();
    quant::release_pages(f.data() + 1, n - 1);  // partial first page kept
    const size_t released = quant::resident_bytes();
    EXPECT_LE(released + (size_t(24) << 20), touched) << touched << " -> " << released;
    uint64_t again = 0;
    for (size_t i = 0; i < n; i += 64) again += f.data()[i];
    EXPECT_EQ(sum, again);
    EXPECT_EQ(f.data()[12345], char(12345 * 131 % 251));
  }
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace kestrel
