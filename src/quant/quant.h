// Affine quantization in the MLX layout (model-spec §7.1), shared by the loader, the CPU backend
// and `kestrel quantize`.
//
// In-memory (and on-disk) layout of an affine-quantized [rows, cols] matrix with b bits, group g:
//   codes  u32 [rows, cols*b/32]: within each row, element j occupies bits b*(j mod (32/b)) onward
//          of word floor(j*b/32), least-significant bits first (8 codes per word at 4 bits).
//   scales bf16 [rows, cols/g], biases bf16 [rows, cols/g]
//   w[n, j] = scales[n, j/g] * q[n, j] + biases[n, j/g],  q in [0, 2^b - 1]
// 4-bit costs 4.5 bits per weight with g = 64 (8.5 bits at 8-bit).
#pragma once
#include "core/weights.h"

#include <cstdint>
#include <span>
#include <vector>

namespace kestrel::quant {

// Dequantises row r of an affine matrix (Q4/Q8) into out[cols] (fp32).
void dequant_row(const Mat& m, int64_t r, float* out);

}  // namespace kestrel::quant
