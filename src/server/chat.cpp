// Request validation, template rendering with placeholder escaping, and job construction.
#include "server/chat.h"

#include "chat/chat_template.h"
#include "core/check.h"
#include "server/api_error.h"
#include "server/text_stream.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <random>
#include <sstream>

namespace kestrel::server {

namespace {
using json = nlohmann::json;

const json* field(const json& b, const char* k) {
  auto it = b.find(k);
  if (it == b.end() || it->is_null()) return nullptr;
  return &*it;
}

std::optional<double> opt_num(const json& b, const char* k, double lo, double hi) {
  const json* v = field(b, k);
  if (!v) return std::nullopt;
  if (!v->is_number() || !std::isfinite(v->get<double>()) || v->get<double>() < lo || v->get<double>() > hi)
    throw invalid(fmt::format("'{}' must be a number between {} and {}", k, lo, hi), k);
  return v->get<double>();
}

std::optional<int64_t> opt_int(const json& b, const char* k, int64_t lo, int64_t hi) {
  const json* v = field(b, k);
  if (!v) return std::nullopt;
  auto bad = [&] { return invalid(fmt::format("'{}' must be an integer between {} and {}", k, lo, hi), k); };
  if (v->is_number_unsigned()) {
    uint64_t u = v->get<uint64_t>();
    if (u > uint64_t(INT64_MAX) || int64_t(u) > hi || int64_t(u) < lo) throw bad();
    return int64_t(u);
  }
  if (v->is_number_integer()) {
    int64_t x = v->get<int64_t>();
    if (x < lo || x > hi) throw bad();
    return x;
  }
  if (v->is_number_float()) {
    double d = v->get<double>();
    if (!std::isfinite(d) || d != std::floor(d) || d < double(lo) || d > double(hi)) throw bad();
    return int64_t(d);
  }
  throw bad();
}

std::optional<bool> opt_bool(const json& b, const char* k) {
  const json* v = field(b, k);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) throw invalid(fmt::format("'{}' must be a boolean", k), k);
  return v->get<bool>();
}

std::string req_string(const json& v, const std::string& param) {
  if (!v.is_string()) throw invalid(fmt::format("'{}' must be a string", param), param);
  return v.get<std::string>();
}

// Client text with every added-token string (and the placeholder marker itself) swapped for
// "\uE000<n>\uE001", so that no client text can match a control token after rendering.
constexpr std::string_view kPhOpen = "\xEE\x80\x80";   // U+E000
constexpr std::string_view kPhClose = "\xEE\x80\x81";  // U+E001
class Escaper {
 public:
  explicit Escaper(const std::vector<std::string>& added) : added_(added) {
    for (const auto& a : added_)
      if (!a.empty()) first_[static_cast<unsigned char>(a[0])] = true;
    first_[static_cast<unsigned char>(kPhOpen[0])] = true;
  }
  // Full added tokens anywhere, and a partial one at either end (the template's own text next to it,
  // e.g. the ">" after a parameter name, could complete it), become placeholders.
  std::string esc(std::string_view s) {
    std::string out;
    size_t i = 0, last = 0;
    auto place = [&](size_t b, size_t e) {
      out.append(s.substr(last, b - last));
      out.append(kPhOpen);
      out.append(std::to_string(orig_.size()));
      out.append(kPhClose);
      orig_.emplace_back(s.substr(b, e - b));
      last = e;
    };
    size_t lead = 0;
    for (const auto& a : added_)
      for (size_t k = std::min(a.size() ? a.size() - 1 : 0, s.size()); k > lead; --k)
        if (s.substr(0, k) == std::string_view(a).substr(a.size() - k)) { lead = k; break; }
    size_t trail = 0;
    for (const auto& a : added_)
      for (size_t k = std::min(a.size() ? a.size() - 1 : 0, s.size()); k > trail; --k)
        if (s.substr(s.size() - k) == std::string_view(a).substr(0, k)) { trail = k; break; }
    if (lead + trail >= s.size() && (lead || trail)) {
      place(0, s.size());
      return out;
    }
    if (lead) place(0, lead);
    i = lead;
    const size_t end = s.size() - trail;
    while (i < end) {
      if (!first_[static_cast<unsigned char>(s[i])]) { ++i; continue; }
      size_t len = 0;
      if (s.substr(i, kPhOpen.size()) == kPhOpen) {
        len = kPhOpen.size();
      } else {
        for (const auto& a : added_)  // longest first
          if (!a.empty() && s.substr(i, a.size()) == a) { len = a.size(); break; }
      }
      if (!len) { ++i; continue; }
      place(i, i + len);
      i += len;
    }
    if (trail && last < end) {
      out.append(s.substr(last, end - last));
      last = end;
    }
    if (trail) place(std::max(last, end), s.size());
    if (last == 0) return std::string(s);
    out.append(s.substr(last));
    return out;
  }
  json esc_json(const json& j) {
    if (j.is_string()) return esc(j.get<std::string>());
    if (j.is_array()) {
      json a = json::array();
      for (const auto& x : j) a.push_back(esc_json(x));
      return a;
    }
    if (j.is_object()) {
      json o = json::object();
      for (auto it = j.begin(); it != j.end(); ++it) o[esc(it.key())] = esc_json(it.value());
      return o;
    }
    return j;
  }
  std::string unesc(std::string_view s) const {
    std::string out;
    size_t i = 0;
    while (true) {
      size_t p = s.find(kPhOpen, i);
      if (p == std::string_view::npos) break;
      size_t q = s.find(kPhClose, p);
      if (q == std::string_view::npos) break;
      out.append(s.substr(i, p - i));
      std::string num(s.substr(p + kPhOpen.size(), q - p - kPhOpen.size()));
      size_t n = 0;
      bool ok = !num.empty() && std::all_of(num.begin(), num.end(), ::isdigit) && (n = std::stoul(num)) < orig_.size();
      out.append(ok ? std::string_view(orig_[n]) : s.substr(p, q + kPhClose.size() - p));
      i = q + kPhClose.size();
    }
    out.append(s.substr(i));
    return out;
  }

 private:
  const std::vector<std::string>& added_;
  bool first_[256] = {};
  std::vector<std::string> orig_;
};

// Concatenated text of a content value (string, text parts, or null).
std::string flatten_content(const json& c, const std::string& param) {
  if (c.is_null()) return "";
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) throw invalid(fmt::format("'{}' must be a string or an array of content parts", param), param);
  std::string s;
  for (size_t i = 0; i < c.size(); ++i) {
    const auto& p = c[i];
    std::string pp = fmt::format("{}[{}]", param, i);
    if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
      throw invalid(fmt::format("'{}' must be an object with a string 'type'", pp), pp);
    std::string t = p["type"].get<std::string>();
    if (t == "text" || t == "input_text") {
      if (!p.contains("text") || !p["text"].is_string())
        throw invalid(fmt::format("'{}.text' must be a string", pp), pp + ".text");
      s += p["text"].get<std::string>();
    } else if (t == "image_url" || t == "input_audio" || t == "file" || t == "image" || t == "video" ||
               t == "input_image") {
      throw invalid(fmt::format("content part type '{}' is not supported: this server is text-only", t), pp + ".type");
    } else if (t == "refusal") {
      if (p.contains("refusal") && p["refusal"].is_string()) s += p["refusal"].get<std::string>();
    } else {
      throw invalid(fmt::format("unknown content part type '{}'", t), pp + ".type");
    }
  }
  return s;
}

bool valid_tool_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  return std::all_of(n.begin(), n.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.';
  });
}

json validate_tools(const json& body) {
  const json* t = field(body, "tools");
  if (!t) return json::array();
  if (!t->is_array()) throw invalid("'tools' must be an array", "tools");
  json out = json::array();
  for (size_t i = 0; i < t->size(); ++i) {
    const auto& x = (*t)[i];
    std::string p = fmt::format("tools[{}]", i);
    if (!x.is_object()) throw invalid(fmt::format("'{}' must be an object", p), p);
    if (x.value("type", std::string()) != "function")
      throw invalid(fmt::format("'{}.type' must be \"function\"", p), p + ".type");
    if (!x.contains("function") || !x["function"].is_object())
      throw invalid(fmt::format("'{}.function' must be an object", p), p + ".function");
    const auto& f = x["function"];
    if (!f.contains("name") || !f["name"].is_string() || !valid_tool_name(f["name"].get<std::string>()))
      throw invalid(fmt::format("'{}.function.name' must match [a-zA-Z0-9_.-]{{1,64}}", p), p + ".function.name");
    if (f.contains("description") && !f["description"].is_string() && !f["description"].is_null())
      throw invalid(fmt::format("'{}.function.description' must be a string", p), p + ".function.description");
    if (f.contains("parameters") && !f["parameters"].is_object() && !f["parameters"].is_null())
      throw invalid(fmt::format("'{}.function.parameters' must be a JSON Schema object", p), p + ".function.parameters");
    out.push_back(x);
  }
  return out;
}

struct ChatMessages {
  json messages = json::array();
};

// OpenAI messages -> what render_chat expects: developer/system merged into one leading system
// message, content parts flattened, `reasoning` accepted as `reasoning_content`, arguments parsed.
json normalize_messages(const json& body) {
  const json* m = field(body, "messages");
  if (!m) throw invalid("'messages' is required", "messages");
  if (!m->is_array() || m->empty()) throw invalid("'messages' must be a non-empty array", "messages");
  std::string system;
  bool have_system = false;
  json rest = json::array();
  for (size_t i = 0; i < m->size(); ++i) {
    const auto& msg = (*m)[i];
    std::string p = fmt::format("messages[{}]", i);
    if (!msg.is_object()) throw invalid(fmt::format("'{}' must be an object", p), p);
    if (!msg.contains("role") || !msg["role"].is_string())
      throw invalid(fmt::format("'{}.role' must be a string", p), p + ".role");
    std::string role = msg["role"].get<std::string>();
    json content = msg.contains("content") ? msg["content"] : json(nullptr);
    std::string text = flatten_content(content, p + ".content");
    if (role == "system" || role == "developer") {
      if (have_system) system += "\n\n";
      system += text;
      have_system = true;
      continue;
    }
    json out = {{"role", role}, {"content", text}};
    if (role == "user") {
    } else if (role == "assistant") {
      const json* rc = field(msg, "reasoning_content");
      if (!rc) rc = field(msg, "reasoning");
      if (rc) {
        out["reasoning_content"] = req_string(*rc, p + ".reasoning_content");
      } else if (text.find("</think>") != std::string::npos) {
        // The template's own split (chat_template.jinja), done here so the tags never reach it as text.
        std::string before = text.substr(0, text.find("</think>"));
        while (!before.empty() && before.back() == '\n') before.pop_back();
        size_t o = before.rfind("<think>");
        if (o != std::string::npos) before = before.substr(o + 7);
        size_t b = before.find_first_not_of('\n');
        before = b == std::string::npos ? "" : before.substr(b);
        std::string after = text.substr(text.rfind("</think>") + 8);
        size_t a = after.find_first_not_of('\n');
        after = a == std::string::npos ? "" : after.substr(a);
        out["reasoning_content"] = before;
        out["content"] = after;
      }
      if (const json* tc = field(msg, "tool_calls")) {
        if (!tc->is_array()) throw invalid(fmt::format("'{}.tool_calls' must be an array", p), p + ".tool_calls");
        json calls = json::array();
        for (size_t k = 0; k < tc->size(); ++k) {
          const auto& c = (*tc)[k];
          std::string cp = fmt::format("{}.tool_calls[{}]", p, k);
          if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
            throw invalid(fmt::format("'{}.function' must be an object", cp), cp + ".function");
          const auto& f = c["function"];
          if (!f.contains("name") || !f["name"].is_string())
            throw invalid(fmt::format("'{}.function.name' must be a string", cp), cp + ".function.name");
          json args = f.contains("arguments") ? f["arguments"] : json::object();
          if (args.is_string()) {
            json parsed;
            if (try_parse_json(args.get<std::string>(), parsed) && parsed.is_object()) args = parsed;
          } else if (!args.is_object() && !args.is_null()) {
            throw invalid(fmt::format("'{}.function.arguments' must be a JSON string or an object", cp),
                          cp + ".function.arguments");
          }
          if (args.is_null()) args = json::object();
          json call = {{"type", "function"}, {"function", {{"name", f["name"]}, {"arguments", args}}}};
          if (c.contains("id") && c["id"].is_string()) call["id"] = c["id"];
          calls.push_back(call);
        }
        if (!calls.empty()) out["tool_calls"] = calls;
      }
    } else if (role == "tool") {
      if (const json* id = field(msg, "tool_call_id")) out["tool_call_id"] = req_string(*id, p + ".tool_call_id");
    } else {
      throw invalid(fmt::format("'{}.role' must be one of system, developer, user, assistant, tool; got '{}'", p,
                                utf8_sanitize(role.substr(0, 32))),
                    p + ".role");
    }
    if (const json* n = field(msg, "name")) out["name"] = req_string(*n, p + ".name");
    rest.push_back(out);
  }
  json msgs = json::array();
  if (have_system) msgs.push_back({{"role", "system"}, {"content", system}});
  for (auto& x : rest) msgs.push_back(std::move(x));
  return msgs;
}

std::vector<int32_t> tokenize_rendered(const std::string& text, const Escaper& esc, const ModelInfo& mi) {
  std::vector<int32_t> ids;
  bool first[256] = {};
  for (const auto& a : mi.added)
    if (!a.empty()) first[static_cast<unsigned char>(a[0])] = true;
  size_t i = 0, seg = 0;
  auto flush = [&](size_t end) {
    if (end > seg) {
      std::string plain = esc.unesc(std::string_view(text).substr(seg, end - seg));
      auto part = mi.tok->encode(plain, false);
      ids.insert(ids.end(), part.begin(), part.end());
    }
  };
  while (i < text.size()) {
    if (!first[static_cast<unsigned char>(text[i])]) { ++i; continue; }
    const std::string* hit = nullptr;
    for (const auto& a : mi.added)
      if (!a.empty() && text.compare(i, a.size(), a) == 0) { hit = &a; break; }
    if (!hit) { ++i; continue; }
    flush(i);
    auto id = mi.tok->token_id(*hit);
    KESTREL_CHECK(id.has_value(), "added token '{}' has no id", *hit);
    ids.push_back(*id);
    i += hit->size();
    seg = i;
  }
  flush(text.size());
  return ids;
}

std::vector<std::string> parse_stop(const json& body) {
  const json* s = field(body, "stop");
  std::vector<std::string> out;
  if (!s) return out;
  auto one = [&](const json& v) {
    if (!v.is_string() || v.get<std::string>().empty() || v.get<std::string>().size() > 1024)
      throw invalid("'stop' entries must be non-empty strings of at most 1024 bytes", "stop");
    out.push_back(v.get<std::string>());
  };
  if (s->is_string()) {
    one(*s);
  } else if (s->is_array()) {
    if (s->size() > 16) throw invalid("'stop' may hold at most 16 strings", "stop");
    for (const auto& v : *s) one(v);
  } else {
    throw invalid("'stop' must be a string or an array of strings", "stop");
  }
  return out;
}

void parse_common(const json& body, const ModelInfo& mi, PreparedRequest& r) {
  check_model(body, mi);
  r.stream = opt_bool(body, "stream").value_or(false);
  if (const json* so = field(body, "stream_options")) {
    if (!so->is_object()) throw invalid("'stream_options' must be an object", "stream_options");
    if (auto iu = field(*so, "include_usage")) {
      if (!iu->is_boolean()) throw invalid("'stream_options.include_usage' must be a boolean", "stream_options.include_usage");
      r.include_usage = iu->get<bool>();
    }
  }
  if (auto n = opt_int(body, "n", 1, 128); n && *n != 1) throw invalid("only n=1 is supported", "n");
  if (auto n = opt_int(body, "best_of", 1, 128); n && *n != 1) throw invalid("only best_of=1 is supported", "best_of");
  SamplingParams sp = mi.defaults;
  if (auto v = opt_num(body, "temperature", 0, 2)) sp.temperature = float(*v);
  if (auto v = opt_num(body, "top_p", 0, 1)) {
    if (*v <= 0) throw invalid("'top_p' must be greater than 0 and at most 1", "top_p");
    sp.top_p = float(*v);
  }
  if (auto v = opt_int(body, "top_k", -1, 1 << 30)) sp.top_k = *v <= 0 ? 0 : int(*v);
  if (auto v = opt_num(body, "min_p", 0, 1)) sp.min_p = float(*v);
  if (auto v = opt_num(body, "presence_penalty", -2, 2)) sp.presence_penalty = float(*v);
  if (auto v = opt_num(body, "frequency_penalty", -2, 2)) sp.frequency_penalty = float(*v);
  if (auto v = opt_num(body, "repetition_penalty", 0, 10)) {
    if (*v <= 0) throw invalid("'repetition_penalty' must be greater than 0", "repetition_penalty");
    sp.repetition_penalty = float(*v);
  }
  if (const json* s = field(body, "seed")) {
    if (s->is_number_unsigned()) sp.seed = s->get<uint64_t>();
    else if (s->is_number_integer()) sp.seed = uint64_t(s->get<int64_t>());
    else throw invalid("'seed' must be an integer", "seed");
  } else {
    sp.seed = (uint64_t(std::random_device{}()) << 32) ^ std::random_device{}();
  }
  r.job.sampling = sp;
  r.stop = parse_stop(body);
  r.job.ignore_eos = opt_bool(body, "ignore_eos").value_or(false);
  r.job.stop_ids = mi.stop_ids;
  if (const json* lb = field(body, "logit_bias")) {
    if (!lb->is_object()) throw invalid("'logit_bias' must be an object", "logit_bias");
    if (!lb->empty()) throw invalid("'logit_bias' is not supported by this server", "logit_bias");
  }
}

void set_max_tokens(const json& body, const ModelInfo& mi, PreparedRequest& r, std::optional<int64_t> dflt) {
  const int64_t P = int64_t(r.job.prompt.size());
  std::optional<int64_t> m = opt_int(body, "max_completion_tokens", 1, INT32_MAX);
  const char* which = "max_completion_tokens";
  if (!m) {
    m = opt_int(body, "max_tokens", 1, INT32_MAX);
    which = "max_tokens";
  }
  if (!m && dflt) m = std::min<int64_t>(*dflt, std::max<int64_t>(mi.ctx - P, 0));
  if (P >= mi.ctx || (m && P + *m > mi.ctx)) {
    throw ApiError(400, "invalid_request_error",
                   fmt::format("This model's maximum context length is {} tokens. However, you requested {} tokens "
                               "({} in the messages, {} in the completion). Please reduce the length of the messages "
                               "or completion.",
                               mi.ctx, P + (m ? *m : 0), P, m ? *m : 0),
                   m ? which : "messages", "context_length_exceeded");
  }
  r.job.max_tokens = int(m ? *m : mi.ctx - P);
}

}  // namespace

void check_model(const json& body, const ModelInfo& mi) {
  const json* m = field(body, "model");
  if (!m) return;
  if (!m->is_string()) throw invalid("'model' must be a string", "model");
  const auto& name = m->get_ref<const std::string&>();
  if (std::find(mi.served_names.begin(), mi.served_names.end(), name) == mi.served_names.end())
    throw ApiError(404, "invalid_request_error",
                   fmt::format("The model '{}' does not exist; this server serves '{}'",
                               utf8_sanitize(name.substr(0, 128)), mi.served_names.empty() ? "" : mi.served_names[0]),
                   "model", "model_not_found");
}

void load_generation_defaults(const std::filesystem::path& dir, ModelInfo& mi) {
  std::ifstream f(dir / "generation_config.json");
  if (!f) return;
  std::stringstream ss;
  ss << f.rdbuf();
  json g;
  KESTREL_CHECK(try_parse_json(ss.str(), g) && g.is_object(), "{}: not a JSON object",
                (dir / "generation_config.json").string());
  auto num = [&](const char* k, float& dst) {
    if (g.contains(k) && g[k].is_number()) dst = g[k].get<float>();
  };
  num("temperature", mi.defaults.temperature);
  num("top_p", mi.defaults.top_p);
  num("min_p", mi.defaults.min_p);
  num("presence_penalty", mi.defaults.presence_penalty);
  num("frequency_penalty", mi.defaults.frequency_penalty);
  num("repetition_penalty", mi.defaults.repetition_penalty);
  if (g.contains("top_k") && g["top_k"].is_number_integer()) mi.defaults.top_k = std::max(0, g["top_k"].get<int>());
  if (g.contains("do_sample") && g["do_sample"].is_boolean() && !g["do_sample"].get<bool>())
    mi.defaults.temperature = 0;
  auto add = [&](const json& v) {
    if (v.is_number_integer() && std::find(mi.stop_ids.begin(), mi.stop_ids.end(), v.get<int32_t>()) == mi.stop_ids.end())
      mi.stop_ids.push_back(v.get<int32_t>());
  };
  if (g.contains("eos_token_id")) {
    if (g["eos_token_id"].is_array())
      for (const auto& v : g["eos_token_id"]) add(v);
    else
      add(g["eos_token_id"]);
  }
}

void index_added_tokens(ModelInfo& mi) {
  mi.added.clear();
  for (int32_t id = 0; id < mi.tok->vocab_size(); ++id)
    if (mi.tok->is_added(id)) mi.added.push_back(mi.tok->token_bytes(id));
  std::sort(mi.added.begin(), mi.added.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  if (auto id = mi.tok->token_id("</think>")) mi.think_close_id = *id;
}

RenderedChat render_chat_request(const json& body, const ModelInfo& mi) {
  json msgs = normalize_messages(body);
  json tools = validate_tools(body);
  ChatOptions co;
  co.enable_thinking = mi.default_enable_thinking;
  if (const json* re = field(body, "reasoning_effort")) {
    static const char* ok[] = {"none", "minimal", "low", "medium", "high", "xhigh", "max"};
    if (!re->is_string() || std::find(std::begin(ok), std::end(ok), re->get<std::string>()) == std::end(ok))
      throw invalid("'reasoning_effort' must be one of none, minimal, low, medium, high, xhigh, max", "reasoning_effort");
    co.enable_thinking = re->get<std::string>() != "none";
  }
  if (const json* kw = field(body, "chat_template_kwargs")) {
    if (!kw->is_object()) throw invalid("'chat_template_kwargs' must be an object", "chat_template_kwargs");
    for (auto it = kw->begin(); it != kw->end(); ++it) {
      std::string p = "chat_template_kwargs." + utf8_sanitize(it.key().substr(0, 64));
      if (it.key() == "enable_thinking" || it.key() == "preserve_thinking") {
        if (it->is_null()) continue;
        if (!it->is_boolean()) throw invalid(fmt::format("'{}' must be a boolean", p), p);
        if (it.key() == "enable_thinking") co.enable_thinking = it->get<bool>();
        else co.preserve_thinking = it->get<bool>();
      } else {
        throw invalid(fmt::format("'{}' is not an allowed template variable (allowed: enable_thinking, "
                                  "preserve_thinking)", p), p);
      }
    }
  }
  Escaper esc(mi.added);
  json emsgs = esc.esc_json(msgs);
  json etools = tools.empty() ? json(nullptr) : esc.esc_json(tools);
  std::string rendered;
  try {
    rendered = render_chat(emsgs, etools, co);
  } catch (const kestrel::Error& e) {
    throw invalid(fmt::format("chat template: {}", e.what()), "messages");
  }
  RenderedChat rc;
  try {
    rc.ids = tokenize_rendered(rendered, esc, mi);
  } catch (const kestrel::Error& e) {
    throw invalid(fmt::format("tokenizer: {}", e.what()), "messages");
  }
  rc.text = esc.unesc(rendered);
  rc.thinking = rendered.size() >= 8 && rendered.compare(rendered.size() - 8, 8, "<think>\n") == 0;
  return rc;
}

PreparedRequest prepare_chat(const json& body, const ModelInfo& mi) {
  PreparedRequest r;
  r.chat = true;
  parse_common(body, mi, r);
  if (field(body, "functions") || field(body, "function_call"))
    throw invalid("'functions' / 'function_call' are deprecated and not supported; use 'tools'", "functions");
  if (const json* rf = field(body, "response_format")) {
    if (!rf->is_object() || !rf->contains("type") || !(*rf)["type"].is_string())
      throw invalid("'response_format' must be an object with a 'type'", "response_format");
    if ((*rf)["type"] != "text")
      throw invalid("'response_format' types other than \"text\" (constrained decoding) are not supported",
                    "response_format");
  }
  r.logprobs = opt_bool(body, "logprobs").value_or(false);
  if (auto t = opt_int(body, "top_logprobs", 0, 20)) {
    if (!r.logprobs && *t > 0) throw invalid("'top_logprobs' requires 'logprobs': true", "top_logprobs");
    r.top_logprobs = int(*t);
  }
  r.job.sampling.logprobs = r.logprobs;
  r.job.sampling.top_logprobs = r.top_logprobs;

  RenderedChat rc = render_chat_request(body, mi);
  json tools = validate_tools(body);
  r.job.prompt = std::move(rc.ids);
  r.prompt_tokens = int(r.job.prompt.size());

  // tool_choice: none | auto | required | {type:function, function:{name}}
  std::string forced_name;
  r.tool_choice = tools.empty() ? "none" : "auto";
  if (const json* tc = field(body, "tool_choice")) {
    if (tc->is_string()) {
      std::string s = tc->get<std::string>();
      if (s != "none" && s != "auto" && s != "required")
        throw invalid("'tool_choice' must be none, auto, required or {\"type\":\"function\",...}", "tool_choice");
      r.tool_choice = s;
    } else if (tc->is_object() && tc->value("type", std::string()) == "function" && tc->contains("function") &&
               (*tc)["function"].is_object() && (*tc)["function"].contains("name") &&
               (*tc)["function"]["name"].is_string()) {
      forced_name = (*tc)["function"]["name"].get<std::string>();
      bool found = false;
      for (const auto& t : tools) found |= t["function"]["name"] == forced_name;
      if (!found) throw invalid(fmt::format("tool_choice names '{}', which is not in 'tools'", utf8_sanitize(forced_name.substr(0, 64))), "tool_choice");
      r.tool_choice = "named";
    } else {
      throw invalid("'tool_choice' must be none, auto, required or {\"type\":\"function\",\"function\":{\"name\":...}}",
                    "tool_choice");
    }
    if (tools.empty() && r.tool_choice != "none")
      throw invalid("'tool_choice' requires 'tools'", "tool_choice");
  }
  if (r.tool_choice == "required" && tools.size() == 1) forced_name = tools[0]["function"]["name"].get<std::string>();
  r.parser.start_in_reasoning = rc.thinking;
  r.parser.parse_tools = !tools.empty() && r.tool_choice != "none";
  r.parser.tools = tools;
  r.parser.parallel_tool_calls = opt_bool(body, "parallel_tool_calls").value_or(true);
  r.parser.id_seed = r.job.sampling.seed ^ 0x9E3779B97F4A7C15ull;
  if (r.tool_choice == "required" || r.tool_choice == "named") {
    // Forced output: the call's opening (and the function name when it is known) is emitted as output,
    // right after the prompt, or right after </think> when the model thinks first.
    std::string forced = "<tool_call>\n<function=" + (forced_name.empty() ? std::string() : forced_name + ">\n");
    if (rc.thinking && mi.think_close_id >= 0) {
      r.job.force_trigger = mi.think_close_id;
      r.job.forced_after = mi.tok->encode("\n\n" + forced, true);
    } else {
      r.job.forced_prefix = mi.tok->encode(forced, true);
    }
  }
  set_max_tokens(body, mi, r, std::nullopt);
  return r;
}

PreparedRequest prepare_completion(const json& body, const ModelInfo& mi) {
  PreparedRequest r;
  r.chat = false;
  parse_common(body, mi, r);
  const json* p = field(body, "prompt");
  if (!p) throw invalid("'prompt' is required", "prompt");
  auto ids_of = [&](const json& a) {
    std::vector<int32_t> ids;
    for (const auto& v : a) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= mi.vocab)
        throw invalid(fmt::format("'prompt' token ids must be integers in [0, {})", mi.vocab), "prompt");
      ids.push_back(v.get<int32_t>());
    }
    return ids;
  };
  try {
    if (p->is_string()) {
      r.job.prompt = mi.tok->encode(p->get<std::string>(), false);
    } else if (p->is_array() && p->size() == 1 && (*p)[0].is_string()) {
      r.job.prompt = mi.tok->encode((*p)[0].get<std::string>(), false);
    } else if (p->is_array() && p->size() == 1 && (*p)[0].is_array()) {
      r.job.prompt = ids_of((*p)[0]);
    } else if (p->is_array() && !p->empty() && (*p)[0].is_number()) {
      r.job.prompt = ids_of(*p);
    } else {
      throw invalid("'prompt' must be a string, an array of one string, an array of token ids, or an array of one "
                    "token-id array",
                    "prompt");
    }
  } catch (const kestrel::Error& e) {
    throw invalid(fmt::format("tokenizer: {}", e.what()), "prompt");
  }
  if (r.job.prompt.empty()) throw invalid("'prompt' must not be empty", "prompt");
  if (const json* lp = field(body, "logprobs")) {
    if (!lp->is_number_integer() || lp->get<int64_t>() < 0 || lp->get<int64_t>() > 5)
      throw invalid("'logprobs' must be an integer between 0 and 5", "logprobs");
    r.logprobs = true;
    r.top_logprobs = lp->get<int>();
  }
  if (opt_bool(body, "echo").value_or(false)) throw invalid("'echo' is not supported", "echo");
  if (const json* s = field(body, "suffix")) {
    if (!s->is_string()) throw invalid("'suffix' must be a string", "suffix");
    if (!s->get<std::string>().empty()) throw invalid("'suffix' (fill-in-the-middle) is not supported", "suffix");
  }
  r.job.sampling.logprobs = r.logprobs;
  r.job.sampling.top_logprobs = r.top_logprobs;
  r.prompt_tokens = int(r.job.prompt.size());
  set_max_tokens(body, mi, r, 16);
  return r;
}

}  // namespace kestrel::server
