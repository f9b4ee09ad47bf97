// Affine quantization in the MLX layout (model-spec §7.1), shared by the loader, the CPU backend
// and `kestrel quantize`.
//
// In-memory (and on-disk) layout of an affine-quantized [rows, cols] matrix with b bits, group g:
//   codes  u32 [rows, cols*b/32]: within each row, element j occupies bits b*(j mod (32/b)) onward
//          of word floor(j*b/32), least-significant bits first (8 codes per word at 4 bits).
//   scales bf16 [rows, cols/g], biases bf16 [rows, cols/g]
//   w[n, j] = scales[n, j/g] * q[n, j] + biases[n, j/g],  q in [0, 2^b - 1]
// 4-bit costs 4.5 bits per weight with g = 64 (8.5 bits at 8-bit). kestrel supports g = 64 and
// b in {4, 8} (the mlx-community recipe); anything else is refused at load.
//
// Quantizer (quantize_group): MLX's affine quantize as its GPU kernels compute it (Metal
// `affine_quantize` in mlx/backend/metal/kernels/quantized.h, the same formula in the CUDA
// backend), in IEEE fp32, per group of g consecutive row elements:
//   w_min = min(w),  w_max = max(0, max(w))          (the kernels start w_max at 0)
//   s     = max((w_max - w_min) / (2^b - 1), 1e-7)
//   side  = |w_min| > |w_max|;  s = side ? s : -s;  edge = side ? w_min : w_max
//   q0    = round(edge / s)                          (round half away from zero)
//   if q0 != 0: s = edge / q0, bias = edge  else bias = 0       (0 is then exactly representable)
//   q     = min(round((w - bias) / s), 2^b - 1)      (never negative; clamped at 0 for safety)
//   scales/biases are stored as bf16(s), bf16(bias) (round to nearest even); the codes are computed
//   with the fp32 s and bias, as MLX does.
// MLX's CPU backend differs only in corner cases (it uses the true group maximum, so all-negative
// groups differ, and rounds half to even); mlx-community checkpoints are produced on the GPU.
#pragma once
#include "core/weights.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kestrel::quant {

constexpr int kGroup = 64;  // the only group size kestrel accepts (shapes::kQuantGroup)

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

// --- Building blocks (tests, `kestrel quantize`). ---

// The MLX recipe's precision for a matrix the recipe would quantize at `bits`: `bits` when the
// input width is a multiple of the group, else 0 (mlx-lm's quantize_model leaves such a matrix
// unquantized).
inline int recipe_bits(int bits, int64_t cols) { return cols % kGroup == 0 ? bits : 0; }

// The recipe's bits for an HF or MLX module path ("...mlp.gate" routers and
// "...mlp.shared_expert_gate" at 8, everything else at 4), before the width rule above.
int recipe_module_bits(const std::string& module_path);

// Quantizes one group of `group` fp32 values (see the header comment): writes group*bits/32 code
// words and the bf16 scale and bias. Throws on a non-finite value.
void quantize_group(const float* w, int group, int bits, uint32_t* codes, uint16_t* scale,
                    uint16_t* bias);

// Quantizes rows [r0, r0 + n) of `src` (BF16/F16/F32) into caller-provided arrays laid out as in
// the header (n rows: codes n*cols*bits/32 words, scales and biases n*cols/group each).
void quantize_rows(const Mat& src, int64_t r0, int64_t n, int bits, int group, uint32_t* codes,
                   uint16_t* scales, uint16_t* biases);

// The code q[r, j] of an affine matrix (tests, debugging).
uint32_t code_at(const Mat& m, int64_t r, int64_t j);

// --- `kestrel quantize`: HF bf16 checkpoint -> MLX affine checkpoint (src/quant/convert.cpp). ---

struct ConvertOptions {
  int bits = 4;                        // default bits (routers and shared-expert gates get 8)
  size_t max_shard_bytes = size_t(5) << 30;  // mlx-lm's MAX_FILE_SIZE_GB
  std::function<void(size_t done, size_t total)> progress;
};

struct ConvertReport {
  size_t tensors_written = 0;
  size_t bytes_in = 0, bytes_out = 0;  // safetensors payload read (text model) and written
  size_t shards = 0;
  size_t dropped = 0;                  // tensors not carried over (model.visual.*, mtp.*)
  int64_t parameters = 0;              // weights written (matrices at their logical size)
  std::vector<std::string> unquantized;  // matrices kept in the source dtype (width rule)
};

// Reads an HF-layout model directory (bf16) and writes `out_dir` in the mlx-community layout:
// language_model.* names, switch_mlp experts, conv1d [C, K, 1], +1 baked into the zero-centred
// norms, u32/scales/biases triplets, config.json with "quantization" and "quantization_config",
// generation_config/tokenizer files copied. The vision tower and the MTP block are dropped, as
// mlx-lm does. Refuses an input that is already quantized and an existing non-empty out_dir.
ConvertReport convert_hf_to_mlx(const std::filesystem::path& in_dir,
                                const std::filesystem::path& out_dir, const ConvertOptions& opts);

}  // namespace kestrel::quant
