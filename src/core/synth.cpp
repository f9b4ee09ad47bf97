// Synthetic checkpoint writer (see synth.h). Values: splitmix64(seed, name, index) mapped to a
// small integer k and then to k * 2^-e (exact in fp32), rounded once to bf16; every quantity is
// integer or exact arithmetic, so the bytes are identical on every machine.
#include "core/synth.h"

#include "core/check.h"
#include "core/dtype.h"
#include "core/safetensors.h"

#include <cmath>

namespace kestrel {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t name_hash(const std::string& s) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

enum class Kind { Matrix, Embed, Head, ZeroNorm, PlainNorm, ALog, DtBias, Conv };

struct Gen {
  const SynthOptions& o;
  std::vector<std::vector<uint8_t>> bufs;
  std::vector<TensorToWrite> out;

  // Uniform integer k in [-127, 127] (std ~73.3) scaled to roughly `target_std` by a power of 2.
  void add(const std::string& name, std::vector<int64_t> shape, Kind kind, int64_t fan_in = 1) {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    std::vector<uint8_t> b(size_t(n) * 2);
    const uint64_t base = splitmix64(o.seed ^ name_hash(name));
    double target = 0.2;
    switch (kind) {
      case Kind::Matrix: target = 1.0 / std::sqrt(double(fan_in)); break;
      case Kind::Head: target = 2.0 / std::sqrt(double(fan_in)); break;
      case Kind::Embed: target = 1.0; break;
      case Kind::ZeroNorm: case Kind::PlainNorm: target = 0.2; break;
      case Kind::DtBias: target = 0.5; break;
      case Kind::Conv: target = 0.35; break;
      case Kind::ALog: break;
    }
    const int e = int(std::lround(std::log2(73.3 / target)));
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t r = splitmix64(base + uint64_t(i));
      float v;
      if (kind == Kind::ALog) {
        v = std::ldexp(float(r % 321), -7);  // [0, 2.5]
      } else {
        v = std::ldexp(float(int(r % 255) - 127), -e);
        if (kind == Kind::PlainNorm) v += 1.f;
      }
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(b.data() + 2 * i, &h, 2);
    }
    bufs.push_back(std::move(b));
    out.push_back({name, DType::BF16, std::move(shape), bufs.back()});
  }
};

}  // namespace

size_t write_synthetic_checkpoint(const ModelConfig& c, const std::filesystem::path& dir,
                                  const SynthOptions& opts) {
  Gen g{opts, {}, {}};
  g.bufs.reserve(size_t(c.num_layers) * 1024 + 64);  // spans into bufs must stay valid
  const int64_t H = c.hidden_size, V = c.vocab_size;
  const int64_t Hv = c.linear_num_value_heads, dv = c.linear_value_head_dim;
  const int64_t C = c.gdn_conv_dim(), K = c.linear_conv_kernel_dim;
  const int64_t nh = c.num_attention_heads, nkv = c.num_kv_heads, D = c.head_dim;
  const int64_t E = c.num_experts, I = c.moe_intermediate_size, Is = c.shared_expert_intermediate_size;
  const std::string r = "model.language_model.";
  g.add(r + "embed_tokens.weight", {V, H}, Kind::Embed);
  g.add(r + "norm.weight", {H}, Kind::ZeroNorm);
  g.add("lm_head.weight", {V, H}, Kind::Head, H);
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = r + "layers." + std::to_string(l) + ".";
    g.add(p + "input_layernorm.weight", {H}, Kind::ZeroNorm);
    g.add(p + "post_attention_layernorm.weight", {H}, Kind::ZeroNorm);
    if (!c.is_full(l)) {
      const std::string a = p + "linear_attn.";
      g.add(a + "in_proj_qkv.weight", {C, H}, Kind::Matrix, H);
      g.add(a + "in_proj_z.weight", {Hv * dv, H}, Kind::Matrix, H);
      g.add(a + "in_proj_b.weight", {Hv, H}, Kind::Matrix, H);
      g.add(a + "in_proj_a.weight", {Hv, H}, Kind::Matrix, H);
      g.add(a + "conv1d.weight", {C, 1, K}, Kind::Conv);
      g.add(a + "A_log", {Hv}, Kind::ALog);
      g.add(a + "dt_bias", {Hv}, Kind::DtBias);
      g.add(a + "norm.weight", {dv}, Kind::PlainNorm);
      g.add(a + "out_proj.weight", {H, Hv * dv}, Kind::Matrix, Hv * dv);
    } else {
      const std::string a = p + "self_attn.";
      g.add(a + "q_proj.weight", {nh * 2 * D, H}, Kind::Matrix, H);
      g.add(a + "k_proj.weight", {nkv * D, H}, Kind::Matrix, H);
      g.add(a + "v_proj.weight", {nkv * D, H}, Kind::Matrix, H);
      g.add(a + "o_proj.weight", {H, nh * D}, Kind::Matrix, nh * D);
      g.add(a + "q_norm.weight", {D}, Kind::ZeroNorm);
      g.add(a + "k_norm.weight", {D}, Kind::ZeroNorm);
    }
    const std::string m = p + "mlp.";
    g.add(m + "gate.weight", {E, H}, Kind::Matrix, H);
    if (opts.fused_experts) {
      g.add(m + "experts.gate_up_proj", {E, 2 * I, H}, Kind::Matrix, H);
      g.add(m + "experts.down_proj", {E, H, I}, Kind::Matrix, I);
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = m + "experts." + std::to_string(e) + ".";
        g.add(ep + "gate_proj.weight", {I, H}, Kind::Matrix, H);
        g.add(ep + "up_proj.weight", {I, H}, Kind::Matrix, H);
        g.add(ep + "down_proj.weight", {H, I}, Kind::Matrix, I);
      }
    }
    g.add(m + "shared_expert.gate_proj.weight", {Is, H}, Kind::Matrix, H);
    g.add(m + "shared_expert.up_proj.weight", {Is, H}, Kind::Matrix, H);
    g.add(m + "shared_expert.down_proj.weight", {H, Is}, Kind::Matrix, Is);
    g.add(m + "shared_expert_gate.weight", {1, H}, Kind::Matrix, H);
  }
  if (opts.with_mtp) {
    g.add("mtp.fc.weight", {H, 2 * H}, Kind::Matrix, 2 * H);
    g.add("mtp.norm.weight", {H}, Kind::ZeroNorm);
  }
  KESTREL_CHECK(std::filesystem::is_directory(dir), "{} is not a directory", dir.string());
  write_safetensors(dir / "model.safetensors", g.out, {{"format", "pt"}});
  size_t n = 0;
  for (const auto& b : g.bufs) n += b.size();
  return n;
}

}  // namespace kestrel
