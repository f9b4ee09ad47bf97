// End to end: the CUDA backend's prompt path (src/cuda/prefill_step.h, every step with more than
// one token) against the CPU backend, and prefill-then-decode against decode-only.
//   * Prompts of 1, 7, 63, 64, 65 and 300 tokens with a 64-token chunk (test-only setting, so the
//     prompts cross chunk boundaries), last-token and all-position logits, each row within 1e-2
//     relative (L2) of the CPU backend's logits for the same prefix, argmax equal wherever the
//     CPU's top-2 gap is decisive; a prompt split over steps after a cached prefix (100 | 1 | 199);
//     300 tokens in one chunk at the default chunk size (the all-logits GEMM in 128-row blocks).
//   * Prefill (65 tokens, two chunks) then 256 decode steps vs the same prompt fed token by token
//     through the decode graph, teacher-forced with the decode-only argmax: logits within 1e-2,
//     argmax equal wherever decisive (top-2 gap > 1e-2 of the top logit); the first 16 steps also
//     against the CPU; then the graph-greedy path from both states equal up to the first near-tie.
// Models: random real-width models (3 GDN + 1 attention, 16 experts top-4) in bf16 and 4-bit (the
// CPU backend reading the same 4-bit weights; 8-bit router), and the committed real-width fixture
// (16 experts top-8) in bf16 and q4. The driver's scratch is poisoned (0xff) before every run.
// Routes (PrefillAPrec): the default (F16) everywhere, Split on the random q4 model, and the F16
// route with a test limit of 1.0 (every chunk exceeds it and is redone on the Split route from
// the state snapshot): same bounds.
#include "core/synth.h"
#include "cpu/cpu_backend.h"
#include "cuda/prefill_step.h"
#include "random_model.h"
#include "util.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

namespace kestrel::cuda::test {
namespace {

int64_t argmax_of(const float* v, int64_t n) { return std::max_element(v, v + n) - v; }
float top2_gap(const float* v, int64_t n) {
  std::vector<float> c(v, v + n);
  std::partial_sort(c.begin(), c.begin() + 2, c.end(), std::greater<float>());
  return c[0] - c[1];
}
bool decisive(const float* v, int64_t n, float rel) {
  const float top = v[argmax_of(v, n)];
  return top2_gap(v, n) > rel * std::max(1.f, std::fabs(top));
}

std::vector<int32_t> random_prompt(int64_t n, int64_t vocab, uint32_t seed) {
  std::mt19937 g(seed);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = int32_t(g() % uint32_t(vocab));
  return p;
}

StepResult run_step(Backend& b, SeqId s, std::span<const int32_t> toks, bool all) {
  StepRequest r{s, toks, all};
  StepResult o;
  b.step({&r, 1}, {&o, 1});
  return o;
}

// Compares GPU logit rows [rows, V] with CPU rows ref[first .. first + rows) of [*, V].
void compare_rows(const std::vector<float>& got, int rows, const std::vector<float>& ref,
                  int64_t first, int64_t V, const std::string& what) {
  ASSERT_EQ(got.size(), size_t(rows) * size_t(V)) << what;
  double worst = 0;
  int64_t worst_row = -1, argmax_bad = 0, decisive_rows = 0;
  for (int r = 0; r < rows; ++r) {
    const int64_t p = first + r;
    std::vector<float> g(got.begin() + r * V, got.begin() + (r + 1) * V);
    std::vector<float> e(ref.begin() + p * V, ref.begin() + (p + 1) * V);
    const double err = rel_err(g, e, (what + fmt::format(" position {}", p)).c_str());
    if (err > worst) {
      worst = err;
      worst_row = p;
    }
    if (decisive(e.data(), V, 1e-2f)) {
      ++decisive_rows;
      if (argmax_of(g.data(), V) != argmax_of(e.data(), V)) {
        ++argmax_bad;
        ADD_FAILURE() << what << ": argmax at position " << p << " is " << argmax_of(g.data(), V)
                      << ", CPU " << argmax_of(e.data(), V) << " (CPU top-2 gap "
                      << top2_gap(e.data(), V) << ")";
      }
    }
  }
  // (Printed in every run: the margin to the bound is what tells a route's precision apart.)
  std::printf("%s: worst logits error %.3g at position %lld of %d rows from %lld\n", what.c_str(), worst,
              (long long)worst_row, rows, (long long)first);
  EXPECT_LT(worst, 1e-2) << what << ": worst logits error " << worst << " at position " << worst_row
                         << " (" << rows << " rows from position " << first << ")";
  EXPECT_EQ(argmax_bad, 0) << what << ": " << argmax_bad << " of " << decisive_rows
                           << " decisive rows differ in argmax";
}

// Prompt logits of the GPU's prefill path against the CPU's all-position logits of one prompt.
void check_prompts(Backend& cpu_b, Backend& gpu_b, const std::string& what, uint32_t seed) {
  const int64_t V = cpu_b.config().vocab_size;
  const int64_t N = 300;
  const auto prompt = random_prompt(N, V, seed);
  const SeqId cs = cpu_b.create_sequence(512);
  const auto ref = run_step(cpu_b, cs, prompt, true);
  ASSERT_EQ(ref.n_rows, int(N));
  cpu_b.free_sequence(cs);
  const std::span<const int32_t> P(prompt);

  set_prefill_max_chunk(gpu_b, 64);
  for (int64_t L : {1, 7, 63, 64, 65, 300})
    for (bool all : {false, true}) {
      const std::string w = fmt::format("{}: prompt {} (chunk 64, {})", what, L, all ? "all logits" : "last");
      poison_prefill_scratch(gpu_b);
      const SeqId gs = gpu_b.create_sequence(512);
      const auto o = run_step(gpu_b, gs, P.first(size_t(L)), all);
      ASSERT_EQ(o.n_rows, all ? int(L) : 1) << w;
      compare_rows(o.logits, o.n_rows, ref.logits, all ? 0 : L - 1, V, w);
      EXPECT_EQ(gpu_b.sequence_length(gs), L) << w;
      gpu_b.free_sequence(gs);
    }
  EXPECT_GT(prefill_scratch_bytes(gpu_b), size_t(0));

  // After a cached prefix: 100 prompt tokens, 1 decode-path token, 199 prompt tokens.
  {
    const std::string w = what + ": split prompt 100 | 1 | 199";
    poison_prefill_scratch(gpu_b);
    const SeqId gs = gpu_b.create_sequence(512);
    const auto a = run_step(gpu_b, gs, P.subspan(0, 100), false);
    compare_rows(a.logits, 1, ref.logits, 99, V, w + " (first part)");
    const auto b = run_step(gpu_b, gs, P.subspan(100, 1), false);
    compare_rows(b.logits, 1, ref.logits, 100, V, w + " (decode step)");
    const auto c = run_step(gpu_b, gs, P.subspan(101), true);
    compare_rows(c.logits, c.n_rows, ref.logits, 101, V, w + " (last part)");
    EXPECT_EQ(gpu_b.sequence_length(gs), N) << w;
    gpu_b.free_sequence(gs);
  }

  // The default chunk: 300 tokens in one chunk; all-position logits in 128-row lm_head blocks.
  set_prefill_max_chunk(gpu_b, kPrefillMaxChunk);
  {
    const std::string w = what + ": prompt 300 (one chunk, all logits)";
    poison_prefill_scratch(gpu_b);
    const SeqId gs = gpu_b.create_sequence(512);
    const auto o = run_step(gpu_b, gs, P, true);
    compare_rows(o.logits, o.n_rows, ref.logits, 0, V, w);
    gpu_b.free_sequence(gs);
  }
  EXPECT_THROW(set_prefill_max_chunk(gpu_b, kPrefillMaxChunk + 1), Error);
  EXPECT_THROW(set_prefill_max_chunk(gpu_b, 0), Error);
}

// Prefill then decode == decode only (and == CPU for the first steps).
void check_prefill_then_decode(Backend& cpu_b, Backend& gpu_b, const std::string& what, uint32_t seed) {
  const int64_t V = gpu_b.config().vocab_size;
  constexpr int kSteps = 256, kCpuSteps = 16;
  const auto prompt = random_prompt(65, V, seed);
  set_prefill_max_chunk(gpu_b, 64);
  poison_prefill_scratch(gpu_b);
  const int64_t cap = int64_t(prompt.size()) + kSteps + 8;
  const SeqId sa = gpu_b.create_sequence(cap), sb = gpu_b.create_sequence(cap);
  const SeqId cs = cpu_b.create_sequence(cap);
  auto la = run_step(gpu_b, sa, prompt, false).logits;  // prefill (2 chunks)
  std::vector<float> lb;
  for (int32_t t : prompt) lb = run_step(gpu_b, sb, std::span<const int32_t>(&t, 1), false).logits;
  auto lc = run_step(cpu_b, cs, prompt, false).logits;
  EXPECT_LT(rel_err(la, lb, (what + " prompt: prefill vs decode-only").c_str()), 1e-2) << what;
  EXPECT_LT(rel_err(la, lc, (what + " prompt: prefill vs CPU").c_str()), 1e-2) << what;

  std::vector<int32_t> traj;
  std::vector<bool> dec;
  double worst = 0, worst_cpu = 0;
  int worst_at = -1, compared = 0;
  for (int s = 0; s < kSteps; ++s) {
    const int32_t t = int32_t(argmax_of(lb.data(), V));
    // Decisive: top-2 gap above 1e-2 of the top logit (the prefilled state was computed from
    // bf16-rounded activations, ~1e-2 absolute on these logits; decode-vs-CPU uses 1e-3).
    const bool d = decisive(lb.data(), V, 1e-2f);
    if (d) {
      EXPECT_EQ(argmax_of(la.data(), V), t) << what << ": decode step " << s
                                            << ": prefilled sequence's argmax differs (gap "
                                            << top2_gap(lb.data(), V) << ")";
      ++compared;
    }
    traj.push_back(t);
    dec.push_back(d);
    const std::span<const int32_t> one(&traj.back(), 1);
    la = run_step(gpu_b, sa, one, false).logits;
    lb = run_step(gpu_b, sb, one, false).logits;
    const double e = rel_err(la, lb, (what + fmt::format(" decode step {}", s)).c_str());
    if (e > worst) {
      worst = e;
      worst_at = s;
    }
    if (s < kCpuSteps) {
      lc = run_step(cpu_b, cs, one, false).logits;
      worst_cpu = std::max(worst_cpu, rel_err(la, lc, (what + fmt::format(" CPU step {}", s)).c_str()));
    }
  }
  EXPECT_LT(worst, 1e-2) << what << ": prefill-then-decode vs decode-only, worst step " << worst_at;
  EXPECT_LT(worst_cpu, 1e-2) << what << ": prefill-then-decode vs CPU over " << kCpuSteps << " steps";
  EXPECT_GE(compared, kSteps / 2) << what << ": too few decisive steps";
  EXPECT_EQ(gpu_b.sequence_length(sa), int64_t(prompt.size()) + kSteps);
  EXPECT_EQ(gpu_b.sequence_length(sb), int64_t(prompt.size()) + kSteps);

  // The graph-greedy path from a prefilled state and from a decode-only state.
  const SeqId sc = gpu_b.create_sequence(cap), sd = gpu_b.create_sequence(cap);
  run_step(gpu_b, sc, prompt, false);
  for (int32_t t : prompt) run_step(gpu_b, sd, std::span<const int32_t>(&t, 1), false);
  const auto gc = greedy_decode(gpu_b, sc, traj[0], kSteps - 1);
  const auto gd = greedy_decode(gpu_b, sd, traj[0], kSteps - 1);
  ASSERT_EQ(gc.size(), size_t(kSteps - 1));
  ASSERT_EQ(gd.size(), size_t(kSteps - 1));
  int required = 0;  // leading decisive steps of the teacher-forced trajectory
  while (required < kSteps - 1 && dec[size_t(required) + 1]) ++required;
  int eq_c = 0, eq_d = 0;
  while (eq_c < kSteps - 1 && gc[size_t(eq_c)] == traj[size_t(eq_c) + 1]) ++eq_c;
  while (eq_d < kSteps - 1 && gd[size_t(eq_d)] == traj[size_t(eq_d) + 1]) ++eq_d;
  EXPECT_GE(eq_c, required) << what << ": greedy after prefill left the trajectory at step " << eq_c
                            << " (decisive up to " << required << ")";
  EXPECT_GE(eq_d, required) << what << ": greedy after decode-only left the trajectory at step " << eq_d
                            << " (decisive up to " << required << ")";
  for (SeqId s : {sa, sb, sc, sd}) gpu_b.free_sequence(s);
  cpu_b.free_sequence(cs);
  set_prefill_max_chunk(gpu_b, kPrefillMaxChunk);
}

void run_random(WFormat fmt, WFormat rfmt, uint32_t seed) {
  const ModelConfig c = small_real_width_config();
  cpu::CpuBackend cpu_b(random_weights(c, fmt, rfmt, seed), 0);
  auto gpu_b = make_cuda_backend(random_weights(c, fmt, rfmt, seed), BackendOptions{});
  const std::string what = fmt::format("random {} router {}", wformat_name(fmt), wformat_name(rfmt));
  check_prompts(cpu_b, *gpu_b, what, seed + 100);
  check_prefill_then_decode(cpu_b, *gpu_b, what, seed + 200);
}

TEST(PrefillE2E, RandomRealWidthBf16) {
  REQUIRE_GPU();
  run_random(WFormat::BF16, WFormat::BF16, 11);
}

TEST(PrefillE2E, RandomRealWidthQ4) {
  REQUIRE_GPU();
  run_random(WFormat::Q4, WFormat::Q8, 12);
}

// Attention with P split (KESTREL_ATTN_P=split; the default multiplies P as one bf16 plane).
TEST(PrefillE2E, AttentionPSplit) {
  REQUIRE_GPU();
  const ScopedEnv env("KESTREL_ATTN_P", "split");
  ASSERT_TRUE(prefill_attn_p_split());
  const ModelConfig c = small_real_width_config();
  const uint32_t seed = 16;
  cpu::CpuBackend cpu_b(random_weights(c, WFormat::Q4, WFormat::Q8, seed), 0);
  auto gpu_b = make_cuda_backend(random_weights(c, WFormat::Q4, WFormat::Q8, seed), BackendOptions{});
  check_prompts(cpu_b, *gpu_b, "random q4, attention P split", seed + 100);
}

// Attention on the wide kernel (KESTREL_ATTN_TILE=128x64: 128-query blocks, 64-key tiles; and
// 128x64k2, two K buffers), end to end on the random real-width q4 model, one-chunk and split
// prompts; and the step refusing the wide kernel with P split.
TEST(PrefillE2E, AttentionWide) {
  REQUIRE_GPU();
  const ModelConfig c = small_real_width_config();
  const uint32_t seed = 18;
  cpu::CpuBackend cpu_b(random_weights(c, WFormat::Q4, WFormat::Q8, seed), 0);
  for (const char* tile : {"128x64", "128x64k2"}) {
    const ScopedEnv env("KESTREL_ATTN_TILE", tile);
    ASSERT_EQ(prefill_attn_wide(), std::string(tile) == "128x64" ? 1 : 2);
    auto gpu_b = make_cuda_backend(random_weights(c, WFormat::Q4, WFormat::Q8, seed), BackendOptions{});
    check_prompts(cpu_b, *gpu_b, fmt::format("random q4, attention {}", tile), seed + 100);
    // The prompt step (created on first use; poison_prefill_scratch creates it) refuses the wide
    // kernel with P split.
    const ScopedEnv split("KESTREL_ATTN_P", "split");
    auto gpu_c = make_cuda_backend(random_weights(c, WFormat::Q4, WFormat::Q8, seed), BackendOptions{});
    EXPECT_THROW(poison_prefill_scratch(*gpu_c), Error) << tile;
  }
}

// The router logits on the CUDA-core fp32 kernel (KESTREL_ROUTER_GEMM=fma; the default is the
// tensor-core route, which every other e2e test runs).
TEST(PrefillE2E, RouterOnFma) {
  REQUIRE_GPU();
  const ScopedEnv env("KESTREL_ROUTER_GEMM", "fma");
  ASSERT_EQ(prefill_router_route(), F32GemmRoute::Fma);
  const ModelConfig c = small_real_width_config();
  const uint32_t seed = 17;
  cpu::CpuBackend cpu_b(random_weights(c, WFormat::Q4, WFormat::Q8, seed), 0);
  auto gpu_b = make_cuda_backend(random_weights(c, WFormat::Q4, WFormat::Q8, seed), BackendOptions{});
  check_prompts(cpu_b, *gpu_b, "random q4, router on fma", seed + 100);
}

TEST(PrefillE2E, SplitRouteAndF16RangeRedo) {
  REQUIRE_GPU();
  const ModelConfig c = small_real_width_config();
  const uint32_t seed = 13;
  cpu::CpuBackend cpu_b(random_weights(c, WFormat::Q4, WFormat::Q8, seed), 0);
  auto gpu_b = make_cuda_backend(random_weights(c, WFormat::Q4, WFormat::Q8, seed), BackendOptions{});
  set_prefill_aprec(*gpu_b, PrefillAPrec::Split);
  check_prompts(cpu_b, *gpu_b, "random q4, split route", seed + 100);
  EXPECT_EQ(prefill_range_redos(*gpu_b), 0);
  set_prefill_aprec(*gpu_b, PrefillAPrec::F16, 1.0f);
  check_prompts(cpu_b, *gpu_b, "random q4, f16 route redone (limit 1)", seed + 100);
  EXPECT_GT(prefill_range_redos(*gpu_b), 0) << "no chunk exceeded an fp16 limit of 1.0";
  check_prefill_then_decode(cpu_b, *gpu_b, "random q4, f16 route redone (limit 1)", seed + 200);
  EXPECT_THROW(set_prefill_aprec(*gpu_b, PrefillAPrec::F16, 1e6f), Error);
}

// The kernel each chunk's GEMMs run on (no GPU needed): Auto takes Pipe from kPipeMinChunk
// tokens; the F16 route is Reg whatever the choice; KESTREL_PREFILL_GEMM picks the choice.
TEST(PrefillRoutes, GemmKernelChoice) {
  using C = PrefillGemmChoice;
  using K = PrefillGemmKernel;
  constexpr auto S = PrefillAPrec::Split, F = PrefillAPrec::F16;
  EXPECT_EQ(prefill_gemm_kernel_for(C::Auto, S, kPipeMinChunk - 1), K::Reg);
  EXPECT_EQ(prefill_gemm_kernel_for(C::Auto, S, kPipeMinChunk), K::Pipe);
  EXPECT_EQ(prefill_gemm_kernel_for(C::Auto, S, kPrefillMaxChunk), K::Pipe);
  EXPECT_EQ(prefill_gemm_kernel_for(C::Pipe, S, 1), K::Pipe);
  EXPECT_EQ(prefill_gemm_kernel_for(C::Reg, S, kPrefillMaxChunk), K::Reg);
  for (C c : {C::Reg, C::Pipe, C::Auto}) EXPECT_EQ(prefill_gemm_kernel_for(c, F, kPrefillMaxChunk), K::Reg);
  {
    const ScopedEnv e("KESTREL_PREFILL_GEMM", "");  // (empty: the default)
    EXPECT_EQ(prefill_gemm_choice_from_env(), C::Auto);
  }
  {
    const ScopedEnv e("KESTREL_PREFILL_GEMM", "pipe");
    EXPECT_EQ(prefill_gemm_choice_from_env(), C::Pipe);
  }
  {
    const ScopedEnv e("KESTREL_PREFILL_GEMM", "reg");
    EXPECT_EQ(prefill_gemm_choice_from_env(), C::Reg);
  }
  const ScopedEnv e("KESTREL_PREFILL_GEMM", "wgmma");
  EXPECT_THROW(prefill_gemm_choice_from_env(), Error);
}

// The Pipe GEMM kernel (prefill_pipe.cu) on the Split route: every projection it takes (Q4 and
// bf16 with K % 512 == 0; the Q8 router stays on Reg) through the whole prompt driver, then decode.
TEST(PrefillE2E, PipeKernelQ4AndBf16) {
  REQUIRE_GPU();
  const ModelConfig c = small_real_width_config();
  for (WFormat f : {WFormat::Q4, WFormat::BF16}) {
    const uint32_t seed = f == WFormat::Q4 ? 14 : 15;
    const WFormat rf = f == WFormat::Q4 ? WFormat::Q8 : WFormat::BF16;
    cpu::CpuBackend cpu_b(random_weights(c, f, rf, seed), 0);
    auto gpu_b = make_cuda_backend(random_weights(c, f, rf, seed), BackendOptions{});
    set_prefill_aprec(*gpu_b, PrefillAPrec::Split);
    set_prefill_gemm_choice(*gpu_b, PrefillGemmChoice::Pipe);
    const std::string what = fmt::format("random {}, pipe kernel", wformat_name(f));
    check_prompts(cpu_b, *gpu_b, what, seed + 100);
    check_prefill_then_decode(cpu_b, *gpu_b, what, seed + 200);
  }
}

// The same for the Q4 model with every Pipe GEMM on one kernel: the exact product-set kernel
// (KESTREL_PIPE_MMA=pp) and the wgmma kernel (wgmma); the default (auto) mixes the two by K.
void run_pipe_kernel_q4(const char* mma, PipeMma want, uint32_t seed) {
  const ScopedEnv env("KESTREL_PIPE_MMA", mma);
  ASSERT_EQ(prefill_pipe_q4_mma(), want);
  const ModelConfig c = small_real_width_config();
  cpu::CpuBackend cpu_b(random_weights(c, WFormat::Q4, WFormat::Q8, seed), 0);
  auto gpu_b = make_cuda_backend(random_weights(c, WFormat::Q4, WFormat::Q8, seed), BackendOptions{});
  set_prefill_aprec(*gpu_b, PrefillAPrec::Split);
  set_prefill_gemm_choice(*gpu_b, PrefillGemmChoice::Pipe);
  const std::string what = fmt::format("random q4, pipe {} kernel", mma);
  check_prompts(cpu_b, *gpu_b, what, seed + 100);
  check_prefill_then_decode(cpu_b, *gpu_b, what, seed + 200);
}
TEST(PrefillE2E, PipeKernelPpQ4) {
  REQUIRE_GPU();
  run_pipe_kernel_q4("pp", PipeMma::Pp, 19);
}
TEST(PrefillE2E, PipeKernelWgmmaQ4) {
  REQUIRE_GPU();
  run_pipe_kernel_q4("wgmma", PipeMma::Wgmma, 20);
}

// The committed real-width fixture (4 layers, 16 experts top-8), weights regenerated with
// core/synth as test_backend.cpp does, bf16 and 4-bit (quantised at load on both backends).
TEST(PrefillE2E, RealWidthFixture) {
  REQUIRE_GPU();
  namespace fs = std::filesystem;
  const fs::path src = fs::path(KESTREL_FIXTURES) / "realwidth";
  const fs::path dir = fs::temp_directory_path() / "kestrel_prefill_realwidth";
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
    check_prompts(*cpu_b, *gpu_b, q == QuantMode::None ? "realwidth bf16" : "realwidth q4", 31);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kestrel::cuda::test
