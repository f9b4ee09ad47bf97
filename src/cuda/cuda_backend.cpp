// CudaBackend: device model (weights in their checkpoint formats), per-sequence device state,
// and the decode step as a straight-line sequence of fused kernels (model-spec §3.1):
//   step_begin (token -> embedding row, position bookkeeping on the device)
//   per layer: [norm+in-proj GEMV with conv epilogue] [GDN step] [gated-norm+out_proj GEMV, +=x]
//           or [norm+q|k|v GEMV] [attention split] [combine+gate] [o_proj GEMV, +=x]
//              [norm+router|shared GEMV] [top-k + expert gate/up] [expert down + shared, +=x]
//   [final norm + lm_head GEMV with fused argmax]
// Nothing in a step reads host memory, so the whole step is captured as one CUDA graph for the
// greedy path; the generated token stays on the GPU (argmax key) and feeds the next replay.
#include "cuda/cuda_backend.h"

#include "core/check.h"
#include "core/shapes.h"
#include "cuda/device_model.h"
#include "cuda/kernels.h"
#include "cuda/prefill_step.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>

namespace kestrel {
namespace cuda {
namespace {

// Pinned double-buffered staging: host (mmap) -> pinned -> device, no host copy of the model.
class Uploader {
 public:
  static constexpr size_t kChunk = size_t(64) << 20;
  Uploader(cudaStream_t s, size_t total, bool progress) : s_(s), total_(total), progress_(progress) {
    for (int i = 0; i < 2; ++i) {
      KCUDA(cudaMallocHost(&buf_[i], kChunk));
      KCUDA(cudaEventCreateWithFlags(&ev_[i], cudaEventDisableTiming));
    }
    t0_ = std::chrono::steady_clock::now();
  }
  ~Uploader() {
    cudaStreamSynchronize(s_);
    for (int i = 0; i < 2; ++i) {
      cudaFreeHost(buf_[i]);
      cudaEventDestroy(ev_[i]);
    }
  }
  void copy(void* dst, const void* src, size_t bytes) {
    const auto* s = static_cast<const uint8_t*>(src);
    auto* d = static_cast<uint8_t*>(dst);
    while (bytes > 0) {
      const size_t n = std::min(bytes, kChunk);
      if (used_[cur_]) KCUDA(cudaEventSynchronize(ev_[cur_]));
      std::memcpy(buf_[cur_], s, n);
      KCUDA(cudaMemcpyAsync(d, buf_[cur_], n, cudaMemcpyHostToDevice, s_));
      KCUDA(cudaEventRecord(ev_[cur_], s_));
      used_[cur_] = true;
      cur_ ^= 1;
      s += n;
      d += n;
      bytes -= n;
      done_ += n;
      if (progress_ && (done_ - last_ >= (size_t(1) << 30) || done_ == total_)) {
        last_ = done_;
        std::fprintf(stderr, "\rloading weights to the GPU: %.1f / %.1f GB", double(done_) / 1e9,
                     double(total_) / 1e9);
        std::fflush(stderr);
      }
    }
  }
  double finish() {
    KCUDA(cudaStreamSynchronize(s_));
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
    if (progress_)
      std::fprintf(stderr, "\rloading weights to the GPU: %.2f GB in %.1f s (%.2f GB/s)\n",
                   double(done_) / 1e9, t, double(done_) / 1e9 / std::max(t, 1e-9));
    return t;
  }

 private:
  cudaStream_t s_;
  void* buf_[2] = {nullptr, nullptr};
  cudaEvent_t ev_[2] = {nullptr, nullptr};
  bool used_[2] = {false, false};
  int cur_ = 0;
  size_t total_ = 0, done_ = 0, last_ = 0;
  bool progress_;
  std::chrono::steady_clock::time_point t0_;
};

DFmt to_dfmt(WFormat f, const char* what) {
  switch (f) {
    case WFormat::BF16: return DFmt::BF16;
    case WFormat::Q4: return DFmt::Q4;
    case WFormat::Q8: return DFmt::Q8;
    default:
      KESTREL_FAIL("CUDA backend: matrix {} is {}; the kernels read BF16, Q4 and Q8 matrices", what,
                   wformat_name(f));
  }
}

size_t mat_bytes(const Mat& m) { return m.nbytes(); }

void validate_widths(const ModelConfig& c) {
  using namespace shapes;
  KESTREL_CHECK(c.hidden_size == kHidden && c.head_dim == kHeadDim &&
                    c.num_attention_heads == kNumHeads && c.num_kv_heads == kNumKvHeads &&
                    c.rotary_dim == kRotaryDim && c.linear_key_head_dim == kGdnHeadDim &&
                    c.linear_value_head_dim == kGdnHeadDim && c.linear_num_key_heads == kGdnKeyHeads &&
                    c.linear_num_value_heads == kGdnValueHeads &&
                    c.linear_conv_kernel_dim == kConvKernel &&
                    c.moe_intermediate_size == kExpertWidth &&
                    c.shared_expert_intermediate_size == kSharedWidth,
                "the CUDA kernels are specialised for the real model's per-layer widths (hidden {}, "
                "heads {}/{} x {}, rotary {}, GDN {}/{} x {}, conv {}, experts {} wide, shared {}); this "
                "config has hidden {}, heads {}/{} x {}, rotary {}, GDN {}/{} x {}, conv {}, experts "
                "{}, shared {} (use --device cpu)",
                kHidden, kNumHeads, kNumKvHeads, kHeadDim, kRotaryDim, kGdnKeyHeads, kGdnValueHeads,
                kGdnHeadDim, kConvKernel, kExpertWidth, kSharedWidth, c.hidden_size,
                c.num_attention_heads, c.num_kv_heads, c.head_dim, c.rotary_dim,
                c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                c.linear_conv_kernel_dim, c.moe_intermediate_size, c.shared_expert_intermediate_size);
  KESTREL_CHECK(c.num_experts >= 1 && c.num_experts <= 512 && c.num_experts_per_tok >= 1 &&
                    c.num_experts_per_tok <= 16 && c.num_experts_per_tok <= c.num_experts,
                "CUDA backend: {} experts, top-{} (supported: <= 512 experts, top-k <= 16)",
                c.num_experts, c.num_experts_per_tok);
}

// Uploads `parts` (row blocks of one logical matrix, same format/cols) into one device matrix.
DMat upload_stacked(DModel& m, Uploader& up, const std::vector<const Mat*>& parts, const char* what) {
  KESTREL_CHECK(!parts.empty() && parts[0]->valid(), "CUDA backend: matrix {} missing", what);
  const Mat& p0 = *parts[0];
  DMat d;
  d.fmt = to_dfmt(p0.fmt, what);
  d.cols = p0.cols;
  d.group = p0.group;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Mat* p = parts[i];
    KESTREL_CHECK(p->valid() && p->fmt == p0.fmt && p->cols == p0.cols && p->group == p0.group,
                  "CUDA backend: {} is stored as one matrix, but its part {} differs from part 0 "
                  "in format, width or group size ({} x {} group {} against {} x {} group {})",
                  what, i, p->rows, p->cols, p->group, p0.rows, p0.cols, p0.group);
    d.rows += p->rows;
  }
  if (d.fmt != DFmt::BF16)
    KESTREL_CHECK(d.group == 64 && d.cols % 64 == 0, "CUDA backend: {} has group {} (64 needed)", what,
                  d.group);
  const size_t rb = d.row_bytes();
  auto* data = m.arena.alloc_n<uint8_t>(rb * size_t(d.rows));
  uint16_t* sc = nullptr;
  uint16_t* bi = nullptr;
  const size_t gpr = d.fmt == DFmt::BF16 ? 0 : size_t(d.cols / 64);
  if (gpr) {
    sc = m.arena.alloc_n<uint16_t>(gpr * size_t(d.rows));
    bi = m.arena.alloc_n<uint16_t>(gpr * size_t(d.rows));
  }
  int64_t r0 = 0;
  for (const Mat* p : parts) {
    up.copy(data + rb * size_t(r0), p->data, rb * size_t(p->rows));
    if (gpr) {
      up.copy(sc + gpr * size_t(r0), p->scales, 2 * gpr * size_t(p->rows));
      up.copy(bi + gpr * size_t(r0), p->biases, 2 * gpr * size_t(p->rows));
    }
    r0 += p->rows;
  }
  d.data = data;
  d.scales = sc;
  d.biases = bi;
  m.weight_bytes += d.nbytes();
  return d;
}
DMat upload(DModel& m, Uploader& up, const Mat& w, const char* what) {
  return upload_stacked(m, up, {&w}, what);
}
float* upload_vec(DModel& m, const std::vector<float>& v, size_t expect, const char* what) {
  KESTREL_CHECK(v.size() == expect, "CUDA backend: vector {} has {} values, expected {}", what, v.size(),
                expect);
  float* d = m.arena.alloc_n<float>(v.size());
  KCUDA(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
  return d;
}

std::unique_ptr<DModel> upload_model(const ModelWeights& w, cudaStream_t s) {
  const ModelConfig& c = w.config;
  validate_widths(c);
  auto m = std::make_unique<DModel>();
  m->cfg = c;
  size_t total = mat_bytes(w.embed) + mat_bytes(w.lm_head);
  for (const auto& l : w.layers) {
    if (l.kind == LayerKind::LinearAttention)
      total += mat_bytes(l.gdn.in_proj_qkv) + mat_bytes(l.gdn.in_proj_z) + mat_bytes(l.gdn.in_proj_b) +
               mat_bytes(l.gdn.in_proj_a) + mat_bytes(l.gdn.out_proj);
    else
      total += mat_bytes(l.attn.q_proj) + mat_bytes(l.attn.k_proj) + mat_bytes(l.attn.v_proj) +
               mat_bytes(l.attn.o_proj);
    total += mat_bytes(l.moe.router) + mat_bytes(l.moe.shared_gate) + mat_bytes(l.moe.shared_up) +
             mat_bytes(l.moe.shared_down) + mat_bytes(l.moe.shared_expert_gate);
    for (size_t e = 0; e < l.moe.gate.size(); ++e)
      total += mat_bytes(l.moe.gate[e]) + mat_bytes(l.moe.up[e]) + mat_bytes(l.moe.down[e]);
  }
  Uploader up(s, total, true);
  m->embed = upload(*m, up, w.embed, "embed_tokens");
  m->lm_head = upload(*m, up, w.lm_head, "lm_head");
  m->final_norm = upload_vec(*m, w.final_norm, size_t(c.hidden_size), "norm");
  const size_t H = size_t(c.hidden_size);
  for (int li = 0; li < c.num_layers; ++li) {
    const LayerWeights& l = w.layers[size_t(li)];
    DLayer d;
    d.kind = l.kind;
    d.input_norm = upload_vec(*m, l.input_norm, H, "input_layernorm");
    d.post_norm = upload_vec(*m, l.post_norm, H, "post_attention_layernorm");
    if (l.kind == LayerKind::LinearAttention) {
      // One matrix (the prompt's one GEMM; the checkpoints store the four in one format).
      d.in_proj = upload_stacked(*m, up, {&l.gdn.in_proj_qkv, &l.gdn.in_proj_z, &l.gdn.in_proj_b,
                                          &l.gdn.in_proj_a},
                                 "linear_attn.in_proj_qkv|z|b|a");
      split_gdn_in_proj(d, c);
      d.out = upload(*m, up, l.gdn.out_proj, "out_proj");
      d.conv_w = upload_vec(*m, l.gdn.conv1d, size_t(c.gdn_conv_dim()) * 4, "conv1d");
      d.A_log = upload_vec(*m, l.gdn.A_log, size_t(c.linear_num_value_heads), "A_log");
      d.dt_bias = upload_vec(*m, l.gdn.dt_bias, size_t(c.linear_num_value_heads), "dt_bias");
      d.gnorm = upload_vec(*m, l.gdn.norm, size_t(c.linear_value_head_dim), "linear_attn.norm");
    } else {
      d.attn_in = upload_stacked(*m, up, {&l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj},
                                 "self_attn.q_proj|k_proj|v_proj");
      split_attn_in(d, c);
      d.o = upload(*m, up, l.attn.o_proj, "o_proj");
      d.q_norm = upload_vec(*m, l.attn.q_norm, size_t(c.head_dim), "q_norm");
      d.k_norm = upload_vec(*m, l.attn.k_norm, size_t(c.head_dim), "k_norm");
    }
    const auto& mo = l.moe;
    KESTREL_CHECK(int(mo.gate.size()) == c.num_experts && mo.up.size() == mo.gate.size() &&
                      mo.down.size() == mo.gate.size(),
                  "CUDA backend: layer {} has {} experts, config says {}", li, mo.gate.size(),
                  c.num_experts);
    std::vector<const Mat*> g, u, dn;
    for (size_t e = 0; e < mo.gate.size(); ++e) {
      g.push_back(&mo.gate[e]);
      u.push_back(&mo.up[e]);
      dn.push_back(&mo.down[e]);
    }
    d.router = upload(*m, up, mo.router, "mlp.gate");
    d.gate = upload_stacked(*m, up, g, "experts.gate");
    d.up = upload_stacked(*m, up, u, "experts.up");
    d.down = upload_stacked(*m, up, dn, "experts.down");
    d.sh_gate = upload(*m, up, mo.shared_gate, "shared_expert.gate_proj");
    d.sh_up = upload(*m, up, mo.shared_up, "shared_expert.up_proj");
    d.sh_down = upload(*m, up, mo.shared_down, "shared_expert.down_proj");
    d.sh_egate = upload(*m, up, mo.shared_expert_gate, "shared_expert_gate");
    m->layers.push_back(d);
  }
  m->load_s = up.finish();
  return m;
}

// ---------------------------------------------------------------- synthetic model
struct Synth {
  DModel& m;
  cudaStream_t s;
  uint64_t seed;
  uint64_t n = 0;
  DMat mat(int64_t rows, int64_t cols, DFmt f) {
    DMat d;
    d.fmt = f;
    d.rows = rows;
    d.cols = cols;
    const uint64_t sd = seed * 1000003ull + (++n);
    const size_t rb = d.row_bytes();
    auto* data = m.arena.alloc_n<uint8_t>(rb * size_t(rows));
    if (f == DFmt::BF16) {
      const float a = 0.02f * std::sqrt(3.f);  // uniform with std 0.02
      fill_uniform_bf16(reinterpret_cast<uint16_t*>(data), size_t(rows * cols), sd, -a, a, s);
    } else {
      fill_random_u32(reinterpret_cast<uint32_t*>(data), rb * size_t(rows) / 4, sd, s);
      const size_t ng = size_t(rows) * size_t(cols / 64);
      auto* sc = m.arena.alloc_n<uint16_t>(ng);
      auto* bi = m.arena.alloc_n<uint16_t>(ng);
      // Codes uniform over [0, 2^b): std (2^b)/sqrt(12); scale so the weights have std ~0.02 and
      // mean ~0 (bias ~ -scale * (2^b - 1) / 2).
      const float levels = f == DFmt::Q4 ? 16.f : 256.f;
      const float s0 = 0.02f / (levels / std::sqrt(12.f));
      fill_uniform_bf16(sc, ng, sd + 1, 0.8f * s0, 1.2f * s0, s);
      const float b0 = -s0 * (levels - 1.f) / 2.f;
      fill_uniform_bf16(bi, ng, sd + 2, 1.1f * b0, 0.9f * b0, s);
      d.scales = sc;
      d.biases = bi;
    }
    d.data = data;
    m.weight_bytes += d.nbytes();
    return d;
  }
  float* vec(size_t len, float lo, float hi) {
    float* p = m.arena.alloc_n<float>(len);
    fill_uniform_f32(p, len, seed * 1000003ull + (++n), lo, hi, s);
    return p;
  }
};

std::unique_ptr<DModel> synth_model(const ModelConfig& c, const std::string& kind, uint64_t seed,
                                    cudaStream_t s) {
  validate_widths(c);
  KESTREL_CHECK(kind == "q4" || kind == "bf16", "synthetic model kind '{}' (expected q4 or bf16)", kind);
  const DFmt F = kind == "q4" ? DFmt::Q4 : DFmt::BF16;
  const DFmt F8 = kind == "q4" ? DFmt::Q8 : DFmt::BF16;  // router, shared-expert gate
  auto m = std::make_unique<DModel>();
  m->cfg = c;
  Synth g{*m, s, seed};
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size,
                Is = c.shared_expert_intermediate_size;
  m->embed = g.mat(c.vocab_size, H, F);
  m->lm_head = g.mat(c.vocab_size, H, F);
  m->final_norm = g.vec(size_t(H), 0.9f, 1.1f);
  for (int li = 0; li < c.num_layers; ++li) {
    DLayer d;
    d.kind = c.layer_types[size_t(li)];
    d.input_norm = g.vec(size_t(H), 0.9f, 1.1f);
    d.post_norm = g.vec(size_t(H), 0.9f, 1.1f);
    if (d.kind == LayerKind::LinearAttention) {
      const int64_t Hv = c.linear_num_value_heads, VD = c.gdn_value_dim();
      d.in_proj = g.mat(c.gdn_conv_dim() + VD + 2 * Hv, H, F);
      split_gdn_in_proj(d, c);
      d.out = g.mat(H, VD, F);
      d.conv_w = g.vec(size_t(c.gdn_conv_dim()) * 4, -0.5f, 0.5f);
      d.A_log = g.vec(size_t(Hv), 0.f, 2.7f);
      d.dt_bias = g.vec(size_t(Hv), -1.f, 1.f);
      d.gnorm = g.vec(size_t(c.linear_value_head_dim), 0.9f, 1.1f);
    } else {
      const int64_t nh = c.num_attention_heads, kv = c.num_kv_heads, D = c.head_dim;
      d.attn_in = g.mat((nh * 2 + 2 * kv) * D, H, F);
      split_attn_in(d, c);
      d.o = g.mat(H, nh * D, F);
      d.q_norm = g.vec(size_t(D), 0.9f, 1.1f);
      d.k_norm = g.vec(size_t(D), 0.9f, 1.1f);
    }
    d.router = g.mat(E, H, F8);
    d.gate = g.mat(E * I, H, F);
    d.up = g.mat(E * I, H, F);
    d.down = g.mat(E * H, I, F);
    d.sh_gate = g.mat(Is, H, F);
    d.sh_up = g.mat(Is, H, F);
    d.sh_down = g.mat(H, Is, F);
    d.sh_egate = g.mat(1, H, F8);
    m->layers.push_back(d);
  }
  KCUDA(cudaStreamSynchronize(s));
  return m;
}

// ---------------------------------------------------------------- the backend
class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(std::unique_ptr<DModel> m, cudaStream_t s) : m_(std::move(m)), s_(s) {
    kernels_init();
    alloc_scratch();
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(s_);
    for (auto& [id, sq] : seqs_) destroy_graph(sq);
    cudaStreamDestroy(s_);
  }
  const ModelConfig& config() const override { return m_->cfg; }
  std::string name() const override { return "cuda"; }

  SeqId create_sequence(int64_t max_tokens) override {
    const auto& c = m_->cfg;
    KESTREL_CHECK(max_tokens > 0 && max_tokens <= c.max_position_embeddings,
                  "sequence capacity {} is outside 1..{} (max_position_embeddings)", max_tokens,
                  c.max_position_embeddings);
    DSeq sq;
    sq.capacity = max_tokens;
    auto& A = sq.arena;
    sq.d_pos = A.alloc_n<int>(1);
    sq.d_len = A.alloc_n<int>(1);
    sq.d_token = A.alloc_n<int32_t>(1);
    sq.d_history = A.alloc_n<int32_t>(size_t(max_tokens));
    KCUDA(cudaMemsetAsync(sq.d_pos, 0, 4, s_));
    KCUDA(cudaMemsetAsync(sq.d_len, 0, 4, s_));
    const size_t conv = size_t(c.gdn_conv_dim()) * 3;
    const size_t rec = size_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim;
    const size_t kv = size_t(max_tokens) * c.num_kv_heads * c.head_dim;
    for (int l = 0; l < c.num_layers; ++l) {
      if (c.is_full(l)) {
        sq.kc.push_back(A.alloc_n<uint16_t>(kv));
        sq.vc.push_back(A.alloc_n<uint16_t>(kv));
        sq.conv.push_back(nullptr);
        sq.rec.push_back(nullptr);
      } else {
        float* cv = A.alloc_n<float>(conv);
        float* rc = A.alloc_n<float>(rec);
        KCUDA(cudaMemsetAsync(cv, 0, conv * 4, s_));
        KCUDA(cudaMemsetAsync(rc, 0, rec * 4, s_));
        sq.conv.push_back(cv);
        sq.rec.push_back(rc);
        sq.kc.push_back(nullptr);
        sq.vc.push_back(nullptr);
      }
    }
    sq.nsplit = attn_nsplit(max_tokens);
    KCUDA(cudaStreamSynchronize(s_));
    const SeqId id = next_id_++;
    seqs_.emplace(id, std::move(sq));
    return id;
  }
  void free_sequence(SeqId seq) override {
    auto it = seqs_.find(seq);
    if (it == seqs_.end()) return;
    KCUDA(cudaStreamSynchronize(s_));
    destroy_graph(it->second);
    seqs_.erase(it);
  }
  int64_t sequence_length(SeqId seq) const override { return get(seq).length; }
  int64_t sequence_capacity(SeqId seq) const override { return get(seq).capacity; }

  void step(std::span<const StepRequest> batch, std::span<StepResult> out) override {
    KESTREL_CHECK(batch.size() == out.size(), "step: {} requests, {} results", batch.size(), out.size());
    for (const auto& r : batch) {
      const DSeq& sq = get(r.seq);
      KESTREL_CHECK(!r.tokens.empty(), "step: sequence {} has no new tokens", r.seq);
      KESTREL_CHECK(sq.length + int64_t(r.tokens.size()) <= sq.capacity,
                    "step: sequence {} would hold {} tokens, capacity {}", r.seq,
                    sq.length + int64_t(r.tokens.size()), sq.capacity);
      for (int32_t t : r.tokens)
        KESTREL_CHECK(t >= 0 && t < m_->cfg.vocab_size, "step: token id {} outside 0..{}", t,
                      m_->cfg.vocab_size - 1);
    }
    const int64_t V = m_->cfg.vocab_size;
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto& r = batch[i];
      DSeq& sq = get(r.seq);
      const int64_t T = int64_t(r.tokens.size());
      StepResult& res = out[i];
      res.n_rows = r.all_logits ? int(T) : 1;
      res.logits.assign(size_t(res.n_rows * V), 0.f);
      if (T > 1) {
        // Prompts: the chunked prefill driver (advances sq and its device counters).
        prefill().run(sq, r.tokens, r.all_logits, res.logits.data(), s_);
        continue;
      }
      ensure_graph(sq, /*greedy=*/false);
      KCUDA(cudaMemcpyAsync(sq.d_token, &r.tokens[0], 4, cudaMemcpyHostToDevice, s_));
      KCUDA(cudaGraphLaunch(sq.graph_plain, s_));
      KCUDA(cudaMemcpyAsync(res.logits.data(), sc_.logits, size_t(V) * 4, cudaMemcpyDeviceToHost, s_));
      // The token copy reads host memory that lives until the stream drains.
      KCUDA(cudaStreamSynchronize(s_));
      sq.length += T;
    }
  }

  // ---- prompt driver (created on the first multi-token step; scratch allocated once then)
  PrefillStep& prefill() {
    if (!prefill_) {
      prefill_ = std::make_unique<PrefillStep>(*m_, prefill_chunk_);
      if (prefill_route_set_) prefill_->set_aprec(prefill_aprec_, prefill_f16_limit_);
      if (prefill_kernel_set_) prefill_->set_gemm_choice(prefill_kernel_);
    }
    return *prefill_;
  }
  void set_prefill_gemm_choice(PrefillGemmChoice k) {
    KCUDA(cudaStreamSynchronize(s_));
    prefill().set_gemm_choice(k);
    prefill_kernel_set_ = true;
    prefill_kernel_ = k;
  }
  void set_prefill_route(PrefillAPrec p, float f16_limit) {
    KCUDA(cudaStreamSynchronize(s_));
    prefill().set_aprec(p, f16_limit);  // validates
    prefill_route_set_ = true;
    prefill_aprec_ = p;
    prefill_f16_limit_ = f16_limit;
  }
  int64_t prefill_redos() const { return prefill_ ? prefill_->range_redos() : 0; }
  void set_prefill_chunk(int64_t n) {
    KESTREL_CHECK(n >= 1 && n <= kPrefillMaxChunk, "prefill chunk {} outside 1..{}", n, kPrefillMaxChunk);
    KCUDA(cudaStreamSynchronize(s_));
    prefill_.reset();
    prefill_chunk_ = n;
  }
  size_t prefill_bytes() const { return prefill_ ? prefill_->scratch_bytes() : 0; }
  void poison_prefill() { prefill().poison(s_); }

  // ---- greedy fast path
  std::vector<int32_t> greedy(SeqId id, int32_t first, int max_new,
                              const std::function<bool(int32_t)>& on_token, int32_t vocab_limit) {
    DSeq& sq = get(id);
    KESTREL_CHECK(vocab_limit >= 0 && vocab_limit <= m_->cfg.vocab_size, "greedy: vocab limit {} of {}",
                  vocab_limit, m_->cfg.vocab_size);
    if (vocab_limit != sq.vocab_limit && sq.graph) {  // the limit is part of the captured graph
      cudaGraphExecDestroy(sq.graph);
      sq.graph = nullptr;
    }
    sq.vocab_limit = vocab_limit;
    KESTREL_CHECK(first >= 0 && first < m_->cfg.vocab_size, "greedy: token {} outside vocabulary", first);
    KESTREL_CHECK(max_new >= 0 && sq.length + max_new <= sq.capacity,
                  "greedy: {} new tokens exceed the capacity of sequence {} ({} of {} used)", max_new,
                  id, sq.length, sq.capacity);
    std::vector<int32_t> outv;
    if (max_new == 0) return outv;
    ensure_graph(sq, /*greedy=*/true);
    const unsigned long long key0 = pack_argmax_host(0.f, uint32_t(first));
    *host_key_ = key0;
    KCUDA(cudaMemcpyAsync(sc_.argmax, host_key_, 8, cudaMemcpyHostToDevice, s_));
    constexpr int kRing = 4;
    bool stopped = false;
    int launched = 0;
    auto read = [&](int i) {
      KCUDA(cudaEventSynchronize(ring_ev_[i % kRing]));
      const int32_t t = unpack_argmax_host(ring_[i % kRing]);
      outv.push_back(t);
      if (on_token && !on_token(t)) stopped = true;
    };
    for (int i = 0; i < max_new && !stopped; ++i) {
      KCUDA(cudaGraphLaunch(sq.graph, s_));
      ++launched;
      KCUDA(cudaMemcpyAsync(&ring_[i % kRing], sc_.argmax, 8, cudaMemcpyDeviceToHost, s_));
      KCUDA(cudaEventRecord(ring_ev_[i % kRing], s_));
      if (i >= 1) read(i - 1);
    }
    if (!stopped) read(launched - 1);
    KCUDA(cudaStreamSynchronize(s_));
    sq.length += launched;
    return outv;
  }

  std::vector<double> time_steps(SeqId id, int32_t first, int warmup, int steps) {
    DSeq& sq = get(id);
    KESTREL_CHECK(sq.length + warmup + steps <= sq.capacity, "bench: capacity {} < {} + {} + {}",
                  sq.capacity, sq.length, warmup, steps);
    ensure_graph(sq, /*greedy=*/true);
    *host_key_ = pack_argmax_host(0.f, uint32_t(first));
    KCUDA(cudaMemcpyAsync(sc_.argmax, host_key_, 8, cudaMemcpyHostToDevice, s_));
    for (int i = 0; i < warmup; ++i) KCUDA(cudaGraphLaunch(sq.graph, s_));
    std::vector<cudaEvent_t> ev(static_cast<size_t>(steps) + 1);
    for (auto& e : ev) KCUDA(cudaEventCreate(&e));
    KCUDA(cudaEventRecord(ev[0], s_));
    for (int i = 0; i < steps; ++i) {
      KCUDA(cudaGraphLaunch(sq.graph, s_));
      KCUDA(cudaEventRecord(ev[size_t(i) + 1], s_));
    }
    KCUDA(cudaStreamSynchronize(s_));
    std::vector<double> t(static_cast<size_t>(steps));
    for (int i = 0; i < steps; ++i) {
      float ms = 0;
      KCUDA(cudaEventElapsedTime(&ms, ev[size_t(i)], ev[size_t(i) + 1]));
      t[size_t(i)] = double(ms) * 1e-3;
    }
    for (auto& e : ev) cudaEventDestroy(e);
    sq.length += warmup + steps;
    return t;
  }

  void synthetic_context(SeqId id, int64_t context, uint64_t seed) {
    DSeq& sq = get(id);
    KESTREL_CHECK(context >= 0 && context < sq.capacity, "synthetic context {} >= capacity {}", context,
                  sq.capacity);
    const auto& c = m_->cfg;
    const size_t kv = size_t(context) * c.num_kv_heads * c.head_dim;
    uint64_t n = 0;
    for (int l = 0; l < c.num_layers; ++l) {
      if (c.is_full(l)) {
        fill_uniform_bf16(sq.kc[size_t(l)], kv, seed + (++n), -1.f, 1.f, s_);
        fill_uniform_bf16(sq.vc[size_t(l)], kv, seed + (++n), -1.f, 1.f, s_);
      } else {
        fill_uniform_f32(sq.conv[size_t(l)], size_t(c.gdn_conv_dim()) * 3, seed + (++n), -1.f, 1.f, s_);
        fill_uniform_f32(sq.rec[size_t(l)],
                         size_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim,
                         seed + (++n), -0.05f, 0.05f, s_);
      }
    }
    const int len = int(context);
    KCUDA(cudaMemcpyAsync(sq.d_len, &len, 4, cudaMemcpyHostToDevice, s_));
    KCUDA(cudaStreamSynchronize(s_));
    sq.length = context;
  }

  double step_bytes(int64_t context) const {
    const auto& c = m_->cfg;
    double b = 0;
    const double per_expert_frac = double(c.num_experts_per_tok) / double(c.num_experts);
    for (const DLayer& d : m_->layers) {
      if (d.kind == LayerKind::LinearAttention) {
        b += double(d.qkv.nbytes() + d.z.nbytes() + d.b.nbytes() + d.a.nbytes() + d.out.nbytes());
        b += 2.0 * 4 * c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
        b += 2.0 * 4 * c.gdn_conv_dim() * 3;
      } else {
        b += double(d.q.nbytes() + d.k.nbytes() + d.v.nbytes() + d.o.nbytes());
        b += 2.0 * 2 * double(context + 1) * c.num_kv_heads * c.head_dim;
      }
      b += double(d.router.nbytes() + d.sh_gate.nbytes() + d.sh_up.nbytes() + d.sh_down.nbytes() +
                  d.sh_egate.nbytes());
      b += per_expert_frac * double(d.gate.nbytes() + d.up.nbytes() + d.down.nbytes());
    }
    b += double(m_->lm_head.nbytes());
    b += double(m_->embed.nbytes()) / double(c.vocab_size);
    return b;
  }

  const DModel& model() const { return *m_; }

 private:
  struct Scratch {
    float *x, *u, *z, *b, *a, *o, *qg, *k, *v, *attn, *partial, *rl, *sgate, *sg, *su, *hn, *tw, *act,
        *logits;
    int* ti;
    unsigned* route_counter;  // RouteTail's completion counter (zero between launches)
    unsigned* moe_counters;   // moe_experts' [2] counters (zero between launches)
    unsigned* sel_flag;       // moe_gate_up -> moe_down selection flag (SelRead::Flag; [2], zero between launches)
    unsigned long long* argmax;
  };

  DSeq& get(SeqId id) {
    auto it = seqs_.find(id);
    KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", id);
    return it->second;
  }
  const DSeq& get(SeqId id) const {
    auto it = seqs_.find(id);
    KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", id);
    return it->second;
  }
  void destroy_graph(DSeq& sq) {
    if (sq.graph) cudaGraphExecDestroy(sq.graph);
    if (sq.graph_plain) cudaGraphExecDestroy(sq.graph_plain);
    sq.graph = sq.graph_plain = nullptr;
  }
  // One graph per sequence and mode: greedy (token from the on-device argmax, fused argmax at the
  // end) or plain (token from d_token, logits left in scratch for the host).
  void ensure_graph(DSeq& sq, bool greedy) {
    cudaGraphExec_t& ex = greedy ? sq.graph : sq.graph_plain;
    if (ex) return;
    KCUDA(cudaStreamBeginCapture(s_, cudaStreamCaptureModeThreadLocal));
    try {
      enqueue_step(sq, greedy);
    } catch (...) {
      cudaGraph_t g = nullptr;
      cudaStreamEndCapture(s_, &g);
      if (g) cudaGraphDestroy(g);
      throw;
    }
    cudaGraph_t g = nullptr;
    KCUDA(cudaStreamEndCapture(s_, &g));
    const cudaError_t e = cudaGraphInstantiate(&ex, g, 0);
    cudaGraphDestroy(g);
    KCUDA(e);
  }

  void alloc_scratch() {
    const auto& c = m_->cfg;
    auto& A = m_->arena;
    sc_.x = A.alloc_n<float>(size_t(c.hidden_size));
    sc_.u = A.alloc_n<float>(size_t(c.gdn_conv_dim()));
    sc_.z = A.alloc_n<float>(size_t(c.gdn_value_dim()));
    sc_.b = A.alloc_n<float>(size_t(c.linear_num_value_heads));
    sc_.a = A.alloc_n<float>(size_t(c.linear_num_value_heads));
    sc_.o = A.alloc_n<float>(size_t(c.gdn_value_dim()));
    sc_.qg = A.alloc_n<float>(size_t(c.num_attention_heads) * 2 * c.head_dim);
    sc_.k = A.alloc_n<float>(size_t(c.num_kv_heads) * c.head_dim);
    sc_.v = A.alloc_n<float>(size_t(c.num_kv_heads) * c.head_dim);
    sc_.attn = A.alloc_n<float>(size_t(c.num_attention_heads) * c.head_dim);
    sc_.partial = A.alloc_n<float>(size_t(c.num_attention_heads) * kAttnMaxSplits * (c.head_dim + 2));
    sc_.rl = A.alloc_n<float>(size_t(c.num_experts));
    sc_.sgate = A.alloc_n<float>(1);
    sc_.sg = A.alloc_n<float>(size_t(c.shared_expert_intermediate_size));
    sc_.su = A.alloc_n<float>(size_t(c.shared_expert_intermediate_size));
    sc_.hn = A.alloc_n<float>(size_t(c.hidden_size));
    sc_.tw = A.alloc_n<float>(16);
    sc_.ti = A.alloc_n<int>(16);
    sc_.route_counter = A.alloc_n<unsigned>(1);
    KCUDA(cudaMemset(sc_.route_counter, 0, sizeof(unsigned)));
    sc_.moe_counters = A.alloc_n<unsigned>(2);
    KCUDA(cudaMemset(sc_.moe_counters, 0, 2 * sizeof(unsigned)));
    sc_.sel_flag = A.alloc_n<unsigned>(2);
    KCUDA(cudaMemset(sc_.sel_flag, 0, 2 * sizeof(unsigned)));
    sc_.act = A.alloc_n<float>(size_t(c.num_experts_per_tok) * c.moe_intermediate_size);
    sc_.logits = A.alloc_n<float>(size_t(c.vocab_size));
    sc_.argmax = A.alloc_n<unsigned long long>(1);
    KCUDA(cudaMallocHost(&host_key_, 8));
    KCUDA(cudaMallocHost(&ring_, 8 * 4));
    for (auto& e : ring_ev_) KCUDA(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  }

  // A single-row GEMV over the residual stream x with the RMSNorm (weight norm_w) fused in front:
  // the shape every layer's input projections, the MoE router/shared expert and lm_head share.
  GemvArgs normed_gemv(const float* norm_w) const {
    GemvArgs g;
    g.M = 1;
    g.K = m_->cfg.hidden_size;
    g.x = sc_.x;
    g.ldx = g.K;
    g.pro = Prologue::RmsNorm;
    g.norm_w = norm_w;
    g.eps = m_->cfg.rms_norm_eps;
    return g;
  }

  void enqueue_step(DSeq& sq, bool greedy) {
    const auto& c = m_->cfg;
    StepBeginArgs sb;
    sb.argmax = greedy ? sc_.argmax : nullptr;
    sb.token = sq.d_token;
    sb.pos = sq.d_pos;
    sb.len = sq.d_len;
    sb.history = sq.d_history;
    sb.embed = m_->embed;
    sb.x = sc_.x;
    step_begin(sb, s_);
    for (int l = 0; l < c.num_layers; ++l) {
      const DLayer& d = m_->layers[size_t(l)];
      if (d.kind == LayerKind::LinearAttention)
        gdn_branch(d, sq, l);
      else
        attn_branch(d, sq, l);
      moe_branch(d);
    }
    GemvArgs g = normed_gemv(m_->final_norm);
    g.seg[0] = GemvSeg{m_->lm_head, Epilogue::Logits, sc_.logits, c.vocab_size, nullptr, nullptr,
                       greedy ? sc_.argmax : nullptr, greedy ? sq.vocab_limit : 0};
    g.nseg = 1;
    gemv(g, s_);
  }

  void gdn_branch(const DLayer& d, DSeq& sq, int l) {
    const auto& c = m_->cfg;
    const int64_t H = c.hidden_size;
    GemvArgs g = normed_gemv(d.input_norm);
    g.seg[0] = GemvSeg{d.qkv, Epilogue::ConvSilu, sc_.u, d.qkv.rows, sq.conv[size_t(l)], d.conv_w, nullptr};
    g.seg[1] = GemvSeg{d.z, Epilogue::Store, sc_.z, d.z.rows, nullptr, nullptr, nullptr};
    g.seg[2] = GemvSeg{d.b, Epilogue::Store, sc_.b, d.b.rows, nullptr, nullptr, nullptr};
    g.seg[3] = GemvSeg{d.a, Epilogue::Store, sc_.a, d.a.rows, nullptr, nullptr, nullptr};
    g.nseg = 4;
    gemv(g, s_);
    GdnDecodeArgs ga;
    ga.T = 1;
    ga.u = sc_.u;
    ga.ldu = c.gdn_conv_dim();
    ga.b = sc_.b;
    ga.a = sc_.a;
    ga.ldb = ga.lda = c.linear_num_value_heads;
    ga.A_log = d.A_log;
    ga.dt_bias = d.dt_bias;
    ga.state = sq.rec[size_t(l)];
    ga.o = sc_.o;
    ga.Hk = c.linear_num_key_heads;
    ga.Hv = c.linear_num_value_heads;
    ga.dk = c.linear_key_head_dim;
    ga.dv = c.linear_value_head_dim;
    gdn_decode(ga, s_);
    GemvArgs go;
    go.M = 1;
    go.K = c.gdn_value_dim();
    go.x = sc_.o;
    go.ldx = go.K;
    go.pro = Prologue::GatedRmsNorm;
    go.norm_w = d.gnorm;
    go.eps = c.rms_norm_eps;
    go.z = sc_.z;
    go.ldz = go.K;
    go.norm_group = c.linear_value_head_dim;
    go.seg[0] = GemvSeg{d.out, Epilogue::Residual, sc_.x, H, nullptr, nullptr, nullptr};
    go.nseg = 1;
    gemv(go, s_);
  }

  void attn_branch(const DLayer& d, DSeq& sq, int l) {
    const auto& c = m_->cfg;
    const int64_t H = c.hidden_size;
    GemvArgs g = normed_gemv(d.input_norm);
    g.seg[0] = GemvSeg{d.q, Epilogue::Store, sc_.qg, d.q.rows, nullptr, nullptr, nullptr};
    g.seg[1] = GemvSeg{d.k, Epilogue::Store, sc_.k, d.k.rows, nullptr, nullptr, nullptr};
    g.seg[2] = GemvSeg{d.v, Epilogue::Store, sc_.v, d.v.rows, nullptr, nullptr, nullptr};
    g.nseg = 3;
    gemv(g, s_);
    AttnDecodeArgs a;
    a.qg = sc_.qg;
    a.k = sc_.k;
    a.v = sc_.v;
    a.q_norm = d.q_norm;
    a.k_norm = d.k_norm;
    a.eps = c.rms_norm_eps;
    a.pos = sq.d_pos;
    a.capacity = sq.capacity;
    a.kcache = sq.kc[size_t(l)];
    a.vcache = sq.vc[size_t(l)];
    a.rope_theta = c.rope_theta;
    a.heads = c.num_attention_heads;
    a.kv_heads = c.num_kv_heads;
    a.head_dim = c.head_dim;
    a.rotary_dim = c.rotary_dim;
    a.nsplit = sq.nsplit;
    a.partial = sc_.partial;
    a.out = sc_.attn;
    attn_decode(a, s_);
    GemvArgs go;
    go.M = 1;
    go.K = int64_t(c.num_attention_heads) * c.head_dim;
    go.x = sc_.attn;
    go.ldx = go.K;
    go.pro = Prologue::None;
    go.seg[0] = GemvSeg{d.o, Epilogue::Residual, sc_.x, H, nullptr, nullptr, nullptr};
    go.nseg = 1;
    gemv(go, s_);
  }

  void moe_branch(const DLayer& d) {
    const auto& c = m_->cfg;
    const int64_t H = c.hidden_size;
    GemvArgs g = normed_gemv(d.post_norm);
    g.x_out = sc_.hn;
    g.seg[0] = GemvSeg{d.router, Epilogue::Store, sc_.rl, d.router.rows, nullptr, nullptr, nullptr};
    g.seg[1] = GemvSeg{d.sh_egate, Epilogue::Store, sc_.sgate, 1, nullptr, nullptr, nullptr};
    g.seg[2] = GemvSeg{d.sh_gate, Epilogue::Store, sc_.sg, d.sh_gate.rows, nullptr, nullptr, nullptr};
    g.seg[3] = GemvSeg{d.sh_up, Epilogue::Store, sc_.su, d.sh_up.rows, nullptr, nullptr, nullptr};
    g.nseg = 4;
    // Routing route and algorithm: read when the step is recorded.
    const RoutePlace place = resolve_route_place(moe_route_place(), d.gate.fmt);
    const RouteAlgo algo = moe_route_algo();
    const bool fused = moe_fused_enabled();
    KESTREL_CHECK(!(fused && place == RoutePlace::GateUp),
                  "KESTREL_MOE_FUSED=1 needs the routing before the experts (KESTREL_MOE_ROUTING=0 or 1)");
    if (place == RoutePlace::Tail)
      g.route = RouteTail{sc_.rl, c.num_experts, c.num_experts_per_tok, sc_.ti, sc_.tw, sc_.route_counter, algo};
    gemv(g, s_);
    if (place == RoutePlace::Kernel)
      decode_route(DecodeRouteArgs{sc_.rl, c.num_experts, c.num_experts_per_tok, sc_.ti, sc_.tw, algo}, s_);
    MoeGateUpArgs gu;
    gu.E = c.num_experts;
    gu.topk = c.num_experts_per_tok;
    gu.h = sc_.hn;
    gu.hidden = H;
    gu.I = c.moe_intermediate_size;
    gu.gate = d.gate;
    gu.up = d.up;
    gu.topk_idx = sc_.ti;
    gu.act = sc_.act;
    if (place == RoutePlace::GateUp) {
      gu.logits = sc_.rl;
      gu.algo = algo;
      gu.route_idx = sc_.ti;
      gu.route_w = sc_.tw;
    }
    MoeDownArgs dn;
    dn.topk = c.num_experts_per_tok;
    dn.hidden = H;
    dn.I = c.moe_intermediate_size;
    dn.Is = c.shared_expert_intermediate_size;
    dn.topk_idx = sc_.ti;
    dn.topk_w = sc_.tw;
    dn.act = sc_.act;
    dn.sg = sc_.sg;
    dn.su = sc_.su;
    dn.sgate = sc_.sgate;
    dn.down = d.down;
    dn.shared_down = d.sh_down;
    dn.x = sc_.x;
    // The down kernel's early selection read (kernels.h, moe_down_early).
    const int early = moe_down_early();
    if (!fused && early >= 1 && moe_down_takes_mma(dn)) {
      if (place == RoutePlace::GateUp) {
        dn.sel = SelRead::Flag;
        dn.sel_ready = gu.sel_ready = sc_.sel_flag;
      } else {
        dn.sel = SelRead::Early;  // the tail or the routing kernel wrote it, two launches back
      }
      gu.trigger_early = early >= 2;
    }
    if (fused) {
      moe_experts(MoeExpertsArgs{gu, dn, sc_.moe_counters}, s_);
    } else {
      moe_gate_up(gu, s_);
      moe_down(dn, s_);
    }
  }

  std::unique_ptr<DModel> m_;
  cudaStream_t s_;
  Scratch sc_{};
  std::map<SeqId, DSeq> seqs_;
  SeqId next_id_ = 1;
  unsigned long long* host_key_ = nullptr;  // pinned
  unsigned long long* ring_ = nullptr;      // pinned [4]
  cudaEvent_t ring_ev_[4] = {};
  int64_t prefill_chunk_ = kPrefillMaxChunk;
  bool prefill_route_set_ = false;  // set_prefill_aprec called: overrides KESTREL_PREFILL_APREC
  PrefillAPrec prefill_aprec_ = PrefillAPrec::Split;
  float prefill_f16_limit_ = kF16Max;
  bool prefill_kernel_set_ = false;  // set_prefill_gemm_choice called: overrides KESTREL_PREFILL_GEMM
  PrefillGemmChoice prefill_kernel_ = PrefillGemmChoice::Auto;
  std::unique_ptr<PrefillStep> prefill_;  // after m_: destroyed first (it refers to *m_)
};

CudaBackend& as_cuda(Backend& b) {
  auto* c = dynamic_cast<CudaBackend*>(&b);
  KESTREL_CHECK(c != nullptr, "backend '{}' is not the CUDA backend", b.name());
  return *c;
}
const CudaBackend& as_cuda(const Backend& b) {
  auto* c = dynamic_cast<const CudaBackend*>(&b);
  KESTREL_CHECK(c != nullptr, "backend '{}' is not the CUDA backend", b.name());
  return *c;
}

cudaStream_t new_stream() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  KESTREL_CHECK(e == cudaSuccess && n > 0, "--device cuda: no usable CUDA device ({})",
                e == cudaSuccess ? "none found" : cudaGetErrorString(e));
  cudaStream_t s = nullptr;
  KCUDA(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  return s;
}

}  // namespace

bool gpu_available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why) *why = e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device";
    cudaGetLastError();
    return false;
  }
  cudaDeviceProp p{};
  if (cudaGetDeviceProperties(&p, 0) != cudaSuccess || p.major != 9) {
    if (why) *why = fmt::format("device 0 is sm_{}{}; kernels are built for sm_90a", p.major, p.minor);
    return false;
  }
  return true;
}

std::vector<int32_t> greedy_decode(Backend& b, SeqId seq, int32_t first, int max_new,
                                   const std::function<bool(int32_t)>& on_token,
                                   int32_t vocab_limit) {
  return as_cuda(b).greedy(seq, first, max_new, on_token, vocab_limit);
}

std::unique_ptr<Backend> make_synthetic_backend(const ModelConfig& cfg, const std::string& kind,
                                                uint64_t seed) {
  cudaStream_t s = new_stream();
  auto m = synth_model(cfg, kind, seed, s);
  return std::make_unique<CudaBackend>(std::move(m), s);
}

ModelConfig real_model_config() {
  using namespace shapes;
  ModelConfig c;
  c.hidden_size = kHidden;
  c.num_layers = kNumLayers;
  c.vocab_size = kVocab;
  c.full_attention_interval = 4;
  for (int l = 0; l < kNumLayers; ++l)
    c.layer_types.push_back(l % 4 == 3 ? LayerKind::FullAttention : LayerKind::LinearAttention);
  c.rms_norm_eps = 1e-6f;
  c.max_position_embeddings = 262144;
  c.num_attention_heads = kNumHeads;
  c.num_kv_heads = kNumKvHeads;
  c.head_dim = kHeadDim;
  c.rope_theta = 1e7;
  c.partial_rotary_factor = 0.25f;
  c.rotary_dim = kRotaryDim;
  c.linear_num_key_heads = kGdnKeyHeads;
  c.linear_num_value_heads = kGdnValueHeads;
  c.linear_key_head_dim = kGdnHeadDim;
  c.linear_value_head_dim = kGdnHeadDim;
  c.linear_conv_kernel_dim = kConvKernel;
  c.num_experts = kNumExperts;
  c.num_experts_per_tok = kTopK;
  c.moe_intermediate_size = kExpertWidth;
  c.shared_expert_intermediate_size = kSharedWidth;
  return c;
}

void set_synthetic_context(Backend& b, SeqId seq, int64_t context, uint64_t seed) {
  as_cuda(b).synthetic_context(seq, context, seed);
}
double decode_step_bytes(const Backend& b, int64_t context) { return as_cuda(b).step_bytes(context); }
int decode_route_place(const Backend& b) {
  const DModel& m = as_cuda(b).model();
  KESTREL_CHECK(!m.layers.empty(), "decode_route_place: a model without layers");
  return int(resolve_route_place(moe_route_place(), m.layers.front().gate.fmt));
}
std::vector<double> time_decode_steps(Backend& b, SeqId seq, int32_t first, int warmup, int steps) {
  return as_cuda(b).time_steps(seq, first, warmup, steps);
}
double load_seconds(const Backend& b) { return as_cuda(b).model().load_s; }
size_t weight_bytes(const Backend& b) { return as_cuda(b).model().weight_bytes; }
void set_prefill_max_chunk(Backend& b, int64_t max_chunk) { as_cuda(b).set_prefill_chunk(max_chunk); }
size_t prefill_scratch_bytes(const Backend& b) { return as_cuda(b).prefill_bytes(); }
void poison_prefill_scratch(Backend& b) { as_cuda(b).poison_prefill(); }
void set_prefill_aprec(Backend& b, PrefillAPrec p, float f16_limit) {
  as_cuda(b).set_prefill_route(p, f16_limit);
}
int64_t prefill_range_redos(const Backend& b) { return as_cuda(b).prefill_redos(); }
void set_prefill_gemm_choice(Backend& b, PrefillGemmChoice c) { as_cuda(b).set_prefill_gemm_choice(c); }

}  // namespace cuda

std::unique_ptr<Backend> make_cuda_backend(std::unique_ptr<ModelWeights> w, const BackendOptions& o) {
  (void)o;
  KESTREL_CHECK(w != nullptr, "make_cuda_backend: no weights");
  cudaStream_t s = cuda::new_stream();
  auto m = cuda::upload_model(*w, s);
  w.reset();  // the host copy (mmap) is no longer needed
  return std::make_unique<cuda::CudaBackend>(std::move(m), s);
}

}  // namespace kestrel
