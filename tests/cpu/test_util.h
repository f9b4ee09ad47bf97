// Shared helpers of the CPU tests.
#pragma once
#include <filesystem>
#include <random>
#include <vector>

namespace kestrel {

inline std::filesystem::path fixtures_dir() { return KESTREL_FIXTURES; }

inline std::vector<float> random_vec(size_t n, uint64_t seed, float scale = 1.f) {
  std::mt19937_64 g(seed);
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

}  // namespace kestrel
