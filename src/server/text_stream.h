// Text plumbing between sampled tokens and what a client sees:
//  - parse_json_body: strict JSON for request bodies (object only, nesting <= 64, valid UTF-8,
//    error messages that never echo the body);
//  - Utf8Assembler: joins raw token bytes and releases only complete UTF-8 (invalid bytes become
//    U+FFFD; a pending partial sequence is flushed as U+FFFD at the end);
//  - StopMatcher: finds stop strings across token boundaries and holds back text that may be the start
//    of one, so a stop string is never partially streamed.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <string_view>
#include <vector>

namespace kestrel::server {

constexpr int kMaxJsonDepth = 64;

// Throws ApiError(400) for malformed JSON, invalid UTF-8, nesting deeper than max_depth, or (with
// require_object) a body that is not a JSON object.
nlohmann::json parse_json_body(std::string_view body, bool require_object = true,
                               int max_depth = kMaxJsonDepth);
// As parse_json_body without the object requirement; returns false instead of throwing.
bool try_parse_json(std::string_view text, nlohmann::json& out, int max_depth = kMaxJsonDepth);

// True iff `s` is well-formed UTF-8 (no overlongs, no surrogates, <= U+10FFFF).
bool is_valid_utf8(std::string_view s);
// Length of the longest prefix of `s` that is complete, well-formed UTF-8 or definitely invalid
// (i.e. everything except a trailing incomplete-but-still-valid partial sequence).
size_t utf8_complete_prefix(std::string_view s);
// Replaces invalid sequences by U+FFFD.
std::string utf8_sanitize(std::string_view s);

class Utf8Assembler {
 public:
  // Appends raw bytes; returns the newly completed, valid UTF-8 text.
  std::string push(std::string_view bytes);
  // Whatever is pending at the end (an incomplete sequence becomes U+FFFD).
  std::string flush();

 private:
  std::string pending_;
};

class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops) : stops_(std::move(stops)) {}
  // Appends text; returns the text that is safe to emit. After a stop string is found, stopped() is
  // true, the returned text ends right before it and every later call returns "".
  std::string push(std::string_view text);
  // The held-back tail at the end of generation (empty after a stop).
  std::string flush();
  bool stopped() const { return stopped_; }
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string held_;
  bool stopped_ = false;
  std::string matched_;
};

// Length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t partial_suffix(std::string_view text, std::string_view marker);

}  // namespace kestrel::server
