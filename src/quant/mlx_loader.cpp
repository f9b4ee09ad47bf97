// Loader of MLX-layout affine checkpoints (mlx-community `*-4bit`, and what `kestrel quantize`
// writes; model-spec §7.1). Produces the same ModelWeights as the HF loader, with the quantized
// matrices as views into the mmap (no copy, no dequantised copy). Refuses anything but affine
// group-64 4/8-bit, and any tensor whose packed width, scales or biases do not match the config.
//
// Layout differences from HF handled here, each once at load:
//   names        language_model.model.* (HF model.language_model.*), language_model.lm_head
//   experts      mlp.switch_mlp.{gate,up,down}_proj stacked [E, N, K*b/32] (HF per expert or fused)
//   conv1d       [C, K, 1] (HF [C, 1, K]); same element order as [C, K]
//   norms        the +1 of the zero-centred norms is already baked in (input/post_attention, final,
//                q_norm, k_norm): read as plain multipliers; linear_attn.norm is plain in both
#include "core/check.h"
#include "core/loader.h"
#include "core/safetensors.h"
#include "quant/quant.h"

#include <cstring>
#include <map>

namespace kestrel::quant {

namespace {

constexpr std::initializer_list<DType> kFloat = {DType::BF16, DType::F16, DType::F32};

std::string shape_str(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}

void check_params(const std::string& src, const std::string& what, int bits, int group) {
  KESTREL_CHECK(group == kGroup,
                "{}: quantization{} group_size = {} is not supported (kestrel loads group_size {})",
                src, what, group, kGroup);
  KESTREL_CHECK(bits == 4 || bits == 8,
                "{}: quantization{} bits = {} is not supported (kestrel loads 4 or 8 bits)", src, what,
                bits);
}

struct MlxLoader {
  TensorLoader& tl;
  const Checkpoint& ck;
  ModelWeights& w;
  const LoadOptions& opts;
  const QuantizationConfig& q;
  std::map<std::string, const QuantOverride*> overrides;
  size_t total = 0, done = 0;

  void progress(size_t bytes) {
    done += bytes;
    if (opts.progress) opts.progress({done, total});
  }

  // A [lead..., K] matrix named `module` (module path without ".weight"): quantized when
  // module.scales exists (bits from the module's override or the default), else in a float dtype.
  Mat matrix(const std::string& module, const std::vector<int64_t>& lead, int64_t K) {
    const std::string wn = module + ".weight", sn = module + ".scales", bn = module + ".biases";
    const TensorInfo* wt = ck.find(wn);
    const TensorInfo* st = ck.find(sn);
    const TensorInfo* bt = ck.find(bn);
    std::vector<int64_t> shape = lead;
    shape.push_back(K);
    KESTREL_CHECK(wt, "missing tensor '{}' (a {} matrix) in the checkpoint", wn, shape_str(shape));
    const auto ov = overrides.find(module);
    if (!st && !bt) {
      KESTREL_CHECK(ov == overrides.end(),
                    "{}: config.json quantizes '{}' at {} bits but '{}' and '{}' are missing",
                    wt->file, module, ov == overrides.end() ? 0 : ov->second->bits, sn, bn);
      KESTREL_CHECK(wt->dtype != DType::U32,
                    "{}: tensor '{}' holds packed codes (U32) but '{}' and '{}' are missing",
                    wt->file, wn, sn, bn);
      const TensorInfo& t = tl.take(wn, kFloat, shape);
      progress(t.nbytes);
      return mat_from_tensor(t);
    }
    KESTREL_CHECK(st, "{}: tensor '{}' is present but '{}' is missing", wt->file, bn, sn);
    KESTREL_CHECK(bt, "{}: tensor '{}' is present but '{}' is missing", wt->file, sn, bn);
    const int bits = ov != overrides.end() ? ov->second->bits : q.bits;
    const int group = ov != overrides.end() ? ov->second->group_size : q.group_size;
    KESTREL_CHECK(K % group == 0,
                  "{}: '{}' is quantized but its input width {} is not a multiple of the group {}",
                  wt->file, module, K, group);
    KESTREL_CHECK(wt->dtype == DType::U32,
                  "{}: tensor '{}' has dtype {}, expected U32 (packed {}-bit codes, since '{}' exists)",
                  wt->file, wn, dtype_name(wt->dtype), bits, sn);
    std::vector<int64_t> packed = lead;
    packed.push_back(K * bits / 32);
    if (wt->shape != packed) {
      const bool same_lead = wt->shape.size() == packed.size() &&
                             std::equal(lead.begin(), lead.end(), wt->shape.begin());
      KESTREL_CHECK(!same_lead,
                    "{}: tensor '{}' has packed width {} (U32 words per row), expected {} = {} "
                    "input columns at {} bits ({} bits per the config; a width of {} would be {} "
                    "bits)",
                    wt->file, wn, wt->shape.back(), K * bits / 32, K, bits, bits,
                    wt->shape.back(), wt->shape.back() * 32 / K);
      KESTREL_FAIL("{}: tensor '{}' has shape {}, expected {} ({} input columns packed at {} bits)",
                   wt->file, wn, wt->shape_str(), shape_str(packed), K, bits);
    }
    std::vector<int64_t> sshape = lead;
    sshape.push_back(K / group);
    const TensorInfo& t = tl.take(wn, {DType::U32}, packed);
    const TensorInfo& s = tl.take(sn, {DType::BF16}, sshape);
    const TensorInfo& b = tl.take(bn, {DType::BF16}, sshape);
    Mat m;
    m.fmt = bits == 4 ? WFormat::Q4 : WFormat::Q8;
    m.rows = t.numel() / packed.back();
    m.cols = K;
    m.group = group;
    m.data = t.data;
    m.scales = reinterpret_cast<const uint16_t*>(s.data);
    m.biases = reinterpret_cast<const uint16_t*>(b.data);
    align(m, t, s, b);
    progress(t.nbytes + s.nbytes + b.nbytes);
    return m;
  }

  // safetensors does not promise aligned tensor offsets; kernels read u32 words and u16 scales, so
  // a misaligned tensor (rare: writers sort by alignment) is copied once into an owned buffer.
  void align(Mat& m, const TensorInfo& t, const TensorInfo& s, const TensorInfo& b) {
    const bool ok = reinterpret_cast<uintptr_t>(t.data) % 4 == 0 &&
                    reinterpret_cast<uintptr_t>(s.data) % 2 == 0 &&
                    reinterpret_cast<uintptr_t>(b.data) % 2 == 0;
    if (ok) return;
    std::vector<uint8_t> buf(t.nbytes + s.nbytes + b.nbytes);
    std::memcpy(buf.data(), t.data, t.nbytes);
    std::memcpy(buf.data() + t.nbytes, s.data, s.nbytes);
    std::memcpy(buf.data() + t.nbytes + s.nbytes, b.data, b.nbytes);
    m.data = buf.data();
    m.scales = reinterpret_cast<const uint16_t*>(buf.data() + t.nbytes);
    m.biases = reinterpret_cast<const uint16_t*>(buf.data() + t.nbytes + s.nbytes);
    w.owned.push_back(std::move(buf));
  }

  std::vector<float> vec(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorInfo& t = tl.take(name, kFloat, shape);
    progress(t.nbytes);
    return tensor_to_f32(t, /*add_one=*/false);
  }
};

}  // namespace

std::unique_ptr<ModelWeights> load_mlx_weights(const std::filesystem::path& dir,
                                               const ModelConfig& cfg, const LoadOptions& opts) {
  const std::string src = (dir / "config.json").string();
  KESTREL_CHECK(cfg.quantization.has_value(), "{}: no quantization block (not an MLX checkpoint)",
                src);
  const QuantizationConfig& q = *cfg.quantization;
  KESTREL_CHECK(q.mode == "affine",
                "{}: quantization.mode = \"{}\" is not supported (kestrel loads \"affine\")", src,
                q.mode);
  check_params(src, "", q.bits, q.group_size);
  KESTREL_CHECK(opts.quant == QuantMode::None,
                "{}: the checkpoint is already quantized; --quant applies to bf16 checkpoints",
                dir.string());

  auto w = std::make_unique<ModelWeights>();
  w->config = cfg;
  std::shared_ptr<Checkpoint> ckpt = Checkpoint::open(dir);
  w->checkpoint = ckpt;
  w->source_format = fmt::format("mlx-q{}", q.bits);
  TensorLoader tl(*ckpt);
  MlxLoader L{tl, *ckpt, *w, opts, q, {}, ckpt->total_bytes(), 0};
  // Overrides of the parts kestrel does not load (vision tower, MTP block) are not validated.
  const char* const kSkipped[] = {"vision_tower.", "language_model.vision_tower.", "mtp.",
                                  "language_model.mtp."};
  for (const auto& o : q.overrides) {
    bool skipped = false;
    for (const char* p : kSkipped) skipped |= o.module.rfind(p, 0) == 0;
    if (skipped) continue;
    check_params(src, "." + o.module, o.bits, o.group_size);
    L.overrides[o.module] = &o;
  }

  const std::string root = "language_model.model.";
  KESTREL_CHECK(ckpt->find(root + "embed_tokens.weight"),
                "{}: no '{}embed_tokens.weight': not an MLX-layout checkpoint (config.json has a "
                "quantization block, so kestrel expects language_model.model.* names)",
                dir.string(), root);
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  w->embed = L.matrix(root + "embed_tokens", {V}, H);
  w->final_norm = L.vec(root + "norm.weight", {H});
  w->lm_head = cfg.tie_word_embeddings ? w->embed : L.matrix("language_model.lm_head", {V}, H);

  const int64_t Hv = cfg.linear_num_value_heads, dv = cfg.linear_value_head_dim;
  const int64_t C = cfg.gdn_conv_dim(), K = cfg.linear_conv_kernel_dim;
  const int64_t nh = cfg.num_attention_heads, nkv = cfg.num_kv_heads, D = cfg.head_dim;
  const int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size;
  const int64_t Is = cfg.shared_expert_intermediate_size;
  for (int li = 0; li < cfg.num_layers; ++li) {
    LayerWeights lw;
    const std::string p = fmt::format("{}layers.{}.", root, li);
    lw.kind = cfg.layer_types[size_t(li)];
    lw.input_norm = L.vec(p + "input_layernorm.weight", {H});          // 1+w baked in
    lw.post_norm = L.vec(p + "post_attention_layernorm.weight", {H});  // 1+w baked in
    if (lw.kind == LayerKind::LinearAttention) {
      const std::string a = p + "linear_attn.";
      GdnWeights& g = lw.gdn;
      g.in_proj_qkv = L.matrix(a + "in_proj_qkv", {C}, H);
      g.in_proj_z = L.matrix(a + "in_proj_z", {Hv * dv}, H);
      g.in_proj_b = L.matrix(a + "in_proj_b", {Hv}, H);
      g.in_proj_a = L.matrix(a + "in_proj_a", {Hv}, H);
      g.conv1d = L.vec(a + "conv1d.weight", {C, K, 1});  // [C, K, 1]: same order as [C, K]
      g.A_log = L.vec(a + "A_log", {Hv});
      g.dt_bias = L.vec(a + "dt_bias", {Hv});
      g.norm = L.vec(a + "norm.weight", {dv});  // plain weight in both layouts
      g.out_proj = L.matrix(a + "out_proj", {H}, Hv * dv);
    } else {
      const std::string a = p + "self_attn.";
      AttnWeights& at = lw.attn;
      at.q_proj = L.matrix(a + "q_proj", {nh * 2 * D}, H);
      at.k_proj = L.matrix(a + "k_proj", {nkv * D}, H);
      at.v_proj = L.matrix(a + "v_proj", {nkv * D}, H);
      at.o_proj = L.matrix(a + "o_proj", {H}, nh * D);
      at.q_norm = L.vec(a + "q_norm.weight", {D});  // 1+w baked in
      at.k_norm = L.vec(a + "k_norm.weight", {D});  // 1+w baked in
    }
    MoeWeights& m = lw.moe;
    const std::string mp = p + "mlp.";
    m.router = L.matrix(mp + "gate", {E}, H);
    const Mat gate = L.matrix(mp + "switch_mlp.gate_proj", {E, I}, H);
    const Mat up = L.matrix(mp + "switch_mlp.up_proj", {E, I}, H);
    const Mat down = L.matrix(mp + "switch_mlp.down_proj", {E, H}, I);
    for (int64_t e = 0; e < E; ++e) {
      m.gate.push_back(gate.slice_rows(e * I, I));
      m.up.push_back(up.slice_rows(e * I, I));
      m.down.push_back(down.slice_rows(e * H, H));
    }
    m.shared_gate = L.matrix(mp + "shared_expert.gate_proj", {Is}, H);
    m.shared_up = L.matrix(mp + "shared_expert.up_proj", {Is}, H);
    m.shared_down = L.matrix(mp + "shared_expert.down_proj", {H}, Is);
    m.shared_expert_gate = L.matrix(mp + "shared_expert_gate", {1}, H);
    w->layers.push_back(std::move(lw));
  }
  // Out of scope, as in the HF loader: the vision tower (mlx-vlm conversions) and the MTP block.
  for (const char* p : kSkipped) tl.skip_prefix(p);
  tl.finish();
  return w;
}

}  // namespace kestrel::quant
