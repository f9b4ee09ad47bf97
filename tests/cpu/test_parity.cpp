// End-to-end parity of the CPU backend against the transformers reference (fp32 on bf16 weights):
// logits at every prompt position and at every greedy decode step, and the greedy tokens.
#include "core/safetensors.h"
#include "core/synth.h"
#include "cpu/cpu_backend.h"
#include "engine/engine.h"
#include "../common/reference_parity.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

namespace kestrel {
namespace {

void check_parity(const std::filesystem::path& dir, const std::filesystem::path& ref_path,
                  const BackendOptions& opts, double tol) {
  auto be = load_backend(dir, opts);
  const auto r = testing::run_reference_parity(*be, ref_path, dir.filename().string(), tol);
  EXPECT_EQ(r.greedy_mismatches, 0) << "greedy tokens differ from the reference";
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
