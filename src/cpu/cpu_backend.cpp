// CPU forward pass, straight-line as the model card reads (model-spec §3.1):
//   x = E[ids]; per layer: x += mixer(norm(x)); x += moe(norm(x)); logits = lm_head(norm(x)).
#include "cpu/cpu_backend.h"

#include "core/check.h"
#include "cpu/ops.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

namespace kestrel::cpu {

GdnRoute choose_gdn_route(int64_t new_tokens) {
  return new_tokens == 1 ? GdnRoute::Recurrent : GdnRoute::Chunked;
}

namespace {
void grow(std::vector<float>& v, int64_t n) {
  if (int64_t(v.size()) < n) v.resize(size_t(n));
}
}  // namespace

CpuBackend::CpuBackend(std::unique_ptr<ModelWeights> w, int threads) : w_(std::move(w)) {
  if (threads > 0) omp_set_num_threads(threads);
  int gdn = 0, attn = 0;
  for (int l = 0; l < w_->config.num_layers; ++l)
    layer_slot_.push_back(w_->config.is_full(l) ? attn++ : gdn++);
}

SeqId CpuBackend::create_sequence(int64_t max_tokens) {
  const auto& c = w_->config;
  KESTREL_CHECK(max_tokens > 0 && max_tokens <= c.max_position_embeddings,
                "sequence capacity {} is outside 1..{} (max_position_embeddings)", max_tokens,
                c.max_position_embeddings);
  Sequence s;
  s.capacity = max_tokens;
  const int64_t K = c.linear_conv_kernel_dim;
  for (int l = 0; l < c.num_layers; ++l) {
    if (c.is_full(l)) {
      s.kc.emplace_back(size_t(max_tokens * c.num_kv_heads * c.head_dim), 0.f);
      s.vc.emplace_back(size_t(max_tokens * c.num_kv_heads * c.head_dim), 0.f);
    } else {
      s.conv.emplace_back(size_t(c.gdn_conv_dim() * (K - 1)), 0.f);
      s.rec.emplace_back(
          size_t(int64_t(c.linear_num_value_heads) * c.linear_key_head_dim * c.linear_value_head_dim),
          0.f);
    }
  }
  const SeqId id = next_id_++;
  seqs_.emplace(id, std::move(s));
  return id;
}

void CpuBackend::free_sequence(SeqId seq) { seqs_.erase(seq); }

int64_t CpuBackend::sequence_length(SeqId seq) const {
  auto it = seqs_.find(seq);
  KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", seq);
  return it->second.length;
}

int64_t CpuBackend::sequence_capacity(SeqId seq) const {
  auto it = seqs_.find(seq);
  KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", seq);
  return it->second.capacity;
}

std::span<float> CpuBackend::gdn_state(SeqId seq, int gdn_index) {
  auto it = seqs_.find(seq);
  KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", seq);
  KESTREL_CHECK(gdn_index >= 0 && gdn_index < int(it->second.rec.size()), "GDN layer {}", gdn_index);
  return it->second.rec[size_t(gdn_index)];
}

void CpuBackend::step(std::span<const StepRequest> batch, std::span<StepResult> out) {
  KESTREL_CHECK(batch.size() == out.size(), "step: {} requests, {} results", batch.size(),
                out.size());
  // Validate the whole batch before any state changes.
  for (const auto& r : batch) {
    auto it = seqs_.find(r.seq);
    KESTREL_CHECK(it != seqs_.end(), "step: unknown sequence {}", r.seq);
    KESTREL_CHECK(!r.tokens.empty(), "step: sequence {} has no new tokens", r.seq);
    KESTREL_CHECK(it->second.length + int64_t(r.tokens.size()) <= it->second.capacity,
                  "step: sequence {} would hold {} tokens, capacity {}", r.seq,
                  it->second.length + int64_t(r.tokens.size()), it->second.capacity);
    for (int32_t t : r.tokens)
      KESTREL_CHECK(t >= 0 && t < w_->config.vocab_size, "step: token id {} outside 0..{}", t,
                    w_->config.vocab_size - 1);
  }
  for (size_t i = 0; i < batch.size(); ++i)
    forward(seqs_.at(batch[i].seq), batch[i].tokens, batch[i].all_logits, out[i]);
}

void CpuBackend::dump(int layer, const char* name, const std::vector<float>& v, int64_t rows,
                      int64_t cols) {
  if (dump_) dump_(layer, name, v.data(), rows, cols);
}

void CpuBackend::forward(Sequence& s, std::span<const int32_t> tokens, bool all_logits,
                         StepResult& r) {
  const auto& c = w_->config;
  const int64_t T = int64_t(tokens.size()), H = c.hidden_size;
  const int64_t pos0 = s.length;
  grow(sc_.x, T * H);
  grow(sc_.h, T * H);
  grow(sc_.out, T * H);
  grow(sc_.moe, T * H);
  float* x = sc_.x.data();
  for (int64_t t = 0; t < T; ++t) w_->embed.row_f32(tokens[size_t(t)], x + t * H);
  dump(-1, "embed", sc_.x, T, H);

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = w_->layers[size_t(l)];
    rmsnorm(x, lw.input_norm.data(), T, H, c.rms_norm_eps, sc_.h.data());
    if (lw.kind == LayerKind::LinearAttention)
      gdn_branch(l, layer_slot_[size_t(l)], s, T);
    else
      attn_branch(l, layer_slot_[size_t(l)], s, T, pos0);
    for (int64_t i = 0; i < T * H; ++i) x[i] += sc_.out[size_t(i)];
    dump(l, "mixer_residual", sc_.x, T, H);
    rmsnorm(x, lw.post_norm.data(), T, H, c.rms_norm_eps, sc_.h.data());
    moe(lw.moe, c, sc_.h.data(), T, sc_.moe.data());
    for (int64_t i = 0; i < T * H; ++i) x[i] += sc_.moe[size_t(i)];
    dump(l, "moe_residual", sc_.x, T, H);
  }

  const int64_t first = all_logits ? 0 : T - 1;
  const int64_t rows = T - first;
  grow(sc_.logits_in, rows * H);
  rmsnorm(x + first * H, w_->final_norm.data(), rows, H, c.rms_norm_eps, sc_.logits_in.data());
  r.n_rows = int(rows);
  r.logits.resize(size_t(rows * c.vocab_size));
  matmul(w_->lm_head, sc_.logits_in.data(), rows, r.logits.data());
  s.length += T;
}

// Gated DeltaNet (model-spec §3.4): projections, causal conv + SiLU, L2-norm, gates, delta rule,
// gated RMSNorm, out_proj. Reads sc_.h, writes sc_.out.
void CpuBackend::gdn_branch(int layer, int gi, Sequence& s, int64_t T) {
  const auto& c = w_->config;
  const GdnWeights& g = w_->layers[size_t(layer)].gdn;
  const int64_t C = c.gdn_conv_dim(), KD = c.gdn_key_dim(), VD = c.gdn_value_dim();
  const int Hk = c.linear_num_key_heads, Hv = c.linear_num_value_heads;
  const int dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  grow(sc_.qkv, T * C);
  grow(sc_.u, T * C);
  grow(sc_.z, T * VD);
  grow(sc_.b, T * Hv);
  grow(sc_.a, T * Hv);
  grow(sc_.beta, T * Hv);
  grow(sc_.g, T * Hv);
  grow(sc_.q, T * KD);
  grow(sc_.k, T * KD);
  grow(sc_.v, T * VD);
  grow(sc_.o, T * VD);
  grow(sc_.y, T * VD);
  const float* h = sc_.h.data();
  matmul(g.in_proj_qkv, h, T, sc_.qkv.data());
  matmul(g.in_proj_z, h, T, sc_.z.data());
  matmul(g.in_proj_b, h, T, sc_.b.data());
  matmul(g.in_proj_a, h, T, sc_.a.data());
  conv1d_silu(sc_.qkv.data(), T, C, c.linear_conv_kernel_dim, g.conv1d.data(),
              s.conv[size_t(gi)].data(), sc_.u.data());
  dump(layer, "gdn_conv", sc_.u, T, C);
  for (int64_t t = 0; t < T; ++t) {
    const float* ut = sc_.u.data() + t * C;
    std::copy(ut, ut + KD, sc_.q.data() + t * KD);
    std::copy(ut + KD, ut + 2 * KD, sc_.k.data() + t * KD);
    std::copy(ut + 2 * KD, ut + C, sc_.v.data() + t * VD);
    for (int j = 0; j < Hv; ++j) {
      sc_.beta[size_t(t * Hv + j)] = sigmoid(sc_.b[size_t(t * Hv + j)]);
      sc_.g[size_t(t * Hv + j)] =
          -std::exp(g.A_log[size_t(j)]) * softplus(sc_.a[size_t(t * Hv + j)] + g.dt_bias[size_t(j)]);
    }
  }
  l2norm_rows(sc_.q.data(), T * Hk, dk, 1e-6f, 1.f / std::sqrt(float(dk)));
  l2norm_rows(sc_.k.data(), T * Hk, dk, 1e-6f, 1.f);
  const GdnDims d{Hk, Hv, dk, dv};
  float* S = s.rec[size_t(gi)].data();
  if (choose_gdn_route(T) == GdnRoute::Recurrent)
    gdn_recurrent(d, T, sc_.q.data(), sc_.k.data(), sc_.v.data(), sc_.beta.data(), sc_.g.data(), S,
                  sc_.o.data());
  else
    gdn_chunked(d, T, sc_.q.data(), sc_.k.data(), sc_.v.data(), sc_.beta.data(), sc_.g.data(), S,
                sc_.o.data(), kGdnChunk);
  dump(layer, "gdn_core", sc_.o, T, VD);
  gated_rmsnorm(sc_.o.data(), sc_.z.data(), g.norm.data(), T * Hv, dv, c.rms_norm_eps,
                sc_.y.data());
  matmul(g.out_proj, sc_.y.data(), T, sc_.out.data());
}

// Gated attention (model-spec §3.5): per-head query/gate split, q/k RMSNorm, partial NeoX RoPE,
// GQA causal softmax over the cache, sigmoid gate, o_proj. Reads sc_.h, writes sc_.out.
void CpuBackend::attn_branch(int layer, int ai, Sequence& s, int64_t T, int64_t pos0) {
  const auto& c = w_->config;
  const AttnWeights& a = w_->layers[size_t(layer)].attn;
  const int nh = c.num_attention_heads, nkv = c.num_kv_heads, D = c.head_dim;
  grow(sc_.qg, T * nh * 2 * D);
  grow(sc_.q, T * nh * D);
  grow(sc_.gate, T * nh * D);
  grow(sc_.k, T * nkv * D);
  grow(sc_.v, T * nkv * D);
  grow(sc_.attn, T * nh * D);
  const float* h = sc_.h.data();
  matmul(a.q_proj, h, T, sc_.qg.data());
  matmul(a.k_proj, h, T, sc_.k.data());
  matmul(a.v_proj, h, T, sc_.v.data());
  for (int64_t t = 0; t < T; ++t)
    for (int hh = 0; hh < nh; ++hh) {
      const float* src = sc_.qg.data() + (t * nh + hh) * 2 * D;
      std::copy(src, src + D, sc_.q.data() + (t * nh + hh) * D);
      std::copy(src + D, src + 2 * D, sc_.gate.data() + (t * nh + hh) * D);
    }
  rmsnorm(sc_.q.data(), a.q_norm.data(), T * nh, D, c.rms_norm_eps, sc_.q.data());
  rmsnorm(sc_.k.data(), a.k_norm.data(), T * nkv, D, c.rms_norm_eps, sc_.k.data());
  rope_neox(sc_.q.data(), T, nh, D, c.rotary_dim, pos0, c.rope_theta);
  rope_neox(sc_.k.data(), T, nkv, D, c.rotary_dim, pos0, c.rope_theta);
  float* kc = s.kc[size_t(ai)].data();
  float* vc = s.vc[size_t(ai)].data();
  std::copy(sc_.k.data(), sc_.k.data() + T * nkv * D, kc + pos0 * nkv * D);
  std::copy(sc_.v.data(), sc_.v.data() + T * nkv * D, vc + pos0 * nkv * D);
  attention(sc_.q.data(), T, pos0, kc, vc, nh, nkv, D, sc_.attn.data());
  for (int64_t i = 0; i < T * nh * D; ++i) sc_.attn[size_t(i)] *= sigmoid(sc_.gate[size_t(i)]);
  dump(layer, "attn_gated", sc_.attn, T, int64_t(nh) * D);
  matmul(a.o_proj, sc_.attn.data(), T, sc_.out.data());
}

}  // namespace kestrel::cpu
