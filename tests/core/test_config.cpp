// config.json: the official wrapper, text-only configs, and a clear refusal (field, value,
// expected) for everything that is not this architecture.
#include "core/check.h"
#include "core/config.h"
#include "test_helpers.h"

#include <nlohmann/json.hpp>

namespace kestrel {
namespace {

using nlohmann::json;
using testing::expect_error;

json tiny() { return read_json_file(testing::fixtures() / "tiny" / "config.json"); }

TEST(Config, TinyWrapper) {
  const ModelConfig c = parse_config(tiny());
  EXPECT_TRUE(c.multimodal_wrapper);
  EXPECT_EQ(c.hidden_size, 128);
  EXPECT_EQ(c.num_layers, 8);
  EXPECT_EQ(c.num_full_layers(), 2);
  EXPECT_TRUE(c.is_full(3));
  EXPECT_FALSE(c.is_full(2));
  EXPECT_EQ(c.rotary_dim, 16);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{4002, 4000}));
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e7);
  EXPECT_FALSE(c.has_real_widths());
  EXPECT_FALSE(c.quantization.has_value());
}

TEST(Config, RealWidthFixtureHasRealWidths) {
  const ModelConfig c = load_config(testing::fixtures() / "realwidth");
  EXPECT_TRUE(c.has_real_widths());
  EXPECT_EQ(c.gdn_conv_dim(), 8192);
}

TEST(Config, TextOnlyConfig) {
  json t = tiny()["text_config"];
  t["eos_token_id"] = {4002, 4000};
  const ModelConfig c = parse_config(t);
  EXPECT_FALSE(c.multimodal_wrapper);
  EXPECT_EQ(c.num_layers, 8);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int>{4002, 4000}));
}

TEST(Config, LegacyRopeFields) {
  json j = tiny();
  j["text_config"].erase("rope_parameters");
  j["text_config"]["rope_theta"] = 1e6;
  const ModelConfig c = parse_config(j);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_EQ(c.rotary_dim, 16);
}

struct Bad {
  const char* what;
  std::function<void(json&)> edit;
  std::vector<std::string> expect;
};

TEST(Config, RefusesOtherArchitectures) {
  const std::vector<Bad> cases = {
      {"model type", [](json& j) { j["model_type"] = "llama"; }, {"model_type", "llama", "qwen3_5_moe"}},
      {"layer pattern", [](json& j) { j["text_config"]["layer_types"][3] = "linear_attention"; },
       {"layer_types[3]", "linear_attention", "full_attention"}},
      {"layer count", [](json& j) { j["text_config"]["num_hidden_layers"] = 9; }, {"layer_types length", "9"}},
      {"gdn heads", [](json& j) { j["text_config"]["linear_num_value_heads"] = 6; },
       {"linear_num_value_heads", "6", "2 x linear_num_key_heads"}},
      {"gdn dims", [](json& j) { j["text_config"]["linear_value_head_dim"] = 64; }, {"linear_value_head_dim", "64"}},
      {"conv", [](json& j) { j["text_config"]["linear_conv_kernel_dim"] = 3; }, {"linear_conv_kernel_dim", "3", "4"}},
      {"gqa", [](json& j) { j["text_config"]["num_key_value_heads"] = 3; }, {"num_key_value_heads", "3"}},
      {"topk", [](json& j) { j["text_config"]["num_experts_per_tok"] = 17; }, {"num_experts_per_tok", "17"}},
      {"rotary", [](json& j) { j["text_config"]["rope_parameters"]["partial_rotary_factor"] = 0.3; },
       {"partial_rotary_factor"}},
      {"yarn", [](json& j) { j["text_config"]["rope_parameters"]["rope_type"] = "yarn"; }, {"rope_type", "yarn"}},
      {"tied", [](json& j) { j["tie_word_embeddings"] = true; }, {"tie_word_embeddings"}},
      {"bias", [](json& j) { j["text_config"]["attention_bias"] = true; }, {"attention_bias"}},
      {"act", [](json& j) { j["text_config"]["hidden_act"] = "gelu"; }, {"hidden_act", "gelu"}},
      {"missing", [](json& j) { j["text_config"].erase("hidden_size"); }, {"missing field", "hidden_size"}},
      {"type", [](json& j) { j["text_config"]["num_experts"] = "16"; }, {"num_experts", "not an integer"}},
      {"hidden", [](json& j) { j["text_config"]["hidden_size"] = 100; }, {"hidden_size", "100", "multiple of 64"}},
      {"norm_topk false", [](json& j) { j["text_config"]["norm_topk_prob"] = false; }, {"norm_topk_prob"}},
      {"mlp only", [](json& j) { j["text_config"]["mlp_only_layers"] = {1}; }, {"mlp_only_layers"}},
      {"text_config type", [](json& j) { j["text_config"] = 5; }, {"text_config"}},
      {"fp8", [](json& j) { j["quantization_config"] = {{"quant_method", "fp8"}}; }, {"quantization_config"}},
      {"huge", [](json& j) { j["text_config"]["vocab_size"] = 1e12; }, {"vocab_size"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    json j = tiny();
    c.edit(j);
    try {
      parse_config(j, "config.json");
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      for (const auto& p : c.expect) EXPECT_NE(m.find(p), std::string::npos) << m << " / " << p;
    }
  }
}

TEST(Config, MalformedFile) {
  testing::TempDir d;
  testing::write_file(d.path / "config.json", "{\"text_config\": {");
  expect_error([&] { load_config(d.path); }, {"config.json", "malformed JSON"});
  testing::write_file(d.path / "config.json", "[]");
  expect_error([&] { load_config(d.path); }, {"not a JSON object"});
  std::filesystem::remove(d.path / "config.json");
  expect_error([&] { load_config(d.path); }, {"no config.json"});
}

TEST(Config, MlxQuantizationBlock) {
  json j = tiny();
  j["quantization"] = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"},
                       {"language_model.model.layers.0.mlp.gate", {{"group_size", 64}, {"bits", 8}}}};
  const ModelConfig c = parse_config(j);
  ASSERT_TRUE(c.quantization.has_value());
  EXPECT_EQ(c.quantization->bits, 4);
  ASSERT_EQ(c.quantization->overrides.size(), 1u);
  EXPECT_EQ(c.quantization->overrides[0].bits, 8);
}

}  // namespace
}  // namespace kestrel
