// End-to-end parity of the CPU backend against the transformers reference (fp32 on bf16 weights):
// logits at every prompt position and at every greedy decode step, and the greedy tokens.
#include "core/safetensors.h"
#include "core/synth.h"
#include "cpu/cpu_backend.h"
#include "engine/engine.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

namespace kestrel {
namespace {

struct Reference {
  std::vector<int32_t> prompt;
  std::vector<float> prompt_logits;  // [T, V]
  std::vector<int32_t> greedy;       // [S+1]
  std::vector<float> decode_logits;  // [S, V]
};

template <class T>
std::vector<T> read_tensor(const SafetensorsFile& f, const std::string& name) {
  const auto& t = f.tensors().at(name);
  std::vector<T> v(t.nbytes / sizeof(T));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

Reference load_reference(const std::filesystem::path& p) {
  SafetensorsFile f(p);
  return {read_tensor<int32_t>(f, "prompt_ids"), read_tensor<float>(f, "prompt_logits"),
          read_tensor<int32_t>(f, "greedy_tokens"), read_tensor<float>(f, "decode_logits")};
}

// max|a - b| / max|b| over one row of logits.
double rel_err(const float* a, const float* b, int64_t n) {
  double md = 0, mr = 0;
  for (int64_t i = 0; i < n; ++i) {
    md = std::max(md, std::abs(double(a[i]) - b[i]));
    mr = std::max(mr, std::abs(double(b[i])));
  }
  return md / mr;
}

int64_t argmax(const float* x, int64_t n) { return std::max_element(x, x + n) - x; }

void check_parity(const std::filesystem::path& dir, const std::filesystem::path& ref_path,
                  const BackendOptions& opts, double tol) {
  const Reference ref = load_reference(ref_path);
  auto be = load_backend(dir, opts);
  const int64_t V = be->config().vocab_size;
  const int64_t T = int64_t(ref.prompt.size());
  ASSERT_EQ(int64_t(ref.prompt_logits.size()), T * V);
  const SeqId s = be->create_sequence(T + int64_t(ref.greedy.size()) + 1);
  StepRequest req{s, ref.prompt, true};
  StepResult res;
  be->step({&req, 1}, {&res, 1});
  ASSERT_EQ(res.n_rows, T);
  double worst = 0;
  for (int64_t t = 0; t < T; ++t) {
    const double e = rel_err(res.logits.data() + t * V, ref.prompt_logits.data() + t * V, V);
    worst = std::max(worst, e);
    EXPECT_LE(e, tol) << "prompt position " << t;
  }
  EXPECT_EQ(argmax(res.logits.data() + (T - 1) * V, V), ref.greedy[0]);
  double worst_dec = 0;
  const int64_t S = int64_t(ref.decode_logits.size()) / V;
  for (int64_t i = 0; i < S; ++i) {
    const int32_t tok = ref.greedy[size_t(i)];
    StepRequest r{s, {&tok, 1}, false};
    StepResult o;
    be->step({&r, 1}, {&o, 1});
    const double e = rel_err(o.logits.data(), ref.decode_logits.data() + i * V, V);
    worst_dec = std::max(worst_dec, e);
    EXPECT_LE(e, tol) << "decode step " << i;
    EXPECT_EQ(argmax(o.logits.data(), V), ref.greedy[size_t(i + 1)]) << "greedy token " << i + 1;
  }
  std::printf("[parity] %s: prompt %lld positions max rel err %.3e; %lld decode steps max rel err %.3e\n",
              dir.filename().c_str(), (long long)T, worst, (long long)S, worst_dec);
}

TEST(CpuParity, TinyMatchesTransformers) {
  const auto dir = fixtures_dir() / "tiny";
  check_parity(dir, dir / "reference.safetensors", {}, 1e-4);
}

// The real-width fixture (hidden 2048, heads 16/2 x 256, GDN 16/32 x 128, expert width 512): its
// weights are regenerated from the seed by the synthetic writer, its reference was computed by
// transformers on those weights (tools/device/fixtures.sh).
TEST(CpuParity, RealWidthMatchesTransformers) {
  const auto fx = fixtures_dir() / "realwidth";
  const auto ref = fx / "reference.safetensors";
  ASSERT_TRUE(std::filesystem::exists(ref)) << "missing " << ref << ": run tools/device/fixtures.sh";
  const auto cfg_json = read_json_file(fx / "config.json");
  const ModelConfig cfg = parse_config(cfg_json);
  const auto dir = std::filesystem::temp_directory_path() / "kestrel-realwidth-parity";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(fx / "config.json", dir / "config.json",
                             std::filesystem::copy_options::overwrite_existing);
  write_synthetic_checkpoint(cfg, dir, {cfg_json["kestrel_synthetic"]["seed"].get<uint64_t>(), false, true});
  check_parity(dir, ref, {}, 1e-4);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kestrel
