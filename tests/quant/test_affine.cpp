// The MLX affine quantizer: known answers, corner cases (constant, zero, all-negative groups,
// rounding ties), the round-trip error bound on random matrices, the packing layout, parameter
// errors, and bit-parity with the fixture script's independent implementation.
#include "quant_test_util.h"

#include <cmath>
#include <random>

namespace kestrel {
namespace {

using namespace qtest;

Mat bf16_mat(const std::vector<uint16_t>& v, int64_t rows, int64_t cols) {
  Mat m;
  m.fmt = WFormat::BF16;
  m.rows = rows;
  m.cols = cols;
  m.data = v.data();
  return m;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> h(v.size());
  for (size_t i = 0; i < v.size(); ++i) h[i] = f32_to_bf16(v[i]);
  return h;
}

struct Q {
  std::vector<uint32_t> codes;
  uint16_t scale = 0, bias = 0;
};

Q quantize_one(const std::vector<float>& w, int bits) {
  Q q;
  q.codes.resize(w.size() * size_t(bits) / 32);
  quant::quantize_group(w.data(), int(w.size()), bits, q.codes.data(), &q.scale, &q.bias);
  return q;
}

uint32_t code(const Q& q, int bits, int j) {
  const int per = 32 / bits;
  return (q.codes[size_t(j / per)] >> (bits * (j % per))) & ((1u << bits) - 1u);
}

TEST(Affine, KnownAnswerMaxSide) {
  // w_min = -1, w_max = 2: |w_min| < |w_max|, so the scale is negative and the bias is w_max.
  std::vector<float> w(64, 0.5f);
  w[0] = -1.f;
  w[63] = 2.f;
  w[10] = 0.f;
  const Q q = quantize_one(w, 4);
  EXPECT_EQ(q.scale, f32_to_bf16(2.f / -10.f));  // q0 = round(2 / -0.2) = -10, s = 2 / q0
  EXPECT_EQ(q.bias, f32_to_bf16(2.f));
  EXPECT_EQ(code(q, 4, 0), 15u);  // (-1 - 2) / -0.2
  EXPECT_EQ(code(q, 4, 63), 0u);
  EXPECT_EQ(code(q, 4, 10), 10u);  // zero sits on the grid exactly: q = -q0
  EXPECT_EQ(code(q, 4, 1), 8u);    // (0.5 - 2) / -0.2 = 7.5 -> 8 (half away from zero)
}

TEST(Affine, KnownAnswerMinSide) {
  std::vector<float> w(64, 0.25f);
  w[3] = -2.f;
  w[7] = 1.f;
  w[9] = 0.f;
  const Q q = quantize_one(w, 4);
  EXPECT_EQ(q.scale, f32_to_bf16(-2.f / -10.f));
  EXPECT_EQ(q.bias, f32_to_bf16(-2.f));
  EXPECT_EQ(code(q, 4, 3), 0u);
  EXPECT_EQ(code(q, 4, 7), 15u);
  EXPECT_EQ(code(q, 4, 9), 10u);
  EXPECT_EQ(code(q, 4, 0), 11u);  // (0.25 + 2) / 0.2 = 11.25
}

TEST(Affine, RoundingTiesGoAwayFromZero) {
  // w_max 15, w_min 0 -> s = -1, bias 15: 14.5 -> (14.5 - 15) / -1 = 0.5 -> 1; 0.5 -> 14.5 -> 15.
  std::vector<float> w(64, 7.f);
  w[0] = 0.f;
  w[1] = 15.f;
  w[2] = 14.5f;
  w[3] = 0.5f;
  w[4] = 13.5f;
  const Q q = quantize_one(w, 4);
  EXPECT_EQ(bf16_to_f32(q.scale), -1.f);
  EXPECT_EQ(bf16_to_f32(q.bias), 15.f);
  EXPECT_EQ(code(q, 4, 2), 1u);
  EXPECT_EQ(code(q, 4, 3), 15u);
  EXPECT_EQ(code(q, 4, 4), 2u);  // 1.5 -> 2
}

TEST(Affine, ConstantAndZeroGroupsReconstructExactly) {
  for (float c : {0.8125f, -0.3f, 0.f, -7.f, 3e4f, -1e-2f}) {
    const float cb = round_bf16(c);
    for (int bits : {4, 8}) {
      const Q q = quantize_one(std::vector<float>(64, cb), bits);
      for (int j = 0; j < 64; ++j) {
        const float r = bf16_to_f32(q.scale) * float(code(q, bits, j)) + bf16_to_f32(q.bias);
        ASSERT_EQ(r, cb) << "constant " << c << " bits " << bits << " element " << j;
      }
    }
  }
  // A tiny positive constant: q0 = round(c / -1e-7) = 0, so bias 0 and the group reconstructs to 0
  // (error c, far below the format's resolution).
  const Q t = quantize_one(std::vector<float>(64, round_bf16(1e-20f)), 4);
  EXPECT_EQ(bf16_to_f32(t.bias), 0.f);
  EXPECT_EQ(bf16_to_f32(t.scale), round_bf16(-1e-7f));
  for (uint32_t wd : t.codes) EXPECT_EQ(wd, 0u);
  const Q z = quantize_one(std::vector<float>(64, 0.f), 4);
  EXPECT_EQ(bf16_to_f32(z.bias), 0.f);
  for (uint32_t wd : z.codes) EXPECT_EQ(wd, 0u);
}

TEST(Affine, AllNegativeGroupUsesZeroAsMaximum) {
  // MLX's GPU kernels start the maximum at 0: an all-negative group spans [w_min, 0].
  std::vector<float> w(64);
  for (int j = 0; j < 64; ++j) w[size_t(j)] = round_bf16(-1.f - 0.01f * float(j));
  const Q q = quantize_one(w, 4);
  const float w_min = *std::min_element(w.begin(), w.end());
  EXPECT_EQ(bf16_to_f32(q.bias), w_min);
  EXPECT_EQ(q.scale, f32_to_bf16(w_min / -15.f));  // (0 - w_min) / 15, q0 = -15
  EXPECT_EQ(code(q, 4, 63), 0u);                   // the minimum element is the edge
}

TEST(Affine, NonFiniteAndBadParametersAreErrors) {
  std::vector<float> w(128, 1.f);
  w[70] = NAN;
  auto h = to_bf16(w);
  std::vector<std::vector<uint8_t>> st;
  expect_error([&] { quant::quantize_matrix(bf16_mat(h, 1, 128), 4, 64, st); },
               {"row 0, group 1", "non-finite"});
  std::vector<uint16_t> ok(192, f32_to_bf16(1.f));
  expect_error([&] { quant::quantize_matrix(bf16_mat(ok, 2, 96), 4, 64, st); },
               {"96 input columns", "multiple of the group size 64"});
  expect_error([&] { quant::quantize_matrix(bf16_mat(ok, 3, 64), 3, 64, st); }, {"bits 3"});
  expect_error([&] { quant::quantize_matrix(bf16_mat(ok, 6, 32), 4, 32, st); }, {"group size 32"});
  const Mat q4 = quant::quantize_matrix(bf16_mat(ok, 3, 64), 4, 64, st);
  expect_error([&] { quant::quantize_matrix(q4, 4, 64, st); }, {"source matrix is Q4"});
}

TEST(Affine, PackingIsLowBitsFirst) {
  std::mt19937 g(7);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> w(3 * 128);
  for (auto& x : w) x = d(g);
  auto h = to_bf16(w);
  std::vector<std::vector<uint8_t>> st;
  for (int bits : {4, 8}) {
    const Mat m = quant::quantize_matrix(bf16_mat(h, 3, 128), bits, 64, st);
    ASSERT_EQ(int(m.fmt), int(bits == 4 ? WFormat::Q4 : WFormat::Q8));
    const auto* words = static_cast<const uint32_t*>(m.data);
    const int per = 32 / bits;
    std::vector<float> row(128);
    for (int64_t r = 0; r < 3; ++r) {
      m.row_f32(r, row.data());
      for (int64_t j = 0; j < 128; ++j) {
        const uint32_t word = words[r * (128 / per) + j / per];
        const uint32_t q = (word >> (bits * (j % per))) & ((1u << bits) - 1u);
        ASSERT_EQ(q, quant::code_at(m, r, j));
        const float s = bf16_to_f32(m.scales[r * 2 + j / 64]), b = bf16_to_f32(m.biases[r * 2 + j / 64]);
        ASSERT_EQ(row[size_t(j)], s * float(q) + b) << "bits " << bits << " [" << r << ", " << j << "]";
      }
    }
    EXPECT_EQ(m.nbytes(), size_t(3 * 128 * bits / 8 + 2 * 3 * 2 * 2));
  }
  // The same values given as F32 quantize identically to their BF16 form.
  std::vector<float> wf(h.size());
  for (size_t i = 0; i < h.size(); ++i) wf[i] = bf16_to_f32(h[i]);
  Mat f;
  f.fmt = WFormat::F32;
  f.rows = 3;
  f.cols = 128;
  f.data = wf.data();
  expect_same_mat(quant::quantize_matrix(f, 4, 64, st), quant::quantize_matrix(bf16_mat(h, 3, 128), 4, 64, st),
                  "f32 vs bf16 source");
}

// Round trip on random matrices: |w - dequant(quant(w))| <= R/n + n|s|2^-8 + |b|2^-8 per element,
// where R = max(0, max w) - min w over the group and n = 2^b - 1 (the grid spacing bound of the MLX
// scale choice, plus the bf16 rounding of the stored scale and bias). The edge element (the
// group's min or max, whichever the bias is) reconstructs exactly for bf16 inputs.
TEST(Affine, RoundTripErrorWithinFormatBound) {
  struct Case {
    const char* name;
    std::function<float(std::mt19937&)> gen;
    bool bf16;
  };
  std::normal_distribution<float> n01(0.f, 1.f);
  std::uniform_real_distribution<float> u01(0.f, 1.f);
  const std::vector<Case> cases = {
      {"normal(0,1) bf16", [&](std::mt19937& g) { return n01(g); }, true},
      {"normal(0,0.02) bf16", [&](std::mt19937& g) { return 0.02f * n01(g); }, true},
      {"log-uniform magnitudes bf16",
       [&](std::mt19937& g) { return (u01(g) - 0.5f) * std::pow(10.f, 4.f * u01(g) - 3.f); }, true},
      {"outliers bf16",
       [&](std::mt19937& g) { return u01(g) < 0.01f ? 8.f * n01(g) : 0.02f * n01(g); }, true},
      {"positive f32", [&](std::mt19937& g) { return 0.1f + std::abs(n01(g)); }, false},
      {"negative f32", [&](std::mt19937& g) { return -0.1f - std::abs(n01(g)); }, false},
  };
  const int64_t R = 64, C = 1024;
  std::vector<std::vector<uint8_t>> st;
  for (int bits : {4, 8}) {
    const float nb = float((1 << bits) - 1);
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      std::mt19937 g(uint32_t(100 + ci));
      std::vector<float> w(size_t(R * C));
      for (auto& x : w) x = cases[ci].gen(g);
      Mat src;
      std::vector<uint16_t> h;
      if (cases[ci].bf16) {
        h = to_bf16(w);
        for (size_t i = 0; i < w.size(); ++i) w[i] = bf16_to_f32(h[i]);
        src = bf16_mat(h, R, C);
      } else {
        src.fmt = WFormat::F32;
        src.rows = R;
        src.cols = C;
        src.data = w.data();
      }
      const Mat m = quant::quantize_matrix(src, bits, 64, st);
      std::vector<float> row(static_cast<size_t>(C));
      double worst_ratio = 0, se = 0, sw = 0;
      for (int64_t r = 0; r < R; ++r) {
        m.row_f32(r, row.data());
        for (int64_t gi = 0; gi < C / 64; ++gi) {
          const float* x = w.data() + r * C + gi * 64;
          const float* y = row.data() + gi * 64;
          const float mn = *std::min_element(x, x + 64), mx = std::max(0.f, *std::max_element(x, x + 64));
          const float s = bf16_to_f32(m.scales[r * (C / 64) + gi]), b = bf16_to_f32(m.biases[r * (C / 64) + gi]);
          const double step = double(mx - mn) / nb;
          const double bound = step + nb * std::abs(s) * 0x1p-8 + std::abs(b) * 0x1p-8 + 1e-7 * std::abs(b);
          bool edge_exact = !cases[ci].bf16;
          for (int j = 0; j < 64; ++j) {
            const double e = std::abs(double(x[j]) - y[j]);
            ASSERT_LE(e, bound) << cases[ci].name << " bits " << bits << " row " << r << " group " << gi
                                << " element " << j << ": " << x[j] << " -> " << y[j];
            if (step > 0) worst_ratio = std::max(worst_ratio, e / step);
            se += e * e;
            sw += double(x[j]) * x[j];
            edge_exact |= y[j] == x[j] && (x[j] == mn || x[j] == *std::max_element(x, x + 64));
          }
          EXPECT_TRUE(edge_exact) << cases[ci].name << " row " << r << " group " << gi;
        }
      }
      std::printf("[round-trip] q%d %-28s max err %.3f x grid step (R/%d), rms rel err %.4f\n", bits,
                  cases[ci].name, worst_ratio, int(nb), std::sqrt(se / sw));
    }
  }
}

// kestrel's quantizer vs the fixture script's independent implementation (tools/make_mlx_fixture.py):
// identical codes, scales and biases, bit for bit, at 4 and 8 bits.
TEST(Affine, IdenticalToFixtureScriptQuantizer) {
  const auto path = fixtures() / "quant" / "parity.safetensors";
  ASSERT_TRUE(fs::exists(path)) << path << " missing: run tools/make_mlx_fixture.py";
  SafetensorsFile f(path);
  const TensorInfo& w = f.tensors().at("w");
  ASSERT_EQ(w.dtype, DType::BF16);
  Mat src = mat_from_tensor(w);
  std::vector<std::vector<uint8_t>> st;
  for (int bits : {4, 8}) {
    const Mat m = quant::quantize_matrix(src, bits, 64, st);
    const TensorInfo& c = f.tensors().at(fmt::format("codes{}", bits));
    const TensorInfo& s = f.tensors().at(fmt::format("scales{}", bits));
    const TensorInfo& b = f.tensors().at(fmt::format("biases{}", bits));
    ASSERT_EQ(c.nbytes, size_t(m.rows * m.cols * bits / 8));
    ASSERT_EQ(s.nbytes, size_t(m.rows * (m.cols / 64)) * 2);
    int bad_codes = 0, bad_sb = 0;
    for (int64_t r = 0; r < m.rows; ++r)
      for (int64_t j = 0; j < m.cols; ++j) {
        const int per = 32 / bits;
        uint32_t word;
        std::memcpy(&word, c.data + 4 * size_t(r * (m.cols / per) + j / per), 4);
        const uint32_t want = (word >> (bits * (j % per))) & ((1u << bits) - 1u);
        if (quant::code_at(m, r, j) != want && bad_codes++ < 5)
          ADD_FAILURE() << "bits " << bits << " code [" << r << ", " << j << "] " << quant::code_at(m, r, j)
                        << " vs script " << want;
      }
    for (size_t i = 0; i < s.nbytes / 2; ++i) {
      uint16_t ss, bb;
      std::memcpy(&ss, s.data + 2 * i, 2);
      std::memcpy(&bb, b.data + 2 * i, 2);
      if ((m.scales[i] != ss || m.biases[i] != bb) && bad_sb++ < 5)
        ADD_FAILURE() << "bits " << bits << " group " << i << ": scale " << m.scales[i] << "/" << ss
                      << " bias " << m.biases[i] << "/" << bb;
    }
    EXPECT_EQ(bad_codes, 0);
    EXPECT_EQ(bad_sb, 0);
    std::printf("[parity] q%d: %lld codes, %zu scale/bias pairs identical to the script\n", bits,
                (long long)(m.rows * m.cols), s.nbytes / 2);
  }
}

TEST(Affine, RecipeBits) {
  EXPECT_EQ(quant::recipe_module_bits("language_model.model.layers.3.mlp.gate"), 8);
  EXPECT_EQ(quant::recipe_module_bits("model.language_model.layers.3.mlp.gate.weight"), 8);
  EXPECT_EQ(quant::recipe_module_bits("language_model.model.layers.0.mlp.shared_expert_gate"), 8);
  EXPECT_EQ(quant::recipe_module_bits("language_model.model.layers.0.mlp.shared_expert.gate_proj"), 4);
  EXPECT_EQ(quant::recipe_module_bits("language_model.model.layers.0.mlp.switch_mlp.gate_proj"), 4);
  EXPECT_EQ(quant::recipe_module_bits("language_model.lm_head"), 4);
  EXPECT_EQ(quant::recipe_bits(4, 2048), 4);
  EXPECT_EQ(quant::recipe_bits(8, 128), 8);
  EXPECT_EQ(quant::recipe_bits(4, 32), 0);
  EXPECT_EQ(quant::recipe_bits(4, 96), 0);
}

}  // namespace
}  // namespace kestrel
