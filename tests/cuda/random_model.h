// Random models for the CUDA end-to-end tests: the real per-layer widths with few layers
// (3 GDN + 1 attention, 16 experts top-4, vocabulary 4096) and random weights in any format, with
// their storage in ModelWeights::owned (shared by test_backend.cpp and test_prefill_e2e.cpp).
#pragma once
#include "core/config.h"
#include "core/weights.h"
#include "util.h"

#include <cstring>
#include <memory>
#include <random>

namespace kestrel::cuda::test {

inline ModelConfig small_real_width_config() {
  ModelConfig c = real_model_config();
  c.num_layers = 4;
  c.layer_types = {LayerKind::LinearAttention, LayerKind::LinearAttention,
                   LayerKind::LinearAttention, LayerKind::FullAttention};
  c.vocab_size = 4096;
  c.num_experts = 16;
  c.num_experts_per_tok = 4;
  c.max_position_embeddings = 4096;
  return c;
}

// Random weights with their storage in ModelWeights::owned. fmt: every matrix; router and shared
// expert gate use rfmt.
inline std::unique_ptr<ModelWeights> random_weights(const ModelConfig& c, WFormat fmt, WFormat rfmt,
                                             uint32_t seed) {
  auto w = std::make_unique<ModelWeights>();
  w->config = c;
  w->source_format = "test-random";
  std::mt19937 g(seed);
  auto mat = [&](int64_t rows, int64_t cols, WFormat f, float sd = 0.02f) {
    auto h = make_mat(f, rows, cols, g, sd);
    Mat m = h->m;
    w->owned.push_back(std::move(h->data));
    m.data = w->owned.back().data();
    if (f != WFormat::BF16) {
      std::vector<uint8_t> s(h->scales.size() * 2), b(h->biases.size() * 2);
      std::memcpy(s.data(), h->scales.data(), s.size());
      std::memcpy(b.data(), h->biases.data(), b.size());
      w->owned.push_back(std::move(s));
      m.scales = reinterpret_cast<const uint16_t*>(w->owned.back().data());
      w->owned.push_back(std::move(b));
      m.biases = reinterpret_cast<const uint16_t*>(w->owned.back().data());
    }
    return m;
  };
  w->owned.reserve(4096);
  const int64_t H = c.hidden_size, E = c.num_experts, I = c.moe_intermediate_size,
                Is = c.shared_expert_intermediate_size;
  w->embed = mat(c.vocab_size, H, fmt, 1.0f);
  w->lm_head = mat(c.vocab_size, H, fmt, 0.05f);
  w->final_norm = randv(size_t(H), g, 0.8f, 1.2f);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights lw;
    lw.kind = c.layer_types[size_t(l)];
    lw.input_norm = randv(size_t(H), g, 0.8f, 1.2f);
    lw.post_norm = randv(size_t(H), g, 0.8f, 1.2f);
    if (lw.kind == LayerKind::LinearAttention) {
      auto& d = lw.gdn;
      d.in_proj_qkv = mat(c.gdn_conv_dim(), H, fmt, 0.05f);
      d.in_proj_z = mat(c.gdn_value_dim(), H, fmt, 0.05f);
      d.in_proj_b = mat(c.linear_num_value_heads, H, fmt, 0.05f);
      d.in_proj_a = mat(c.linear_num_value_heads, H, fmt, 0.05f);
      d.out_proj = mat(H, c.gdn_value_dim(), fmt, 0.02f);
      d.conv1d = randv(size_t(c.gdn_conv_dim()) * 4, g, -0.5f, 0.5f);
      d.A_log = randv(size_t(c.linear_num_value_heads), g, 0.f, 2.7f);
      d.dt_bias = randv(size_t(c.linear_num_value_heads), g, -1.f, 1.f);
      d.norm = randv(size_t(c.linear_value_head_dim), g, 0.8f, 1.2f);
    } else {
      auto& a = lw.attn;
      const int64_t nh = c.num_attention_heads, kv = c.num_kv_heads, D = c.head_dim;
      a.q_proj = mat(nh * 2 * D, H, fmt, 0.05f);
      a.k_proj = mat(kv * D, H, fmt, 0.05f);
      a.v_proj = mat(kv * D, H, fmt, 0.05f);
      a.o_proj = mat(H, nh * D, fmt, 0.02f);
      a.q_norm = randv(size_t(D), g, 0.8f, 1.2f);
      a.k_norm = randv(size_t(D), g, 0.8f, 1.2f);
    }
    auto& m = lw.moe;
    m.router = mat(E, H, rfmt, 0.1f);
    Mat gate = mat(E * I, H, fmt, 0.05f), up = mat(E * I, H, fmt, 0.05f), down = mat(E * H, I, fmt, 0.05f);
    for (int64_t e = 0; e < E; ++e) {
      m.gate.push_back(gate.slice_rows(e * I, I));
      m.up.push_back(up.slice_rows(e * I, I));
      m.down.push_back(down.slice_rows(e * H, H));
    }
    m.shared_gate = mat(Is, H, fmt, 0.05f);
    m.shared_up = mat(Is, H, fmt, 0.05f);
    m.shared_down = mat(H, Is, fmt, 0.05f);
    m.shared_expert_gate = mat(1, H, rfmt, 0.05f);
    w->layers.push_back(std::move(lw));
  }
  return w;
}

}  // namespace kestrel::cuda::test
