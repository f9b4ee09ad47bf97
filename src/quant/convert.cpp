// `kestrel quantize`: HF bf16 checkpoint -> MLX affine checkpoint (mlx-community layout, as mlx-lm's
// convert + quantize_model + save_model write it; model-spec §7.1). Every input tensor is accounted
// for (TensorLoader::finish); the vision tower and the MTP block are dropped, as mlx-lm does.
// Memory: one output shard (<= 5 GiB by default) is built at a time; the input stays in the mmap.
#include "core/check.h"
#include "core/loader.h"
#include "core/safetensors.h"
#include "quant/progress.h"
#include "quant/quant.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstring>
#include <fstream>

namespace kestrel::quant {

namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

constexpr std::initializer_list<DType> kFloat = {DType::BF16, DType::F16, DType::F32};

struct RowSeg {
  Mat m;
  int64_t r0 = 0, n = 0;
};

// One output unit: a matrix (quantized -> weight/scales/biases, or kept in its dtype) or a small
// tensor copied (optionally with the +1 of zero-centred norms baked in).
struct Job {
  std::string name;             // matrices: module path (".weight" etc. appended); raw: tensor name
  std::vector<int64_t> shape;   // output logical shape ([lead..., K] for matrices)
  int bits = 0;                 // 4/8: quantized; 0: not quantized
  std::vector<RowSeg> rows;     // matrix source rows, concatenated in order
  const TensorInfo* raw = nullptr;
  bool add_one = false;

  bool is_matrix() const { return raw == nullptr; }
  int64_t K() const { return shape.back(); }
  int64_t nrows() const {
    int64_t r = 1;
    for (size_t i = 0; i + 1 < shape.size(); ++i) r *= shape[i];
    return r;
  }
  DType src_dtype() const {
    if (raw) return raw->dtype;
    switch (rows.front().m.fmt) {
      case WFormat::F16: return DType::F16;
      case WFormat::F32: return DType::F32;
      default: return DType::BF16;
    }
  }
  size_t out_bytes() const {
    if (raw) return raw->nbytes;
    if (bits == 0) return size_t(nrows() * K()) * dtype_size(src_dtype());
    return size_t(nrows() * K() * bits / 8) + 2 * size_t(nrows() * (K() / kGroup)) * 2;
  }
  int64_t params() const {
    if (raw) return raw->numel();
    return nrows() * K();
  }
};

struct Out {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

size_t elem_bytes(WFormat f) { return f == WFormat::F32 ? 4 : 2; }

void run_job(const Job& j, std::vector<Out>& outs) {
  if (j.raw) {
    Out o{j.name, j.raw->dtype, j.shape, std::vector<uint8_t>(j.raw->data, j.raw->data + j.raw->nbytes)};
    if (j.add_one) {
      const size_t n = size_t(j.raw->numel());
      if (j.raw->dtype == DType::BF16) {
        for (size_t i = 0; i < n; ++i) {
          uint16_t h;
          std::memcpy(&h, o.bytes.data() + 2 * i, 2);
          h = f32_to_bf16(1.0f + bf16_to_f32(h));  // mlx-lm: v + 1.0 in the weight's dtype
          std::memcpy(o.bytes.data() + 2 * i, &h, 2);
        }
      } else if (j.raw->dtype == DType::F32) {
        for (size_t i = 0; i < n; ++i) {
          float x;
          std::memcpy(&x, o.bytes.data() + 4 * i, 4);
          x += 1.0f;
          std::memcpy(o.bytes.data() + 4 * i, &x, 4);
        }
      } else {
        KESTREL_FAIL("tensor '{}': norm weights of dtype {} are not supported (BF16 or F32)",
                     j.raw->name, dtype_name(j.raw->dtype));
      }
    }
    outs.push_back(std::move(o));
    return;
  }
  const int64_t K = j.K(), N = j.nrows();
  if (j.bits == 0) {
    const size_t eb = elem_bytes(j.rows.front().m.fmt);
    Out o{j.name + ".weight", j.src_dtype(), j.shape, std::vector<uint8_t>(size_t(N * K) * eb)};
    size_t off = 0;
    for (const auto& s : j.rows) {
      KESTREL_CHECK(s.m.fmt == j.rows.front().m.fmt, "'{}': expert matrices of mixed dtypes", j.name);
      const size_t n = size_t(s.n * K) * eb;
      std::memcpy(o.bytes.data() + off, static_cast<const uint8_t*>(s.m.data) + size_t(s.r0 * K) * eb, n);
      off += n;
    }
    outs.push_back(std::move(o));
    return;
  }
  std::vector<int64_t> wshape = j.shape, sshape = j.shape;
  wshape.back() = K * j.bits / 32;
  sshape.back() = K / kGroup;
  Out w{j.name + ".weight", DType::U32, wshape, std::vector<uint8_t>(size_t(N * K * j.bits / 8))};
  Out s{j.name + ".scales", DType::BF16, sshape, std::vector<uint8_t>(size_t(N * (K / kGroup)) * 2)};
  Out b{j.name + ".biases", DType::BF16, sshape, std::vector<uint8_t>(size_t(N * (K / kGroup)) * 2)};
  int64_t r = 0;
  for (const auto& seg : j.rows) {
    quantize_rows(seg.m, seg.r0, seg.n, j.bits, kGroup,
                  reinterpret_cast<uint32_t*>(w.bytes.data()) + r * (K * j.bits / 32),
                  reinterpret_cast<uint16_t*>(s.bytes.data()) + r * (K / kGroup),
                  reinterpret_cast<uint16_t*>(b.bytes.data()) + r * (K / kGroup));
    r += seg.n;
  }
  KESTREL_CHECK(r == N, "'{}': {} source rows for {} output rows", j.name, r, N);
  outs.push_back(std::move(w));
  outs.push_back(std::move(s));
  outs.push_back(std::move(b));
}

// Builds the job list from the HF checkpoint (the same expectations as the HF loader).
struct Planner {
  TensorLoader& tl;
  const ModelConfig& cfg;
  int default_bits;
  std::vector<Job> jobs;
  json overrides = json::object();
  std::vector<std::string> unquantized;
  size_t bytes_in = 0;

  Planner(TensorLoader& l, const ModelConfig& c, int bits) : tl(l), cfg(c), default_bits(bits) {}

  const TensorInfo& take(const std::string& name, const std::vector<int64_t>& shape) {
    const TensorInfo& t = tl.take(name, kFloat, shape);
    bytes_in += t.nbytes;
    return t;
  }
  void raw(const std::string& in, const std::vector<int64_t>& in_shape, const std::string& out,
           std::vector<int64_t> out_shape, bool add_one) {
    Job j;
    j.raw = &take(in, in_shape);
    j.name = out;
    j.shape = std::move(out_shape);
    j.add_one = add_one;
    jobs.push_back(std::move(j));
  }
  void matrix(const std::string& module, std::vector<int64_t> shape, std::vector<RowSeg> rows) {
    Job j;
    j.name = module;
    j.shape = std::move(shape);
    const int want = recipe_module_bits(module) == 8 ? 8 : default_bits;
    j.bits = recipe_bits(want, j.K());
    if (j.bits == 0) unquantized.push_back(module);
    if (j.bits != 0 && j.bits != default_bits)
      overrides[module] = {{"group_size", kGroup}, {"bits", j.bits}};
    j.rows = std::move(rows);
    jobs.push_back(std::move(j));
  }
  // A 2-D HF matrix `in` [N, K] -> MLX module `module`.
  void matrix2d(const std::string& in, int64_t N, int64_t K, const std::string& module) {
    const Mat m = mat_from_tensor(take(in, {N, K}));
    matrix(module, {N, K}, {{m, 0, N}});
  }
};

void copy_side_files(const fs::path& in, const fs::path& out) {
  for (const auto& e : fs::directory_iterator(in)) {
    if (!e.is_regular_file()) continue;
    const std::string n = e.path().filename().string();
    if (n.empty() || n[0] == '.') continue;
    if (n == "config.json" || n == "model.safetensors.index.json") continue;
    const std::string ext = e.path().extension().string();
    // mlx-lm's download patterns minus the weights: *.json, *.jinja, *.txt, tokenizer.model, *.tiktoken
    if (ext == ".json" || ext == ".jinja" || ext == ".txt" || ext == ".tiktoken" ||
        n == "tokenizer.model")
      fs::copy_file(e.path(), out / n, fs::copy_options::overwrite_existing);
  }
}

}  // namespace

ConvertReport convert_hf_to_mlx(const fs::path& in_dir, const fs::path& out_dir,
                                const ConvertOptions& opts) {
  KESTREL_CHECK(opts.bits == 4 || opts.bits == 8, "quantize: bits {} not supported (4 or 8)",
                opts.bits);
  const ModelConfig cfg = load_config(in_dir);
  KESTREL_CHECK(!cfg.quantization, "{}: the checkpoint is already quantized (config.json has a "
                "quantization block); kestrel quantize reads bf16 checkpoints", in_dir.string());
  KESTREL_CHECK(fs::weakly_canonical(in_dir) != fs::weakly_canonical(out_dir),
                "quantize: --out must differ from --model");
  if (fs::exists(out_dir)) {
    KESTREL_CHECK(fs::is_directory(out_dir) && fs::is_empty(out_dir),
                  "quantize: output {} exists and is not an empty directory", out_dir.string());
  }
  json config = read_json_file(in_dir / "config.json");
  std::unique_ptr<Checkpoint> ckpt = Checkpoint::open(in_dir);
  TensorLoader tl(*ckpt);
  Planner P(tl, cfg, opts.bits);

  const std::string root =
      ckpt->find("model.language_model.embed_tokens.weight") ? "model.language_model." : "model.";
  const std::string out_root = "language_model.model.";
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t Hv = cfg.linear_num_value_heads, dv = cfg.linear_value_head_dim;
  const int64_t C = cfg.gdn_conv_dim(), K = cfg.linear_conv_kernel_dim;
  const int64_t nh = cfg.num_attention_heads, nkv = cfg.num_kv_heads, D = cfg.head_dim;
  const int64_t E = cfg.num_experts, I = cfg.moe_intermediate_size;
  const int64_t Is = cfg.shared_expert_intermediate_size;

  P.matrix2d(root + "embed_tokens.weight", V, H, out_root + "embed_tokens");
  P.raw(root + "norm.weight", {H}, out_root + "norm.weight", {H}, true);
  if (!cfg.tie_word_embeddings) P.matrix2d("lm_head.weight", V, H, "language_model.lm_head");
  for (int li = 0; li < cfg.num_layers; ++li) {
    const std::string p = fmt::format("{}layers.{}.", root, li);
    const std::string o = fmt::format("{}layers.{}.", out_root, li);
    P.raw(p + "input_layernorm.weight", {H}, o + "input_layernorm.weight", {H}, true);
    P.raw(p + "post_attention_layernorm.weight", {H}, o + "post_attention_layernorm.weight", {H},
          true);
    if (cfg.layer_types[size_t(li)] == LayerKind::LinearAttention) {
      const std::string a = p + "linear_attn.", b = o + "linear_attn.";
      P.matrix2d(a + "in_proj_qkv.weight", C, H, b + "in_proj_qkv");
      P.matrix2d(a + "in_proj_z.weight", Hv * dv, H, b + "in_proj_z");
      P.matrix2d(a + "in_proj_b.weight", Hv, H, b + "in_proj_b");
      P.matrix2d(a + "in_proj_a.weight", Hv, H, b + "in_proj_a");
      // [C, 1, K] -> [C, K, 1] (mlx sanitize moveaxis(2, 1)): the same bytes.
      P.raw(a + "conv1d.weight", {C, 1, K}, b + "conv1d.weight", {C, K, 1}, false);
      P.raw(a + "A_log", {Hv}, b + "A_log", {Hv}, false);
      P.raw(a + "dt_bias", {Hv}, b + "dt_bias", {Hv}, false);
      P.raw(a + "norm.weight", {dv}, b + "norm.weight", {dv}, false);  // plain weight: no +1
      P.matrix2d(a + "out_proj.weight", H, Hv * dv, b + "out_proj");
    } else {
      const std::string a = p + "self_attn.", b = o + "self_attn.";
      P.matrix2d(a + "q_proj.weight", nh * 2 * D, H, b + "q_proj");
      P.matrix2d(a + "k_proj.weight", nkv * D, H, b + "k_proj");
      P.matrix2d(a + "v_proj.weight", nkv * D, H, b + "v_proj");
      P.matrix2d(a + "o_proj.weight", H, nh * D, b + "o_proj");
      P.raw(a + "q_norm.weight", {D}, b + "q_norm.weight", {D}, true);
      P.raw(a + "k_norm.weight", {D}, b + "k_norm.weight", {D}, true);
    }
    const std::string mp = p + "mlp.", mo = o + "mlp.";
    P.matrix2d(mp + "gate.weight", E, H, mo + "gate");
    std::vector<RowSeg> gate, up, down;
    if (tl.has(mp + "experts.gate_up_proj")) {  // fused [E, 2I, H] + [E, H, I]
      const Mat gu = mat_from_tensor(P.take(mp + "experts.gate_up_proj", {E, 2 * I, H}));
      const Mat dn = mat_from_tensor(P.take(mp + "experts.down_proj", {E, H, I}));
      for (int64_t e = 0; e < E; ++e) {
        gate.push_back({gu, e * 2 * I, I});
        up.push_back({gu, e * 2 * I + I, I});
        down.push_back({dn, e * H, H});
      }
    } else {  // per expert
      for (int64_t e = 0; e < E; ++e) {
        const std::string ep = fmt::format("{}experts.{}.", mp, e);
        gate.push_back({mat_from_tensor(P.take(ep + "gate_proj.weight", {I, H})), 0, I});
        up.push_back({mat_from_tensor(P.take(ep + "up_proj.weight", {I, H})), 0, I});
        down.push_back({mat_from_tensor(P.take(ep + "down_proj.weight", {H, I})), 0, H});
      }
    }
    P.matrix(mo + "switch_mlp.gate_proj", {E, I, H}, std::move(gate));
    P.matrix(mo + "switch_mlp.up_proj", {E, I, H}, std::move(up));
    P.matrix(mo + "switch_mlp.down_proj", {E, H, I}, std::move(down));
    P.matrix2d(mp + "shared_expert.gate_proj.weight", Is, H, mo + "shared_expert.gate_proj");
    P.matrix2d(mp + "shared_expert.up_proj.weight", Is, H, mo + "shared_expert.up_proj");
    P.matrix2d(mp + "shared_expert.down_proj.weight", H, Is, mo + "shared_expert.down_proj");
    P.matrix2d(mp + "shared_expert_gate.weight", 1, H, mo + "shared_expert_gate");
  }
  ConvertReport rep;
  for (const auto& [name, _] : ckpt->all())
    if (name.rfind("model.visual.", 0) == 0 || name.rfind("mtp.", 0) == 0) ++rep.dropped;
  tl.skip_prefix("model.visual.");
  tl.skip_prefix("mtp.");
  tl.finish();
  rep.bytes_in = P.bytes_in;
  rep.unquantized = P.unquantized;

  // Shards as mlx-lm's make_shards: a new shard when the next unit would exceed the limit.
  std::vector<std::vector<size_t>> shards(1);
  size_t cur = 0, total_out = 0;
  int64_t total_params = 0;
  for (size_t i = 0; i < P.jobs.size(); ++i) {
    const size_t b = P.jobs[i].out_bytes();
    if (cur + b > opts.max_shard_bytes && !shards.back().empty()) {
      shards.emplace_back();
      cur = 0;
    }
    shards.back().push_back(i);
    cur += b;
    total_out += b;
    total_params += P.jobs[i].params();
  }
  fs::create_directories(out_dir);
  json weight_map = json::object();
  size_t done_in = 0;
  for (size_t si = 0; si < shards.size(); ++si) {
    const std::string fname = shards.size() == 1
                                  ? std::string("model.safetensors")
                                  : fmt::format("model-{:05d}-of-{:05d}.safetensors", si + 1,
                                                shards.size());
    std::vector<Out> outs;
    for (size_t ji : shards[si]) {
      const Job& j = P.jobs[ji];
      run_job(j, outs);
      // The source bf16 pages are done with: keep the resident set at about one output shard.
      if (j.raw) {
        release_pages(j.raw->data, j.raw->nbytes);
      } else {
        for (const auto& sg : j.rows) {
          const size_t eb = elem_bytes(sg.m.fmt);
          release_pages(static_cast<const uint8_t*>(sg.m.data) + size_t(sg.r0 * j.K()) * eb,
                        size_t(sg.n * j.K()) * eb);
        }
      }
      done_in += j.raw ? j.raw->nbytes
                       : [&] {
                           size_t n = 0;
                           for (const auto& s : j.rows) n += size_t(s.n * j.K()) * elem_bytes(s.m.fmt);
                           return n;
                         }();
      if (opts.progress) opts.progress(done_in, rep.bytes_in);
    }
    // u32 first, then 4-byte floats, then 2-byte: every tensor's offset stays aligned to its size.
    std::stable_sort(outs.begin(), outs.end(), [](const Out& a, const Out& b) {
      return dtype_size(a.dtype) > dtype_size(b.dtype);
    });
    std::vector<TensorToWrite> tw;
    for (const auto& o : outs) {
      tw.push_back({o.name, o.dtype, o.shape, o.bytes});
      weight_map[o.name] = fname;
      rep.bytes_out += o.bytes.size();
    }
    write_safetensors(out_dir / fname, tw, {{"format", "mlx"}});
    rep.tensors_written += tw.size();
  }
  rep.shards = shards.size();
  rep.parameters = total_params;
  (void)total_out;
  {
    json index = {{"metadata", {{"total_size", rep.bytes_out}, {"total_parameters", total_params}}},
                  {"weight_map", weight_map}};
    std::ofstream f(out_dir / "model.safetensors.index.json");
    f << index.dump(4) << "\n";
    KESTREL_CHECK(f.good(), "cannot write {}", (out_dir / "model.safetensors.index.json").string());
  }
  copy_side_files(in_dir, out_dir);

  // config.json last, so an interrupted run leaves no loadable directory. As mlx-lm's
  // quantize_model + save_config: a "quantization" block with one override per 8-bit module,
  // mirrored in "quantization_config"; vision_config removed with the vision weights.
  json q = {{"group_size", kGroup}, {"bits", opts.bits}, {"mode", "affine"}};
  for (auto it = P.overrides.begin(); it != P.overrides.end(); ++it) q[it.key()] = it.value();
  config["quantization"] = q;
  config["quantization_config"] = q;
  config.erase("vision_config");
  {
    std::ofstream f(out_dir / "config.json");
    f << config.dump(4) << "\n";
    KESTREL_CHECK(f.good(), "cannot write {}", (out_dir / "config.json").string());
  }
  return rep;
}

}  // namespace kestrel::quant
