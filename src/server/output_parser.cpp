// The reasoning + Qwen XML tool-call state machine (see output_parser.h for the rules).
#include "server/output_parser.h"

#include "server/text_stream.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

namespace kestrel::server {

namespace {
using json = nlohmann::json;

constexpr std::string_view kThinkOpen = "<think>";
constexpr std::string_view kThinkClose = "</think>";
constexpr std::string_view kToolOpen = "<tool_call>";
constexpr std::string_view kToolClose = "</tool_call>";
constexpr std::string_view kFuncOpen = "<function=";
constexpr std::string_view kFuncClose = "</function>";
constexpr std::string_view kParamOpen = "<parameter=";
constexpr std::string_view kParamClose = "</parameter>";
constexpr size_t kMaxName = 128;  // longest function / parameter name accepted in a tag

enum class M { No, Partial, Full };
M match(std::string_view rest, std::string_view marker) {
  if (rest.size() >= marker.size()) return rest.substr(0, marker.size()) == marker ? M::Full : M::No;
  return marker.substr(0, rest.size()) == rest ? M::Partial : M::No;
}
bool is_ws(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }
size_t skip_ws(std::string_view s) {
  size_t i = 0;
  while (i < s.size() && is_ws(s[i])) ++i;
  return i;
}
std::string lower(std::string_view s) {
  std::string r(s);
  for (auto& c : r) c = char(std::tolower(static_cast<unsigned char>(c)));
  return r;
}
std::string trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && is_ws(s[b])) ++b;
  while (e > b && is_ws(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}
// JSON string escaping of a fragment, without the quotes (escaping is per character, so fragments
// concatenate to the escaping of the whole).
std::string escape_fragment(std::string_view s) {
  std::string d = json(std::string(s)).dump(-1, ' ', false, json::error_handler_t::replace);
  return d.substr(1, d.size() - 2);
}
// Reads "NAME>" at the start of `rest`: returns the name length (excluding '>'), npos if incomplete,
// or -2 cast if malformed.
constexpr size_t kIncomplete = std::string::npos;
constexpr size_t kBad = std::string::npos - 1;
size_t tag_name(std::string_view rest, bool final) {
  for (size_t i = 0; i < rest.size() && i <= kMaxName; ++i) {
    char c = rest[i];
    if (c == '>') return i == 0 ? kBad : i;
    if (c == '<' || c == '\n' || c == '"') return kBad;
  }
  if (rest.size() > kMaxName || final) return kBad;
  return kIncomplete;
}

std::string schema_type(const json* s) {
  if (!s || !s->is_object()) return "string";
  if (auto it = s->find("type"); it != s->end()) {
    if (it->is_string()) return lower(it->get<std::string>());
    if (it->is_array())
      for (const auto& t : *it)
        if (t.is_string() && t.get<std::string>() != "null") return lower(t.get<std::string>());
  }
  for (const char* k : {"anyOf", "oneOf"}) {
    if (auto it = s->find(k); it != s->end() && it->is_array())
      for (const auto& alt : *it) {
        std::string t = schema_type(&alt);
        if (t != "null") return t;
      }
  }
  if (auto it = s->find("enum"); it != s->end() && it->is_array() && !it->empty()) {
    const auto& v = (*it)[0];
    if (v.is_number_integer()) return "integer";
    if (v.is_number()) return "number";
    if (v.is_boolean()) return "boolean";
    return "string";
  }
  if (s->contains("properties")) return "object";
  if (s->contains("items")) return "array";
  return "string";
}
bool starts(const std::string& s, std::string_view p) { return s.rfind(p, 0) == 0; }
bool is_string_type(const std::string& t) {
  return !(starts(t, "int") || starts(t, "uint") || starts(t, "long") || starts(t, "short") ||
           starts(t, "unsigned") || starts(t, "num") || starts(t, "float") || starts(t, "double") ||
           starts(t, "decimal") || starts(t, "bool") || starts(t, "object") || starts(t, "array") ||
           starts(t, "dict") || starts(t, "list") || t == "null");
}

// Python literal -> JSON for the object/array fallback: single-quoted strings and True/False/None.
std::string python_literal_to_json(std::string_view s) {
  std::string out;
  char q = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (q) {
      if (c == '\\' && i + 1 < s.size()) {
        if (s[i + 1] == '\'' && q == '\'') { out += '\''; ++i; continue; }
        out += c; out += s[++i]; continue;
      }
      if (c == q) { out += '"'; q = 0; continue; }
      if (c == '"' && q == '\'') { out += "\\\""; continue; }
      out += c;
      continue;
    }
    if (c == '\'' || c == '"') { q = c; out += '"'; continue; }
    auto word = [&](std::string_view w) {
      return s.substr(i, w.size()) == w &&
             (i + w.size() == s.size() || !std::isalnum(static_cast<unsigned char>(s[i + w.size()])));
    };
    if (word("True")) { out += "true"; i += 3; continue; }
    if (word("False")) { out += "false"; i += 4; continue; }
    if (word("None")) { out += "null"; i += 3; continue; }
    out += c;
  }
  return out;
}
}  // namespace

bool schema_is_string(const json* schema) { return is_string_type(schema_type(schema)); }

json convert_param_value(const std::string& value, const json* schema) {
  const std::string t = schema_type(schema);
  const std::string lv = lower(trim(value));
  if (is_string_type(t)) return json(utf8_sanitize(value));
  if (lv == "null" || lv == "none") return nullptr;
  const std::string v = trim(value);
  if (starts(t, "int") || starts(t, "uint") || starts(t, "long") || starts(t, "short") ||
      starts(t, "unsigned")) {
    int64_t x = 0;
    auto [p, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
    if (ec == std::errc() && p == v.data() + v.size() && !v.empty()) return x;
    return json(utf8_sanitize(value));
  }
  if (starts(t, "num") || starts(t, "float") || starts(t, "double") || starts(t, "decimal")) {
    if (!v.empty()) {
      char* end = nullptr;
      double d = std::strtod(v.c_str(), &end);
      if (end == v.c_str() + v.size() && std::isfinite(d) &&
          v.find_first_of("xXnN") == std::string::npos) {  // no hex floats, nan, inf
        if (d == std::floor(d) && std::fabs(d) < 9007199254740992.0) return int64_t(d);
        return d;
      }
    }
    return json(utf8_sanitize(value));
  }
  if (starts(t, "bool")) return lv == "true";
  if (starts(t, "object") || starts(t, "array") || starts(t, "dict") || starts(t, "list")) {
    json j;
    if (try_parse_json(v, j)) {
      // A double-encoded value ("{\"a\": 1}" as a JSON string): decode once more.
      json inner;
      if (j.is_string() && try_parse_json(j.get<std::string>(), inner) && (inner.is_object() || inner.is_array()))
        return inner;
      return j;
    }
    if (try_parse_json(python_literal_to_json(v), j)) return j;
    return json(utf8_sanitize(value));
  }
  return json(utf8_sanitize(value));
}

OutputParser::OutputParser(ParserOptions opts)
    : opts_(std::move(opts)), st_(opts_.start_in_reasoning ? St::Reasoning : St::Content),
      rng_(opts_.id_seed) {}

std::vector<ParserEvent> OutputParser::feed(std::string_view text) {
  buf_.append(text);
  advance(false);
  std::vector<ParserEvent> r;
  r.swap(out_);
  return r;
}

std::vector<ParserEvent> OutputParser::finish() {
  advance(true);
  if (st_ == St::Reasoning || st_ == St::Content) close_section();
  std::vector<ParserEvent> r;
  r.swap(out_);
  return r;
}

void OutputParser::advance(bool final) {
  while (step(final)) {
  }
  buf_.erase(0, pos_);
  pos_ = 0;
}

void OutputParser::emit_section(ParserEvent::Kind kind, std::string_view text) {
  if (text.empty()) return;
  std::string s = held_nl_;
  held_nl_.clear();
  s.append(text);
  if (lead_) {
    size_t i = 0;
    while (i < s.size() && s[i] == '\n') ++i;
    s.erase(0, i);
    if (s.empty()) return;
    lead_ = false;
  }
  size_t e = s.size();
  while (e > 0 && s[e - 1] == '\n') --e;
  held_nl_ = s.substr(e);
  s.resize(e);
  if (s.empty()) return;
  if (!out_.empty() && out_.back().kind == kind) {
    out_.back().text += s;
  } else {
    ParserEvent ev;
    ev.kind = kind;
    ev.text = std::move(s);
    out_.push_back(std::move(ev));
  }
}

void OutputParser::close_section() {
  held_nl_.clear();
  lead_ = true;
}

void OutputParser::emit_args(std::string_view frag) {
  if (!reporting() || frag.empty()) return;
  if (!out_.empty() && out_.back().kind == ParserEvent::Kind::ToolArgs && out_.back().index == call_index_) {
    out_.back().text.append(frag);
    return;
  }
  ParserEvent ev;
  ev.kind = ParserEvent::Kind::ToolArgs;
  ev.index = call_index_;
  ev.text = std::string(frag);
  out_.push_back(std::move(ev));
}

void OutputParser::open_call(std::string name) {
  ++call_index_;
  call_name_ = std::move(name);
  params_ = 0;
  stray_.clear();
  call_props_ = nullptr;
  if (opts_.tools.is_array())
    for (const auto& t : opts_.tools) {
      const json* fn = t.is_object() && t.contains("function") ? &t["function"] : nullptr;
      if (fn && fn->is_object() && fn->value("name", std::string()) == call_name_) {
        auto it = fn->find("parameters");
        if (it != fn->end() && it->is_object()) {
          auto p = it->find("properties");
          if (p != it->end() && p->is_object()) call_props_ = &*p;
        }
        break;
      }
    }
  if (!reporting()) return;
  ++reported_calls_;
  static const char* hex = "0123456789abcdef";
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += hex[rng_() & 15];
  ParserEvent ev;
  ev.kind = ParserEvent::Kind::ToolStart;
  ev.index = call_index_;
  ev.id = std::move(id);
  ev.name = call_name_;
  out_.push_back(std::move(ev));
}

void OutputParser::close_call() {
  if (params_ > 0) {
    emit_args("}");
    return;
  }
  // No <parameter> blocks: a JSON object body is taken as the arguments; anything else gives {}.
  json j;
  std::string body = trim(stray_);
  if (!body.empty() && try_parse_json(body, j) && j.is_object())
    emit_args(j.dump(-1, ' ', false, json::error_handler_t::replace));
  else
    emit_args("{}");
}

void OutputParser::open_param(std::string name) {
  param_name_ = std::move(name);
  param_schema_ = nullptr;
  if (call_props_) {
    auto it = call_props_->find(param_name_);
    if (it != call_props_->end()) param_schema_ = &*it;
  }
  param_is_string_ = schema_is_string(param_schema_);
  std::string frag = params_ == 0 ? "{" : ", ";
  frag += json(utf8_sanitize(param_name_)).dump() + ": ";
  if (param_is_string_) frag += "\"";
  emit_args(frag);
  ++params_;
  value_.clear();
  value_sent_ = 0;
}

void OutputParser::stream_value() {
  if (!param_is_string_ || value_.empty()) return;
  const size_t start = value_[0] == '\n' ? 1 : 0;
  if (value_sent_ < start) value_sent_ = start;
  size_t end = value_.size();
  if (end > start && value_[end - 1] == '\n') --end;  // may be the stripped trailing newline
  if (end > value_sent_) {
    emit_args(escape_fragment(std::string_view(value_).substr(value_sent_, end - value_sent_)));
    value_sent_ = end;
  }
}

void OutputParser::close_value() {
  const size_t start = !value_.empty() && value_[0] == '\n' ? 1 : 0;
  size_t end = value_.size();
  if (end > start && value_[end - 1] == '\n') --end;
  if (param_is_string_) {
    if (value_sent_ < start) value_sent_ = start;
    if (end > value_sent_)
      emit_args(escape_fragment(std::string_view(value_).substr(value_sent_, end - value_sent_)));
    emit_args("\"");
  } else {
    emit_args(convert_param_value(value_.substr(start, end - start), param_schema_)
                  .dump(-1, ' ', false, json::error_handler_t::replace));
  }
  value_.clear();
  value_sent_ = 0;
}

bool OutputParser::step(bool final) {
  std::string_view rest = std::string_view(buf_).substr(pos_);
  switch (st_) {
    case St::Reasoning:
    case St::Content: {
      const bool reasoning = st_ == St::Reasoning;
      const auto kind = reasoning ? ParserEvent::Kind::Reasoning : ParserEvent::Kind::Content;
      if (output_start_) {
        // A "<think>" re-emitted at the very start opens (or continues) the reasoning section.
        M m = match(rest, kThinkOpen);
        if (m == M::Partial && !final) return false;
        if (m == M::Full) {
          pos_ += kThinkOpen.size();
          st_ = St::Reasoning;
          output_start_ = false;
          return true;
        }
        if (!rest.empty()) output_start_ = false;
      }
      size_t p_close = reasoning ? rest.find(kThinkClose) : std::string_view::npos;
      size_t p_tool = opts_.parse_tools ? rest.find(kToolOpen) : std::string_view::npos;
      size_t p = std::min(p_close, p_tool);
      if (p != std::string_view::npos) {
        emit_section(kind, rest.substr(0, p));
        close_section();
        if (p == p_close) {
          pos_ += p + kThinkClose.size();
          st_ = St::Content;
        } else {  // <tool_call> (also inside reasoning: an implicit end of the reasoning)
          pos_ += p + kToolOpen.size();
          st_ = St::ToolOpen;
          open_ws_.clear();
        }
        return true;
      }
      size_t hold = 0;
      if (!final) {
        if (reasoning) hold = std::max(hold, partial_suffix(rest, kThinkClose));
        if (opts_.parse_tools) hold = std::max(hold, partial_suffix(rest, kToolOpen));
      }
      emit_section(kind, rest.substr(0, rest.size() - hold));
      pos_ += rest.size() - hold;
      return false;
    }
    case St::ToolOpen: {
      size_t ws = skip_ws(rest);
      std::string_view r = rest.substr(ws);
      auto fallback = [&] {
        // Not a tool call after all: the marker and its whitespace are plain content.
        st_ = St::Content;
        emit_section(ParserEvent::Kind::Content, std::string(kToolOpen) + std::string(rest.substr(0, ws)));
        pos_ += ws;
        return true;
      };
      M m = match(r, kFuncOpen);
      if (m == M::No) return fallback();
      if (m == M::Partial) return final ? fallback() : false;
      size_t n = tag_name(r.substr(kFuncOpen.size()), final);
      if (n == kIncomplete) return false;
      if (n == kBad) return fallback();
      std::string name = trim(r.substr(kFuncOpen.size(), n));
      if (name.empty()) return fallback();
      pos_ += ws + kFuncOpen.size() + n + 1;
      open_call(std::move(name));
      st_ = St::FuncBody;
      return true;
    }
    case St::FuncBody: {
      size_t ws = skip_ws(rest);
      stray_.append(rest.substr(0, ws));  // whitespace may belong to a stray JSON body
      pos_ += ws;
      std::string_view r = rest.substr(ws);
      if (r.empty()) {
        if (final) {
          close_call();
          st_ = St::Between;
        }
        return false;
      }
      bool partial = false;
      for (auto mk : {kParamOpen, kFuncClose, kToolClose, kParamClose}) {
        M m = match(r, mk);
        if (m == M::Partial) partial = true;
        if (m != M::Full) continue;
        if (mk == kParamOpen) {
          size_t n = tag_name(r.substr(mk.size()), final);
          if (n == kIncomplete) return false;
          if (n == kBad) break;  // stray text
          open_param(trim(r.substr(mk.size(), n)));
          pos_ += mk.size() + n + 1;
          st_ = St::ParamValue;
        } else if (mk == kFuncClose) {
          close_call();
          pos_ += mk.size();
          st_ = St::FuncClose;
        } else if (mk == kToolClose) {
          close_call();
          pos_ += mk.size();
          st_ = St::Between;
        } else {  // a duplicated </parameter>: ignored
          pos_ += mk.size();
        }
        return true;
      }
      if (partial && !final) return false;
      // Stray text inside the function (kept: a JSON object body becomes the arguments).
      size_t k = r[0] == '<' ? 1 : std::min(r.find('<'), r.size());
      stray_.append(r.substr(0, k));
      pos_ += k;
      if (final && pos_ >= buf_.size()) {
        close_call();
        st_ = St::Between;
      }
      return true;
    }
    case St::ParamValue: {
      static constexpr std::string_view terms[] = {kParamClose, "\n<parameter=", "\n</function>",
                                                   "\n</tool_call>"};
      size_t best = std::string_view::npos, which = 0;
      for (size_t t = 0; t < 4; ++t) {
        size_t p = rest.find(terms[t]);
        if (p < best) { best = p; which = t; }
      }
      if (best != std::string_view::npos) {
        value_.append(rest.substr(0, best));
        if (which == 0) {
          pos_ += best + kParamClose.size();
          st_ = St::ParamClose;
        } else {  // missing </parameter>: the value ends at the line-start tag
          pos_ += best;
          close_value();
          st_ = St::FuncBody;
        }
        return true;
      }
      if (final) {
        value_.append(rest);
        pos_ += rest.size();
        close_value();
        st_ = St::FuncBody;
        return true;
      }
      size_t hold = 0;
      for (auto t : terms) hold = std::max(hold, partial_suffix(rest, t));
      value_.append(rest.substr(0, rest.size() - hold));
      pos_ += rest.size() - hold;
      stream_value();
      return false;
    }
    case St::ParamClose: {
      // After "</parameter>": structural only if a tag follows; otherwise literal text of the value.
      size_t ws = skip_ws(rest);
      std::string_view r = rest.substr(ws);
      bool partial = r.empty();
      for (auto mk : {kParamOpen, kFuncClose, kParamClose, kToolClose}) {
        M m = match(r, mk);
        if (m == M::Full) {
          close_value();
          st_ = St::FuncBody;
          return true;
        }
        if (m == M::Partial) partial = true;
      }
      if (partial) {
        if (!final) return false;
        close_value();
        st_ = St::FuncBody;
        return true;
      }
      value_.append(kParamClose);
      st_ = St::ParamValue;
      return true;
    }
    case St::FuncClose: {
      size_t ws = skip_ws(rest);
      std::string_view r = rest.substr(ws);
      M m = match(r, kToolClose);
      if (m == M::Full) {
        pos_ += ws + kToolClose.size();
        st_ = St::Between;
        return true;
      }
      if ((m == M::Partial || r.empty()) && !final) return false;
      pos_ += ws;
      st_ = St::Between;
      return !r.empty();
    }
    case St::Between: {
      size_t ws = skip_ws(rest);
      std::string_view r = rest.substr(ws);
      M m = match(r, kToolOpen);
      if (m == M::Full) {
        pos_ += ws + kToolOpen.size();
        st_ = St::ToolOpen;
        return true;
      }
      if (r.empty() || (m == M::Partial && !final)) {
        if (final) pos_ += ws;
        return false;
      }
      pos_ += ws;
      st_ = St::Content;
      lead_ = false;
      return true;
    }
  }
  return false;
}

}  // namespace kestrel::server
