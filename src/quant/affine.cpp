// Affine (MLX) quantization and dequantisation; see quant.h for the layout and the formula.
#include "quant/quant.h"

#include "core/check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kestrel::quant {

namespace {

// One row, specialised on the bit width so the word unpacking unrolls (the CPU backend calls this
// for every row of every quantized matrix it multiplies).
template <int kBits>
void dequant_row_bits(const uint32_t* w, const uint16_t* s, const uint16_t* b, int64_t cols,
                      int group, float* out) {
  constexpr int kPer = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1u;
  const int64_t groups = cols / group;
  const int words_per_group = group / kPer;
  for (int64_t g = 0; g < groups; ++g) {
    const float scale = bf16_to_f32(s[g]), bias = bf16_to_f32(b[g]);
    const uint32_t* wg = w + g * words_per_group;
    float* o = out + g * group;
    for (int k = 0; k < words_per_group; ++k) {
      const uint32_t word = wg[k];
      for (int i = 0; i < kPer; ++i) o[k * kPer + i] = scale * float((word >> (kBits * i)) & kMask) + bias;
    }
  }
}

}  // namespace

void dequant_row(const Mat& m, int64_t r, float* out) {
  const int bits = m.bits();
  KESTREL_CHECK(bits == 4 || bits == 8, "dequant_row: format {} is not affine", wformat_name(m.fmt));
  const int64_t words_per_row = m.cols * bits / 32;
  const int64_t groups_per_row = m.cols / m.group;
  const uint32_t* w = static_cast<const uint32_t*>(m.data) + r * words_per_row;
  const uint16_t* s = m.scales + r * groups_per_row;
  const uint16_t* b = m.biases + r * groups_per_row;
  if (bits == 4)
    dequant_row_bits<4>(w, s, b, m.cols, m.group, out);
  else
    dequant_row_bits<8>(w, s, b, m.cols, m.group, out);
}

uint32_t code_at(const Mat& m, int64_t r, int64_t j) {
  const int bits = m.bits();
  KESTREL_CHECK(bits == 4 || bits == 8, "code_at: format {} is not affine", wformat_name(m.fmt));
  KESTREL_CHECK(r >= 0 && r < m.rows && j >= 0 && j < m.cols, "code_at: [{}, {}] outside [{}, {}]",
                r, j, m.rows, m.cols);
  const int per_word = 32 / bits;
  const uint32_t* w = static_cast<const uint32_t*>(m.data) + r * (m.cols / per_word);
  return (w[j / per_word] >> (bits * (j % per_word))) & ((1u << bits) - 1u);
}

int recipe_module_bits(const std::string& path) {
  std::string p = path;
  if (p.size() > 7 && p.compare(p.size() - 7, 7, ".weight") == 0) p.resize(p.size() - 7);
  auto ends_with = [&](const char* s) {
    const size_t n = std::strlen(s);
    return p.size() >= n && p.compare(p.size() - n, n, s) == 0;
  };
  // mlx-lm qwen3_5 quant_predicate: path.endswith("mlp.gate") or path.endswith("shared_expert_gate").
  return ends_with("mlp.gate") || ends_with("shared_expert_gate") ? 8 : 4;
}

void quantize_group(const float* w, int group, int bits, uint32_t* codes, uint16_t* scale_out,
                    uint16_t* bias_out) {
  KESTREL_CHECK(bits == 4 || bits == 8, "quantize: bits {} not supported (4 or 8)", bits);
  KESTREL_CHECK(group > 0 && group % (32 / bits) == 0, "quantize: group {} not a multiple of {}",
                group, 32 / bits);
  const float n_bins = float((1 << bits) - 1);
  const float eps = 1e-7f;
  float w_min = std::numeric_limits<float>::max();
  float w_max = 0.f;  // as MLX's GPU kernels: the maximum starts at 0
  for (int i = 0; i < group; ++i) {
    KESTREL_CHECK(std::isfinite(w[i]), "quantize: non-finite weight {} at group element {}", w[i],
                  i);
    w_min = std::min(w_min, w[i]);
    w_max = std::max(w_max, w[i]);
  }
  float scale = std::max((w_max - w_min) / n_bins, eps);
  const bool side = std::fabs(w_min) > std::fabs(w_max);
  scale = side ? scale : -scale;
  const float edge = side ? w_min : w_max;
  const float q0 = std::round(edge / scale);  // half away from zero, as Metal/CUDA round()
  const bool at_zero = q0 == 0.0f;
  scale = at_zero ? scale : edge / q0;
  const float bias = at_zero ? 0.0f : edge;
  *scale_out = f32_to_bf16(scale);
  *bias_out = f32_to_bf16(bias);

  const int per_word = 32 / bits;
  for (int k = 0; k < group / per_word; ++k) {
    uint32_t word = 0;
    for (int i = 0; i < per_word; ++i) {
      float q = std::round((w[k * per_word + i] - bias) / scale);
      q = std::min(std::max(q, 0.0f), n_bins);
      word |= uint32_t(q) << (bits * i);
    }
    codes[k] = word;
  }
}

void quantize_rows(const Mat& src, int64_t r0, int64_t n, int bits, int group, uint32_t* codes,
                   uint16_t* scales, uint16_t* biases) {
  KESTREL_CHECK(src.fmt == WFormat::BF16 || src.fmt == WFormat::F16 || src.fmt == WFormat::F32,
                "quantize: source matrix is {}, expected BF16, F16 or F32 (already quantized?)",
                wformat_name(src.fmt));
  KESTREL_CHECK(bits == 4 || bits == 8, "quantize: bits {} not supported (kestrel uses 4 or 8)",
                bits);
  KESTREL_CHECK(group == kGroup, "quantize: group size {} not supported (kestrel uses {})", group,
                kGroup);
  KESTREL_CHECK(src.cols > 0 && src.cols % group == 0,
                "quantize: {} input columns is not a multiple of the group size {}", src.cols,
                group);
  KESTREL_CHECK(r0 >= 0 && n >= 0 && r0 + n <= src.rows, "quantize: rows [{}, {}) of {}", r0,
                r0 + n, src.rows);
  const int64_t words = src.cols * bits / 32, groups = src.cols / group;
  const int64_t gw = group * bits / 32;
  bool bad = false;
  std::string err;
  // Threads only pay off on real-size matrices (a tiny expert is quicker alone than a team start).
#pragma omp parallel if (n * src.cols >= (int64_t(1) << 18))
  {
    std::vector<float> row(size_t(src.cols));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      src.row_f32(r0 + i, row.data());
      for (int64_t g = 0; g < groups; ++g) {
        try {
          quantize_group(row.data() + g * group, group, bits, codes + i * words + g * gw,
                         scales + i * groups + g, biases + i * groups + g);
        } catch (const Error& e) {
#pragma omp critical
          {
            if (!bad) err = fmt::format("row {}, group {}: {}", r0 + i, g, e.what());
            bad = true;
          }
        }
      }
    }
  }
  KESTREL_CHECK(!bad, "quantize: {}", err);
}

Mat quantize_matrix(const Mat& src, int bits, int group, std::vector<std::vector<uint8_t>>& storage) {
  KESTREL_CHECK(src.valid(), "quantize: empty source matrix");
  KESTREL_CHECK(src.cols > 0 && group > 0 && src.cols % group == 0,
                "quantize: {} input columns is not a multiple of the group size {}", src.cols,
                group);
  const size_t code_bytes = size_t(src.rows * src.cols * bits / 8);
  const size_t sb_bytes = size_t(src.rows * (src.cols / group)) * 2;
  std::vector<uint8_t> buf(code_bytes + 2 * sb_bytes);
  auto* codes = reinterpret_cast<uint32_t*>(buf.data());
  auto* scales = reinterpret_cast<uint16_t*>(buf.data() + code_bytes);
  auto* biases = reinterpret_cast<uint16_t*>(buf.data() + code_bytes + sb_bytes);
  quantize_rows(src, 0, src.rows, bits, group, codes, scales, biases);
  Mat m;
  m.fmt = bits == 4 ? WFormat::Q4 : WFormat::Q8;
  m.rows = src.rows;
  m.cols = src.cols;
  m.group = group;
  m.data = codes;
  m.scales = scales;
  m.biases = biases;
  storage.push_back(std::move(buf));  // moving a vector keeps its heap buffer: the views stay valid
  return m;
}

}  // namespace kestrel::quant
