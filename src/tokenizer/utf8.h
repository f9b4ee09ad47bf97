// UTF-8 helpers shared by the tokenizer, the streaming detokenizer and the chat renderer: strict
// validation and lossy conversion with the "maximal subpart" rule (one U+FFFD per maximal prefix of
// an ill-formed sequence), which is what Rust's String::from_utf8_lossy (HF tokenizers' decode) does.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace kestrel::utf8 {

enum class SeqKind { kValid, kInvalid, kIncomplete };

struct Seq {
  SeqKind kind;
  size_t len;  // bytes consumed: the code point, the maximal subpart, or the truncated prefix
};

// Classifies the sequence starting at s[i] (i < s.size()).
inline Seq next_seq(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) return {SeqKind::kValid, 1};
  size_t width;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    width = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    width = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    width = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return {SeqKind::kInvalid, 1};
  }
  for (size_t k = 1; k < width; ++k) {
    if (i + k >= s.size()) return {SeqKind::kIncomplete, k};
    const unsigned char x = b(i + k);
    const bool ok = k == 1 ? (x >= lo && x <= hi) : (x >= 0x80 && x <= 0xBF);
    if (!ok) return {SeqKind::kInvalid, k};
  }
  return {SeqKind::kValid, width};
}

// Offset of the first ill-formed or truncated byte, or npos when `s` is valid UTF-8.
inline size_t first_invalid(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= s.size()) {
      unsigned long long w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= s.size()) break;
    const Seq q = next_seq(s, i);
    if (q.kind != SeqKind::kValid) return i;
    i += q.len;
  }
  return std::string_view::npos;
}

inline constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Appends `s` to `out`, each maximal ill-formed subpart (and a truncated tail) becoming U+FFFD.
inline void append_lossy(std::string& out, std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const Seq q = next_seq(s, i);
    if (q.kind == SeqKind::kValid) {
      out.append(s.data() + i, q.len);
    } else {
      out.append(kReplacement);
    }
    i += q.len;
  }
}

// Appends a code point as UTF-8.
inline void append_cp(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

// Decodes the valid code point at s[i] (caller guarantees validity); advances i.
inline char32_t decode_cp(std::string_view s, size_t& i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  if (c < 0x80) {
    i += 1;
    return c;
  }
  if (c < 0xE0) {
    const char32_t cp = ((c & 0x1F) << 6) | (b(i + 1) & 0x3F);
    i += 2;
    return cp;
  }
  if (c < 0xF0) {
    const char32_t cp = ((c & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
    i += 3;
    return cp;
  }
  const char32_t cp = ((c & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) |
                      (b(i + 3) & 0x3F);
  i += 4;
  return cp;
}

}  // namespace kestrel::utf8
