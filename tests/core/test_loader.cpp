// The loader accounts for every tensor: missing, unexpected, wrong dtype and wrong shape are errors
// that name the tensor; model.visual.* and mtp.* are skipped by name; both expert layouts load.
#include "core/check.h"
#include "core/weights.h"
#include "test_helpers.h"

namespace kestrel {
namespace {

using testing::expect_error;
using testing::OwnedTensor;
using testing::TempDir;

const std::string kL0 = "model.language_model.layers.0.";

OwnedTensor* find(std::vector<OwnedTensor>& v, const std::string& name) {
  for (auto& t : v)
    if (t.name == name) return &t;
  return nullptr;
}

TEST(Loader, LoadsTinyAndSkipsVisualAndMtp) {
  auto all = testing::read_all(testing::fixtures() / "tiny" / "model.safetensors");
  int visual = 0, mtp = 0;
  for (const auto& t : all) {
    visual += t.name.rfind("model.visual.", 0) == 0;
    mtp += t.name.rfind("mtp.", 0) == 0;
  }
  EXPECT_GT(visual, 0) << "the fixture must exercise the skip path";
  EXPECT_GT(mtp, 0);
  auto w = load_weights(testing::fixtures() / "tiny");
  EXPECT_EQ(w->layers.size(), 8u);
  EXPECT_EQ(w->layers[3].kind, LayerKind::FullAttention);
  EXPECT_EQ(w->layers[0].moe.gate.size(), 16u);
  EXPECT_EQ(w->lm_head.rows, 4096);
  EXPECT_GT(w->matrix_bytes(), 0u);
}

TEST(Loader, MissingTensor) {
  TempDir d;
  testing::mutated_tiny(d.path, [](std::vector<OwnedTensor>& v) {
    std::erase_if(v, [](const OwnedTensor& t) { return t.name == kL0 + "linear_attn.A_log"; });
  });
  expect_error([&] { load_weights(d.path); }, {"missing tensor", kL0 + "linear_attn.A_log"});
}

TEST(Loader, UnexpectedTensor) {
  TempDir d;
  testing::mutated_tiny(d.path, [](std::vector<OwnedTensor>& v) {
    v.push_back({kL0 + "mystery.weight", DType::BF16, {2}, std::vector<uint8_t>(4)});
  });
  expect_error([&] { load_weights(d.path); }, {"unexpected tensor", kL0 + "mystery.weight"});
}

TEST(Loader, WrongDtype) {
  TempDir d;
  testing::mutated_tiny(d.path, [](std::vector<OwnedTensor>& v) { find(v, "lm_head.weight")->dtype = DType::I16; });
  expect_error([&] { load_weights(d.path); }, {"lm_head.weight", "dtype I16", "expected BF16"});
}

TEST(Loader, WrongShape) {
  TempDir d;
  testing::mutated_tiny(d.path, [](std::vector<OwnedTensor>& v) {
    auto* t = find(v, kL0 + "linear_attn.in_proj_qkv.weight");
    t->shape = {t->shape[0] / 2, t->shape[1] * 2};
  });
  expect_error([&] { load_weights(d.path); },
               {kL0 + "linear_attn.in_proj_qkv.weight", "has shape [256, 256]", "expected [512, 128]"});
}

TEST(Loader, WrongConfigForTensors) {
  TempDir d;
  testing::mutated_tiny(d.path, [](std::vector<OwnedTensor>&) {});
  auto cfg = read_json_file(d.path / "config.json");
  cfg["text_config"]["moe_intermediate_size"] = 64;
  testing::write_file(d.path / "config.json", cfg.dump());
  expect_error([&] { load_weights(d.path); }, {"gate_proj.weight", "expected [64, 128]"});
}

TEST(Loader, TruncatedCheckpoint) {
  TempDir d;
  testing::mutated_tiny(d.path, [](std::vector<OwnedTensor>&) {});
  const std::string bytes = testing::read_file(d.path / "model.safetensors");
  testing::write_file(d.path / "model.safetensors", bytes.substr(0, bytes.size() / 2));
  expect_error([&] { load_weights(d.path); }, {"model.safetensors", "outside the data section"});
  testing::write_file(d.path / "model.safetensors", bytes.substr(0, 100));
  expect_error([&] { load_weights(d.path); }, {"model.safetensors", "exceeds the file"});
}

// The fused 3-D expert layout (experts.gate_up_proj / experts.down_proj) gives the same weights as
// the per-expert layout transformers writes.
TEST(Loader, FusedExpertLayoutEqualsPerExpert) {
  TempDir d;
  const auto& c = load_config(testing::fixtures() / "tiny");
  testing::mutated_tiny(d.path, [&](std::vector<OwnedTensor>& v) {
    for (int l = 0; l < c.num_layers; ++l) {
      const std::string p = "model.language_model.layers." + std::to_string(l) + ".mlp.experts.";
      OwnedTensor gu{p + "gate_up_proj", DType::BF16,
                     {c.num_experts, 2 * c.moe_intermediate_size, c.hidden_size}, {}};
      OwnedTensor dn{p + "down_proj", DType::BF16,
                     {c.num_experts, c.hidden_size, c.moe_intermediate_size}, {}};
      for (int e = 0; e < c.num_experts; ++e) {
        const std::string ep = p + std::to_string(e) + ".";
        for (const char* n : {"gate_proj.weight", "up_proj.weight"}) {
          auto* t = find(v, ep + n);
          gu.bytes.insert(gu.bytes.end(), t->bytes.begin(), t->bytes.end());
        }
        auto* t = find(v, ep + "down_proj.weight");
        dn.bytes.insert(dn.bytes.end(), t->bytes.begin(), t->bytes.end());
      }
      std::erase_if(v, [&](const OwnedTensor& t) {
        return t.name.rfind(p, 0) == 0 && t.name != p + "gate_up_proj";
      });
      v.push_back(std::move(gu));
      v.push_back(std::move(dn));
    }
  });
  auto a = load_weights(testing::fixtures() / "tiny");
  auto b = load_weights(d.path);
  std::vector<float> ra(size_t(c.hidden_size)), rb(size_t(c.hidden_size));
  for (int l = 0; l < c.num_layers; ++l)
    for (int e = 0; e < c.num_experts; ++e)
      for (int r : {0, c.moe_intermediate_size - 1}) {
        a->layers[size_t(l)].moe.up[size_t(e)].row_f32(r, ra.data());
        b->layers[size_t(l)].moe.up[size_t(e)].row_f32(r, rb.data());
        ASSERT_EQ(ra, rb) << "layer " << l << " expert " << e;
        a->layers[size_t(l)].moe.gate[size_t(e)].row_f32(r, ra.data());
        b->layers[size_t(l)].moe.gate[size_t(e)].row_f32(r, rb.data());
        ASSERT_EQ(ra, rb);
      }
  std::vector<float> da(size_t(c.moe_intermediate_size)), db(da.size());
  a->layers[7].moe.down[15].row_f32(c.hidden_size - 1, da.data());
  b->layers[7].moe.down[15].row_f32(c.hidden_size - 1, db.data());
  EXPECT_EQ(da, db);
}

}  // namespace
}  // namespace kestrel
