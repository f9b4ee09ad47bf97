// Micro-benchmark of the dependency primitives a persistent / fused decode kernel is built on,
// on the GPU machine: what one kernel boundary costs in a CUDA graph, and what one in-kernel
// "producers publish a count, consumers wait for it" step costs, in its variants (who fences,
// how the waiters poll). Build and run (tools/gpu_check.sh does):
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a tools/device/sync_probe.cu -o sync_probe
//   ./sync_probe > sync_probe.json
// Each case is a graph of kNodes kernel nodes replayed kReps times; the figure is the median
// replay time / kNodes (microseconds per launch). Not a test: it prints measurements.
#include "probe_common.cuh"

#include <string>

#define CK(x) PROBE_CK(x)

constexpr int kNodes = 100;
constexpr int kReps = 15;

__global__ void empty_kernel(int* sink) {
  if (sink != nullptr && threadIdx.x == 0 && blockIdx.x == 1u << 30) *sink = 1;
}

enum Fence : int { kFenceThread0 = 0, kFenceAll = 1 };
enum Poll : int { kPollAcquireSleep = 0, kPollVolatile = 1, kPollAcquire = 2 };

// Blocks [0, np) publish, blocks [np, grid) wait for the count np, then the last waiter resets.
// With np == grid (no waiters) the count is not reset: pass a scratch counter.
__global__ void publish_wait_kernel(unsigned* c, int np, int fence, int poll, int work) {
  float v = float(threadIdx.x);
  for (int i = 0; i < work; ++i) v = v * 0.999f + 1.f;  // a little independent work per block
  if (v == -1.f) c[1] = 7u;                            // never: keeps the loop
  if (int(blockIdx.x) < np) {
    if (fence == kFenceAll) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      if (fence == kFenceThread0) __threadfence();
      atomicAdd(c, 1u);
    }
  } else {
    if (threadIdx.x == 0) {
      const long long t0 = clock64();
      for (;;) {
        unsigned x;
        if (poll == kPollVolatile) {
          x = *reinterpret_cast<volatile unsigned*>(c);
        } else {
          asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(x) : "l"(c) : "memory");
        }
        if (x >= unsigned(np)) break;
        if (poll == kPollAcquireSleep) __nanosleep(32);
        if (clock64() - t0 > (1ll << 32)) __trap();
      }
      if (poll == kPollVolatile) __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0 && atomicAdd(c + 1, 1u) == gridDim.x - unsigned(np) - 1) {
      c[0] = 0u;
      c[1] = 0u;
    }
  }
}

template <class F>
double time_graph(cudaStream_t s, F&& record) {
  return probe::time_graph(s, kNodes, kReps, [&](int) { record(); });
}

int main() {
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  unsigned *c = nullptr, *scratch = nullptr;
  CK(cudaMalloc(&c, 8));
  CK(cudaMemset(c, 0, 8));
  CK(cudaMalloc(&scratch, 8));
  const int sms = prop.multiProcessorCount;
  std::printf("{\n  \"gpu\": \"%s\", \"sms\": %d, \"nodes\": %d, \"reps\": %d,\n  \"us_per_launch\": {\n",
              prop.name, sms, kNodes, kReps);
  bool first = true;
  auto out = [&](const char* name, double us) {
    std::printf("%s    \"%s\": %.3f", first ? "" : ",\n", name, us);
    first = false;
    std::fflush(stdout);
  };
  for (int grid : {1, 132, 264, 528})
    out((std::string("empty_grid") + std::to_string(grid)).c_str(),
        time_graph(s, [&] { empty_kernel<<<grid, 256, 0, s>>>(nullptr); }));
  // Work alone (no dependency), then the same work with a publish/wait step in the middle.
  for (int work : {0, 2000}) {
    const std::string w = "_work" + std::to_string(work);
    out(("nodep_grid256" + w).c_str(),
        time_graph(s, [&] { publish_wait_kernel<<<256, 256, 0, s>>>(scratch, 256, kFenceThread0, 0, work); }));
    // Two dependent launches of 128 blocks each (the kernel boundary as the dependency): per pair.
    out(("two_kernels_128+128_per_pair" + w).c_str(), time_graph(s, [&] {
          publish_wait_kernel<<<128, 256, 0, s>>>(scratch, 128, kFenceThread0, 0, work);
          publish_wait_kernel<<<128, 256, 0, s>>>(scratch, 128, kFenceThread0, 0, work);
        }));
    const char* fn[] = {"fence_thread0", "fence_all"};
    const char* pn[] = {"acquire_sleep32", "volatile", "acquire"};
    for (int f : {kFenceThread0, kFenceAll})
      for (int p : {kPollAcquireSleep, kPollVolatile, kPollAcquire})
        out((std::string("publish_wait_128+128_") + fn[f] + "_" + pn[p] + w).c_str(),
            time_graph(s, [&] { publish_wait_kernel<<<256, 256, 0, s>>>(c, 128, f, p, work); }));
  }
  std::printf("\n  }\n}\n");
  unsigned h[2];
  CK(cudaMemcpy(h, c, 8, cudaMemcpyDeviceToHost));
  if (h[0] != 0 || h[1] != 0) {
    std::fprintf(stderr, "sync_probe: counters not reset (%u, %u)\n", h[0], h[1]);
    return 1;
  }
  return 0;
}
