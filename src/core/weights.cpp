// Mat views and the HF-layout loader (model-spec §2). MLX-layout checkpoints are loaded by
// quant::load_mlx_weights; quantize-at-load goes through quant::quantize_matrix.
#include "core/weights.h"

#include "core/check.h"
#include "core/loader.h"
#include "core/safetensors.h"
#include "quant/progress.h"
#include "quant/quant.h"

namespace kestrel {

const char* wformat_name(WFormat f) {
  switch (f) {
    case WFormat::BF16: return "BF16";
    case WFormat::F16: return "F16";
    case WFormat::F32: return "F32";
    case WFormat::Q4: return "Q4";
    case WFormat::Q8: return "Q8";
  }
  return "?";
}

Mat Mat::slice_rows(int64_t r0, int64_t n) const {
  KESTREL_CHECK(r0 >= 0 && n >= 0 && r0 + n <= rows, "Mat::slice_rows [{}, {}) of {} rows", r0,
                r0 + n, rows);
  Mat m = *this;
  m.rows = n;
  const auto* base = static_cast<const uint8_t*>(data);
  switch (fmt) {
    case WFormat::BF16: case WFormat::F16: m.data = base + r0 * cols * 2; break;
    case WFormat::F32: m.data = base + r0 * cols * 4; break;
    case WFormat::Q4: case WFormat::Q8: {
      m.data = base + r0 * (cols * bits() / 8);
      m.scales = scales + r0 * (cols / group);
      m.biases = biases + r0 * (cols / group);
      break;
    }
  }
  return m;
}

size_t Mat::nbytes() const {
  switch (fmt) {
    case WFormat::BF16: case WFormat::F16: return size_t(rows * cols * 2);
    case WFormat::F32: return size_t(rows * cols * 4);
    case WFormat::Q4: case WFormat::Q8:
      return size_t(rows * cols * bits() / 8 + 2 * rows * (cols / group) * 2);
  }
  return 0;
}

void Mat::row_f32(int64_t r, float* out) const {
  switch (fmt) {
    case WFormat::BF16: {
      const auto* p = static_cast<const uint16_t*>(data) + r * cols;
      for (int64_t j = 0; j < cols; ++j) out[j] = bf16_to_f32(p[j]);
      return;
    }
    case WFormat::F16: {
      const auto* p = static_cast<const uint16_t*>(data) + r * cols;
      for (int64_t j = 0; j < cols; ++j) out[j] = f16_to_f32(p[j]);
      return;
    }
    case WFormat::F32: {
      const auto* p = static_cast<const float*>(data) + r * cols;
      for (int64_t j = 0; j < cols; ++j) out[j] = p[j];
      return;
    }
    case WFormat::Q4: case WFormat::Q8: quant::dequant_row(*this, r, out); return;
  }
}

size_t ModelWeights::matrix_bytes() const {
  size_t n = embed.nbytes() + lm_head.nbytes();
  for (const auto& l : layers) {
    for (const Mat* m : {&l.gdn.in_proj_qkv, &l.gdn.in_proj_z, &l.gdn.in_proj_b, &l.gdn.in_proj_a,
                         &l.gdn.out_proj, &l.attn.q_proj, &l.attn.k_proj, &l.attn.v_proj,
                         &l.attn.o_proj, &l.moe.router, &l.moe.shared_gate, &l.moe.shared_up,
                         &l.moe.shared_down, &l.moe.shared_expert_gate})
      if (m->valid()) n += m->nbytes();
    for (const auto* v : {&l.moe.gate, &l.moe.up, &l.moe.down})
      for (const auto& m : *v) n += m.nbytes();
  }
  return n;
}

Mat mat_from_tensor(const TensorInfo& t) {
  KESTREL_CHECK(t.shape.size() == 2 || t.shape.size() == 3,
                "{}: tensor '{}' of shape {} is not a matrix", t.file, t.name, t.shape_str());
  Mat m;
  switch (t.dtype) {
    case DType::BF16: m.fmt = WFormat::BF16; break;
    case DType::F16: m.fmt = WFormat::F16; break;
    case DType::F32: m.fmt = WFormat::F32; break;
    default:
      KESTREL_FAIL("{}: tensor '{}' has dtype {}, expected BF16, F16 or F32", t.file, t.name,
                   dtype_name(t.dtype));
  }
  m.cols = t.shape.back();
  m.rows = t.numel() / std::max<int64_t>(m.cols, 1);
  m.data = t.data;
  return m;
}

std::vector<float> tensor_to_f32(const TensorInfo& t, bool add_one) {
  std::vector<float> v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    float x;
    switch (t.dtype) {
      case DType::BF16: { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); x = bf16_to_f32(h); break; }
      case DType::F16: { uint16_t h; std::memcpy(&h, t.data + 2 * i, 2); x = f16_to_f32(h); break; }
      case DType::F32: std::memcpy(&x, t.data + 4 * i, 4); break;
      default:
        KESTREL_FAIL("{}: tensor '{}' has dtype {}, expected BF16, F16 or F32", t.file, t.name,
                     dtype_name(t.dtype));
    }
    v[i] = add_one ? 1.f + x : x;
  }
  return v;
}

namespace {

constexpr std::initializer_list<DType> kFloat = {DType::BF16, DType::F16, DType::F32};

// Loads HF-layout matrices, quantizing them at load when asked.
struct HfLoader {
  TensorLoader& tl;
  ModelWeights& w;
  const LoadOptions& opts;
  size_t total = 0, done = 0;

  void progress(size_t bytes) {
    done += bytes;
    if (opts.progress) opts.progress({done, total});
  }

  // bits: the MLX recipe's precision for this matrix when quantizing at load.
  Mat matrix(const std::string& name, std::vector<int64_t> shape, int bits = 4) {
    const TensorInfo& t = tl.take(name, kFloat, shape);
    Mat m = mat_from_tensor(t);
    // MLX recipe (mlx-lm quantize_model): a matrix whose input width is not a multiple of the
    // group stays unquantized; quant::recipe_bits returns 0 for it.
    if (opts.quant == QuantMode::Q4 && quant::recipe_bits(bits, m.cols) != 0) {
      m = quant::quantize_matrix(m, bits, 64, w.owned);
      quant::release_pages(t.data, t.nbytes);  // the bf16 source is no longer referenced
    }
    progress(t.nbytes);
    return m;
  }
  std::vector<float> vec(const std::string& name, std::vector<int64_t> shape, bool add_one) {
    const TensorInfo& t = tl.take(name, kFloat, shape);
    progress(t.nbytes);
    return tensor_to_f32(t, add_one);
  }
};

}  // namespace

std::unique_ptr<ModelWeights> load_weights(const std::filesystem::path& dir,
                                           const LoadOptions& opts) {
  ModelConfig cfg = load_config(dir);
  if (cfg.quantization) {
    KESTREL_CHECK(opts.quant == QuantMode::None,
                  "{}: the checkpoint is already quantized; --quant applies to bf16 checkpoints",
                  dir.string());
    return quant::load_mlx_weights(dir, cfg, opts);
  }
  auto w = std::make_unique<ModelWeights>();
  w->config = cfg;
  std::shared_ptr<Checkpoint> ckpt = Checkpoint::open(dir);
  w->checkpoint = ckpt;
  w->source_format = opts.quant == QuantMode::Q4 ? "hf-bf16 quantized at load to q4" : "hf-bf16";
  TensorLoader tl(*ckpt);
  HfLoader L{tl, *w, opts, ckpt->total_bytes()};

  const std::string root =
      ckpt->find("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  w->embed = L.matrix(root + "embed_tokens.weight", {V, H});
  w->final_norm = L.vec(root + "norm.weight", {H}, true);
  w->lm_head = L.matrix("lm_head.weight", {V, H});

  const int64_t Hk = cfg.linear_num_key_heads, Hv = cfg.linear_num_value_heads;
  const int64_t dk = cfg.linear_key_head_dim, dv = cfg.linear_value_head_dim;
  const int64_t C = cfg.gdn_conv_dim(), K = cfg.linear_conv_kernel_dim;
  const int64_t nh = cfg.num_attention_heads, nkv = cfg.num_kv_heads, D = cfg.head_dim;
  const int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size;
  const int64_t Is = cfg.shared_expert_intermediate_size;
  for (int li = 0; li < cfg.num_layers; ++li) {
    LayerWeights lw;
    const std::string p = fmt::format("{}layers.{}.", root, li);
    lw.kind = cfg.layer_types[size_t(li)];
    lw.input_norm = L.vec(p + "input_layernorm.weight", {H}, true);
    lw.post_norm = L.vec(p + "post_attention_layernorm.weight", {H}, true);
    if (lw.kind == LayerKind::LinearAttention) {
      const std::string a = p + "linear_attn.";
      GdnWeights& g = lw.gdn;
      g.in_proj_qkv = L.matrix(a + "in_proj_qkv.weight", {C, H});
      g.in_proj_z = L.matrix(a + "in_proj_z.weight", {Hv * dv, H});
      g.in_proj_b = L.matrix(a + "in_proj_b.weight", {Hv, H});
      g.in_proj_a = L.matrix(a + "in_proj_a.weight", {Hv, H});
      g.conv1d = L.vec(a + "conv1d.weight", {C, 1, K}, false);
      g.A_log = L.vec(a + "A_log", {Hv}, false);
      g.dt_bias = L.vec(a + "dt_bias", {Hv}, false);
      g.norm = L.vec(a + "norm.weight", {dv}, false);
      g.out_proj = L.matrix(a + "out_proj.weight", {H, Hv * dv});
      (void)Hk;
      (void)dk;
    } else {
      const std::string a = p + "self_attn.";
      AttnWeights& at = lw.attn;
      at.q_proj = L.matrix(a + "q_proj.weight", {nh * 2 * D, H});
      at.k_proj = L.matrix(a + "k_proj.weight", {nkv * D, H});
      at.v_proj = L.matrix(a + "v_proj.weight", {nkv * D, H});
      at.o_proj = L.matrix(a + "o_proj.weight", {H, nh * D});
      at.q_norm = L.vec(a + "q_norm.weight", {D}, true);
      at.k_norm = L.vec(a + "k_norm.weight", {D}, true);
    }
    MoeWeights& m = lw.moe;
    const std::string mp = p + "mlp.";
    m.router = L.matrix(mp + "gate.weight", {E, H}, 8);
    // Experts come fused (experts.gate_up_proj [E, 2I, H] + experts.down_proj [E, H, I], the
    // module layout) or per expert (experts.{e}.{gate,up,down}_proj.weight, what transformers 5
    // writes with save_pretrained). Both give the same views.
    if (tl.has(mp + "experts.gate_up_proj")) {
      const Mat gate_up = L.matrix(mp + "experts.gate_up_proj", {E, 2 * I, H});
      const Mat down = L.matrix(mp + "experts.down_proj", {E, H, I});
      for (int64_t e = 0; e < E; ++e) {
        m.gate.push_back(gate_up.slice_rows(e * 2 * I, I));    // rows 0..I-1 of expert e: gate
        m.up.push_back(gate_up.slice_rows(e * 2 * I + I, I));  // rows I..2I-1: up
        m.down.push_back(down.slice_rows(e * H, H));
      }
    } else {
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = fmt::format("{}experts.{}.", mp, e);
        m.gate.push_back(L.matrix(ep + "gate_proj.weight", {I, H}));
        m.up.push_back(L.matrix(ep + "up_proj.weight", {I, H}));
        m.down.push_back(L.matrix(ep + "down_proj.weight", {H, I}));
      }
    }
    m.shared_gate = L.matrix(mp + "shared_expert.gate_proj.weight", {Is, H});
    m.shared_up = L.matrix(mp + "shared_expert.up_proj.weight", {Is, H});
    m.shared_down = L.matrix(mp + "shared_expert.down_proj.weight", {H, Is});
    m.shared_expert_gate = L.matrix(mp + "shared_expert_gate.weight", {1, H}, 8);
    w->layers.push_back(std::move(lw));
  }
  tl.skip_prefix("model.visual.");
  tl.skip_prefix("mtp.");
  tl.finish();
  return w;
}

}  // namespace kestrel
