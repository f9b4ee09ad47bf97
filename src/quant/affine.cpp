// Affine (MLX) dequantisation of one row; see quant.h for the layout.
#include "quant/quant.h"

#include "core/check.h"

namespace kestrel::quant {

void dequant_row(const Mat& m, int64_t r, float* out) {
  const int bits = m.bits();
  KESTREL_CHECK(bits == 4 || bits == 8, "dequant_row: format {} is not affine", wformat_name(m.fmt));
  const int per_word = 32 / bits;
  const uint32_t mask = (1u << bits) - 1u;
  const int64_t words_per_row = m.cols / per_word;
  const int64_t groups_per_row = m.cols / m.group;
  const uint32_t* w = static_cast<const uint32_t*>(m.data) + r * words_per_row;
  const uint16_t* s = m.scales + r * groups_per_row;
  const uint16_t* b = m.biases + r * groups_per_row;
  for (int64_t g = 0; g < groups_per_row; ++g) {
    const float scale = bf16_to_f32(s[g]), bias = bf16_to_f32(b[g]);
    for (int64_t j = g * m.group; j < (g + 1) * m.group; ++j) {
      const uint32_t q = (w[j / per_word] >> (bits * (j % per_word))) & mask;
      out[j] = scale * float(q) + bias;
    }
  }
}

}  // namespace kestrel::quant
