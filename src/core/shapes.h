// The real model's per-layer widths (Qwen3.6-35B-A3B). CUDA kernels may specialise on these; counts
// (layers, experts, top-k, vocabulary, context) stay runtime values read from config.json.
#pragma once

namespace kestrel::shapes {
constexpr int kHidden = 2048;
constexpr int kHeadDim = 256;       // gated attention head dim
constexpr int kNumHeads = 16;       // attention query heads
constexpr int kNumKvHeads = 2;      // attention kv heads (GQA 8:1)
constexpr int kRotaryDim = 64;      // partial rotary (0.25 of 256)
constexpr int kGdnHeadDim = 128;    // GDN key/value head dim
constexpr int kGdnKeyHeads = 16;
constexpr int kGdnValueHeads = 32;
constexpr int kConvKernel = 4;
constexpr int kExpertWidth = 512;   // moe_intermediate_size
constexpr int kSharedWidth = 512;   // shared_expert_intermediate_size
constexpr int kNumExperts = 256;
constexpr int kTopK = 8;
constexpr int kNumLayers = 40;
constexpr int kVocab = 248320;
constexpr int kQuantGroup = 64;     // affine quantization group size
}  // namespace kestrel::shapes
