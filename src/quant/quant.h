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
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

namespace kestrel::quant {

// Dequantises row r of an affine matrix (Q4/Q8) into out[cols] (fp32).
void dequant_row(const Mat& m, int64_t r, float* out);

// --- Implemented by the quantization component (issue 5); called by core/weights.cpp. ---

// Quantizes an unquantized matrix (BF16/F16/F32) to affine `bits` (4 or 8) with group `group`,
// round to nearest, exactly as MLX's quantize does. The codes/scales/biases are appended to
// `storage` (one new buffer); the returned Mat points into it.
Mat quantize_matrix(const Mat& src, int bits, int group, std::vector<std::vector<uint8_t>>& storage);

// Loads an MLX-layout quantized checkpoint (config.json with a "quantization" block) into the same
// ModelWeights structure the HF loader produces. `cfg` is the parsed config.
std::unique_ptr<ModelWeights> load_mlx_weights(const std::filesystem::path& model_dir,
                                               const ModelConfig& cfg, const LoadOptions& opts);

}  // namespace kestrel::quant
