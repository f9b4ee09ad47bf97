// Shared helpers of the quantization tests: temp dirs, checkpoint variants, weight comparison.
#pragma once
#include "core/check.h"
#include "core/config.h"
#include "core/safetensors.h"
#include "core/weights.h"
#include "quant/quant.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace kestrel::qtest {

namespace fs = std::filesystem;
using json = nlohmann::json;

inline fs::path fixtures() { return KESTREL_FIXTURES; }

struct TmpDir {
  fs::path path;
  explicit TmpDir(const std::string& name) {
    path = fs::temp_directory_path() / fmt::format("kestrel-quant-{}-{}", name, getpid());
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~TmpDir() { fs::remove_all(path); }
};

struct Tensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline std::vector<Tensor> read_all(const fs::path& file) {
  SafetensorsFile f(file);
  std::vector<Tensor> v;
  for (const auto& [name, t] : f.tensors())
    v.push_back({name, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes)});
  return v;
}

inline Tensor* find(std::vector<Tensor>& v, const std::string& name) {
  for (auto& t : v)
    if (t.name == name) return &t;
  return nullptr;
}

// Writes a copy of the MLX checkpoint `src` (single model.safetensors) into `out`, with `edit`
// applied to its tensors and `edit_cfg` to its config.json.
inline void write_variant(const fs::path& src, const fs::path& out,
                          const std::function<void(std::vector<Tensor>&)>& edit,
                          const std::function<void(json&)>& edit_cfg = {}) {
  auto tensors = read_all(src / "model.safetensors");
  if (edit) edit(tensors);
  std::vector<TensorToWrite> tw;
  for (const auto& t : tensors) tw.push_back({t.name, t.dtype, t.shape, t.bytes});
  fs::create_directories(out);
  write_safetensors(out / "model.safetensors", tw, {{"format", "mlx"}});
  json cfg = read_json_file(src / "config.json");
  if (edit_cfg) edit_cfg(cfg);
  std::ofstream(out / "config.json") << cfg.dump(2);
}

// Every matrix of a model, mutable (in the order of for_each_mat).
inline void for_each_mat_mut(ModelWeights& w, const std::function<void(Mat&)>& fn) {
  fn(w.embed);
  fn(w.lm_head);
  for (auto& L : w.layers) {
    for (Mat* m : {&L.gdn.in_proj_qkv, &L.gdn.in_proj_z, &L.gdn.in_proj_b, &L.gdn.in_proj_a,
                   &L.gdn.out_proj, &L.attn.q_proj, &L.attn.k_proj, &L.attn.v_proj, &L.attn.o_proj,
                   &L.moe.router, &L.moe.shared_gate, &L.moe.shared_up, &L.moe.shared_down,
                   &L.moe.shared_expert_gate})
      if (m->valid()) fn(*m);
    for (size_t e = 0; e < L.moe.gate.size(); ++e) {
      fn(L.moe.gate[e]);
      fn(L.moe.up[e]);
      fn(L.moe.down[e]);
    }
  }
}

// Every matrix of a model with a stable name.
inline void for_each_mat(const ModelWeights& w, const std::function<void(const std::string&, const Mat&)>& fn) {
  fn("embed", w.embed);
  fn("lm_head", w.lm_head);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const auto& L = w.layers[l];
    const std::string p = fmt::format("layer {} ", l);
    const std::pair<const char*, const Mat*> mats[] = {
        {"in_proj_qkv", &L.gdn.in_proj_qkv}, {"in_proj_z", &L.gdn.in_proj_z},
        {"in_proj_b", &L.gdn.in_proj_b},     {"in_proj_a", &L.gdn.in_proj_a},
        {"out_proj", &L.gdn.out_proj},       {"q_proj", &L.attn.q_proj},
        {"k_proj", &L.attn.k_proj},          {"v_proj", &L.attn.v_proj},
        {"o_proj", &L.attn.o_proj},          {"router", &L.moe.router},
        {"shared_gate", &L.moe.shared_gate}, {"shared_up", &L.moe.shared_up},
        {"shared_down", &L.moe.shared_down}, {"shared_expert_gate", &L.moe.shared_expert_gate}};
    for (const auto& [n, m] : mats)
      if (m->valid()) fn(p + n, *m);
    for (size_t e = 0; e < L.moe.gate.size(); ++e) {
      fn(fmt::format("{}expert {} gate", p, e), L.moe.gate[e]);
      fn(fmt::format("{}expert {} up", p, e), L.moe.up[e]);
      fn(fmt::format("{}expert {} down", p, e), L.moe.down[e]);
    }
  }
}

// Bit-identical matrices: same format and shape, same codes/scales/biases (or elements) per row.
inline void expect_same_mat(const Mat& a, const Mat& b, const std::string& what) {
  ASSERT_EQ(int(a.fmt), int(b.fmt)) << what << ": " << wformat_name(a.fmt) << " vs " << wformat_name(b.fmt);
  ASSERT_EQ(a.rows, b.rows) << what;
  ASSERT_EQ(a.cols, b.cols) << what;
  if (a.bits() == 0) {
    const size_t n = size_t(a.rows * a.cols) * (a.fmt == WFormat::F32 ? 4 : 2);
    EXPECT_EQ(std::memcmp(a.data, b.data, n), 0) << what << ": elements differ";
    return;
  }
  ASSERT_EQ(a.group, b.group) << what;
  const size_t cb = size_t(a.rows * a.cols * a.bits() / 8), sb = size_t(a.rows * (a.cols / a.group)) * 2;
  EXPECT_EQ(std::memcmp(a.data, b.data, cb), 0) << what << ": codes differ";
  EXPECT_EQ(std::memcmp(a.scales, b.scales, sb), 0) << what << ": scales differ";
  EXPECT_EQ(std::memcmp(a.biases, b.biases, sb), 0) << what << ": biases differ";
}

// Expects `fn` to throw kestrel::Error whose message contains every one of `needles`.
inline void expect_error(const std::function<void()>& fn, std::initializer_list<const char*> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << *needles.begin() << "'";
  } catch (const Error& e) {
    for (const char* n : needles)
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' lacks '" << n << "'";
  }
}

}  // namespace kestrel::qtest
