// config.json parsing and architecture validation (model-spec §1).
#include "core/config.h"

#include "core/check.h"

#include <cmath>
#include <fstream>
#include <sstream>

namespace kestrel {

using nlohmann::json;

json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  KESTREL_CHECK(in.good(), "cannot open {}", path.string());
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::parse_error& e) {
    KESTREL_FAIL("{}: malformed JSON: {}", path.string(), e.what());
  }
}

namespace {

// Typed field access with messages that name the file, the field and what was expected.
struct Fields {
  const json& j;
  const std::string& src;
  std::string prefix;

  const json* find(const char* key) const {
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }
  std::string name(const char* key) const { return prefix + key; }

  int integer(const char* key) const {
    const json* v = find(key);
    KESTREL_CHECK(v, "{}: missing field '{}' (an integer)", src, name(key));
    KESTREL_CHECK(v->is_number_integer(), "{}: field '{}' = {} is not an integer", src, name(key),
                  v->dump());
    const auto x = v->get<int64_t>();
    KESTREL_CHECK(x >= 0 && x <= (int64_t(1) << 31) - 1, "{}: field '{}' = {} is out of range", src,
                  name(key), x);
    return int(x);
  }
  int integer_or(const char* key, int dflt) const { return find(key) ? integer(key) : dflt; }

  double number(const char* key) const {
    const json* v = find(key);
    KESTREL_CHECK(v, "{}: missing field '{}' (a number)", src, name(key));
    KESTREL_CHECK(v->is_number(), "{}: field '{}' = {} is not a number", src, name(key), v->dump());
    const double x = v->get<double>();
    KESTREL_CHECK(std::isfinite(x), "{}: field '{}' is not finite", src, name(key));
    return x;
  }
  double number_or(const char* key, double dflt) const { return find(key) ? number(key) : dflt; }

  bool boolean_or(const char* key, bool dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    KESTREL_CHECK(v->is_boolean(), "{}: field '{}' = {} is not a boolean", src, name(key), v->dump());
    return v->get<bool>();
  }
  std::string string_or(const char* key, const std::string& dflt) const {
    const json* v = find(key);
    if (!v) return dflt;
    KESTREL_CHECK(v->is_string(), "{}: field '{}' = {} is not a string", src, name(key), v->dump());
    return v->get<std::string>();
  }
};

#define EXPECT_FIELD(cond, field, value, expected)                                              \
  KESTREL_CHECK(cond, "{}: field '{}' = {} does not fit Qwen3.6-35B-A3B (expected {})", src, \
                field, value, expected)

std::vector<int> int_list(const json& v, const std::string& src, const std::string& field) {
  std::vector<int> out;
  if (v.is_number_integer()) {
    out.push_back(v.get<int>());
  } else {
    KESTREL_CHECK(v.is_array(), "{}: field '{}' = {} is not an integer or a list", src, field,
                  v.dump());
    for (const auto& x : v) {
      KESTREL_CHECK(x.is_number_integer(), "{}: field '{}' has a non-integer entry {}", src, field,
                    x.dump());
      out.push_back(x.get<int>());
    }
  }
  return out;
}

void parse_quantization(const json& q, const std::string& src, ModelConfig& c) {
  KESTREL_CHECK(q.is_object(), "{}: field 'quantization' = {} is not an object", src, q.dump());
  QuantizationConfig qc;
  Fields f{q, src, "quantization."};
  qc.bits = f.integer("bits");
  qc.group_size = f.integer("group_size");
  qc.mode = f.string_or("mode", "affine");
  for (auto it = q.begin(); it != q.end(); ++it) {
    if (!it.value().is_object()) continue;
    Fields o{it.value(), src, "quantization." + it.key() + "."};
    qc.overrides.push_back({it.key(), o.integer("bits"), o.integer_or("group_size", qc.group_size)});
  }
  c.quantization = qc;
}

}  // namespace

int ModelConfig::num_full_layers() const {
  int n = 0;
  for (auto k : layer_types) n += k == LayerKind::FullAttention;
  return n;
}

bool ModelConfig::has_real_widths() const {
  return hidden_size == 2048 && num_attention_heads == 16 && num_kv_heads == 2 && head_dim == 256 &&
         linear_num_key_heads == 16 && linear_num_value_heads == 32 && linear_key_head_dim == 128 &&
         linear_value_head_dim == 128 && moe_intermediate_size == 512 &&
         shared_expert_intermediate_size == 512 && rotary_dim == 64;
}

ModelConfig parse_config(const json& root, const std::string& src) {
  KESTREL_CHECK(root.is_object(), "{}: top level is not a JSON object", src);
  ModelConfig c;
  const json* text = &root;
  std::string prefix;
  if (auto it = root.find("text_config"); it != root.end()) {
    KESTREL_CHECK(it->is_object(), "{}: field 'text_config' is not an object", src);
    text = &*it;
    prefix = "text_config.";
    c.multimodal_wrapper = true;
    Fields top{root, src, ""};
    const std::string mt = top.string_or("model_type", "qwen3_5_moe");
    EXPECT_FIELD(mt == "qwen3_5_moe", "model_type", mt, "\"qwen3_5_moe\"");
  }
  Fields f{*text, src, prefix};
  {
    const std::string mt = f.string_or("model_type", "qwen3_5_moe_text");
    EXPECT_FIELD(mt == "qwen3_5_moe_text" || mt == "qwen3_5_moe", f.name("model_type"), mt,
                 "\"qwen3_5_moe_text\"");
  }

  c.hidden_size = f.integer("hidden_size");
  c.num_layers = f.integer("num_hidden_layers");
  c.vocab_size = f.integer("vocab_size");
  c.rms_norm_eps = float(f.number_or("rms_norm_eps", 1e-6));
  c.max_position_embeddings = f.integer_or("max_position_embeddings", 262144);
  c.full_attention_interval = f.integer_or("full_attention_interval", 4);

  c.num_attention_heads = f.integer("num_attention_heads");
  c.num_kv_heads = f.integer("num_key_value_heads");
  c.head_dim = f.integer("head_dim");
  c.linear_num_key_heads = f.integer("linear_num_key_heads");
  c.linear_num_value_heads = f.integer("linear_num_value_heads");
  c.linear_key_head_dim = f.integer("linear_key_head_dim");
  c.linear_value_head_dim = f.integer("linear_value_head_dim");
  c.linear_conv_kernel_dim = f.integer("linear_conv_kernel_dim");
  c.num_experts = f.integer("num_experts");
  c.num_experts_per_tok = f.integer("num_experts_per_tok");
  c.moe_intermediate_size = f.integer("moe_intermediate_size");
  c.shared_expert_intermediate_size = f.integer("shared_expert_intermediate_size");
  c.mtp_num_hidden_layers = f.integer_or("mtp_num_hidden_layers", 0);

  // Rope: rope_parameters (transformers v5) or legacy rope_theta / partial_rotary_factor.
  double theta = f.number_or("rope_theta", 0);
  double prf = f.number_or("partial_rotary_factor", 0);
  if (const json* rp = f.find("rope_parameters")) {
    KESTREL_CHECK(rp->is_object(), "{}: field '{}' is not an object", src, f.name("rope_parameters"));
    Fields r{*rp, src, f.name("rope_parameters") + "."};
    const std::string type = r.string_or("rope_type", "default");
    EXPECT_FIELD(type == "default", r.name("rope_type"), type,
                 "\"default\" (YaRN is not supported by kestrel)");
    theta = r.number_or("rope_theta", theta);
    prf = r.number_or("partial_rotary_factor", prf);
  }
  if (const json* rs = f.find("rope_scaling")) {
    KESTREL_CHECK(false, "{}: field '{}' = {} is not supported (expected no rope scaling)", src,
                  f.name("rope_scaling"), rs->dump());
  }
  c.rope_theta = theta;
  c.partial_rotary_factor = float(prf);

  // Architecture checks. Counts are free (tiny test models); relations are fixed.
  EXPECT_FIELD(c.hidden_size > 0 && c.hidden_size % 64 == 0, f.name("hidden_size"), c.hidden_size,
               "a positive multiple of 64");
  EXPECT_FIELD(c.num_layers > 0, f.name("num_hidden_layers"), c.num_layers, "> 0");
  EXPECT_FIELD(c.vocab_size > 0, f.name("vocab_size"), c.vocab_size, "> 0");
  EXPECT_FIELD(c.full_attention_interval > 0, f.name("full_attention_interval"),
               c.full_attention_interval, "> 0");
  EXPECT_FIELD(c.rms_norm_eps > 0 && c.rms_norm_eps < 1e-2, f.name("rms_norm_eps"), c.rms_norm_eps,
               "a small positive number (1e-6)");
  const json* lt = f.find("layer_types");
  KESTREL_CHECK(lt && lt->is_array(), "{}: field '{}' is missing or not a list", src,
                f.name("layer_types"));
  EXPECT_FIELD(int(lt->size()) == c.num_layers, f.name("layer_types") + " length", lt->size(),
               fmt::format("num_hidden_layers = {}", c.num_layers));
  for (size_t i = 0; i < lt->size(); ++i) {
    const json& e = (*lt)[i];
    const std::string s = e.is_string() ? e.get<std::string>() : e.dump();
    const bool want_full = (int(i) + 1) % c.full_attention_interval == 0;
    const char* expected = want_full ? "\"full_attention\"" : "\"linear_attention\"";
    EXPECT_FIELD(s == (want_full ? "full_attention" : "linear_attention"),
                 fmt::format("{}layer_types[{}]", prefix, i), s,
                 fmt::format("{} (full attention every {} layers)", expected,
                             c.full_attention_interval));
    c.layer_types.push_back(want_full ? LayerKind::FullAttention : LayerKind::LinearAttention);
  }
  EXPECT_FIELD(c.num_kv_heads > 0 && c.num_attention_heads > 0 &&
                   c.num_attention_heads % c.num_kv_heads == 0,
               f.name("num_key_value_heads"), c.num_kv_heads,
               fmt::format("a divisor of num_attention_heads = {}", c.num_attention_heads));
  EXPECT_FIELD(c.head_dim > 0 && c.head_dim % 2 == 0, f.name("head_dim"), c.head_dim,
               "a positive even number");
  EXPECT_FIELD(c.linear_num_key_heads > 0 &&
                   c.linear_num_value_heads == 2 * c.linear_num_key_heads,
               f.name("linear_num_value_heads"), c.linear_num_value_heads,
               fmt::format("2 x linear_num_key_heads = {}", 2 * c.linear_num_key_heads));
  EXPECT_FIELD(c.linear_key_head_dim > 0 && c.linear_key_head_dim == c.linear_value_head_dim,
               f.name("linear_value_head_dim"), c.linear_value_head_dim,
               fmt::format("linear_key_head_dim = {}", c.linear_key_head_dim));
  EXPECT_FIELD(c.linear_conv_kernel_dim == 4, f.name("linear_conv_kernel_dim"),
               c.linear_conv_kernel_dim, 4);
  EXPECT_FIELD(c.num_experts > 0, f.name("num_experts"), c.num_experts, "> 0");
  EXPECT_FIELD(c.num_experts_per_tok > 0 && c.num_experts_per_tok <= c.num_experts,
               f.name("num_experts_per_tok"), c.num_experts_per_tok,
               fmt::format("1..num_experts = {}", c.num_experts));
  EXPECT_FIELD(c.moe_intermediate_size > 0, f.name("moe_intermediate_size"),
               c.moe_intermediate_size, "> 0");
  EXPECT_FIELD(c.shared_expert_intermediate_size > 0, f.name("shared_expert_intermediate_size"),
               c.shared_expert_intermediate_size, "> 0");
  EXPECT_FIELD(c.rope_theta > 0, f.name("rope_parameters.rope_theta"), c.rope_theta, "> 0");
  const double rot = c.head_dim * c.partial_rotary_factor;
  EXPECT_FIELD(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1 &&
                   rot == std::floor(rot) && int(rot) % 2 == 0,
               f.name("partial_rotary_factor"), c.partial_rotary_factor,
               "a fraction of head_dim giving an even rotary dim (0.25)");
  c.rotary_dim = int(rot);
  c.tie_word_embeddings = root.value("tie_word_embeddings", false) ||
                          (text->contains("tie_word_embeddings") &&
                           (*text)["tie_word_embeddings"].is_boolean() &&
                           (*text)["tie_word_embeddings"].get<bool>());
  EXPECT_FIELD(!c.tie_word_embeddings, "tie_word_embeddings", "true", "false (untied lm_head)");
  {
    Fields t{*text, src, prefix};
    EXPECT_FIELD(!t.boolean_or("attention_bias", false), f.name("attention_bias"), "true", "false");
    const std::string act = t.string_or("hidden_act", "silu");
    EXPECT_FIELD(act == "silu", f.name("hidden_act"), act, "\"silu\"");
  }
  if (const json* mlp_only = f.find("mlp_only_layers")) {
    EXPECT_FIELD(mlp_only->is_array() && mlp_only->empty(), f.name("mlp_only_layers"),
                 mlp_only->dump(), "[] (every layer is MoE)");
  }
  if (const json* step = f.find("decoder_sparse_step")) {
    EXPECT_FIELD(step->is_number_integer() && step->get<int>() == 1, f.name("decoder_sparse_step"),
                 step->dump(), 1);
  }
  if (const json* norm_topk = f.find("norm_topk_prob")) {
    EXPECT_FIELD(norm_topk->is_boolean() && norm_topk->get<bool>(), f.name("norm_topk_prob"),
                 norm_topk->dump(), "true (top-k weights are always renormalised)");
  }

  // eos: top-level list (official wrapper) or text_config's.
  if (auto it = root.find("eos_token_id"); it != root.end() && !it->is_null()) {
    c.eos_token_ids = int_list(*it, src, "eos_token_id");
  } else if (const json* e = f.find("eos_token_id")) {
    c.eos_token_ids = int_list(*e, src, f.name("eos_token_id"));
  }
  c.bos_token_id = f.integer_or("bos_token_id", -1);

  if (auto it = root.find("quantization"); it != root.end() && !it->is_null()) {
    parse_quantization(*it, src, c);
  } else if (auto it2 = root.find("quantization_config"); it2 != root.end() && !it2->is_null()) {
    KESTREL_CHECK(it2->is_object() && it2->contains("bits") && it2->contains("group_size"),
                  "{}: field 'quantization_config' = {} is not supported (kestrel loads bf16 "
                  "checkpoints and MLX affine 4/8-bit ones)",
                  src, it2->dump().substr(0, 200));
    parse_quantization(*it2, src, c);
  }
  return c;
}

ModelConfig load_config(const std::filesystem::path& model_dir) {
  const auto path = model_dir / "config.json";
  KESTREL_CHECK(std::filesystem::exists(path), "{}: no config.json in the model directory",
                model_dir.string());
  return parse_config(read_json_file(path), path.string());
}

}  // namespace kestrel
