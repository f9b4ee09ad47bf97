// Helpers of the CUDA tests: GPU skip, random host matrices in every weight format, device copies,
// comparison with the first bad index printed.
#pragma once
#include "core/check.h"
#include "core/dtype.h"
#include "core/weights.h"
#include "cuda/cuda_backend.h"
#include "cuda/kernels.h"

#include <gtest/gtest.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace kestrel::cuda::test {

#define REQUIRE_GPU()                                                  \
  do {                                                                 \
    std::string why_;                                                  \
    if (!::kestrel::cuda::gpu_available(&why_))                        \
      GTEST_SKIP() << "no usable GPU (" << why_ << "): GPU test skipped"; \
  } while (0)

// Sets an environment variable for a scope (the route switches read at each launch) and puts
// back what was there before.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) setenv(name_.c_str(), old_.c_str(), 1);
    else unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_, old_;
  bool had_ = false;
};

inline std::vector<float> randv(size_t n, std::mt19937& g, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

// A host matrix with its own storage (BF16, or affine Q4/Q8 with random codes and scales).
struct HostMat {
  Mat m;
  std::vector<uint8_t> data;
  std::vector<uint16_t> scales, biases;
};
inline std::unique_ptr<HostMat> make_mat(WFormat f, int64_t rows, int64_t cols, std::mt19937& g,
                                         float std_ = 0.05f) {
  auto h = std::make_unique<HostMat>();
  h->m.fmt = f;
  h->m.rows = rows;
  h->m.cols = cols;
  h->m.group = 64;
  if (f == WFormat::BF16) {
    h->data.resize(size_t(rows * cols) * 2);
    auto* p = reinterpret_cast<uint16_t*>(h->data.data());
    std::normal_distribution<float> d(0.f, std_);
    for (int64_t i = 0; i < rows * cols; ++i) p[i] = f32_to_bf16(d(g));
  } else {
    const int bits = f == WFormat::Q4 ? 4 : 8;
    h->data.resize(size_t(rows * cols * bits / 8));
    for (auto& b : h->data) b = uint8_t(g());
    const size_t ng = size_t(rows * cols / 64);
    h->scales.resize(ng);
    h->biases.resize(ng);
    const float levels = float(1 << bits);
    const float s0 = std_ / (levels / std::sqrt(12.f));
    std::uniform_real_distribution<float> ds(0.7f * s0, 1.3f * s0), db(-0.2f, 0.2f);
    for (size_t i = 0; i < ng; ++i) {
      const float s = ds(g);
      h->scales[i] = f32_to_bf16(s);
      h->biases[i] = f32_to_bf16(-s * (levels - 1) / 2 * (1.f + db(g)));
    }
    h->m.scales = h->scales.data();
    h->m.biases = h->biases.data();
  }
  h->m.data = h->data.data();
  return h;
}

inline DFmt dfmt(WFormat f) {
  return f == WFormat::Q4 ? DFmt::Q4 : f == WFormat::Q8 ? DFmt::Q8 : DFmt::BF16;
}

// Device memory that frees itself.
struct DevBuf {
  void* p = nullptr;
  size_t n = 0;
  explicit DevBuf(size_t bytes) : n(bytes) { KCUDA(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~DevBuf() { cudaFree(p); }
  DevBuf(const DevBuf&) = delete;
  template <class T>
  T* as() const { return static_cast<T*>(p); }
};
template <class T>
inline std::unique_ptr<DevBuf> to_dev(const std::vector<T>& v) {
  auto b = std::make_unique<DevBuf>(v.size() * sizeof(T));
  KCUDA(cudaMemcpy(b->p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return b;
}
// Output buffer poisoned with NaN (0xFF bytes) so unwritten elements fail the comparison.
inline std::unique_ptr<DevBuf> poisoned(size_t nfloat) {
  auto b = std::make_unique<DevBuf>(nfloat * 4);
  KCUDA(cudaMemset(b->p, 0xff, nfloat * 4));
  return b;
}
// The same for n bf16 (or other 16-bit) elements.
inline std::unique_ptr<DevBuf> poisoned16(size_t n) {
  auto b = std::make_unique<DevBuf>(n * 2);
  KCUDA(cudaMemset(b->p, 0xff, n * 2));
  return b;
}
template <class T>
inline std::vector<T> to_host(const DevBuf& b, size_t n) {
  std::vector<T> v(n);
  KCUDA(cudaDeviceSynchronize());
  KCUDA(cudaMemcpy(v.data(), b.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

struct DevMat {
  std::unique_ptr<DevBuf> data, scales, biases;
  DMat d;
};
inline std::unique_ptr<DevMat> to_dev(const Mat& m) {
  auto r = std::make_unique<DevMat>();
  r->d.fmt = dfmt(m.fmt);
  r->d.rows = m.rows;
  r->d.cols = m.cols;
  r->d.group = m.group;
  const size_t db = r->d.row_bytes() * size_t(m.rows);
  r->data = std::make_unique<DevBuf>(db);
  KCUDA(cudaMemcpy(r->data->p, m.data, db, cudaMemcpyHostToDevice));
  if (m.fmt == WFormat::Q4 || m.fmt == WFormat::Q8) {
    const size_t ng = size_t(m.rows * (m.cols / m.group)) * 2;
    r->scales = std::make_unique<DevBuf>(ng);
    r->biases = std::make_unique<DevBuf>(ng);
    KCUDA(cudaMemcpy(r->scales->p, m.scales, ng, cudaMemcpyHostToDevice));
    KCUDA(cudaMemcpy(r->biases->p, m.biases, ng, cudaMemcpyHostToDevice));
    r->d.scales = r->scales->as<uint16_t>();
    r->d.biases = r->biases->as<uint16_t>();
  }
  r->d.data = r->data->p;
  return r;
}

// ||a - e|| / ||e|| over all elements; fails on any non-finite value, printing the first.
inline double rel_err(const std::vector<float>& a, const std::vector<float>& e, const char* what) {
  EXPECT_EQ(a.size(), e.size()) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < e.size(); ++i) {
    if (!std::isfinite(a[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << a[i] << " (expected " << e[i] << ")";
      return INFINITY;
    }
    num += double(a[i] - e[i]) * double(a[i] - e[i]);
    den += double(e[i]) * double(e[i]);
  }
  return std::sqrt(num / std::max(den, 1e-30));
}
// Elementwise |a-e| <= atol + rtol |e|, printing the first violation.
inline void expect_close(const std::vector<float>& a, const std::vector<float>& e, float atol,
                         float rtol, const std::string& what) {
  ASSERT_EQ(a.size(), e.size()) << what;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::fabs(a[i] - e[i]) <= atol + rtol * std::fabs(e[i]))) {
      ADD_FAILURE() << what << ": first bad index " << i << ": got " << a[i] << ", expected " << e[i];
      return;
    }
}

}  // namespace kestrel::cuda::test
