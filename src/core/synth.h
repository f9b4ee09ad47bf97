// Deterministic synthetic checkpoints: HF-layout bf16 safetensors for any valid config, with every
// value a function of (seed, tensor name, element index) only. Used for the real-width fixture
// (whose transformers reference is committed but whose ~0.5 GB of weights are regenerated in CI)
// and by tests that need malformed or re-laid-out checkpoints.
#pragma once
#include "core/config.h"

#include <cstdint>
#include <filesystem>

namespace kestrel {

struct SynthOptions {
  uint64_t seed = 1;
  bool fused_experts = false;  // experts.gate_up_proj/down_proj instead of per-expert tensors
  bool with_mtp = true;        // fake mtp.* tensors (skipped by the loader)
};

// Writes out_dir/model.safetensors for `cfg` (out_dir must exist). Returns bytes written.
size_t write_synthetic_checkpoint(const ModelConfig& cfg, const std::filesystem::path& out_dir,
                                  const SynthOptions& opts);

}  // namespace kestrel
