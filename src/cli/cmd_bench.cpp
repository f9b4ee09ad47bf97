// kestrel bench: batch-1 decode speed on the GPU, written as JSON records under bench/results/.
//   kestrel bench --synthetic q4|bf16 [--contexts 0,4096,32768,131072] [--steps 64] [--warmup 16]
//   kestrel bench --model DIR [...]           (a real checkpoint on --device cuda)
// Route switches: --gemv, --pdl, --moe, --route, --route-algo (one record per combination).
// Each record: kind=decode, weights, context, tok_per_s (from the median step time of >= 64 graph
// replays after warm-up), achieved_gb_per_s (bytes the step must move / median step time),
// floor_tok_per_s at 4.0 TB/s and the fraction reached, gpu, git_sha, date.
//   kestrel bench --synthetic q4|bf16 --prefill 512,4096,32768,131072 [--prefill-runs 3]
//                 [--prefill-aprec split|f16|both]   (the GEMM route: split, the default, is exact)
//                 [--prefill-gemm auto|reg|pipe|both|all]  (the Split route's GEMM kernel choice)
// Prompt (prefill) speed instead: each prompt of random tokens through the backend's real step
// (Backend::step on a fresh sequence, last-token logits back on the host: the time to first
// token), wall-clock; one untimed warm-up prompt first, then the median of --prefill-runs runs
// for prompts up to 8192 tokens and one run for longer ones. Records: kind=prefill, weights,
// prompt_tokens, aprec, gemm, range_redos, tok_per_s, achieved_tflops (see prefill_flops), ttft_ms, gpu,
// git_sha, date.
#include "cli/commands.h"
#include "core/check.h"
#include "engine/engine.h"

#if defined(KESTREL_HAS_CUDA)
#include "cuda/cuda_backend.h"
#include "cuda/kernels.h"
#include "cuda/prefill_step.h"

#include <cuda_runtime.h>
#include <fmt/ranges.h>
#endif

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct BenchOpts {
  std::string synthetic;
  std::string model;
  std::string contexts = "0,4096,32768,131072";
  int steps = 64;
  int warmup = 16;
  int layers = 0;  // synthetic: 0 = all 40
  std::string out_dir = "bench/results";
  uint64_t seed = 1;
  std::string pdl = "on";  // programmatic dependent launch: on (the default route) | off | both
  std::string moe = "mma";  // MoE experts route(s): split, fused, mma (default); a comma list or all
  std::string route = "auto";  // MoE routing place(s): tail (of the router GEMV), kernel, gate_up, auto (default); a comma list or all
  std::string route_algo = "block";  // MoE routing algorithm(s): warp, block (default); a comma list or both
  std::string gemv = "1";    // GEMV route(s) for M = 1: 1, 2, 3; a comma list or all
  std::string prefill;       // prompt lengths: run the prefill benchmark instead of decode
  int prefill_runs = 3;      // timed runs per prompt of <= 8192 tokens (one for longer)
  int64_t prefill_prefix = 0;  // cached tokens before each timed prompt (a follow-up turn); 0: from empty
  std::string prefill_aprec = "split";  // GEMM route of fp32 activations: split | f16 | both
  std::string prefill_gemm = "default";  // Split route's GEMM kernel: reg | pipe | both | default (env)
};

constexpr double kBandwidth = 4.0e12;  // measured H200 ceiling (performance.md §0.1), bytes/s

[[maybe_unused]] std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

[[maybe_unused]] std::string git_sha() {
  if (const char* e = std::getenv("KESTREL_GIT_SHA"); e && *e) return e;
  std::string s;
  if (FILE* p = popen("git rev-parse HEAD 2>/dev/null", "r")) {
    char buf[128];
    if (std::fgets(buf, sizeof buf, p)) s = buf;
    pclose(p);
  }
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r')) s.pop_back();
  return s.empty() ? "unknown" : s;
}

[[maybe_unused]] std::vector<int64_t> parse_list(const std::string& s, const char* flag = "--contexts") {
  std::vector<int64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    KESTREL_CHECK(!item.empty(), "{}: empty entry in '{}'", flag, s);
    size_t used = 0;
    long long x = 0;
    try {
      x = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    KESTREL_CHECK(used == item.size() && x >= 0, "{}: '{}' is not a token count", flag, item);
    v.push_back(x);
  }
  KESTREL_CHECK(!v.empty(), "{}: no values given", flag);
  return v;
}

// Work of a T-token prompt from an empty cache, in FLOPs (2 per multiply-add): every weight GEMM
// of every token with the top-k routed experts (GDN / attention projections, router, k experts,
// shared expert and its gate; active parameters without embedding and lm_head), lm_head for the
// last position only, and causal attention (Q K^T and P V over T (T + 1) / 2 query-key pairs per
// head). Not counted: the GDN chunked delta rule, conv, norms, routing, softmax.
[[maybe_unused]] double prefill_flops(const kestrel::ModelConfig& c, int64_t T) {
  const double H = c.hidden_size, D = c.head_dim, nh = c.num_attention_heads, kv = c.num_kv_heads;
  double per_token = 0, attn_layers = 0;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.is_full(l)) {
      per_token += (nh * 2 * D + 2 * kv * D) * H + H * nh * D;
      attn_layers += 1;
    } else {
      per_token += (double(c.gdn_conv_dim()) + double(c.gdn_value_dim()) + 2.0 * c.linear_num_value_heads) * H +
                   H * double(c.gdn_value_dim());
    }
    per_token += double(c.num_experts) * H + double(c.num_experts_per_tok) * 3.0 * c.moe_intermediate_size * H +
                 3.0 * c.shared_expert_intermediate_size * H + H;
  }
  const double pairs = double(T) * double(T + 1) / 2.0;
  return 2.0 * per_token * double(T) + 2.0 * double(c.vocab_size) * H + attn_layers * 4.0 * nh * D * pairs;
}

#if defined(KESTREL_HAS_CUDA)
void run_prefill_bench(const BenchOpts& o, kestrel::Backend& b, const std::string& weights,
                       const std::string& gpu, const std::string& sha, const std::string& date) {
  using namespace kestrel;
  const auto prompts = parse_list(o.prefill, "--prefill");
  KESTREL_CHECK(o.prefill_runs >= 1, "bench: --prefill-runs {}", o.prefill_runs);
  const ModelConfig& c = b.config();
  const int64_t P = o.prefill_prefix;
  for (int64_t n : prompts)
    KESTREL_CHECK(n >= 2 && P >= 0 && P + n < c.max_position_embeddings,
                  "--prefill: prompt {} after a prefix of {} outside 2..{} tokens (one-token steps are decode)", n,
                  P, c.max_position_embeddings - 1);
  std::mt19937 g(uint32_t(o.seed));
  auto prompt_of = [&](int64_t n) {
    std::vector<int32_t> p(static_cast<size_t>(n));
    for (auto& t : p) t = int32_t(g() % uint32_t(c.vocab_size));
    return p;
  };
  const std::vector<int32_t> prefix = prompt_of(P);
  // One prompt: a fresh sequence (allocated outside the timing) holding the prefix (untimed), then
  // Backend::step over the prompt with the last token's logits back on the host.
  auto time_prompt = [&](const std::vector<int32_t>& p) {
    const SeqId s = b.create_sequence(P + int64_t(p.size()) + 1);
    if (P > 0) {
      StepRequest pr{s, prefix, false};
      StepResult pres;
      b.step({&pr, 1}, {&pres, 1});
    }
    StepRequest r{s, p, false};
    StepResult res;
    const auto t0 = std::chrono::steady_clock::now();
    b.step({&r, 1}, {&res, 1});
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    for (float v : res.logits)
      KESTREL_CHECK(std::isfinite(v), "bench: non-finite logit after a {}-token prompt", p.size());
    b.free_sequence(s);
    return t;
  };
  {
    const auto warm = prompt_of(std::min<int64_t>(prompts.front(), 4096));
    const double t = time_prompt(warm);
    std::fprintf(stderr, "bench: warm-up prompt of %zu tokens %.1f ms (prefill scratch %.2f GB)\n",
                 warm.size(), t * 1e3, double(cuda::prefill_scratch_bytes(b)) / 1e9);
  }
  KESTREL_CHECK(o.prefill_aprec == "f16" || o.prefill_aprec == "split" || o.prefill_aprec == "both",
                "--prefill-aprec {} (f16, split or both)", o.prefill_aprec);
  // Split-route kernel choices: one of reg | pipe | auto, "both" (reg and pipe), "all", or the
  // default (KESTREL_PREFILL_GEMM, else auto).
  using Choice = cuda::PrefillGemmChoice;
  std::vector<Choice> choices;
  const std::string& pg = o.prefill_gemm;
  if (pg == "default") choices.push_back(cuda::prefill_gemm_choice_from_env());
  if (pg == "reg" || pg == "both" || pg == "all") choices.push_back(Choice::Reg);
  if (pg == "pipe" || pg == "both" || pg == "all") choices.push_back(Choice::Pipe);
  if (pg == "auto" || pg == "all") choices.push_back(Choice::Auto);
  KESTREL_CHECK(!choices.empty(), "--prefill-gemm {} (reg, pipe, auto, both or all)", pg);
  std::vector<std::pair<cuda::PrefillAPrec, Choice>> routes;
  if (o.prefill_aprec != "split") routes.push_back({cuda::PrefillAPrec::F16, Choice::Reg});
  if (o.prefill_aprec != "f16")
    for (Choice k : choices) routes.push_back({cuda::PrefillAPrec::Split, k});
  nlohmann::json records = nlohmann::json::array();
  std::printf("%-8s %6s %5s %9s %5s %11s %11s %10s %9s %6s\n", "weights", "aprec", "gemm", "prompt", "runs",
              "ttft_ms", "tok/s", "TFLOP/s", "of 778", "redos");
  for (const auto& [route, kern] : routes)
  for (int64_t n : prompts) {
    cuda::set_prefill_aprec(b, route);
    cuda::set_prefill_gemm_choice(b, kern);
    const char* aprec = route == cuda::PrefillAPrec::F16 ? "f16" : "split";
    const int64_t chunk = std::min<int64_t>(n, cuda::kPrefillMaxChunk);
    const char* gemm = route == cuda::PrefillAPrec::F16 ? "reg" : cuda::prefill_gemm_choice_name(kern);
    const char* kernel =
        cuda::prefill_gemm_kernel_for(kern, route, chunk) == cuda::PrefillGemmKernel::Pipe ? "pipe" : "reg";
    const int64_t redos0 = cuda::prefill_range_redos(b);
    const int runs = n <= cuda::kPrefillMaxChunk ? o.prefill_runs : 1;
    const auto p = prompt_of(n);
    std::vector<double> t;
    for (int i = 0; i < runs; ++i) t.push_back(time_prompt(p));
    std::sort(t.begin(), t.end());
    const double med = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
    // (After a prefix: the prompt's own GEMMs, its attention over prefix + itself, one lm_head row.)
    const double flops = prefill_flops(c, P + n) - (P > 0 ? prefill_flops(c, P) - 2.0 * c.vocab_size * c.hidden_size : 0.0),
                 tflops = flops / med / 1e12;
    const int64_t redos = cuda::prefill_range_redos(b) - redos0;
    std::printf("%-8s %6s %5s %9lld %5d %11.2f %11.1f %10.1f %8.1f%% %6lld\n", weights.c_str(), aprec, gemm,
                (long long)n, runs, med * 1e3, double(n) / med, tflops, 100.0 * tflops / 778.0,
                (long long)redos);
    std::fflush(stdout);
    records.push_back({{"kind", "prefill"},
                       {"weights", weights},
                       {"prompt_tokens", n},
                       {"prefix_tokens", P},
                       {"aprec", aprec},
                       {"gemm", gemm},
                       {"gemm_kernel", kernel},
                       {"pipe_q4_mma", cuda::prefill_pipe_mma_name(cuda::prefill_pipe_q4_mma())},
                       {"attn_tile", std::array{"64x32", "128x64", "128x64k2"}[cuda::prefill_attn_wide()]},
                       {"moe_tile_rows", std::getenv("KESTREL_PREFILL_MOE_BM") ? std::getenv("KESTREL_PREFILL_MOE_BM")
                                                                              : "default"},
                       {"range_redos", redos},
                       {"tok_per_s", double(n) / med},
                       {"achieved_tflops", tflops},
                       {"ttft_ms", med * 1e3},
                       {"ttft_ms_min", t.front() * 1e3},
                       {"ttft_ms_max", t.back() * 1e3},
                       {"runs", runs},
                       {"flops", flops},
                       {"flops_counted",
                        "2 per multiply-add: every token's weight GEMMs with the top-k experts (GDN/attention "
                        "projections, router, experts, shared expert and gate), lm_head for the last "
                        "position, causal attention QK^T and PV over T(T+1)/2 pairs per head; the GDN delta "
                        "rule, conv, norms and routing not counted"},
                       {"measured", "wall clock of Backend::step on a fresh sequence (tokens in, last-token "
                                    "logits on the host); median after one warm-up prompt"},
                       {"chunk_tokens", cuda::kPrefillMaxChunk},
                       {"prefill_scratch_bytes", cuda::prefill_scratch_bytes(b)},
                       {"layers", c.num_layers},
                       {"gpu", gpu},
                       {"git_sha", sha},
                       {"date", date}});
  }
  std::filesystem::create_directories(o.out_dir);
  std::string stamp = date;
  std::replace(stamp.begin(), stamp.end(), ':', '-');
  const auto path = std::filesystem::path(o.out_dir) / ("prefill-" + weights + "-" + stamp + ".json");
  std::ofstream f(path);
  KESTREL_CHECK(f.good(), "bench: cannot write {}", path.string());
  f << records.dump(2) << "\n";
  std::fprintf(stderr, "bench: wrote %s\n", path.string().c_str());
}
#endif

void run_bench(const BenchOpts& o) {
#if !defined(KESTREL_HAS_CUDA)
  (void)o;
  KESTREL_FAIL("kestrel bench needs the CUDA backend; this build has none (configure with -DKESTREL_CUDA=ON)");
#else
  using namespace kestrel;
  KESTREL_CHECK(o.synthetic.empty() != o.model.empty(), "bench: give exactly one of --synthetic or --model");
  KESTREL_CHECK(o.steps >= 64, "bench: --steps {} (the median is taken over at least 64 steps)", o.steps);
  KESTREL_CHECK(o.warmup >= 1, "bench: --warmup {}", o.warmup);
  const auto contexts = parse_list(o.contexts);
  const int64_t max_ctx = *std::max_element(contexts.begin(), contexts.end());

  std::unique_ptr<Backend> b;
  std::string weights;
  const auto t0 = std::chrono::steady_clock::now();
  if (!o.synthetic.empty()) {
    KESTREL_CHECK(o.synthetic == "q4" || o.synthetic == "bf16", "--synthetic {} (expected q4 or bf16)",
                  o.synthetic);
    ModelConfig c = cuda::real_model_config();
    if (o.layers > 0) {
      KESTREL_CHECK(o.layers <= c.num_layers, "--layers {} > {}", o.layers, c.num_layers);
      c.num_layers = o.layers;
      c.layer_types.resize(size_t(o.layers));
    }
    b = cuda::make_synthetic_backend(c, o.synthetic, o.seed);
    weights = o.synthetic;
  } else {
    BackendOptions bo;
    bo.device = DeviceKind::Cuda;
    b = load_backend(o.model, bo);
    weights = "checkpoint";
  }
  const double build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  const std::string gpu = prop.name;
  const std::string sha = git_sha(), date = utc_now();
  std::fprintf(stderr, "bench: %s weights %.2f GB on %s (ready in %.1f s)\n", weights.c_str(),
               double(cuda::weight_bytes(*b)) / 1e9, gpu.c_str(), build_s);
  if (!o.prefill.empty()) {
    run_prefill_bench(o, *b, weights, gpu, sha, date);
    return;
  }

  KESTREL_CHECK(o.pdl == "on" || o.pdl == "off" || o.pdl == "both", "--pdl {} (on, off or both)", o.pdl);
  // A comma list of names (or `every`) -> the chosen indices in the order given.
  auto choose = [](const std::string& list, const char* flag, const char* every,
                   const std::vector<std::string>& names) {
    std::vector<int> v;
    if (list == every)
      for (size_t i = 0; i < names.size(); ++i) v.push_back(int(i));
    std::stringstream ss(list == every ? std::string() : list);
    std::string item;
    while (std::getline(ss, item, ',')) {
      const auto it = std::find(names.begin(), names.end(), item);
      KESTREL_CHECK(it != names.end(), "{} {}: '{}' is not one of {} (or {})", flag, list, item,
                    fmt::join(names, ", "), every);
      v.push_back(int(it - names.begin()));
    }
    KESTREL_CHECK(!v.empty(), "{}: no values given", flag);
    return v;
  };
  // GEMV routes: 1, 2, 3, 5 (streamed, 1 block per SM) and 5x2 (the same at 2 blocks per SM),
  // encoded as route * 10 + blocks per SM.
  std::vector<int> gemv_modes;
  const int gemv_codes[] = {11, 21, 31, 51, 52};
  for (int i : choose(o.gemv, "--gemv", "all", {"1", "2", "3", "5", "5x2"})) gemv_modes.push_back(gemv_codes[i]);
  std::vector<bool> pdl_modes;
  if (o.pdl != "on") pdl_modes.push_back(false);
  if (o.pdl != "off") pdl_modes.push_back(true);
  // 0 split (two launches), 1 fused (one launch), 2 split with the q4 experts on the tensor cores.
  const std::vector<std::string> moe_names = {"split", "fused", "mma"};
  const std::vector<int> moe_modes = choose(o.moe, "--moe", "all", moe_names);
  // Indices are the RoutePlace / RouteAlgo values.
  const std::vector<int> route_places = choose(o.route, "--route", "all", {"tail", "kernel", "gate_up", "auto"});
  const std::vector<int> route_algos = choose(o.route_algo, "--route-algo", "both", {"warp", "block"});
  nlohmann::json records = nlohmann::json::array();
  std::printf("%-8s %4s %4s %5s %7s %5s %9s %10s %10s %11s %10s %8s\n", "weights", "gemv", "pdl", "moe", "route",
              "algo", "context", "step_ms", "tok/s", "GB/s", "floor", "of floor");
  struct Mode {
    int gemv;
    bool pdl;
    int moe;
    cuda::RoutePlace place;
    cuda::RouteAlgo algo;
  };
  std::vector<Mode> modes;
  for (int g : gemv_modes)
    for (bool p : pdl_modes)
      for (int f : moe_modes)
        for (int r : route_places)
          for (int al : route_algos)
            if (!(f == 1 && r == int(cuda::RoutePlace::GateUp)))  // the fused launch routes before it
              modes.push_back({g, p, f, cuda::RoutePlace(r), cuda::RouteAlgo(al)});
  KESTREL_CHECK(!modes.empty(), "bench: no decode configuration to run (--moe fused routes by tail or kernel only)");
  for (int64_t ctx : contexts)
  for (const Mode& md : modes) {
    const bool pdl = md.pdl;
    cuda::set_pdl_enabled(pdl);  // both read when the sequence's graph is captured
    cuda::set_gemv_version(md.gemv / 10);
    cuda::set_gemv_stream_blocks_per_sm(md.gemv % 10);
    cuda::set_moe_fused_enabled(md.moe == 1);
    cuda::set_moe_mma_enabled(md.moe == 2);
    cuda::set_moe_route_place(md.place);
    cuda::set_moe_route_algo(md.algo);
    const char* place = cuda::route_place_name(cuda::RoutePlace(cuda::decode_route_place(*b)));  // Auto resolved
    const SeqId s = b->create_sequence(std::max<int64_t>(ctx + o.warmup + o.steps + 1, 64));
    if (ctx > 0) cuda::set_synthetic_context(*b, s, ctx, o.seed + uint64_t(ctx));
    auto t = cuda::time_decode_steps(*b, s, 1, o.warmup, o.steps);
    std::sort(t.begin(), t.end());
    const double med = t.size() % 2 ? t[t.size() / 2] : 0.5 * (t[t.size() / 2 - 1] + t[t.size() / 2]);
    const double bytes = cuda::decode_step_bytes(*b, ctx);
    const double tps = 1.0 / med, gbs = bytes / med / 1e9, floor = kBandwidth / bytes;
    const std::string gname = std::to_string(md.gemv / 10) + (md.gemv % 10 == 2 ? "x2" : "");
    std::printf("%-8s %4s %4s %5s %7s %5s %9lld %10.4f %10.1f %11.1f %10.1f %7.1f%%\n", weights.c_str(),
                gname.c_str(),
                cuda::pdl_pin_enabled() ? (pdl ? "on+p" : "of+p") : (pdl ? "on" : "off"), moe_names[size_t(md.moe)].c_str(), place,
                cuda::route_algo_name(md.algo), (long long)ctx,
                med * 1e3, tps, gbs, floor, 100.0 * tps / floor);
    std::fflush(stdout);
    records.push_back({{"kind", "decode"},
                       {"weights", weights},
                       {"context", ctx},
                       {"tok_per_s", tps},
                       {"achieved_gb_per_s", gbs},
                       {"step_ms_median", med * 1e3},
                       {"step_ms_min", t.front() * 1e3},
                       {"step_ms_max", t.back() * 1e3},
                       {"steps", o.steps},
                       {"warmup", o.warmup},
                       {"bytes_per_step", bytes},
                       {"floor_tok_per_s_at_4TBps", floor},
                       {"fraction_of_floor", tps / floor},
                       {"layers", b->config().num_layers},
                       {"pdl", pdl},
                       {"pdl_pin", cuda::pdl_pin_enabled()},  // KESTREL_PDL_PIN (kernels.h)
                       {"gdn_early_trigger", cuda::gdn_early_trigger()},
                       {"moe_down_early", cuda::moe_down_early()},  // KESTREL_MOE_DOWN_EARLY
                       {"moe_gate_up_depth", cuda::moe_gate_up_depth()},  // KESTREL_MOE_GU_DEPTH
                       {"gemv_preload", cuda::gemv_preload()},      // KESTREL_GEMV_PRELOAD
                       {"gemv_route", md.gemv / 10},
                       {"gemv_stream_blocks_per_sm", md.gemv % 10},
                       {"moe_route", moe_names[size_t(md.moe)].c_str()},
                       {"routing", place},
                       {"routing_requested", cuda::route_place_name(md.place)},
                       {"routing_algo", cuda::route_algo_name(md.algo)},
                       {"gpu", gpu},
                       {"git_sha", sha},
                       {"date", date}});
    b->free_sequence(s);
  }
  (void)max_ctx;
  std::filesystem::create_directories(o.out_dir);
  std::string stamp = date;
  std::replace(stamp.begin(), stamp.end(), ':', '-');
  const auto path = std::filesystem::path(o.out_dir) / ("decode-" + weights + "-" + stamp + ".json");
  std::ofstream f(path);
  KESTREL_CHECK(f.good(), "bench: cannot write {}", path.string());
  f << records.dump(2) << "\n";
  std::fprintf(stderr, "bench: wrote %s\n", path.string().c_str());
#endif
}

void setup_bench(CLI::App& root) {
  auto o = std::make_shared<BenchOpts>();
  auto* c = root.add_subcommand("bench", "Decode benchmark on the GPU (JSON records to bench/results/)");
  c->add_option("--synthetic", o->synthetic, "Synthetic full-size model built on the GPU: q4 or bf16");
  c->add_option("--model", o->model, "Model directory (instead of --synthetic)");
  c->add_option("--contexts", o->contexts, "Comma-separated context lengths in tokens");
  c->add_option("--steps", o->steps, "Timed decode steps per context (>= 64)");
  c->add_option("--warmup", o->warmup, "Untimed steps first");
  c->add_option("--layers", o->layers, "Synthetic: number of layers (default all 40)");
  c->add_option("--out", o->out_dir, "Output directory");
  c->add_option("--seed", o->seed, "Synthetic weights seed");
  c->add_option("--pdl", o->pdl, "Programmatic dependent launch: on, off or both (one record each)");
  c->add_option("--route", o->route,
                "MoE routing place: tail (last block of the router GEMV), kernel (its own launch), gate_up "
                "(every block of moe_gate_up routes for itself), auto (the default: gate_up for q4 experts on the "
                "tensor cores, else kernel); a comma list or all (one record each)");
  c->add_option("--route-algo", o->route_algo,
                "MoE routing algorithm: warp (one warp) or block (256 threads); a comma list or both");
  c->add_option("--moe", o->moe,
                "MoE experts route: split (two launches), fused (one launch), mma (split, q4 experts on the "
                "tensor cores); a comma list or all (one record each)");
  c->add_option("--gemv", o->gemv, "GEMV route for M = 1: 1, 2, 3 (tensor cores, q4), 5 (streamed by bulk copies, q4), 5x2 (5 at 2 blocks per SM); a comma list or all (one record each)");
  c->add_option("--prefill", o->prefill,
                "Comma-separated prompt lengths: benchmark prompts (prefill) instead of decode");
  c->add_option("--prefill-runs", o->prefill_runs, "Timed runs per prompt of <= 8192 tokens (median)");
  c->add_option("--prefill-prefix", o->prefill_prefix,
                "Cached tokens in the sequence before each timed prompt (a follow-up turn; default 0)");
  c->add_option("--prefill-aprec", o->prefill_aprec,
                "GEMM route of fp32 activations in prompts: f16, split (exact) or both (one record each)");
  c->add_option("--prefill-gemm", o->prefill_gemm,
                "GEMM kernel choice of the split route: auto, reg, pipe, both (reg and pipe) or all (one "
                "record each); default from KESTREL_PREFILL_GEMM, else auto");
  c->callback([o] { run_bench(*o); });
}

}  // namespace

KESTREL_COMMAND(setup_bench);
