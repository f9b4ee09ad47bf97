// The CUDA backend (sm_90a, one GPU): weights uploaded once in their checkpoint formats (BF16, or
// affine Q4/Q8 in the MLX layout), fp32 activations, bf16 KV cache, fp32 GDN state. Decode runs
// ~6 kernels per layer (fused norms, projections, conv, residuals; see docs/kernels/decode.md).
// Prompts (multi-token steps) go through the prompt driver (src/cuda/prefill_step.cpp: chunked
// tensor-core GEMMs, chunked DeltaNet, flash attention) feeding the same per-sequence state.
#pragma once
#include "engine/engine.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace kestrel {

std::unique_ptr<Backend> make_cuda_backend(std::unique_ptr<ModelWeights> w, const BackendOptions& o);

namespace cuda {

// True iff a CUDA device can be used (tests skip otherwise); `why` says why not.
bool gpu_available(std::string* why = nullptr);

// Greedy decoding on the GPU for a CUDA backend's sequence: `first` is appended, then each
// generated token is fed back; the argmax stays on the GPU and each step is one CUDA graph
// replay (captured per sequence on first use). on_token (may be empty) receives each generated
// token; returning false stops. Steps are pipelined one deep, so on an early stop the stopping
// token has also been appended to the sequence (sequence_length() says so). Returns the
// generated tokens. vocab_limit > 0 restricts the argmax to ids < vocab_limit (the lm_head rows
// past the tokenizer's vocabulary are padding). Throws if `b` is not a CUDA backend or the
// capacity would be exceeded.
std::vector<int32_t> greedy_decode(Backend& b, SeqId seq, int32_t first, int max_new,
                                   const std::function<bool(int32_t)>& on_token = {},
                                   int32_t vocab_limit = 0);

// Synthetic full-size model: deterministic random weights at the config's shapes built directly
// on the GPU (std ~0.02, finite scales). kind: "q4" (MLX-style mix: 4-bit everywhere, 8-bit router
// and shared-expert gate) or "bf16".
std::unique_ptr<Backend> make_synthetic_backend(const ModelConfig& cfg, const std::string& kind,
                                                uint64_t seed);
// The real model's configuration (Qwen3.6-35B-A3B text model) for synthetic runs.
ModelConfig real_model_config();

// For benchmarks: makes `seq` hold `context` tokens of synthetic history (random bf16 KV, random
// GDN/conv state) without running them, so a decode step reads a cache of that length.
void set_synthetic_context(Backend& b, SeqId seq, int64_t context, uint64_t seed);

// Bytes one decode step must read or write at a given context (weights actually used by one token
// with top-k experts, GDN/conv state read + written, KV read), for achieved-bandwidth figures.
double decode_step_bytes(const Backend& b, int64_t context);

// The MoE routing place the decode step records with under the current route switches (for the
// records of benchmarks: the Auto default resolved for this model's experts); 0..2, RoutePlace.
int decode_route_place(const Backend& b);

// Timed greedy decode for benchmarks: per-step device times (seconds) of `steps` graph replays
// after `warmup` untimed ones, starting from token `first`.
std::vector<double> time_decode_steps(Backend& b, SeqId seq, int32_t first, int warmup, int steps);

// Seconds the weights took to reach the GPU (0 for synthetic models) and their bytes.
double load_seconds(const Backend& b);
size_t weight_bytes(const Backend& b);

}  // namespace cuda
}  // namespace kestrel
