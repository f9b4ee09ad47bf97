// End to end: the CUDA backend against the CPU backend on a random model at the real per-layer
// widths with few layers (3 GDN + 1 attention, 16 experts top-4, vocabulary 4096), in bf16 and in
// 4-bit (both backends reading the same 4-bit weights): logits within 1e-2 relative, greedy tokens
// equal over 40 steps wherever the CPU's top-2 logits are not within rounding, and the graph-replayed
// greedy path equal to step-by-step decoding.
#include "core/synth.h"
#include "cpu/cpu_backend.h"
#include "random_model.h"
#include "util.h"

#include <algorithm>
#include <filesystem>

namespace kestrel::cuda::test {
namespace {

int64_t argmax(const float* v, int64_t n) { return std::max_element(v, v + n) - v; }
float top2_gap(const float* v, int64_t n) {
  std::vector<float> c(v, v + n);
  std::partial_sort(c.begin(), c.begin() + 2, c.end(), std::greater<float>());
  return c[0] - c[1];
}

// min_leading: how many leading decisive steps (top-2 logits not within rounding) the CPU trajectory
// must have for the graph-greedy comparison to count.
void compare_backends(Backend& cpu_b, std::unique_ptr<Backend>& gpu_b, const std::string& what,
                      int min_leading = 32);

void run_e2e(WFormat fmt, WFormat rfmt, uint32_t seed) {
  const ModelConfig c = small_real_width_config();
  cpu::CpuBackend cpu_b(random_weights(c, fmt, rfmt, seed), 0);
  auto gpu_b = make_cuda_backend(random_weights(c, fmt, rfmt, seed), BackendOptions{});
  compare_backends(cpu_b, gpu_b,
                   fmt::format("e2e {} router {}", wformat_name(fmt), wformat_name(rfmt)));
}

void compare_backends(Backend& cpu_b, std::unique_ptr<Backend>& gpu_b, const std::string& what,
                      int min_leading) {
  const int64_t V = cpu_b.config().vocab_size;
  const std::vector<int32_t> prompt = {11, 4000, 7, 123, 2048};
  const SeqId cs = cpu_b.create_sequence(256), gs = gpu_b->create_sequence(256);

  StepRequest rc{cs, prompt, true}, rg{gs, prompt, true};
  StepResult oc, og;
  cpu_b.step({&rc, 1}, {&oc, 1});
  gpu_b->step({&rg, 1}, {&og, 1});
  ASSERT_EQ(og.n_rows, int(prompt.size()));
  EXPECT_LT(rel_err(og.logits, oc.logits, (what + " prompt logits").c_str()), 1e-2);

  // 40 decode steps fed with the CPU's greedy tokens.
  std::vector<float> last(oc.logits.end() - V, oc.logits.end());
  std::vector<int32_t> cpu_tokens;
  std::vector<bool> decisive_at;
  int compared = 0;
  double worst = 0;
  for (int s = 0; s < 40; ++s) {
    const int32_t t = int32_t(argmax(last.data(), V));
    const bool decisive = top2_gap(last.data(), V) > 1e-3f * std::max(1.f, std::fabs(last[size_t(t)]));
    cpu_tokens.push_back(t);
    decisive_at.push_back(decisive);
    std::vector<int32_t> one{t};
    StepRequest a{cs, one, false}, b{gs, one, false};
    StepResult ra, rb;
    cpu_b.step({&a, 1}, {&ra, 1});
    gpu_b->step({&b, 1}, {&rb, 1});
    const double e = rel_err(rb.logits, ra.logits, (what + " decode logits").c_str());
    worst = std::max(worst, e);
    if (decisive) {
      EXPECT_EQ(argmax(rb.logits.data(), V), argmax(ra.logits.data(), V)) << what << " step " << s;
      ++compared;
    }
    last = ra.logits;
  }
  EXPECT_LT(worst, 1e-2) << what << ": worst decode-step logits error";
  EXPECT_GE(compared, 32) << what << ": too few decisive steps to compare";
  EXPECT_EQ(gpu_b->sequence_length(gs), int64_t(prompt.size()) + 40);

  // Graph-replayed greedy path from the same prompt: tokens equal to the CPU's greedy tokens.
  const SeqId gs2 = gpu_b->create_sequence(256);
  std::vector<int32_t> p4(prompt.begin(), prompt.end());
  StepRequest r2{gs2, p4, false};
  StepResult o2;
  gpu_b->step({&r2, 1}, {&o2, 1});
  const int32_t first = int32_t(argmax(o2.logits.data(), V));
  EXPECT_EQ(first, cpu_tokens[0]) << what;
  int streamed = 0;
  const auto gen = greedy_decode(*gpu_b, gs2, first, 39, [&](int32_t) { ++streamed; return true; });
  ASSERT_EQ(gen.size(), 39u);
  EXPECT_EQ(streamed, 39);
  // Tokens must agree up to the first CPU step whose top-2 logits were within rounding.
  int required = 0;
  while (required < 39 && decisive_at[size_t(required) + 1]) ++required;
  int equal_prefix = 0;
  while (equal_prefix < 39 && gen[size_t(equal_prefix)] == cpu_tokens[size_t(equal_prefix) + 1]) ++equal_prefix;
  EXPECT_GE(equal_prefix, required) << what << ": graph greedy path diverged from the CPU at step "
                                    << equal_prefix << " (decisive up to " << required << ")";
  EXPECT_GE(required, min_leading) << what << ": fewer than " << min_leading
                                   << " leading decisive steps to compare";
  EXPECT_EQ(gpu_b->sequence_length(gs2), int64_t(prompt.size()) + 39);
  // An early stop: the stopping token is appended too (one-deep pipelining), as documented.
  const SeqId gs3 = gpu_b->create_sequence(64);
  const auto few = greedy_decode(*gpu_b, gs3, 5, 20, [&](int32_t) { return false; });
  EXPECT_EQ(few.size(), 1u);
  EXPECT_EQ(gpu_b->sequence_length(gs3), 2);
  // vocab_limit keeps the argmax among ids below it (the graph is recaptured for the new limit).
  const SeqId gs4 = gpu_b->create_sequence(64);
  const auto lim = greedy_decode(*gpu_b, gs4, 5, 8, {}, 100);
  ASSERT_EQ(lim.size(), 8u);
  for (int32_t t : lim) EXPECT_LT(t, 100) << what;
  // Capacity is enforced before anything runs.
  EXPECT_THROW(greedy_decode(*gpu_b, gs3, 5, 100), Error);
}

TEST(CudaBackend, MatchesCpuBackendBf16) {
  REQUIRE_GPU();
  run_e2e(WFormat::BF16, WFormat::BF16, 1);
}

TEST(CudaBackend, MatchesCpuBackendQ4) {
  REQUIRE_GPU();
  run_e2e(WFormat::Q4, WFormat::Q8, 2);
}

// A boolean route (read when the sequences' graphs are captured) switched on for one q4 run:
// the other tests run with it off, its default.
// One q4 run with a route switch turned away from its default (`dflt`), then back.
void run_e2e_with(bool (*enabled)(), void (*set)(bool), bool dflt, const char* what) {
  ASSERT_EQ(enabled(), dflt) << what << " is " << (dflt ? "on" : "off") << " by default";
  set(!dflt);
  run_e2e(WFormat::Q4, WFormat::Q8, 2);
  set(dflt);
}

TEST(CudaBackend, MatchesCpuBackendQ4PdlOff) {  // the other tests run with PDL, its default
  REQUIRE_GPU();
  run_e2e_with(pdl_enabled, set_pdl_enabled, true, "programmatic dependent launch");
}

TEST(CudaBackend, MatchesCpuBackendQ4PdlUnpinned) {  // PDL (the default) without the pinning
  REQUIRE_GPU();
  ASSERT_TRUE(pdl_enabled());
  run_e2e_with(pdl_pin_enabled, set_pdl_pin, true, "the blocks-per-SM pinning");
}

TEST(CudaBackend, MatchesCpuBackendQ4GdnLateTrigger) {  // the GDN step's trigger after its loop
  REQUIRE_GPU();
  run_e2e_with(gdn_early_trigger, set_gdn_early_trigger, true, "the GDN step's early trigger");
}

TEST(CudaBackend, MatchesCpuBackendQ4Preload) {  // route 1's one-row GEMV with its register preload
  REQUIRE_GPU();
  run_e2e_with(gemv_preload, set_gemv_preload, false, "the one-row GEMV's preload");
}

TEST(CudaBackend, MatchesCpuBackendQ4DownEarlyLevels) {  // moe_down_early 0 and 1 (2 is the default)
  REQUIRE_GPU();
  ASSERT_EQ(moe_down_early(), 2) << "level 2 is the default";
  for (int level : {0, 1}) {
    set_moe_down_early(level);
    run_e2e(WFormat::Q4, WFormat::Q8, 2);
  }
  set_moe_down_early(2);
  EXPECT_THROW(set_moe_down_early(3), std::exception);
}

TEST(CudaBackend, MatchesCpuBackendQ4GateUpDepth2) {  // two tiles in flight per tensor-core gate/up block
  REQUIRE_GPU();
  ASSERT_EQ(moe_gate_up_depth(), 1) << "one tile in flight is the default";
  set_moe_gate_up_depth(2);
  run_e2e(WFormat::Q4, WFormat::Q8, 2);
  set_moe_gate_up_depth(1);
  EXPECT_THROW(set_moe_gate_up_depth(3), std::exception);
}

TEST(CudaBackend, MatchesCpuBackendQ4MoeScalar) {  // q4 experts off the tensor cores (the former default)
  REQUIRE_GPU();
  run_e2e_with(moe_mma_enabled, set_moe_mma_enabled, true, "the tensor-core experts");
}

TEST(CudaBackend, MatchesCpuBackendQ4MoeFused) {  // moe_experts: gate/up and down in one launch
  REQUIRE_GPU();
  run_e2e_with(moe_fused_enabled, set_moe_fused_enabled, false, "the fused MoE launch");
}

// A routing place and algorithm (read when the sequences' graphs are captured) for one q4 run;
// the other tests run with the defaults (Auto: inside gate/up for q4 experts on the tensor cores,
// the routing kernel otherwise; the block algorithm).
void run_e2e_routing(RoutePlace p, RouteAlgo al) {
  ASSERT_EQ(moe_route_place(), RoutePlace::Auto) << "the per-model place is the default";
  ASSERT_EQ(moe_route_algo(), RouteAlgo::Block) << "the block routing is the default";
  set_moe_route_place(p);
  set_moe_route_algo(al);
  run_e2e(WFormat::Q4, WFormat::Q8, 2);
  set_moe_route_place(RoutePlace::Auto);
  set_moe_route_algo(RouteAlgo::Block);
}

// The Auto place's choice; host only (no GPU needed).
TEST(CudaRoutes, AutoPlaceFollowsTheExpertKernel) {
  ASSERT_EQ(moe_route_place(), RoutePlace::Auto);
  ASSERT_TRUE(moe_mma_enabled());
  ASSERT_FALSE(moe_fused_enabled());
  EXPECT_EQ(resolve_route_place(RoutePlace::Auto, DFmt::Q4), RoutePlace::GateUp);
  EXPECT_EQ(resolve_route_place(RoutePlace::Auto, DFmt::BF16), RoutePlace::Kernel);
  EXPECT_EQ(resolve_route_place(RoutePlace::Auto, DFmt::Q8), RoutePlace::Kernel);
  for (RoutePlace p : {RoutePlace::Tail, RoutePlace::Kernel, RoutePlace::GateUp})
    EXPECT_EQ(resolve_route_place(p, DFmt::Q4), p) << "an explicit place is kept";
  set_moe_mma_enabled(false);  // the scalar gate/up: routing before it
  EXPECT_EQ(resolve_route_place(RoutePlace::Auto, DFmt::Q4), RoutePlace::Kernel);
  set_moe_mma_enabled(true);
  set_moe_fused_enabled(true);  // the fused launch needs the selection before it
  EXPECT_EQ(resolve_route_place(RoutePlace::Auto, DFmt::Q4), RoutePlace::Kernel);
  set_moe_fused_enabled(false);
  EXPECT_THROW(set_moe_route_place(RoutePlace(4)), std::exception);
  EXPECT_STREQ(route_place_name(RoutePlace::Auto), "auto");
}

TEST(CudaBackend, MatchesCpuBackendQ4RouteTailWarp) {  // the former default: one warp in the router GEMV's tail
  REQUIRE_GPU();
  run_e2e_routing(RoutePlace::Tail, RouteAlgo::Warp);
}

TEST(CudaBackend, MatchesCpuBackendQ4RouteKernelBlock) {  // the routing kernel (the bf16 default)
  REQUIRE_GPU();
  run_e2e_routing(RoutePlace::Kernel, RouteAlgo::Block);
}

TEST(CudaBackend, MatchesCpuBackendQ4RouteTailBlock) {  // the 256-thread routing in the router GEMV's tail
  REQUIRE_GPU();
  run_e2e_routing(RoutePlace::Tail, RouteAlgo::Block);
}

TEST(CudaBackend, MatchesCpuBackendQ4DownEarlyRouteKernel) {  // level 2 with the selection from the routing kernel
  REQUIRE_GPU();
  ASSERT_EQ(moe_down_early(), 2) << "level 2 is the default";
  run_e2e_routing(RoutePlace::Kernel, RouteAlgo::Block);
}

TEST(CudaBackend, MatchesCpuBackendQ4RouteGateUp) {  // every moe_gate_up block routes for itself
  REQUIRE_GPU();
  run_e2e_routing(RoutePlace::GateUp, RouteAlgo::Block);
}

TEST(CudaBackend, MatchesCpuBackendQ4GemvV2) {
  REQUIRE_GPU();
  set_gemv_version(2);  // read when the sequences' graphs are captured
  run_e2e(WFormat::Q4, WFormat::Q8, 4);
  set_gemv_version(1);
}

TEST(CudaBackend, MatchesCpuBackendQ4GemvV5) {  // the streamed GEMV (bulk copies, tensor cores)
  REQUIRE_GPU();
  set_gemv_version(5);
  run_e2e(WFormat::Q4, WFormat::Q8, 4);
  set_gemv_version(1);
}

// The committed real-width fixture (tests/fixtures/realwidth: 4 layers, 16 experts top-8), its
// weights regenerated with core/synth (as `kestrel synth-model --seed 1` does), loaded through the
// real loader: bf16, and 4-bit via LoadOptions::quant = Q4 on both backends.
TEST(CudaBackend, RealWidthFixtureMatchesCpu) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path src = fs::path(KESTREL_FIXTURES) / "realwidth";
  const fs::path dir = fs::temp_directory_path() / "kestrel_cuda_realwidth";
  fs::create_directories(dir);
  fs::copy_file(src / "config.json", dir / "config.json", fs::copy_options::overwrite_existing);
  const ModelConfig cfg = load_config(dir);
  write_synthetic_checkpoint(cfg, dir, SynthOptions{1, false, true});
  for (QuantMode q : {QuantMode::None, QuantMode::Q4}) {
    BackendOptions co, go;
    co.device = DeviceKind::Cpu;
    go.device = DeviceKind::Cuda;
    co.load.quant = go.load.quant = q;
    auto cpu_b = load_backend(dir, co);
    auto gpu_b = load_backend(dir, go);
    ASSERT_EQ(gpu_b->name(), "cuda");
    // The q4 real-width trajectory from this prompt reaches a near-tie (top-2 gap within rounding)
    // at step 11 on the CPU itself (H200 run 2026-12-02), so its graph-greedy run can only be
    // compared that far; the step-fed comparison above it still checks >= 32 decisive steps.
    compare_backends(*cpu_b, gpu_b, q == QuantMode::None ? "realwidth bf16" : "realwidth q4",
                     q == QuantMode::None ? 32 : 8);
  }
  fs::remove_all(dir);
}

TEST(CudaBackend, RefusesOtherWidths) {
  REQUIRE_GPU();
  ModelConfig c = small_real_width_config();
  auto w = random_weights(c, WFormat::BF16, WFormat::BF16, 3);
  w->config.hidden_size = 1024;  // a config whose widths the kernels do not cover
  EXPECT_THROW(make_cuda_backend(std::move(w), BackendOptions{}), Error);
}

TEST(CudaBackend, SyntheticRealSizeSmoke) {
  REQUIRE_GPU();
  // A few layers of the full-size synthetic q4 model: finite logits, decoding runs, bytes counted.
  ModelConfig c = real_model_config();
  c.num_layers = 4;
  c.layer_types.resize(4);
  auto b = make_synthetic_backend(c, "q4", 7);
  const SeqId s = b->create_sequence(4200);
  set_synthetic_context(*b, s, 4096, 9);
  const auto times = time_decode_steps(*b, s, 1, 2, 8);
  ASSERT_EQ(times.size(), 8u);
  for (double t : times) EXPECT_GT(t, 0.0);
  std::vector<int32_t> tok{42};
  StepRequest r{s, tok, false};
  StepResult o;
  b->step({&r, 1}, {&o, 1});
  for (float v : o.logits) ASSERT_TRUE(std::isfinite(v));
  EXPECT_GT(decode_step_bytes(*b, 4096), decode_step_bytes(*b, 0));
}

}  // namespace
}  // namespace kestrel::cuda::test
