// Model weights as plain structs of non-owning views. Big matrices stay where they are (the mmap of
// the checkpoint, or a quantized buffer owned by ModelWeights); only small vectors (norms, A_log,
// dt_bias, conv taps) are converted to fp32 at load, with the +1 of zero-centred norms applied once.
#pragma once
#include "core/config.h"
#include "core/dtype.h"

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace kestrel {

class Checkpoint;

// Storage format of a weight matrix. Affine formats (MLX layout, see quant/quant.h):
//   w[n, j] = scale[n, j/group] * q[n, j] + bias[n, j/group]; q packed little-endian in u32 words.
enum class WFormat : uint8_t { BF16, F16, F32, Q4, Q8 };
const char* wformat_name(WFormat f);

// A 2-D weight [rows = out_features, cols = in_features], row-major, applied as y = x * W^T.
struct Mat {
  WFormat fmt = WFormat::BF16;
  int64_t rows = 0, cols = 0;
  const void* data = nullptr;        // BF16/F16/F32 elements, or u32 words [rows, cols*bits/32]
  const uint16_t* scales = nullptr;  // affine: bf16 [rows, cols/group]
  const uint16_t* biases = nullptr;  // affine: bf16 [rows, cols/group]
  int group = 64;                    // affine group size

  bool valid() const { return data != nullptr; }
  int bits() const { return fmt == WFormat::Q4 ? 4 : fmt == WFormat::Q8 ? 8 : 0; }
  // Rows [r0, r0 + n) as a view (checked).
  Mat slice_rows(int64_t r0, int64_t n) const;
  // Bytes the matrix occupies (data + scales + biases).
  size_t nbytes() const;
  // Dequantises/upcasts row r into out[cols] (fp32).
  void row_f32(int64_t r, float* out) const;
};

struct GdnWeights {
  Mat in_proj_qkv;             // [conv_dim, hidden]: q (Hk*dk) | k (Hk*dk) | v (Hv*dv)
  Mat in_proj_z;               // [Hv*dv, hidden]
  Mat in_proj_b;               // [Hv, hidden]
  Mat in_proj_a;               // [Hv, hidden]
  std::vector<float> conv1d;   // fp32 [conv_dim, K]; tap K-1 multiplies the current token
  std::vector<float> A_log;    // fp32 [Hv]
  std::vector<float> dt_bias;  // fp32 [Hv]
  std::vector<float> norm;     // fp32 [dv], plain weight (not 1+w)
  Mat out_proj;                // [hidden, Hv*dv]
};

struct AttnWeights {
  Mat q_proj;                  // [heads*2*head_dim, hidden]: per head h, query rows then gate rows
  Mat k_proj;                  // [kv_heads*head_dim, hidden]
  Mat v_proj;                  // [kv_heads*head_dim, hidden]
  Mat o_proj;                  // [hidden, heads*head_dim]
  std::vector<float> q_norm;   // fp32 [head_dim], effective multiplier (1+w)
  std::vector<float> k_norm;   // fp32 [head_dim], effective multiplier (1+w)
};

struct MoeWeights {
  Mat router;                  // [E, hidden]
  std::vector<Mat> gate;       // per expert [I, hidden]
  std::vector<Mat> up;         // per expert [I, hidden]
  std::vector<Mat> down;       // per expert [hidden, I]
  Mat shared_gate;             // [Is, hidden]
  Mat shared_up;               // [Is, hidden]
  Mat shared_down;             // [hidden, Is]
  Mat shared_expert_gate;      // [1, hidden]
};

struct LayerWeights {
  LayerKind kind = LayerKind::LinearAttention;
  std::vector<float> input_norm;  // fp32 [hidden], effective multiplier (1+w)
  std::vector<float> post_norm;   // fp32 [hidden], effective multiplier (1+w)
  GdnWeights gdn;                 // valid iff kind == LinearAttention
  AttnWeights attn;               // valid iff kind == FullAttention
  MoeWeights moe;
};

// Quantize-at-load choice (bf16 checkpoints only).
enum class QuantMode : uint8_t { None, Q4 };

struct LoadProgress {
  size_t done_bytes = 0, total_bytes = 0;
};
using ProgressFn = std::function<void(const LoadProgress&)>;

struct ModelWeights {
  ModelConfig config;
  Mat embed;                      // [vocab, hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm;  // fp32 [hidden], effective multiplier (1+w)
  Mat lm_head;                    // [vocab, hidden]

  std::shared_ptr<const Checkpoint> checkpoint;      // keeps the mmap alive
  std::vector<std::vector<uint8_t>> owned;           // buffers of quantized-at-load matrices
  std::string source_format;                         // "hf-bf16", "mlx-q4", ...

  size_t matrix_bytes() const;  // bytes of all matrices (what a decode pass streams, roughly)
};

struct LoadOptions {
  QuantMode quant = QuantMode::None;
  ProgressFn progress;
};

// Helpers shared by the HF and MLX loaders.
class TensorLoader;
struct TensorInfo;
// An unquantized 2-D (or [E, N, K] viewed as [E*N, K]) tensor as a Mat view over its bytes.
Mat mat_from_tensor(const TensorInfo& t);
// Small tensors (norms, A_log, dt_bias, conv taps) converted to fp32; `add_one` applies the 1+w of
// zero-centred norms.
std::vector<float> tensor_to_f32(const TensorInfo& t, bool add_one = false);

// Loads a model directory (config.json + safetensors): HF layout, or MLX quantized layout when the
// config has a "quantization" block. Every tensor is accounted for.
std::unique_ptr<ModelWeights> load_weights(const std::filesystem::path& model_dir,
                                           const LoadOptions& opts = {});

}  // namespace kestrel
