// The CPU backend: the whole text model in fp32 math over the loaded weights (bf16/f16/f32
// upcast, Q4/Q8 dequantised on the fly, never a full fp32 copy). It is the reference every other
// backend is tested against.
#pragma once
#include "engine/engine.h"

#include <functional>
#include <map>

namespace kestrel::cpu {

// Optional hook: called with every named intermediate ("layer L / name", fp32 [rows, cols]) so a run
// can be diffed layer by layer against the HF reference.
using DumpHook = std::function<void(int layer, const char* name, const float* data, int64_t rows,
                                    int64_t cols)>;

// Chooses the GDN formulation of a multi-token step (prompts use the chunked form, as the
// reference does; single-token steps the recurrence).
enum class GdnRoute : uint8_t { Recurrent, Chunked };
GdnRoute choose_gdn_route(int64_t new_tokens);
constexpr int kGdnChunk = 64;

class CpuBackend final : public Backend {
 public:
  CpuBackend(std::unique_ptr<ModelWeights> w, int threads);
  const ModelConfig& config() const override { return w_->config; }
  std::string name() const override { return "cpu"; }
  SeqId create_sequence(int64_t max_tokens) override;
  void free_sequence(SeqId seq) override;
  int64_t sequence_length(SeqId seq) const override;
  int64_t sequence_capacity(SeqId seq) const override;
  void step(std::span<const StepRequest> batch, std::span<StepResult> out) override;

  const ModelWeights& weights() const { return *w_; }
  void set_dump_hook(DumpHook h) { dump_ = std::move(h); }
  // Test access to the per-sequence GDN recurrent state of GDN layer `gdn_index` (fp32 [Hv, dk, dv]).
  std::span<float> gdn_state(SeqId seq, int gdn_index);

 private:
  struct Sequence {
    int64_t capacity = 0, length = 0;
    std::vector<std::vector<float>> conv;  // per GDN layer: fp32 [conv_dim, K-1], oldest first
    std::vector<std::vector<float>> rec;   // per GDN layer: fp32 [Hv, dk, dv]
    std::vector<std::vector<float>> kc;    // per attention layer: fp32 [capacity, kv_heads, head_dim]
    std::vector<std::vector<float>> vc;
  };
  // Scratch buffers, grown (never shrunk) to the largest step seen.
  struct Scratch {
    std::vector<float> x, h, out, qkv, z, b, a, u, o, y, qg, q, k, v, gate, attn, moe, logits_in;
    std::vector<float> beta, g;
  };
  void forward(Sequence& s, std::span<const int32_t> tokens, bool all_logits, StepResult& r);
  void gdn_branch(int layer, int gdn_i, Sequence& s, int64_t T);
  void attn_branch(int layer, int attn_i, Sequence& s, int64_t T, int64_t pos0);
  void dump(int layer, const char* name, const std::vector<float>& v, int64_t rows, int64_t cols);

  std::unique_ptr<ModelWeights> w_;
  std::vector<int> layer_slot_;  // layer -> index among GDN layers or attention layers
  std::map<SeqId, Sequence> seqs_;
  SeqId next_id_ = 1;
  Scratch sc_;
  DumpHook dump_;
};

}  // namespace kestrel::cpu
