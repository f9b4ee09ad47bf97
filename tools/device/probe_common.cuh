// Shared by the GPU-machine micro-benchmarks (tools/device/*_probe.cu): error check and the graph
// timer. Each probe is its own program; nothing here is part of the engine.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define PROBE_CK(x)                                                                                 \
  do {                                                                                              \
    cudaError_t e_ = (x);                                                                           \
    if (e_ != cudaSuccess) {                                                                        \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));       \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

namespace probe {

// Microseconds per node: `record(i)` enqueues node i (i < nodes) on s; the graph of all nodes is
// replayed reps + 2 times (the first two not counted), median replay time / nodes.
template <class F>
double time_graph(cudaStream_t s, int nodes, int reps, F&& record) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  PROBE_CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < nodes; ++i) record(i);
  PROBE_CK(cudaStreamEndCapture(s, &g));
  PROBE_CK(cudaGraphInstantiate(&ge, g, 0));
  cudaEvent_t a, b;
  PROBE_CK(cudaEventCreate(&a));
  PROBE_CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < reps + 2; ++r) {
    PROBE_CK(cudaEventRecord(a, s));
    PROBE_CK(cudaGraphLaunch(ge, s));
    PROBE_CK(cudaEventRecord(b, s));
    PROBE_CK(cudaEventSynchronize(b));
    float ms = 0;
    PROBE_CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) t.push_back(double(ms) * 1e3 / nodes);
  }
  std::sort(t.begin(), t.end());
  PROBE_CK(cudaGraphExecDestroy(ge));
  PROBE_CK(cudaGraphDestroy(g));
  PROBE_CK(cudaEventDestroy(a));
  PROBE_CK(cudaEventDestroy(b));
  return t[t.size() / 2];
}

}  // namespace probe
