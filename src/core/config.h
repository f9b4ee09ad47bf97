// config.json of Qwen3.6-35B-A3B (model_type qwen3_5_moe): parse and validate.
// Accepts the official multimodal wrapper (text_config + top-level eos list) and text-only configs.
// Refuses any architecture other than this one, naming the field, its value and what was expected.
// Sizes come from the file, so tiny test models run exactly the code the real model runs.
#pragma once
#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kestrel {

enum class LayerKind : uint8_t { LinearAttention, FullAttention };

// The per-module quantization of an MLX checkpoint ("quantization" block). Filled in by the loader
// of quantized checkpoints (src/quant); absent for bf16 checkpoints.
struct QuantOverride {
  std::string module;  // e.g. "language_model.model.layers.3.mlp.gate"
  int bits = 4;
  int group_size = 64;
};
struct QuantizationConfig {
  int bits = 4;
  int group_size = 64;
  std::string mode = "affine";
  std::vector<QuantOverride> overrides;
};

struct ModelConfig {
  // Text model.
  int hidden_size = 0;
  int num_layers = 0;
  int vocab_size = 0;
  std::vector<LayerKind> layer_types;
  int full_attention_interval = 4;
  float rms_norm_eps = 1e-6f;
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;

  // Gated attention layers.
  int num_attention_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  double rope_theta = 0;
  float partial_rotary_factor = 0;
  int rotary_dim = 0;  // head_dim * partial_rotary_factor

  // Gated DeltaNet layers.
  int linear_num_key_heads = 0;
  int linear_num_value_heads = 0;
  int linear_key_head_dim = 0;
  int linear_value_head_dim = 0;
  int linear_conv_kernel_dim = 0;

  // MoE.
  int num_experts = 0;
  int num_experts_per_tok = 0;
  int moe_intermediate_size = 0;
  int shared_expert_intermediate_size = 0;

  int mtp_num_hidden_layers = 0;
  std::vector<int> eos_token_ids;
  int bos_token_id = -1;

  std::optional<QuantizationConfig> quantization;  // MLX-style block, if present
  bool multimodal_wrapper = false;                 // the file had text_config

  // Derived sizes.
  int gdn_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int gdn_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  int gdn_conv_dim() const { return 2 * gdn_key_dim() + gdn_value_dim(); }
  int num_full_layers() const;
  int num_linear_layers() const { return num_layers - num_full_layers(); }
  bool is_full(int layer) const { return layer_types[size_t(layer)] == LayerKind::FullAttention; }
  // True iff every per-layer width equals the real model's (CUDA kernels specialise on these).
  bool has_real_widths() const;
};

// Parses and validates; `source` names the file in error messages.
ModelConfig parse_config(const nlohmann::json& j, const std::string& source = "config.json");
ModelConfig load_config(const std::filesystem::path& model_dir);

// Reads a JSON file with a clear error (file name, parse position) on failure.
nlohmann::json read_json_file(const std::filesystem::path& path);

}  // namespace kestrel
