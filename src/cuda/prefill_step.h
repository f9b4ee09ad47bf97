// The prompt (prefill) driver of the CUDA backend: runs a sequence's new tokens through the model
// in chunks of up to max_chunk tokens with the multi-token kernels (prefill.h, prefill_ops.h),
// leaving exactly the per-sequence state the decode graph continues from (DSeq: conv windows, GDN
// states, KV cache rows pos0.., history, d_len / d_pos / d_token, host length).
//
// Per chunk of T tokens at positions pos0..pos0+T-1 (docs/kernels/prefill_kernels.md):
//   x = embed[history[pos0..]]
//   per layer: h = rmsnorm(x, input_norm) (in hn)
//     GDN:  qkv|z|b|a = h W^T (one GEMM); u = silu(conv(qkv)) (window carried); o = delta rule (chunk 64,
//           state carried); y = gnorm * rmsnorm(o) * silu(z) (per head); x += y out^T
//     attn: qg|k|v = h W^T; q/k norm + RoPE, k/v appended to the cache, causal flash attention with
//           the sigmoid gate; x += attn o^T
//     MoE:  hn = rmsnorm(x, post_norm); router logits hn R^T (exact fp32); x += moe(hn)
//   last chunk: logits = rmsnorm(x[T-1], final_norm) lm_head^T (exact fp32, as decode), or, with
//   all_logits, every row of every chunk through the tensor-core GEMM in blocks of kLogitRows.
// Scratch is allocated once, at construction, for max_chunk tokens; nothing is allocated per
// step. Inside a chunk nothing synchronises the host; the logits copies at the end do.
// GEMM route (PrefillAPrec, prefill.h): Split (default: bf16 hi + lo, the fp32 oracle's numbers to
// accumulation order; its GEMMs on the Reg or the Pipe kernel, PrefillGemmChoice) or F16 (opt-in: one fp16 plane per fp32 activation, +22 % at 4K, and it
// misses the end-to-end bound on random real-width models: bench/PREFILL_NOTES.md v4). On the F16
// route every chunk first snapshots the sequence's conv windows and GDN states and ends with one
// host read of the range flag; if an activation exceeded the fp16 range, the chunk is redone on
// the Split route from the snapshot (KV rows are simply rewritten), with a warning: never a
// clamped result. KESTREL_PREFILL_APREC=split|f16 sets the route of new drivers.
// Host-compiled .cpp only.
#pragma once
#include "cuda/device_model.h"
#include "cuda/prefill.h"
#include "cuda/prefill_ops.h"
#include "engine/engine.h"

#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace kestrel::cuda {

constexpr int64_t kPrefillMaxChunk = 8192;  // tokens per chunk (issue 7)
constexpr int64_t kLogitRows = 128;          // all_logits: lm_head rows per block (device buffer)

// Which kernel runs the Split route's GEMMs (PrefillGemmKernel): always Reg, always Pipe, or Auto
// (the default): Pipe for chunks of at least kPipeMinChunk tokens and for the all-logits lm_head
// (vocabulary-wide: enough tiles at any row count), Reg below. The Pipe kernel's 128 x 128 tiles
// at one block per SM under-fill the machine on short chunks (at 512 tokens out_proj has 64
// tiles, and most experts' 128-row tiles hold a few rows): measured at 512 tokens Reg 5,865
// tok/s, Pipe 5,012; at 4096 Reg 12,396, Pipe 15,034 (H100, bench/PREFILL_NOTES.md v5).
enum class PrefillGemmChoice : uint8_t { Reg, Pipe, Auto };
constexpr int64_t kPipeMinChunk = 2048;
// The kernel of a chunk of T tokens on `route` (F16 chunks: Reg, the only F16 kernel).
inline PrefillGemmKernel prefill_gemm_kernel_for(PrefillGemmChoice c, PrefillAPrec route, int64_t T) {
  if (route != PrefillAPrec::Split || c == PrefillGemmChoice::Reg) return PrefillGemmKernel::Reg;
  return c == PrefillGemmChoice::Pipe || T >= kPipeMinChunk ? PrefillGemmKernel::Pipe
                                                            : PrefillGemmKernel::Reg;
}
const char* prefill_gemm_choice_name(PrefillGemmChoice c);

// Scratch bytes of the driver for chunks of max_chunk tokens of this config.
size_t prefill_step_scratch_bytes(const ModelConfig& c, int64_t max_chunk);

class PrefillStep {
 public:
  PrefillStep(const DModel& m, int64_t max_chunk);
  PrefillStep(const PrefillStep&) = delete;
  PrefillStep& operator=(const PrefillStep&) = delete;

  int64_t max_chunk() const { return max_chunk_; }
  size_t scratch_bytes() const { return arena_.bytes(); }
  // Tests: fills every scratch buffer with 0xff bytes (NaN floats, -1 ints), so a value read
  // before it is written shows up.
  void poison(cudaStream_t s);

  // The GEMM route and, for tests of the redo, the fp16 clamp bound (<= kF16Max).
  void set_aprec(PrefillAPrec p, float f16_limit = kF16Max);
  PrefillAPrec aprec() const { return aprec_; }
  // The kernel choice of the Split route's GEMMs (KESTREL_PREFILL_GEMM=reg|pipe|auto).
  void set_gemm_choice(PrefillGemmChoice c) { gemm_choice_ = c; }
  PrefillGemmChoice gemm_choice() const { return gemm_choice_; }
  // Chunks redone on the Split route because of the fp16 range (since construction).
  int64_t range_redos() const { return range_redos_; }

  // Appends `tokens` (validated by the caller: ids in range, capacity) to sequence sq and writes
  // the logits of the last token, or of every token with all_logits, to host memory `logits`
  // ([1 or tokens.size(), vocab] floats). Returns when the logits are on the host.
  void run(DSeq& sq, std::span<const int32_t> tokens, bool all_logits, float* logits, cudaStream_t s);

 private:
  struct Buffers {
    float* x;          // [Tm, hidden] residual stream
    float* hn;         // [Tm, hidden] normed MoE input, fp32 (also final norm, last row)
    // GDN
    float* proj;       // GDN: [Tm, conv_dim + value_dim + 2 Hv] h in_proj^T (pre-conv q|k|v, z, b, a);
                       // attention: [Tm, heads * 2 * head_dim + 2 kv_heads * head_dim] q|gate, k, v
    float* u;          // [Tm, conv_dim] post-conv q|k|v
    float* o;          // [Tm, value_dim] delta-rule output
    float* y;          // [Tm, value_dim] gated-norm output
    float* gdn;        // prefill_gdn_scratch_bytes(Tm, Hv)
    // attention
    uint16_t* qbuf;    // [2, Tm, heads * head_dim] bf16: q's hi and lo parts
    float* attn;       // [Tm, heads * head_dim]
    // logits
    float* logits;     // [kLogitRows, vocab]
  };

  void chunk(DSeq& sq, int64_t pos0, int64_t T, bool exact, cudaStream_t s);
  void snapshot(const DSeq& sq, bool restore, cudaStream_t s);
  void gdn_layer(const DLayer& d, DSeq& sq, int l, int64_t T, cudaStream_t s);
  void attn_layer(const DLayer& d, DSeq& sq, int l, int64_t pos0, int64_t T, cudaStream_t s);
  void moe_layer(const DLayer& d, int64_t T, cudaStream_t s);
  void norm(const float* x, const float* w, int64_t T, float* y, uint16_t* y16, cudaStream_t s);
  PipeSplitArgs split_planes(int64_t T, int64_t K) const;
  PipeA split(const float* a, int64_t lda, int64_t T, int64_t K, cudaStream_t s);
  void gemm(const PipeA& pa, const float* a, int64_t lda, int64_t T, const DMat& W, float* c,
            int64_t ldc, GemmEpi epi, cudaStream_t s);
  void last_logits(int64_t T, float* host, cudaStream_t s);
  void all_logits(int64_t T, float* host, cudaStream_t s);

  template <class T>
  T* take(size_t n) {
    void* p = arena_.alloc(n * sizeof(T));
    allocs_.emplace_back(p, n * sizeof(T));
    return static_cast<T*>(p);
  }

  const DModel& m_;
  int64_t max_chunk_;
  DeviceArena arena_;
  std::vector<std::pair<void*, size_t>> allocs_;
  Buffers buf_{};
  MoePrefillScratch moe_{};
  PrefillAPrec aprec_ = PrefillAPrec::Split;
  PrefillAPrec route_ = PrefillAPrec::Split;  // of the chunk being enqueued
  float f16_limit_ = kF16Max;
  unsigned* range_flag_ = nullptr;          // device word
  std::vector<float*> snap_conv_, snap_rec_;  // per GDN layer (F16 route's redo)
  int64_t range_redos_ = 0;
  int moe_bm_ = 0;  // KESTREL_PREFILL_MOE_BM (F16 route; 0 = default)
  PrefillGemmChoice gemm_choice_ = PrefillGemmChoice::Auto;
  // The attention kernel's routes (KESTREL_ATTN_P / _QK / _PV / _TILE, read once at construction).
  bool attn_p_split_ = false, attn_qk_wgmma_ = true, attn_pv_wgmma_ = true;
  int attn_wide_ = 0;
  F32GemmRoute router_route_ = F32GemmRoute::Tc;
  PrefillGemmKernel kernel_ = PrefillGemmKernel::Reg;  // of the chunk being enqueued
};

// Test / tuning hooks of a CUDA backend (defined in cuda_backend.cpp): the prompt chunk size
// (1..kPrefillMaxChunk; rebuilds the driver and its scratch; default kPrefillMaxChunk) and the
// driver's scratch bytes (0 before the first multi-token step); poison_prefill_scratch creates the
// driver if needed and fills its scratch with 0xff bytes (tests).
void set_prefill_max_chunk(Backend& b, int64_t max_chunk);
size_t prefill_scratch_bytes(const Backend& b);
void poison_prefill_scratch(Backend& b);
// The GEMM route of the backend's prompt driver (kept across driver rebuilds) and the number of
// chunks it redid on the Split route (tests).
void set_prefill_aprec(Backend& b, PrefillAPrec p, float f16_limit = kF16Max);
int64_t prefill_range_redos(const Backend& b);
// KESTREL_PREFILL_APREC: "split" (default) or "f16"; anything else is an error.
PrefillAPrec prefill_aprec_from_env();
// The backend's prompt driver's Split-route GEMM kernel choice (kept across driver rebuilds).
void set_prefill_gemm_choice(Backend& b, PrefillGemmChoice c);
// KESTREL_PREFILL_GEMM: "auto" (default), "reg" or "pipe"; anything else is an error.
PrefillGemmChoice prefill_gemm_choice_from_env();

}  // namespace kestrel::cuda
