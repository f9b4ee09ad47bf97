// Strict request JSON, UTF-8 assembly of token bytes, and stop-string hold-back.
#include "server/text_stream.h"

#include "server/api_error.h"

#include <fmt/format.h>

#include <algorithm>

namespace kestrel::server {

namespace {
struct DepthExceeded {};

// Length of the UTF-8 sequence starting at s[i] if it is valid and complete; 0 if invalid; -1 if it
// is a valid prefix cut off by the end of the string.
int utf8_seq(std::string_view s, size_t i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  int len;
  unsigned lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    if (i + size_t(k) >= s.size()) return -1;
    const auto b = static_cast<unsigned char>(s[i + size_t(k)]);
    const unsigned l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) return 0;
  }
  return len;
}
constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
}  // namespace

bool try_parse_json(std::string_view text, nlohmann::json& out, int max_depth) {
  int depth = 0;
  auto cb = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json&) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start || ev == E::array_start) {
      if (++depth > max_depth) throw DepthExceeded{};
    } else if (ev == E::object_end || ev == E::array_end) {
      --depth;
    }
    return true;
  };
  try {
    out = nlohmann::json::parse(text.begin(), text.end(), cb, /*allow_exceptions=*/true);
    return true;
  } catch (const DepthExceeded&) {
    return false;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

nlohmann::json parse_json_body(std::string_view body, bool require_object, int max_depth) {
  if (body.empty()) throw invalid("request body is empty; expected a JSON object");
  int depth = 0;
  auto cb = [&](int, nlohmann::json::parse_event_t ev, nlohmann::json&) {
    using E = nlohmann::json::parse_event_t;
    if (ev == E::object_start || ev == E::array_start) {
      if (++depth > max_depth) throw DepthExceeded{};
    } else if (ev == E::object_end || ev == E::array_end) {
      --depth;
    }
    return true;
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(body.begin(), body.end(), cb, true);
  } catch (const DepthExceeded&) {
    throw invalid(fmt::format("JSON nesting exceeds the limit of {} levels", max_depth));
  } catch (const nlohmann::json::parse_error& e) {
    // Never echo the body: only the byte offset (nlohmann's message quotes the input).
    const bool utf8 = std::string_view(e.what()).find("UTF-8") != std::string_view::npos ||
                      std::string_view(e.what()).find("surrogate") != std::string_view::npos;
    throw invalid(fmt::format("invalid JSON body at byte {}{}", e.byte,
                              utf8 ? ": invalid UTF-8 or unpaired surrogate in a string" : ""));
  } catch (const nlohmann::json::exception&) {
    throw invalid("invalid JSON body");
  }
  if (require_object && !j.is_object())
    throw invalid(fmt::format("request body must be a JSON object, got {}", j.type_name()));
  return j;
}

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    int n = utf8_seq(s, i);
    if (n <= 0) return false;
    i += size_t(n);
  }
  return true;
}

size_t utf8_complete_prefix(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    int n = utf8_seq(s, i);
    if (n < 0) return i;
    i += n == 0 ? 1 : size_t(n);
  }
  return i;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    int n = utf8_seq(s, i);
    if (n > 0) {
      out.append(s.substr(i, size_t(n)));
      i += size_t(n);
    } else {
      out.append(kReplacement);
      i += 1;
      if (n < 0) {
        // A truncated sequence: one U+FFFD for all of it.
        while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
      }
    }
  }
  return out;
}

std::string Utf8Assembler::push(std::string_view bytes) {
  pending_.append(bytes);
  size_t n = utf8_complete_prefix(pending_);
  std::string out = utf8_sanitize(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string Utf8Assembler::flush() {
  std::string out = pending_.empty() ? std::string() : std::string(kReplacement);
  pending_.clear();
  return out;
}

size_t partial_suffix(std::string_view text, std::string_view marker) {
  size_t best = 0;
  const size_t max = std::min(text.size(), marker.size() > 0 ? marker.size() - 1 : 0);
  for (size_t k = 1; k <= max; ++k)
    if (text.substr(text.size() - k) == marker.substr(0, k)) best = k;
  return best;
}

std::string StopMatcher::push(std::string_view text) {
  if (stopped_) return {};
  held_.append(text);
  if (stops_.empty()) {
    std::string out;
    out.swap(held_);
    return out;
  }
  // Earliest full match wins.
  size_t best = std::string::npos;
  for (const auto& s : stops_) {
    size_t p = held_.find(s);
    if (p != std::string::npos && p < best) {
      best = p;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, best);
    held_.clear();
    return out;
  }
  size_t hold = 0;
  for (const auto& s : stops_) hold = std::max(hold, partial_suffix(held_, s));
  // Never split a UTF-8 sequence when holding back (the text is valid UTF-8, so only cut at starts).
  size_t cut = held_.size() - hold;
  while (cut > 0 && cut < held_.size() && (static_cast<unsigned char>(held_[cut]) & 0xC0) == 0x80) --cut;
  std::string out = held_.substr(0, cut);
  held_.erase(0, cut);
  return out;
}

std::string StopMatcher::flush() {
  std::string out;
  if (!stopped_) out.swap(held_);
  held_.clear();
  return out;
}

}  // namespace kestrel::server
