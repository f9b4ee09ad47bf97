// For the probes that compile one of the engine's kernel files into themselves (gemv_probe,
// moe_probe): the host helpers those files take from launchers.cpp (which needs the core
// library), and random affine weights. Include after the kernel file.
#pragma once
#include "probe_common.cuh"

#include "cuda/kernels.h"

namespace kestrel::cuda {
void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "CUDA error %s in %s at %s:%d\n", cudaGetErrorString(e), what, file, line);
    std::exit(1);
  }
}
int num_sms() {
  static int n = [] {
    int v = 0;
    cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, 0);
    return v;
  }();
  return n;
}
bool pdl_enabled() { return false; }
size_t pinned_smem(const void*, size_t dyn, int) { return dyn; }  // the probes run unpinned
int g_probe_gemv_version = 1;  // the GEMV route a probe runs (gemv_probe: 1, then 3)
int gemv_version() { return g_probe_gemv_version; }
int g_probe_stream_bps = 2;  // gemv_probe: route 5's blocks per SM
int gemv_stream_blocks_per_sm() { return g_probe_stream_bps; }
bool g_probe_moe_mma = false;  // moe_probe: the tensor-core gate/up for one row
bool moe_mma_enabled() { return g_probe_moe_mma; }
bool moe_down_takes_mma(const MoeDownArgs& a) { return a.down.fmt == DFmt::Q4 && g_probe_moe_mma && a.topk <= 8; }
int g_probe_gu_depth = 1;  // moe_probe: tiles in flight per tensor-core gate/up block
int moe_gate_up_depth() { return g_probe_gu_depth; }
bool g_probe_gemv_preload = true;  // gemv_probe: route 1's one-row GEMV preloads its first row
bool gemv_preload() { return g_probe_gemv_preload; }
size_t DMat::row_bytes() const {
  return fmt == DFmt::BF16 ? size_t(cols) * 2 : fmt == DFmt::Q8 ? size_t(cols) : size_t(cols) / 2;
}
size_t DMat::nbytes() const {
  return row_bytes() * size_t(rows) + (fmt == DFmt::BF16 ? 0 : 4 * size_t(rows) * size_t(cols / group));
}
}  // namespace kestrel::cuda

namespace probe {

__global__ void fill_u32(uint32_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t z = uint32_t(i) * 2654435761u ^ seed;
    z ^= z >> 15;
    z *= 2246822519u;
    z ^= z >> 13;
    p[i] = z;
  }
}
// bf16 scales in [0.001, 0.003), biases in [-0.01, 0.01): finite, small dots.
__global__ void fill_scales(uint16_t* s, uint16_t* b, size_t n) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float u = float((i * 7919u) % 1000u) / 1000.f;
    s[i] = uint16_t(__float_as_uint(0.001f + 0.002f * u) >> 16);
    b[i] = uint16_t(__float_as_uint(-0.01f + 0.02f * u) >> 16);
  }
}

// A random affine matrix (Q4 or Q8, group 64) in device memory.
inline kestrel::cuda::DMat affine_mat(int64_t rows, int64_t cols, uint32_t seed,
                                      kestrel::cuda::DFmt fmt = kestrel::cuda::DFmt::Q4) {
  kestrel::cuda::DMat m;
  m.fmt = fmt;
  m.rows = rows;
  m.cols = cols;
  m.group = 64;
  const size_t data = m.row_bytes() * size_t(rows), groups = size_t(rows) * size_t(cols / 64);
  void* d;
  uint16_t *s, *b;
  PROBE_CK(cudaMalloc(&d, data));
  PROBE_CK(cudaMalloc(&s, groups * 2));
  PROBE_CK(cudaMalloc(&b, groups * 2));
  fill_u32<<<1024, 256>>>(static_cast<uint32_t*>(d), data / 4, seed);
  fill_scales<<<1024, 256>>>(s, b, groups);
  m.data = d;
  m.scales = s;
  m.biases = b;
  return m;
}

inline float* dev_floats(size_t n, float v) {
  std::vector<float> h(n, v);
  float* d;
  PROBE_CK(cudaMalloc(&d, n * 4));
  PROBE_CK(cudaMemcpy(d, h.data(), n * 4, cudaMemcpyHostToDevice));
  return d;
}

}  // namespace probe
