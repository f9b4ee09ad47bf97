// Small kernel families: step begin (token in, embedding row out, position bookkeeping on the
// device so a captured graph replays without host input), deterministic random fills for the
// synthetic model, and the host helpers of kernels.h.
#include "cuda/gemv_core.cuh"

#include <algorithm>
#include <cstring>

namespace kestrel::cuda {

unsigned long long pack_argmax_host(float v, uint32_t row) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return (static_cast<unsigned long long>(u) << 32) | (0xffffffffu - row);
}
int32_t unpack_argmax_host(unsigned long long key) {
  return int32_t(0xffffffffu - uint32_t(key & 0xffffffffull));
}

namespace {

__device__ __forceinline__ float embed_value(const DMat& e, int64_t row, int64_t k) {
  if (e.fmt == DFmt::BF16)
    return bf16_bits_to_f32(static_cast<const uint16_t*>(e.data)[row * e.cols + k]);
  const int bits = e.fmt == DFmt::Q4 ? 4 : 8;
  const int per = 32 / bits;
  const uint32_t wd = static_cast<const uint32_t*>(e.data)[row * (e.cols / per) + k / per];
  const uint32_t q = (wd >> (bits * (k % per))) & ((1u << bits) - 1u);
  const int64_t g = row * (e.cols / e.group) + k / e.group;
  return bf16_bits_to_f32(e.scales[g]) * float(q) + bf16_bits_to_f32(e.biases[g]);
}

__global__ void step_begin_kernel(const __grid_constant__ StepBeginArgs a) {
  __shared__ int tok_s;
  pdl_launch_dependents();
  pdl_wait();
  if (threadIdx.x == 0) {
    const int32_t t = a.argmax != nullptr
                          ? int32_t(0xffffffffu - uint32_t(*a.argmax & 0xffffffffull))
                          : *a.token;
    tok_s = t;
  }
  __syncthreads();
  const int32_t t = tok_s;
  for (int64_t k = threadIdx.x; k < a.embed.cols; k += blockDim.x) a.x[k] = embed_value(a.embed, t, k);
  if (threadIdx.x == 0) {
    *a.token = t;
    const int len = *a.len;
    a.history[len] = t;
    *a.pos = len;
    *a.len = len + 1;
    if (a.argmax != nullptr) *a.argmax = 0ull;
  }
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__device__ __forceinline__ float u01(uint64_t seed, size_t i) {
  return float(mix64(seed * 0x632be59bd9b4e019ull + i) >> 40) * (1.f / 16777216.f);
}

__global__ void fill_f32_kernel(float* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = lo + (hi - lo) * u01(seed, i);
}
__global__ void fill_bf16_kernel(uint16_t* p, size_t n, uint64_t seed, float lo, float hi) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __bfloat16_as_ushort(__float2bfloat16_rn(lo + (hi - lo) * u01(seed, i)));
}
__global__ void fill_u32_kernel(uint32_t* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = uint32_t(mix64(seed * 0x632be59bd9b4e019ull + i));
}
__global__ void fill_const_kernel(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = v;
}

int fill_blocks(size_t n) {
  const size_t b = (n + 255) / 256;
  return int(std::min<size_t>(b, size_t(num_sms()) * 32));
}

}  // namespace

void step_begin_launch(const StepBeginArgs& a, cudaStream_t s) {
  launch_pdl(step_begin_kernel, dim3(1), dim3(256), 0, s, a);
}

void fill_uniform_f32(float* p, size_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  if (n == 0) return;
  fill_f32_kernel<<<fill_blocks(n), 256, 0, s>>>(p, n, seed, lo, hi);
  KCUDA_LAUNCH("fill_f32_kernel");
}
void fill_uniform_bf16(uint16_t* p, size_t n, uint64_t seed, float lo, float hi, cudaStream_t s) {
  if (n == 0) return;
  fill_bf16_kernel<<<fill_blocks(n), 256, 0, s>>>(p, n, seed, lo, hi);
  KCUDA_LAUNCH("fill_bf16_kernel");
}
void fill_random_u32(uint32_t* p, size_t n, uint64_t seed, cudaStream_t s) {
  if (n == 0) return;
  fill_u32_kernel<<<fill_blocks(n), 256, 0, s>>>(p, n, seed);
  KCUDA_LAUNCH("fill_u32_kernel");
}
void fill_f32(float* p, size_t n, float v, cudaStream_t s) {
  if (n == 0) return;
  fill_const_kernel<<<fill_blocks(n), 256, 0, s>>>(p, n, v);
  KCUDA_LAUNCH("fill_const_kernel");
}

}  // namespace kestrel::cuda
