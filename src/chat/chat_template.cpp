// The official Qwen3.6 chat template, rendered by hand. Debian packages no C++ Jinja engine and
// kestrel serves exactly one template, so this file transcribes that template statement by statement
// (the Jinja source is quoted in official_template.inc) instead of interpreting Jinja; a model
// directory with another template is refused (check_chat_template). Semantics are Python's where the
// template relies on them: `|trim` is str.strip() (Unicode whitespace), `tojson` is transformers'
// json.dumps(ensure_ascii=False) with ", " / ": " separators and insertion order, raise_exception
// messages are reproduced verbatim. Inputs on which jinja2 would silently print Python reprs or
// iterate characters (a message that is not an object, tools or tool_calls given as a string, a
// content part that is not an object, a non-scalar `text`) are rejected with a clear error instead.
// tests/chat checks byte equality against jinja2 configured as transformers configures it.
#include "chat/chat_template.h"

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string_view>

#include "core/check.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kestrel {
namespace {

using ojson = nlohmann::ordered_json;

const std::string kOfficial =
#include "chat/official_template.inc"
    ;

// The Qwen3.6 added tokens (model-spec §5.2); any of them inside a template literal is a control token.
constexpr std::string_view kControlTokens[] = {
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"};

constexpr std::string_view kToolInstructions =
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\n"
    "that can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must "
    "be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the "
    "function call, but NOT after\n- If there is no function call available, answer the question "
    "like normal with your current knowledge and do not tell the user about function calls\n"
    "</IMPORTANT>";

// A string with the byte ranges that are template-written control tokens (vision placeholders
// inside rendered content); substr keeps the ranges that fall inside.
struct MStr {
  std::string s;
  std::vector<std::pair<size_t, size_t>> ctl;

  MStr substr(size_t pos, size_t n = std::string::npos) const {
    MStr r;
    pos = std::min(pos, s.size());
    const size_t end = n == std::string::npos ? s.size() : std::min(s.size(), pos + n);
    r.s = s.substr(pos, end - pos);
    for (auto [a, b] : ctl)
      if (a >= pos && b <= end) r.ctl.emplace_back(a - pos, b - pos);
    return r;
  }
  void append_text(std::string_view t) { s += t; }
  void append_control(std::string_view t) {
    ctl.emplace_back(s.size(), s.size() + t.size());
    s += t;
  }
};

// Python str.isspace() (what str.strip() removes).
bool py_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

// The code point at s[i] if it is a Python whitespace character (sets len); ill-formed bytes
// count as non-space (encode rejects them later anyway).
bool space_at(const std::string& s, size_t i, size_t& len) {
  const utf8::Seq q = utf8::next_seq(s, i);
  if (q.kind != utf8::SeqKind::kValid) return false;
  size_t j = i;
  len = q.len;
  return py_space(utf8::decode_cp(s, j));
}

MStr py_strip(const MStr& m) {
  const std::string& s = m.s;
  size_t b = 0, len = 0;
  while (b < s.size() && space_at(s, b, len)) b += len;
  size_t e = s.size();
  while (e > b) {
    size_t k = e - 1;  // start of the last code point
    while (k > b && e - k < 4 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    if (!space_at(s, k, len) || k + len != e) break;
    e = k;
  }
  return m.substr(b, e - b);
}

MStr lstrip_nl(const MStr& m) {
  size_t b = 0;
  while (b < m.s.size() && m.s[b] == '\n') ++b;
  return m.substr(b);
}

MStr rstrip_nl(const MStr& m) {
  size_t e = m.s.size();
  while (e > 0 && m.s[e - 1] == '\n') --e;
  return m.substr(0, e);
}

bool starts_with(const std::string& s, std::string_view p) { return s.compare(0, p.size(), p) == 0; }
bool ends_with(const std::string& s, std::string_view p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

void py_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) out += fmt::format("\\u{:04x}", c);
        else out += ch;
    }
  }
  out += '"';
}

// transformers' tojson: json.dumps(x, ensure_ascii=False) (", " and ": " separators, key order kept).
void py_json(std::string& out, const ojson& v) {
  switch (v.type()) {
    case ojson::value_t::object: {
      out += '{';
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) out += ", ";
        first = false;
        py_json_string(out, it.key());
        out += ": ";
        py_json(out, it.value());
      }
      out += '}';
      break;
    }
    case ojson::value_t::array: {
      out += '[';
      for (size_t i = 0; i < v.size(); ++i) {
        if (i) out += ", ";
        py_json(out, v[i]);
      }
      out += ']';
      break;
    }
    case ojson::value_t::string: py_json_string(out, v.get_ref<const std::string&>()); break;
    case ojson::value_t::null: out += "null"; break;
    case ojson::value_t::discarded: KESTREL_FAIL("chat template: discarded JSON value");
    // Booleans, integers and floats: nlohmann's shortest round-trip form equals Python's repr
    // (1.0, 1e-05, 1e+16, 0.0001, ...).
    default: out += v.dump(); break;
  }
}

std::string py_tojson(const ojson& v) {
  std::string s;
  py_json(s, v);
  return s;
}

// `{{ x }}` of a scalar in jinja2: Python str().
std::string py_str(const ojson& v, const char* what) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_null()) return "None";
  if (v.is_number()) return v.dump();
  KESTREL_FAIL("chat template: {} must be a string, got {}", what, v.dump().substr(0, 80));
}

[[noreturn]] void raise_exception(const char* msg) { throw Error(msg); }

std::string role_of(const ojson& m) {
  auto it = m.find("role");
  return it != m.end() && it->is_string() ? it->get<std::string>() : std::string();
}

const ojson* get(const ojson& m, const char* key) {
  auto it = m.find(key);
  return it == m.end() ? nullptr : &*it;
}

class Renderer {
 public:
  explicit Renderer(const ChatOptions& o) : o_(o) {}

  RenderedChat run(const ojson& messages_in, const ojson& tools) {
    const ojson messages = normalise(messages_in);
    KESTREL_CHECK(tools.is_null() || tools.is_array(), "chat template: tools must be an array or null, got {}",
                  tools.type_name());
    if (messages.empty()) raise_exception("No messages provided.");
    const size_t n = messages.size();
    if (tools.is_array() && !tools.empty()) {
      tmpl("<|im_start|>system\n");
      tmpl("# Tools\n\nYou have access to the following functions:\n\n<tools>");
      for (const ojson& tool : tools) {
        tmpl("\n");
        text(py_tojson(tool));
      }
      tmpl("\n</tools>");
      tmpl(kToolInstructions);
      if (role_of(messages[0]) == "system") {
        const MStr c = py_strip(render_content(get(messages[0], "content"), false, true));
        if (!c.s.empty()) {
          tmpl("\n\n");
          text(c);
        }
      }
      tmpl("<|im_end|>\n");
    } else if (role_of(messages[0]) == "system") {
      const MStr c = py_strip(render_content(get(messages[0], "content"), false, true));
      tmpl("<|im_start|>system\n");
      text(c);
      tmpl("<|im_end|>\n");
    }

    bool multi_step_tool = true;
    size_t last_query_index = n - 1;
    for (size_t k = 0; k < n; ++k) {
      const size_t index = n - 1 - k;
      const ojson& m = messages[index];
      if (multi_step_tool && role_of(m) == "user") {
        const MStr c = py_strip(render_content(get(m, "content"), false, false));
        if (!(starts_with(c.s, "<tool_response>") && ends_with(c.s, "</tool_response>"))) {
          multi_step_tool = false;
          last_query_index = index;
        }
      }
    }
    if (multi_step_tool) raise_exception("No user query found in messages.");

    for (size_t i = 0; i < n; ++i) {
      const ojson& m = messages[i];
      MStr content = py_strip(render_content(get(m, "content"), true, false));
      const std::string role = role_of(m);
      if (role == "system") {
        if (i != 0) raise_exception("System message must be at the beginning.");
      } else if (role == "user") {
        tmpl("<|im_start|>user\n");
        text(content);
        tmpl("<|im_end|>\n");
      } else if (role == "assistant") {
        assistant(m, content, i > last_query_index);
      } else if (role == "tool") {
        if (i > 0 && role_of(messages[i - 1]) != "tool") tmpl("<|im_start|>user");
        tmpl("\n<tool_response>\n");
        text(content);
        tmpl("\n</tool_response>");
        if (i + 1 < n && role_of(messages[i + 1]) != "tool") tmpl("<|im_end|>\n");
        else if (i + 1 == n) tmpl("<|im_end|>\n");
      } else {
        raise_exception("Unexpected message role.");
      }
    }
    if (o_.add_generation_prompt) {
      tmpl("<|im_start|>assistant\n");
      if (o_.enable_thinking.has_value() && !*o_.enable_thinking) tmpl("<think>\n\n</think>\n\n");
      else tmpl("<think>\n");
    }
    return std::move(out_);
  }

 private:
  // Request normalisation shared with the server (openai-api.md §0.9): developer -> system,
  // `reasoning` -> `reasoning_content`, tool-call arguments given as a JSON string -> object.
  static ojson normalise(const ojson& in) {
    KESTREL_CHECK(in.is_array(), "chat template: messages must be an array, got {}", in.type_name());
    ojson msgs = in;
    for (size_t i = 0; i < msgs.size(); ++i) {
      ojson& m = msgs[i];
      KESTREL_CHECK(m.is_object(), "chat template: message {} must be an object, got {}", i, m.type_name());
      if (role_of(m) == "developer") m["role"] = "system";
      if (!m.contains("reasoning_content") && m.contains("reasoning") && m["reasoning"].is_string())
        m["reasoning_content"] = m["reasoning"];
      if (!m.contains("tool_calls") || m["tool_calls"].is_null()) continue;
      ojson& calls = m["tool_calls"];
      KESTREL_CHECK(calls.is_array(), "chat template: message {}: tool_calls must be an array, got {}", i,
                    calls.type_name());
      for (size_t j = 0; j < calls.size(); ++j) {
        ojson& tc = calls[j];
        KESTREL_CHECK(tc.is_object(), "chat template: message {}: tool_calls[{}] must be an object", i, j);
        ojson& fn = tc.contains("function") ? tc["function"] : tc;
        KESTREL_CHECK(fn.is_object(), "chat template: message {}: tool_calls[{}].function must be an object",
                      i, j);
        if (!fn.contains("arguments")) continue;
        ojson& args = fn["arguments"];
        if (args.is_string()) {
          try {
            args = ojson::parse(args.get<std::string>());
          } catch (const ojson::exception&) {
            KESTREL_FAIL("chat template: message {}: tool_calls[{}] arguments are not valid JSON: {}", i, j,
                         args.get<std::string>().substr(0, 200));
          }
        }
        KESTREL_CHECK(args.is_object(),
                      "chat template: message {}: tool_calls[{}] arguments must be a JSON object, got {}", i, j,
                      args.type_name());
      }
    }
    return msgs;
  }

  // Template literal: any added token in it is a control token.
  void tmpl(std::string_view lit) {
    size_t i = 0, plain = 0;
    while (i < lit.size()) {
      const std::string_view* hit = nullptr;
      if (lit[i] == '<') {
        for (const auto& t : kControlTokens)
          if (lit.substr(i, t.size()) == t && (!hit || t.size() > hit->size())) hit = &t;
      }
      if (!hit) {
        ++i;
        continue;
      }
      out_.text.append(lit.substr(plain, i - plain));
      out_.controls.emplace_back(out_.text.size(), out_.text.size() + hit->size());
      out_.text.append(*hit);
      i += hit->size();
      plain = i;
    }
    out_.text.append(lit.substr(plain));
  }
  void text(std::string_view s) { out_.text.append(s); }
  void text(const MStr& m) {
    const size_t base = out_.text.size();
    out_.text += m.s;
    for (auto [a, b] : m.ctl) out_.controls.emplace_back(base + a, base + b);
  }

  // The template's render_content macro.
  MStr render_content(const ojson* content, bool do_vision_count, bool is_system_content) {
    MStr r;
    if (!content || content->is_null()) return r;
    if (content->is_string()) {
      r.s = content->get<std::string>();
      return r;
    }
    if (!content->is_array()) raise_exception("Unexpected content type.");
    for (const ojson& item : *content) {
      KESTREL_CHECK(item.is_object(), "chat template: content parts must be objects, got {}", item.type_name());
      const ojson* type = get(item, "type");
      const bool type_is = type && type->is_string();
      if (item.contains("image") || item.contains("image_url") || (type_is && *type == "image")) {
        if (is_system_content) raise_exception("System message cannot contain images.");
        if (do_vision_count) ++image_count_;
        if (o_.add_vision_id) r.append_text(fmt::format("Picture {}: ", image_count_));
        r.append_control("<|vision_start|>");
        r.append_control("<|image_pad|>");
        r.append_control("<|vision_end|>");
      } else if (item.contains("video") || (type_is && *type == "video")) {
        if (is_system_content) raise_exception("System message cannot contain videos.");
        if (do_vision_count) ++video_count_;
        if (o_.add_vision_id) r.append_text(fmt::format("Video {}: ", video_count_));
        r.append_control("<|vision_start|>");
        r.append_control("<|video_pad|>");
        r.append_control("<|vision_end|>");
      } else if (item.contains("text")) {
        r.append_text(py_str(item["text"], "content part text"));
      } else {
        raise_exception("Unexpected item type in content.");
      }
    }
    return r;
  }

  void assistant(const ojson& m, MStr content, bool after_last_query) {
    MStr reasoning;
    const ojson* rc = get(m, "reasoning_content");
    if (rc && rc->is_string()) {
      reasoning.s = rc->get<std::string>();
    } else if (content.s.find("</think>") != std::string::npos) {
      // content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n')
      MStr head = rstrip_nl(content.substr(0, content.s.find("</think>")));
      const size_t open = head.s.rfind("<think>");
      if (open != std::string::npos) head = head.substr(open + 7);
      reasoning = lstrip_nl(head);
      // content.split('</think>')[-1].lstrip('\n')
      content = lstrip_nl(content.substr(content.s.rfind("</think>") + 8));
    }
    reasoning = py_strip(reasoning);
    if (o_.preserve_thinking || after_last_query) {
      tmpl("<|im_start|>assistant\n<think>\n");
      text(reasoning);
      tmpl("\n</think>\n\n");
      text(content);
    } else {
      tmpl("<|im_start|>assistant\n");
      text(content);
    }
    const ojson* calls = get(m, "tool_calls");
    if (calls && calls->is_array()) {
      for (size_t j = 0; j < calls->size(); ++j) {
        const ojson& tc0 = (*calls)[j];
        const ojson& tc = tc0.contains("function") ? tc0["function"] : tc0;
        const ojson* name = get(tc, "name");
        KESTREL_CHECK(name && name->is_string(), "chat template: tool_calls[{}] has no function name", j);
        if (j == 0) {
          if (!py_strip(content).s.empty()) tmpl("\n\n<tool_call>\n<function=");
          else tmpl("<tool_call>\n<function=");
        } else {
          tmpl("\n<tool_call>\n<function=");
        }
        text(name->get<std::string>());
        tmpl(">\n");
        if (const ojson* args = get(tc, "arguments")) {
          for (auto it = args->begin(); it != args->end(); ++it) {
            tmpl("<parameter=");
            text(it.key());
            tmpl(">\n");
            text(it.value().is_string() ? it.value().get<std::string>() : py_tojson(it.value()));
            tmpl("\n</parameter>\n");
          }
        }
        tmpl("</function>\n</tool_call>");
      }
    }
    tmpl("<|im_end|>\n");
  }

  const ChatOptions& o_;
  RenderedChat out_;
  int image_count_ = 0, video_count_ = 0;
};

}  // namespace

RenderedChat render_chat_ordered(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 const ChatOptions& opts) {
  return Renderer(opts).run(messages, tools);
}

std::string render_chat_text(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                             const ChatOptions& opts) {
  return render_chat_ordered(messages, tools, opts).text;
}

std::string render_chat(const nlohmann::json& messages, const nlohmann::json& tools, const ChatOptions& opts) {
  // nlohmann::json has already sorted object keys; see render_chat_ordered for request order.
  return render_chat_text(nlohmann::ordered_json(messages), nlohmann::ordered_json(tools), opts);
}

std::vector<int32_t> encode_chat(const Tokenizer& tok, const RenderedChat& r) {
  std::vector<int32_t> ids;
  size_t pos = 0;
  for (auto [a, b] : r.controls) {
    KESTREL_CHECK(a >= pos && b <= r.text.size() && a < b, "encode_chat: control ranges out of order");
    const auto piece = std::string_view(r.text).substr(a, b - a);
    const auto id = tok.token_id(piece);
    KESTREL_CHECK(id && tok.is_added(*id), "encode_chat: control token {} is not an added token of this tokenizer",
                  piece);
    const auto seg = tok.encode(std::string_view(r.text).substr(pos, a - pos), false);
    ids.insert(ids.end(), seg.begin(), seg.end());
    ids.push_back(*id);
    pos = b;
  }
  const auto tail = tok.encode(std::string_view(r.text).substr(pos), false);
  ids.insert(ids.end(), tail.begin(), tail.end());
  return ids;
}

const std::string& official_chat_template() { return kOfficial; }

void check_chat_template(const std::filesystem::path& dir) {
  std::string tpl, where;
  const auto jinja = dir / "chat_template.jinja";
  if (std::filesystem::exists(jinja)) {
    std::ifstream f(jinja, std::ios::binary);
    std::ostringstream ss;
    ss << f.rdbuf();
    tpl = ss.str();
    where = jinja.string();
  } else {
    const auto cfg_path = dir / "tokenizer_config.json";
    KESTREL_CHECK(std::filesystem::exists(cfg_path), "{}: no chat_template.jinja and no tokenizer_config.json",
                  dir.string());
    std::ifstream f(cfg_path, std::ios::binary);
    nlohmann::json cfg;
    try {
      cfg = nlohmann::json::parse(f);
    } catch (const nlohmann::json::exception& e) {
      KESTREL_FAIL("{}: malformed JSON: {}", cfg_path.string(), e.what());
    }
    where = cfg_path.string() + " chat_template";
    const auto it = cfg.find("chat_template");
    KESTREL_CHECK(it != cfg.end() && !it->is_null(), "{}: no chat template (chat_template.jinja or "
                  "tokenizer_config.json chat_template)", dir.string());
    if (it->is_string()) {
      tpl = it->get<std::string>();
    } else {
      KESTREL_CHECK(it->is_array(), "{}: must be a string or a list of {{name, template}}", where);
      for (const auto& t : *it)
        if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
          tpl = t["template"].get<std::string>();
      KESTREL_CHECK(!tpl.empty(), "{}: no \"default\" template", where);
    }
  }
  std::string_view t(tpl);
  while (!t.empty() && t.back() == '\n') t.remove_suffix(1);  // a trailing newline renders identically
  if (t == kOfficial) return;
  size_t k = 0;
  while (k < t.size() && k < kOfficial.size() && t[k] == kOfficial[k]) ++k;
  KESTREL_FAIL("{}: not the official Qwen3.6 chat template ({} bytes, expected {}; first difference at byte {}); "
               "kestrel renders only the official template", where, t.size(), kOfficial.size(), k);
}

}  // namespace kestrel
