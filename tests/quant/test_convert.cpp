// `kestrel quantize` (quant::convert_hf_to_mlx): the tiny HF checkpoint converted by kestrel is
// byte-identical, tensor by tensor, to the fixture script's independent MLX conversion, loads back
// to the same weights, shards like mlx-lm, and refuses bad inputs.
#include "quant_test_util.h"

#include "core/synth.h"

#include <cstdlib>
#include <map>

namespace kestrel {
namespace {

using namespace qtest;

std::map<std::string, Tensor> by_name(const fs::path& file) {
  std::map<std::string, Tensor> m;
  for (auto& t : read_all(file)) m[t.name] = std::move(t);
  return m;
}

void expect_same_weights(const ModelWeights& a, const ModelWeights& b) {
  std::vector<std::pair<std::string, Mat>> x, y;
  for_each_mat(a, [&](const std::string& n, const Mat& m) { x.push_back({n, m}); });
  for_each_mat(b, [&](const std::string& n, const Mat& m) { y.push_back({n, m}); });
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) expect_same_mat(x[i].second, y[i].second, x[i].first);
  EXPECT_EQ(a.final_norm, b.final_norm);
  for (size_t l = 0; l < a.layers.size(); ++l) {
    const auto &p = a.layers[l], &q = b.layers[l];
    EXPECT_EQ(p.input_norm, q.input_norm) << l;
    EXPECT_EQ(p.post_norm, q.post_norm) << l;
    EXPECT_EQ(p.attn.q_norm, q.attn.q_norm) << l;
    EXPECT_EQ(p.attn.k_norm, q.attn.k_norm) << l;
    EXPECT_EQ(p.gdn.conv1d, q.gdn.conv1d) << l;
    EXPECT_EQ(p.gdn.A_log, q.gdn.A_log) << l;
    EXPECT_EQ(p.gdn.dt_bias, q.gdn.dt_bias) << l;
    EXPECT_EQ(p.gdn.norm, q.gdn.norm) << l;
  }
}

TEST(Convert, TinyIsByteIdenticalToTheFixtureScriptsMlxCopy) {
  TmpDir d("convert");
  const fs::path out = d.path / "out";
  size_t calls = 0, last = 0, total = 0;
  quant::ConvertOptions o;
  o.progress = [&](size_t done, size_t tot) {
    EXPECT_GE(done, last);
    last = done;
    total = tot;
    ++calls;
  };
  const auto rep = quant::convert_hf_to_mlx(fixtures() / "tiny", out, o);
  EXPECT_EQ(last, total);
  EXPECT_GT(calls, 10u);
  EXPECT_EQ(rep.shards, 1u);
  EXPECT_EQ(rep.unquantized.size(), 16u);  // expert + shared down_proj (width 32) in 8 layers
  size_t vis_mtp = 0;
  {
    auto ck = Checkpoint::open(fixtures() / "tiny");
    for (const auto& [n, _] : ck->all()) vis_mtp += n.rfind("model.visual.", 0) == 0 || n.rfind("mtp.", 0) == 0;
  }
  EXPECT_EQ(rep.dropped, vis_mtp);

  const auto ours = by_name(out / "model.safetensors");
  const auto script = by_name(fixtures() / "tiny-mlx4" / "model.safetensors");
  EXPECT_EQ(ours.size(), script.size());
  EXPECT_EQ(rep.tensors_written, ours.size());
  size_t bytes = 0;
  for (const auto& [name, t] : script) {
    auto it = ours.find(name);
    if (it == ours.end()) {
      ADD_FAILURE() << "kestrel quantize did not write " << name;
      continue;
    }
    EXPECT_EQ(int(it->second.dtype), int(t.dtype)) << name;
    EXPECT_EQ(it->second.shape, t.shape) << name;
    EXPECT_TRUE(it->second.bytes == t.bytes) << name << ": bytes differ";
    bytes += t.bytes.size();
  }
  EXPECT_EQ(rep.bytes_out, bytes);
  // The whole config (quantization block with its 8-bit overrides, quantization_config, no
  // vision_config) equals the script's.
  const json a = read_json_file(out / "config.json"), b = read_json_file(fixtures() / "tiny-mlx4" / "config.json");
  EXPECT_EQ(a, b) << a.dump(1).substr(0, 2000);
  EXPECT_EQ(a["quantization"], a["quantization_config"]);
  EXPECT_FALSE(a.contains("vision_config"));
  // The index lists every tensor; the side files came along.
  const json idx = read_json_file(out / "model.safetensors.index.json");
  EXPECT_EQ(idx["weight_map"].size(), ours.size());
  EXPECT_EQ(idx["metadata"]["total_size"].get<size_t>(), bytes);
  for (const char* f : {"generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
    if (fs::exists(fixtures() / "tiny" / f)) {
      EXPECT_TRUE(fs::exists(out / f)) << f;
    }
  EXPECT_FALSE(fs::exists(out / "reference.safetensors"));
  std::printf("[convert] %zu tensors, %zu bytes identical to the script's; %zu dropped (vision/MTP)\n",
              ours.size(), bytes, rep.dropped);

  // And it loads back to exactly the fixture's weights, with no copies.
  auto w = load_weights(out);
  EXPECT_TRUE(w->owned.empty());
  expect_same_weights(*w, *load_weights(fixtures() / "tiny-mlx4"));
}

TEST(Convert, ShardsLikeMlxLmAndLoadsBack) {
  TmpDir d("shards");
  quant::ConvertOptions o;
  o.max_shard_bytes = 700 << 10;
  const auto rep = quant::convert_hf_to_mlx(fixtures() / "tiny", d.path / "out", o);
  ASSERT_GT(rep.shards, 2u);
  for (size_t i = 1; i <= rep.shards; ++i) {
    const auto f = d.path / "out" / fmt::format("model-{:05d}-of-{:05d}.safetensors", i, rep.shards);
    ASSERT_TRUE(fs::exists(f)) << f;
    EXPECT_LE(fs::file_size(f), size_t(700 << 10) + (300 << 10)) << f;  // one unit may overflow
  }
  EXPECT_FALSE(fs::exists(d.path / "out" / "model.safetensors"));
  auto w = load_weights(d.path / "out");
  EXPECT_TRUE(w->owned.empty()) << "shard writer keeps every tensor aligned";
  expect_same_weights(*w, *load_weights(fixtures() / "tiny-mlx4"));
}

// The fused HF expert layout (experts.gate_up_proj [E, 2I, H] + experts.down_proj [E, H, I]): the
// converter's gate/up split and the HF loader's quantize-at-load views give the same matrices.
TEST(Convert, FusedExpertLayoutMatchesQuantizeAtLoad) {
  TmpDir d("fused");
  const fs::path in = d.path / "in";
  fs::create_directories(in);
  fs::copy_file(fixtures() / "tiny" / "config.json", in / "config.json");
  write_synthetic_checkpoint(load_config(in), in, {5, true, true});
  ASSERT_TRUE(Checkpoint::open(in)->find("model.language_model.layers.0.mlp.experts.gate_up_proj"));
  quant::convert_hf_to_mlx(in, d.path / "out", {});
  auto mlx = load_weights(d.path / "out");
  LoadOptions q4;
  q4.quant = QuantMode::Q4;
  auto hf = load_weights(in, q4);
  std::vector<std::pair<std::string, Mat>> x, y;
  for_each_mat(*mlx, [&](const std::string& n, const Mat& m) { x.push_back({n, m}); });
  for_each_mat(*hf, [&](const std::string& n, const Mat& m) { y.push_back({n, m}); });
  ASSERT_EQ(x.size(), y.size());
  for (size_t i = 0; i < x.size(); ++i) expect_same_mat(x[i].second, y[i].second, x[i].first);
}

// A sharded HF input (model-0000i-of-0000N.safetensors + index, as the official checkpoint ships)
// converts to the same bytes as the single-file one.
TEST(Convert, ShardedHfInput) {
  TmpDir d("shardin");
  const fs::path in = d.path / "in";
  fs::create_directories(in);
  for (const char* f : {"config.json", "generation_config.json"}) fs::copy_file(fixtures() / "tiny" / f, in / f);
  auto all = read_all(fixtures() / "tiny" / "model.safetensors");
  json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", json::object()}};
  for (int s = 0; s < 3; ++s) {
    const std::string name = fmt::format("model-{:05d}-of-00003.safetensors", s + 1);
    std::vector<TensorToWrite> tw;
    for (size_t i = size_t(s); i < all.size(); i += 3) {
      tw.push_back({all[i].name, all[i].dtype, all[i].shape, all[i].bytes});
      index["weight_map"][all[i].name] = name;
    }
    write_safetensors(in / name, tw);
  }
  std::ofstream(in / "model.safetensors.index.json") << index.dump();
  quant::convert_hf_to_mlx(in, d.path / "out", {});
  const auto ours = by_name(d.path / "out" / "model.safetensors");
  const auto script = by_name(fixtures() / "tiny-mlx4" / "model.safetensors");
  ASSERT_EQ(ours.size(), script.size());
  for (const auto& [name, t] : script) EXPECT_TRUE(ours.count(name) && ours.at(name).bytes == t.bytes) << name;
}

TEST(Convert, RefusesBadInputs) {
  TmpDir d("refuse");
  expect_error([&] { quant::convert_hf_to_mlx(fixtures() / "tiny-mlx4", d.path / "a", {}); },
               {"already quantized"});
  fs::create_directories(d.path / "busy");
  std::ofstream(d.path / "busy" / "x") << "x";
  expect_error([&] { quant::convert_hf_to_mlx(fixtures() / "tiny", d.path / "busy", {}); },
               {"exists and is not an empty directory"});
  quant::ConvertOptions o;
  o.bits = 3;
  expect_error([&] { quant::convert_hf_to_mlx(fixtures() / "tiny", d.path / "b", o); }, {"bits 3"});
  expect_error([&] { quant::convert_hf_to_mlx(d.path / "nowhere", d.path / "c", {}); }, {"config.json"});
  // A checkpoint missing a tensor fails before anything is written.
  fs::create_directories(d.path / "in");
  fs::copy_file(fixtures() / "tiny" / "config.json", d.path / "in" / "config.json");
  {
    auto t = read_all(fixtures() / "tiny" / "model.safetensors");
    std::erase_if(t, [](const Tensor& x) { return x.name.find("layers.2.linear_attn.in_proj_z") != std::string::npos; });
    std::vector<TensorToWrite> tw;
    for (const auto& x : t) tw.push_back({x.name, x.dtype, x.shape, x.bytes});
    write_safetensors(d.path / "in" / "model.safetensors", tw);
  }
  expect_error([&] { quant::convert_hf_to_mlx(d.path / "in", d.path / "d", {}); },
               {"missing tensor 'model.language_model.layers.2.linear_attn.in_proj_z.weight'"});
  EXPECT_FALSE(fs::exists(d.path / "d" / "config.json"));
}

// The CLI end to end: `kestrel quantize` writes what the library writes.
TEST(Convert, CliQuantizeCommand) {
  const fs::path bin = KESTREL_BINARY;
  if (!fs::exists(bin)) GTEST_SKIP() << "kestrel binary not built at " << bin;
  TmpDir d("cli");
  const auto out = d.path / "q4";
  const std::string cmd = fmt::format("'{}' quantize --model '{}' --out '{}' --quant q4 > '{}' 2>&1", bin.string(),
                                      (fixtures() / "tiny").string(), out.string(), (d.path / "log").string());
  ASSERT_EQ(std::system(cmd.c_str()), 0) << std::ifstream(d.path / "log").rdbuf();
  const auto ours = by_name(out / "model.safetensors");
  const auto script = by_name(fixtures() / "tiny-mlx4" / "model.safetensors");
  ASSERT_EQ(ours.size(), script.size());
  for (const auto& [name, t] : script) EXPECT_TRUE(ours.count(name) && ours.at(name).bytes == t.bytes) << name;
  const std::string bad = fmt::format("'{}' quantize --model '{}' --out '{}' --quant q8 > '{}' 2>&1", bin.string(),
                                      (fixtures() / "tiny").string(), (d.path / "x").string(),
                                      (d.path / "log2").string());
  EXPECT_NE(std::system(bad.c_str()), 0);
  std::stringstream log;
  log << std::ifstream(d.path / "log2").rdbuf();
  EXPECT_NE(log.str().find("--quant q8: not supported"), std::string::npos) << log.str();
}

}  // namespace
}  // namespace kestrel
