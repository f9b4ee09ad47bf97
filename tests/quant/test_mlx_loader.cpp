// The MLX-layout loader on the tiny-mlx4 fixture (written by tools/make_mlx_fixture.py, an
// independent implementation of mlx-lm's layout): formats per module, zero-copy views, identical
// weights to the HF checkpoint quantized at load, and clear errors on malformed checkpoints.
#include "quant_test_util.h"

namespace kestrel {
namespace {

using namespace qtest;

fs::path mlx4() { return fixtures() / "tiny-mlx4"; }
const std::string L0 = "language_model.model.layers.0.";

TEST(MlxLoader, LoadsTinyMlx4WithThePerModuleFormats) {
  size_t last_done = 0, total = 0, calls = 0;
  LoadOptions o;
  o.progress = [&](const LoadProgress& p) {
    EXPECT_GE(p.done_bytes, last_done);
    last_done = p.done_bytes;
    total = p.total_bytes;
    ++calls;
  };
  auto w = load_weights(mlx4(), o);
  EXPECT_EQ(w->source_format, "mlx-q4");
  EXPECT_TRUE(w->owned.empty()) << "aligned MLX tensors are used in place (no copy)";
  EXPECT_EQ(last_done, total);
  EXPECT_GT(calls, 100u);
  const ModelConfig& c = w->config;
  EXPECT_EQ(int(w->embed.fmt), int(WFormat::Q4));
  EXPECT_EQ(int(w->lm_head.fmt), int(WFormat::Q4));
  for (int l = 0; l < c.num_layers; ++l) {
    const auto& L = w->layers[size_t(l)];
    EXPECT_EQ(int(L.moe.router.fmt), int(WFormat::Q8)) << l;
    EXPECT_EQ(int(L.moe.shared_expert_gate.fmt), int(WFormat::Q8)) << l;
    EXPECT_EQ(int(L.moe.gate[3].fmt), int(WFormat::Q4)) << l;
    EXPECT_EQ(int(L.moe.shared_up.fmt), int(WFormat::Q4)) << l;
    // Input width 32 is not a multiple of 64: mlx-lm leaves these unquantized.
    EXPECT_EQ(int(L.moe.down[3].fmt), int(WFormat::BF16)) << l;
    EXPECT_EQ(int(L.moe.shared_down.fmt), int(WFormat::BF16)) << l;
    if (!c.is_full(l)) {
      EXPECT_EQ(int(L.gdn.in_proj_a.fmt), int(WFormat::Q4)) << l;
      EXPECT_EQ(L.gdn.conv1d.size(), size_t(c.gdn_conv_dim() * c.linear_conv_kernel_dim));
    }
  }
  // Expert views: expert e of the stacked [E, I, H] tensor is rows e*I .. e*I+I-1.
  const auto& m = w->layers[0].moe;
  EXPECT_EQ(static_cast<const uint8_t*>(m.gate[5].data) - static_cast<const uint8_t*>(m.gate[0].data),
            5 * c.moe_intermediate_size * c.hidden_size / 2);
}

TEST(MlxLoader, IdenticalToHfCheckpointQuantizedAtLoad) {
  auto mlx = load_weights(mlx4());
  LoadOptions q4;
  q4.quant = QuantMode::Q4;
  auto hf = load_weights(fixtures() / "tiny", q4);
  std::vector<std::pair<std::string, Mat>> a, b;
  for_each_mat(*mlx, [&](const std::string& n, const Mat& m) { a.push_back({n, m}); });
  for_each_mat(*hf, [&](const std::string& n, const Mat& m) { b.push_back({n, m}); });
  ASSERT_EQ(a.size(), b.size());
  size_t quantized = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    ASSERT_EQ(a[i].first, b[i].first);
    expect_same_mat(a[i].second, b[i].second, a[i].first);
    quantized += a[i].second.bits() != 0;
  }
  EXPECT_GT(quantized, a.size() / 2);
  // Small vectors: identical, except the zero-centred norms, which the MLX file stores as
  // bf16(1 + w) (mlx-lm adds 1 in the bf16 weight) while the HF path keeps 1 + w in fp32.
  auto same = [](const std::vector<float>& x, const std::vector<float>& y, const std::string& n) {
    ASSERT_EQ(x.size(), y.size()) << n;
    for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(x[i], y[i]) << n << "[" << i << "]";
  };
  auto baked = [](const std::vector<float>& mlx_v, const std::vector<float>& hf_v,
                  const std::string& n) -> size_t {
    EXPECT_EQ(mlx_v.size(), hf_v.size()) << n;
    size_t differ = 0, bad = 0;
    for (size_t i = 0; i < std::min(mlx_v.size(), hf_v.size()); ++i) {
      if (mlx_v[i] != round_bf16(hf_v[i]) && bad++ < 3)
        ADD_FAILURE() << n << "[" << i << "]: " << mlx_v[i] << " vs bf16(" << hf_v[i] << ")";
      differ += mlx_v[i] != hf_v[i];
    }
    return differ;
  };
  size_t rounded = baked(mlx->final_norm, hf->final_norm, "final_norm");
  for (size_t l = 0; l < mlx->layers.size(); ++l) {
    const auto &x = mlx->layers[l], &y = hf->layers[l];
    rounded += baked(x.input_norm, y.input_norm, "input_norm");
    rounded += baked(x.post_norm, y.post_norm, "post_norm");
    rounded += baked(x.attn.q_norm, y.attn.q_norm, "q_norm");
    rounded += baked(x.attn.k_norm, y.attn.k_norm, "k_norm");
    same(x.gdn.conv1d, y.gdn.conv1d, "conv1d");
    same(x.gdn.A_log, y.gdn.A_log, "A_log");
    same(x.gdn.dt_bias, y.gdn.dt_bias, "dt_bias");
    same(x.gdn.norm, y.gdn.norm, "linear_attn.norm");
  }
  EXPECT_GT(rounded, 0u) << "the tiny norms are random, so bf16(1+w) != 1+w somewhere";
  std::printf("[identical] %zu matrices bit-identical (%zu quantized); %zu norm entries differ only by "
              "the bf16 rounding of the MLX file's baked 1+w\n", a.size(), quantized, rounded);
}

TEST(MlxLoader, SkipsMtpAndVisionAndRealignsMisalignedTensors) {
  TmpDir d("align");
  write_variant(
      mlx4(), d.path,
      [](std::vector<Tensor>& t) {
        // An odd-sized 2-byte tensor first: every later tensor lands at an odd offset.
        t.insert(t.begin(), Tensor{"language_model.mtp.norm.weight", DType::BF16, {3}, std::vector<uint8_t>(6, 0)});
        t.push_back({"vision_tower.blocks.0.attn.qkv.weight", DType::BF16, {2, 2}, std::vector<uint8_t>(8, 0)});
      },
      // mlx-vlm style overrides for the skipped parts are not validated.
      [](json& c) { c["quantization"]["vision_tower.blocks.0.attn.qkv"] = {{"bits", 6}, {"group_size", 32}}; });
  auto w = load_weights(d.path);
  EXPECT_FALSE(w->owned.empty()) << "misaligned quantized tensors are copied once, aligned";
  auto ref = load_weights(mlx4());
  std::vector<Mat> a, b;
  for_each_mat(*w, [&](const std::string&, const Mat& m) { a.push_back(m); });
  for_each_mat(*ref, [&](const std::string&, const Mat& m) { b.push_back(m); });
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].bits()) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(a[i].data) % 4, 0u);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(a[i].scales) % 2, 0u);
    }
    expect_same_mat(a[i], b[i], fmt::format("matrix {}", i));
  }
}

struct Broken {
  const char* what;
  std::function<void(std::vector<Tensor>&)> edit;
  std::function<void(json&)> cfg;
  std::vector<const char*> needles;
};

TEST(MlxLoader, MalformedCheckpointsGiveClearErrors) {
  const std::string qkv = L0 + "linear_attn.in_proj_qkv", z = L0 + "linear_attn.in_proj_z";
  const std::string out = L0 + "linear_attn.out_proj", gate = L0 + "mlp.gate";
  const std::vector<Broken> cases = {
      {"packed width of an 8-bit tensor under a 4-bit config",
       [&](auto& t) {
         Tensor* w = find(t, qkv + ".weight");
         w->shape.back() *= 2;
         w->bytes.resize(w->bytes.size() * 2);
       },
       {}, {"in_proj_qkv.weight' has packed width 32", "expected 16", "would be 8 bits"}},
      {"scales of the wrong shape",
       [&](auto& t) {
         Tensor* s = find(t, z + ".scales");
         s->shape.back() = 1;
         s->bytes.resize(s->bytes.size() / 2);
       },
       {}, {"in_proj_z.scales' has shape [256, 1], expected [256, 2]"}},
      {"scales of the wrong dtype",
       [&](auto& t) { find(t, z + ".scales")->dtype = DType::F16; },
       {}, {"in_proj_z.scales' has dtype F16, expected BF16"}},
      {"missing .scales",
       [&](auto& t) { t.erase(std::find_if(t.begin(), t.end(), [&](auto& x) { return x.name == out + ".scales"; })); },
       {}, {"out_proj.biases' is present but", "out_proj.scales' is missing"}},
      {"missing .biases",
       [&](auto& t) { t.erase(std::find_if(t.begin(), t.end(), [&](auto& x) { return x.name == out + ".biases"; })); },
       {}, {"out_proj.scales' is present but", "out_proj.biases' is missing"}},
      {"packed codes without scales and biases",
       [&](auto& t) {
         std::erase_if(t, [&](auto& x) { return x.name == out + ".scales" || x.name == out + ".biases"; });
       },
       {}, {"out_proj.weight' holds packed codes (U32)"}},
      {"group size 32", {}, [](json& c) { c["quantization"]["group_size"] = 32; },
       {"quantization group_size = 32 is not supported"}},
      {"bits 3", {}, [](json& c) { c["quantization"]["bits"] = 3; }, {"quantization bits = 3 is not supported"}},
      {"override bits 2", {}, [&](json& c) { c["quantization"][gate]["bits"] = 2; },
       {"quantization.language_model.model.layers.0.mlp.gate bits = 2 is not supported"}},
      {"override group 128", {}, [&](json& c) { c["quantization"][gate]["group_size"] = 128; },
       {"mlp.gate group_size = 128 is not supported"}},
      {"router override says 4 bits, the tensor holds 8-bit codes", {},
       [&](json& c) { c["quantization"].erase(gate); },
       {"mlp.gate.weight' has packed width 32", "expected 16"}},
      {"config quantizes a module stored unquantized", {},
       [&](json& c) { c["quantization"][L0 + "mlp.switch_mlp.down_proj"] = {{"bits", 8}, {"group_size", 64}}; },
       {"quantizes 'language_model.model.layers.0.mlp.switch_mlp.down_proj' at 8 bits", "missing"}},
      {"mode mxfp4", {}, [](json& c) { c["quantization"]["mode"] = "mxfp4"; },
       {"quantization.mode = \"mxfp4\" is not supported"}},
      {"unknown tensor",
       [&](auto& t) { t.push_back({L0 + "mlp.bogus.weight", DType::BF16, {2}, std::vector<uint8_t>(4, 0)}); },
       {}, {"1 unexpected tensor(s)", "mlp.bogus.weight"}},
      {"conv1d in the HF layout",
       [&](auto& t) {
         Tensor* c = find(t, L0 + "linear_attn.conv1d.weight");
         c->shape = {c->shape[0], 1, c->shape[1]};
       },
       {}, {"conv1d.weight' has shape [512, 1, 4], expected [512, 4, 1]"}},
      {"missing expert tensor",
       [&](auto& t) { std::erase_if(t, [&](auto& x) { return x.name.find(L0 + "mlp.switch_mlp.up_proj") == 0; }); },
       {}, {"missing tensor 'language_model.model.layers.0.mlp.switch_mlp.up_proj.weight'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    TmpDir d("broken");
    write_variant(mlx4(), d.path, c.edit, c.cfg);
    try {
      load_weights(d.path);
      ADD_FAILURE() << c.what << ": loaded without error";
    } catch (const Error& e) {
      for (const char* n : c.needles)
        EXPECT_NE(std::string(e.what()).find(n), std::string::npos) << "message: " << e.what();
      std::printf("[malformed] %s -> %s\n", c.what, e.what());
    }
  }
}

TEST(MlxLoader, QuantizeAtLoadOfAQuantizedCheckpointIsAnError) {
  LoadOptions q4;
  q4.quant = QuantMode::Q4;
  expect_error([&] { load_weights(mlx4(), q4); }, {"already quantized"});
}

TEST(MlxLoader, HfNamesUnderAQuantizationBlockAreRefused) {
  TmpDir d("hfnames");
  fs::copy_file(fixtures() / "tiny" / "model.safetensors", d.path / "model.safetensors");
  json cfg = read_json_file(fixtures() / "tiny" / "config.json");
  cfg["quantization"] = {{"bits", 4}, {"group_size", 64}};
  std::ofstream(d.path / "config.json") << cfg.dump();
  expect_error([&] { load_weights(d.path); }, {"not an MLX-layout checkpoint"});
}

}  // namespace
}  // namespace kestrel
