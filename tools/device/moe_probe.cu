// The decode step's MoE expert kernels (src/cuda/moe.cu, compiled into this file) at the real
// shapes (E 256, top-8, hidden 2048, expert width 512, q4), timed alone and in combination, to
// locate the cost of the fused launch (moe_experts, 42 us per layer against 22 us for the two
// launches in the step at 5740032): gate/up alone, down alone (each in the two-launch and in the
// fused kernel's block shapes), both shapes co-resident in one launch without the dependency, the
// fused launch, and the two launches. The routed experts rotate over 32 disjoint sets so that every
// launch reads its expert rows from DRAM. Output: JSON, microseconds per launch (median of
// graph replays / nodes). Build (tools/gpu_check.sh stage 4 does):
//   nvcc -O3 -std=c++20 -Isrc --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a tools/device/moe_probe.cu -o moe_probe
#include "cuda/moe.cu"

#include "probe_engine.cuh"

#include <numeric>
#include <string>
#include <random>

namespace kestrel::cuda {

// Probe kernels from moe.cu's block functions (same translation unit, so its unnamed namespace
// is visible here).
__global__ void __launch_bounds__(256, 2) probe_gu_fused_shape(const __grid_constant__ MoeGateUpArgs a) {
  gate_up_block<DFmt::Q4, kFusedGuTasks<DFmt::Q4>>(a, blockIdx.x);
}
__global__ void __launch_bounds__(256, 2) probe_down_fused_shape(const __grid_constant__ MoeDownArgs a) {
  down_block<DFmt::Q4, 512, kFusedDownRows>(a, blockIdx.x, nullptr, 0u);
}
// Both parts in one launch with no dependency (the down part reads act while it is written:
// the values are meaningless, the timing is what is measured).
__global__ void __launch_bounds__(256, 2) probe_both_nodep(const __grid_constant__ MoeExpertsArgs a) {
  const int ngu = gate_up_blocks(int64_t(a.gu.topk) * a.gu.I, kFusedGuTasks<DFmt::Q4>);
  if (int(blockIdx.x) < ngu)
    gate_up_block<DFmt::Q4, kFusedGuTasks<DFmt::Q4>>(a.gu, blockIdx.x);
  else
    down_block<DFmt::Q4, 512, kFusedDownRows>(a.dn, int(blockIdx.x) - ngu, nullptr, 0u);
}
}  // namespace kestrel::cuda

using namespace kestrel::cuda;

#define CK(x) PROBE_CK(x)

namespace probe {

constexpr int kNodes = 64;
constexpr int kReps = 11;
constexpr int kSets = 32;  // disjoint expert sets of 8 (256 experts)

template <class F>
double time_graph(cudaStream_t s, F&& record) {
  return probe::time_graph(s, kNodes, kReps, record);
}

}  // namespace probe
using namespace probe;

int main() {
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  constexpr int64_t E = 256, I = 512, H = 2048, K8 = 8;
  const DMat gate = affine_mat(E * I, H, 1), up = affine_mat(E * I, H, 2), down = affine_mat(E * H, I, 3),
             sdown = affine_mat(H, I, 4);
  // 32 disjoint ascending sets of 8 experts.
  std::vector<int> perm(E);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(5));
  std::vector<int> sets(size_t(kSets) * K8);
  for (int q = 0; q < kSets; ++q) {
    std::sort(perm.begin() + q * K8, perm.begin() + (q + 1) * K8);
    std::copy(perm.begin() + q * K8, perm.begin() + (q + 1) * K8, sets.begin() + q * K8);
  }
  int* d_sets;
  CK(cudaMalloc(&d_sets, sets.size() * 4));
  CK(cudaMemcpy(d_sets, sets.data(), sets.size() * 4, cudaMemcpyHostToDevice));
  float* h = dev_floats(H, 0.5f);
  float* act = dev_floats(size_t(K8 * I), 0.1f);
  float* tw = dev_floats(16, 0.125f);
  float* sg = dev_floats(I, 0.2f);
  float* su = dev_floats(I, 0.3f);
  float* sgate = dev_floats(1, 0.f);
  float* x = dev_floats(H, 0.f);
  unsigned* counters;
  CK(cudaMalloc(&counters, 8));
  CK(cudaMemset(counters, 0, 8));
  CK(cudaDeviceSynchronize());

  auto args = [&](int i) {
    MoeExpertsArgs a;
    const int* idx = d_sets + (i % kSets) * K8;
    a.gu.topk = int(K8);
    a.gu.E = E;
    a.gu.h = h;
    a.gu.hidden = H;
    a.gu.I = I;
    a.gu.gate = gate;
    a.gu.up = up;
    a.gu.topk_idx = idx;
    a.gu.act = act;
    a.dn.topk = int(K8);
    a.dn.hidden = H;
    a.dn.I = a.dn.Is = I;
    a.dn.topk_idx = idx;
    a.dn.topk_w = tw;
    a.dn.act = act;
    a.dn.sg = sg;
    a.dn.su = su;
    a.dn.sgate = sgate;
    a.dn.down = down;
    a.dn.shared_down = sdown;
    a.dn.x = x;
    a.counters = counters;
    return a;
  };
  const int ngu_f = gate_up_blocks(K8 * I, kFusedGuTasks<DFmt::Q4>), ndn_f = int(H / kFusedDownRows);
  std::printf("{\n  \"gpu_sms\": %d, \"nodes\": %d, \"reps\": %d, \"fused_blocks\": [%d, %d], \"resident_fused\": %d,\n"
              "  \"us_per_launch\": {",
              num_sms(), kNodes, kReps, ngu_f, ndn_f, moe_experts_resident(DFmt::Q4));
  bool first = true;
  auto out = [&](const char* name, double us) {
    std::printf("%s\n    \"%s\": %.3f", first ? "" : ",", name, us);
    first = false;
    std::fflush(stdout);
  };
  out("gate_up_alone", time_graph(s, [&](int i) { moe_gate_up_launch(args(i).gu, s); }));
  g_probe_moe_mma = true;  // moe_gate_up_mma_kernel, moe_down_mma_kernel (KESTREL_MOE_MMA=1)
  out("gate_up_mma_alone", time_graph(s, [&](int i) { moe_gate_up_launch(args(i).gu, s); }));
  out("down_mma_alone", time_graph(s, [&](int i) { moe_down_launch(args(i).dn, s); }));
  out("two_launches_mma", time_graph(s, [&](int i) {
        const MoeExpertsArgs a = args(i);
        moe_gate_up_launch(a.gu, s);
        moe_down_launch(a.dn, s);
      }));
  // The tensor-core gate/up at other grids (512 tiles; the launcher takes min(tiles, 2 per SM,
  // resident)): 132 blocks, 256 and 264 (about 2 tiles each), 396 (all resident), one per tile.
  for (int grid : {132, 256, 264, 396, 512}) {
    const std::string name = "gate_up_mma_grid" + std::to_string(grid);
    out(name.c_str(), time_graph(s, [&](int i) { moe_gate_up_mma_kernel<1><<<grid, 256, 0, s>>>(args(i).gu); }));
  }
  out("gate_up_mma_resident_blocks", double(gate_up_mma_resident()));
  // Two tiles' loads in flight per block (KESTREL_MOE_GU_DEPTH=2; bench/NOTES.md v14).
  g_probe_gu_depth = 2;
  out("gate_up_mma_depth2_alone", time_graph(s, [&](int i) { moe_gate_up_launch(args(i).gu, s); }));
  out("two_launches_mma_depth2", time_graph(s, [&](int i) {
        const MoeExpertsArgs a = args(i);
        moe_gate_up_launch(a.gu, s);
        moe_down_launch(a.dn, s);
      }));
  out("gate_up_mma_depth2_resident_blocks", double(gate_up_mma_resident()));
  g_probe_gu_depth = 1;
  g_probe_moe_mma = false;
  out("down_alone", time_graph(s, [&](int i) { moe_down_launch(args(i).dn, s); }));
  out("two_launches", time_graph(s, [&](int i) {
        const MoeExpertsArgs a = args(i);
        moe_gate_up_launch(a.gu, s);
        moe_down_launch(a.dn, s);
      }));
  out("gate_up_fused_shape_alone", time_graph(s, [&](int i) {
        probe_gu_fused_shape<<<ngu_f, 256, 0, s>>>(args(i).gu);
      }));
  out("down_fused_shape_alone", time_graph(s, [&](int i) {
        probe_down_fused_shape<<<ndn_f, 256, 0, s>>>(args(i).dn);
      }));
  out("both_shapes_one_launch_no_dependency", time_graph(s, [&](int i) {
        probe_both_nodep<<<ngu_f + ndn_f, 256, 0, s>>>(args(i));
      }));
  out("fused_moe_experts", time_graph(s, [&](int i) { moe_experts_launch(args(i), s); }));
  std::printf("\n  }\n}\n");
  unsigned hc[2];
  CK(cudaMemcpy(hc, counters, 8, cudaMemcpyDeviceToHost));
  if (hc[0] != 0 || hc[1] != 0) {
    std::fprintf(stderr, "moe_probe: counters not reset (%u, %u)\n", hc[0], hc[1]);
    return 1;
  }
  return 0;
}
