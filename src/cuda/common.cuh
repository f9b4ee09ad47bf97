// Shared device-side helpers of the CUDA backend: error checks, the device weight view (DMat),
// warp reductions. Every kernel family includes this; nothing here launches work.
#pragma once
// No fmt / kestrel::Error in .cu files (nvcc cannot compile fmt 9's C++20 consteval checks): the
// validated launchers live in launchers.cpp and call the raw *_launch functions of launch.h.
#include "cuda/launch.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <utility>

namespace kestrel::cuda {

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Sum over aligned groups of G lanes (G a power of two <= 32).
template <int G>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int o = G / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float bf16_bits_to_f32(uint16_t h) {
  return __uint_as_float(uint32_t(h) << 16);
}
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }

// Block-wide sum (blockDim.x a multiple of 32, <= 1024); `red` is >= 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* red) {
  v = warp_sum(v);
  const int w = threadIdx.x >> 5, l = threadIdx.x & 31;
  __syncthreads();
  if (l == 0) red[w] = v;
  __syncthreads();
  const int nw = blockDim.x >> 5;
  float t = l < nw ? red[l] : 0.f;
  return warp_sum(t);
}

// Programmatic dependent launch (sm_90): every kernel waits for its predecessor in pdl_wait (until
// that grid has finished and its writes are visible); work that reads nothing the predecessor
// writes (weight prefetch, barrier setup) goes before the wait. So may reads of what was written
// two or more launches back (the GDN state, the KV cache, the step's position), provided the
// predecessor triggers only after its own pdl_wait (every kernel below that fills the GPU does;
// of the top-triggering ones, step_begin and the routing kernel, no successor reads early): its
// trigger then implies that everything before it has completed. pdl_launch_dependents lets the
// next kernel's blocks start launching once every block of this grid has called it or exited
// (the first call in a block counts). Where it goes: a kernel whose blocks fill the GPU calls it
// once its main loop is done, so the next kernel's launch and prologue overlap only the tail;
// the small ones (a block or a few) call it at the top, and so does the GDN step (one wave of
// 128 blocks; gdn.cu) once its state loads are out. Until bench/NOTES.md v13 every kernel
// called it at the top and PDL lost 3-10 %; moving the triggers alone did not change that for q4,
// pinning the per-SM-sized grids' blocks per SM (kernels.h, pinned_smem) did: the block scheduler
// had stacked them unevenly on the SMs the predecessor left free. Both are no-ops without the
// launch attribute.
__device__ __forceinline__ void pdl_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Launches `k` with the PDL attribute when pdl_enabled().
template <typename... KArgs, typename... Args>
inline void launch_pdl(void (*k)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t s,
                       Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = pdl_enabled() ? 1 : 0;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  KCUDA(cudaLaunchKernelEx(&cfg, k, std::forward<Args>(args)...));
}

}  // namespace kestrel::cuda
