// Byte-level BPE of Qwen3.5/3.6 from a Hugging Face tokenizer.json, byte-exact with HF tokenizers:
// added tokens split first (verbatim, leftmost-longest), NFC (utf8proc) per remaining segment, the
// Split pre-tokenizer regex (PCRE2, UTF+UCP, JIT; behaviour Isolated), the GPT-2 byte<->unicode map,
// and merges by rank with a min-heap over (rank, position) exactly as HF's `BPE::merge_word`
// (O(n log n) per pre-token, so a 1 MB run without spaces stays fast). Refuses every tokenizer.json
// feature Qwen does not use (other models, byte fallback, unk, dropout, prefix spaces, normalized
// added tokens) with an error naming the field, instead of approximating it.
#include "tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <unordered_map>

#include "core/check.h"
#include "tokenizer/utf8.h"

namespace kestrel {
namespace {

using nlohmann::json;

// GPT-2 bytes_to_unicode(): printable bytes map to themselves, the rest to U+0100.. in byte order.
std::array<char32_t, 256> byte_to_cp() {
  std::array<char32_t, 256> m{};
  std::array<bool, 256> printable{};
  for (int b = '!'; b <= '~'; ++b) printable[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) printable[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) printable[b] = true;
  char32_t n = 0;
  for (int b = 0; b < 256; ++b) m[b] = printable[b] ? static_cast<char32_t>(b) : 256 + n++;
  return m;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  KESTREL_CHECK(f.good(), "cannot open {}", p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json parse_json(const std::filesystem::path& p) {
  const std::string text = read_file(p);
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    KESTREL_FAIL("{}: malformed JSON: {}", p.string(), e.what());
  }
}

const json& field(const json& obj, const char* key, const char* where) {
  KESTREL_CHECK(obj.is_object(), "tokenizer.json: {} must be an object", where);
  auto it = obj.find(key);
  KESTREL_CHECK(it != obj.end(), "tokenizer.json: {} has no field \"{}\"", where, key);
  return *it;
}

std::string str_field(const json& obj, const char* key, const char* where) {
  const json& v = field(obj, key, where);
  KESTREL_CHECK(v.is_string(), "tokenizer.json: {}.{} must be a string, got {}", where, key, v.dump());
  return v.get<std::string>();
}

// A boolean option that must be absent/null or equal `expected` (a feature Qwen does not use).
void expect_flag(const json& obj, const char* key, bool expected, const char* where) {
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return;
  KESTREL_CHECK(it->is_boolean() && it->get<bool>() == expected,
                "tokenizer.json: {}.{} = {} is not supported (expected {})", where, key, it->dump(),
                expected);
}

// Python-`re`/Oniguruma `\s` is the Unicode White_Space property; PCRE2's UCP `\s` differs in a
// few code points (U+0085, U+180E history), so the pattern's \s and \S are spelt out explicitly.
constexpr const char* kWhiteSpace =
    "\\t\\n\\x{0B}\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";

std::string translate_regex(const std::string& re) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < re.size(); ++i) {
    const char c = re[i];
    if (c == '\\' && i + 1 < re.size()) {
      const char n = re[i + 1];
      if (n == 's') {
        out += in_class ? std::string(kWhiteSpace) : "[" + std::string(kWhiteSpace) + "]";
      } else if (n == 'S') {
        KESTREL_CHECK(!in_class, "tokenizer.json: \\S inside a character class is not supported");
        out += "[^" + std::string(kWhiteSpace) + "]";
      } else {
        out += c;
        out += n;
      }
      ++i;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < re.size() && re[i + 1] == '^') out += re[++i];
      if (i + 1 < re.size() && re[i + 1] == ']') out += re[++i];  // literal ] first in class
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

struct Pcre2Code {
  pcre2_code* code = nullptr;
  ~Pcre2Code() {
    if (code) pcre2_code_free(code);
  }
};

// Per-thread PCRE2 match state (match data and a JIT stack are not tied to a pattern).
struct MatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchState() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 8 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~MatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(mctx);
    pcre2_match_data_free(md);
  }
};

MatchState& match_state() {
  thread_local MatchState s;
  return s;
}

struct MergeInfo {
  int32_t rank;
  int32_t new_id;
};

// Open-addressing hash map (id pair -> merge), the hot lookup of encode.
class MergeMap {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, MergeInfo{0, 0});
    mask_ = cap - 1;
  }
  bool insert(int32_t a, int32_t b, MergeInfo v) {  // false if the pair exists
    const uint64_t k = key(a, b);
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == kEmpty) {
        keys_[i] = k;
        vals_[i] = v;
        return true;
      }
      if (keys_[i] == k) return false;
    }
  }
  const MergeInfo* find(int32_t a, int32_t b) const {
    const uint64_t k = key(a, b);
    for (size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ULL;
  static uint64_t key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  static size_t hash(uint64_t k) { return static_cast<size_t>((k * 0x9E3779B97F4A7C15ULL) >> 17); }
  std::vector<uint64_t> keys_;
  std::vector<MergeInfo> vals_;
  size_t mask_ = 0;
};

struct AddedToken {
  std::string content;
  int32_t id;
  bool special;
};

class BpeTokenizer final : public Tokenizer {
 public:
  explicit BpeTokenizer(const std::filesystem::path& dir);
  std::vector<int32_t> encode(std::string_view text, bool parse_special) const override;
  std::string decode(std::span<const int32_t> ids, bool skip_special) const override;
  std::string token_bytes(int32_t id) const override {
    check_id(id);
    return bytes_[id];
  }
  std::string token_piece(int32_t id) const override {
    check_id(id);
    return pieces_[id];
  }
  std::optional<int32_t> token_id(std::string_view token) const override {
    auto it = lookup_.find(std::string(token));
    if (it == lookup_.end()) return std::nullopt;
    return it->second;
  }
  bool is_special(int32_t id) const override { return id >= 0 && id < n_ && special_[id]; }
  bool is_added(int32_t id) const override { return id >= 0 && id < n_ && added_[id]; }
  int32_t vocab_size() const override { return n_; }
  std::optional<int32_t> eos_token_id() const override { return eos_; }

 private:
  void check_id(int32_t id) const {
    KESTREL_CHECK(id >= 0 && id < n_ && valid_[id], "token id {} out of range (vocabulary of {})",
                  id, n_);
  }
  void load_model(const json& model);
  void load_pretokenizer(const json& pre);
  void encode_segment(std::string_view seg, std::vector<int32_t>& out) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;

  int32_t n_ = 0;
  std::vector<std::string> pieces_;  // tokenizer.json form
  std::vector<std::string> bytes_;   // raw bytes
  std::vector<uint8_t> valid_, special_, added_;
  std::unordered_map<std::string, int32_t> vocab_;   // regular tokens (byte-level form)
  std::unordered_map<std::string, int32_t> lookup_;  // vocab + added contents
  std::array<int32_t, 256> byte_id_{};
  MergeMap merges_;
  bool ignore_merges_ = false;
  std::array<std::string, 256> byte_str_;  // byte -> its byte-level unicode char (UTF-8)
  std::vector<AddedToken> added_list_;
  std::array<std::vector<size_t>, 256> added_by_first_;  // indices into added_list_, longest first
  Pcre2Code regex_;
  std::optional<int32_t> eos_;
};

BpeTokenizer::BpeTokenizer(const std::filesystem::path& dir) {
  const auto tj_path = dir / "tokenizer.json";
  KESTREL_CHECK(std::filesystem::exists(tj_path), "{}: no tokenizer.json", dir.string());
  const json tj = parse_json(tj_path);
  KESTREL_CHECK(tj.is_object(), "tokenizer.json: top level must be an object");

  // normalizer: NFC (or none).
  const json& norm = tj.contains("normalizer") ? tj["normalizer"] : json();
  KESTREL_CHECK(norm.is_null() || (norm.is_object() && norm.value("type", "") == "NFC"),
                "tokenizer.json: normalizer {} is not supported (expected NFC)", norm.dump());
  KESTREL_CHECK(norm.is_object(), "tokenizer.json: normalizer missing (Qwen3.6 uses NFC)");

  load_pretokenizer(field(tj, "pre_tokenizer", "top level"));
  const json& dec = field(tj, "decoder", "top level");
  KESTREL_CHECK(dec.is_object() && dec.value("type", "") == "ByteLevel",
                "tokenizer.json: decoder {} is not supported (expected ByteLevel)", dec.dump());
  if (tj.contains("post_processor") && !tj["post_processor"].is_null()) {
    const json& pp = tj["post_processor"];
    KESTREL_CHECK(pp.is_object() && pp.value("type", "") == "ByteLevel",
                  "tokenizer.json: post_processor {} is not supported (expected none or ByteLevel)",
                  pp.dump().substr(0, 200));
  }
  load_model(field(tj, "model", "top level"));

  // Added tokens.
  const json& added = field(tj, "added_tokens", "top level");
  KESTREL_CHECK(added.is_array(), "tokenizer.json: added_tokens must be an array");
  int32_t max_id = static_cast<int32_t>(pieces_.size()) - 1;
  for (const json& a : added) {
    KESTREL_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer(),
                  "tokenizer.json: added token without integer id: {}", a.dump());
    const int64_t id = a["id"].get<int64_t>();
    KESTREL_CHECK(id >= 0 && id < (1 << 30), "tokenizer.json: added token id {} out of range", id);
    const std::string content = str_field(a, "content", "added_tokens[]");
    KESTREL_CHECK(!content.empty(), "tokenizer.json: added token {} has empty content", id);
    KESTREL_CHECK(utf8::first_invalid(content) == std::string_view::npos,
                  "tokenizer.json: added token {} is not valid UTF-8", id);
    for (const char* k : {"lstrip", "rstrip", "single_word", "normalized"})
      expect_flag(a, k, false, "added_tokens[]");
    const bool special = a.value("special", false);
    added_list_.push_back({content, static_cast<int32_t>(id), special});
    max_id = std::max<int32_t>(max_id, static_cast<int32_t>(id));
  }
  n_ = max_id + 1;
  pieces_.resize(n_);
  bytes_.resize(n_);
  valid_.resize(n_, 0);
  special_.assign(n_, 0);
  added_.assign(n_, 0);
  for (const auto& [piece, id] : vocab_) valid_[id] = 1;
  for (const AddedToken& a : added_list_) {
    if (valid_[a.id] && !added_[a.id]) {
      KESTREL_CHECK(pieces_[a.id] == a.content,
                    "tokenizer.json: added token {} \"{}\" collides with vocab token \"{}\"", a.id,
                    a.content, pieces_[a.id]);
    }
    KESTREL_CHECK(!added_[a.id], "tokenizer.json: added token id {} appears twice", a.id);
    auto [it, fresh] = lookup_.emplace(a.content, a.id);
    KESTREL_CHECK(fresh || it->second == a.id, "tokenizer.json: token \"{}\" has two ids ({}, {})",
                  a.content, it->second, a.id);
    valid_[a.id] = added_[a.id] = 1;
    special_[a.id] = a.special;
    pieces_[a.id] = a.content;
    bytes_[a.id] = a.content;
  }
  for (size_t i = 0; i < added_list_.size(); ++i)
    added_by_first_[static_cast<unsigned char>(added_list_[i].content[0])].push_back(i);
  for (auto& v : added_by_first_)
    std::stable_sort(v.begin(), v.end(), [&](size_t x, size_t y) {
      return added_list_[x].content.size() > added_list_[y].content.size();
    });

  // tokenizer_config.json (optional): eos_token, and no BOS.
  const auto cfg_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(cfg_path)) {
    const json cfg = parse_json(cfg_path);
    KESTREL_CHECK(cfg.is_object(), "tokenizer_config.json: top level must be an object");
    KESTREL_CHECK(!cfg.value("add_bos_token", false),
                  "tokenizer_config.json: add_bos_token=true is not supported (Qwen3.6 adds no BOS)");
    if (cfg.contains("eos_token") && !cfg["eos_token"].is_null()) {
      const json& e = cfg["eos_token"];
      std::string s;
      if (e.is_string()) {
        s = e.get<std::string>();
      } else {
        KESTREL_CHECK(e.is_object() && e.contains("content") && e["content"].is_string(),
                      "tokenizer_config.json: eos_token must be a string or {{\"content\": ...}}, got {}",
                      e.dump());
        s = e["content"].get<std::string>();
      }
      auto id = token_id(s);
      KESTREL_CHECK(id.has_value(), "tokenizer_config.json: eos_token \"{}\" is not in the vocabulary", s);
      eos_ = *id;
    }
  }
}

void BpeTokenizer::load_pretokenizer(const json& pre) {
  KESTREL_CHECK(pre.is_object() && pre.value("type", "") == "Sequence" && pre.contains("pretokenizers") &&
                    pre["pretokenizers"].is_array() && pre["pretokenizers"].size() == 2,
                "tokenizer.json: pre_tokenizer must be Sequence[Split, ByteLevel], got {}",
                pre.dump().substr(0, 300));
  const json& split = pre["pretokenizers"][0];
  const json& bl = pre["pretokenizers"][1];
  KESTREL_CHECK(split.is_object() && split.value("type", "") == "Split",
                "tokenizer.json: pre_tokenizer[0] must be Split, got {}", split.dump().substr(0, 200));
  KESTREL_CHECK(split.value("behavior", "") == "Isolated",
                "tokenizer.json: Split.behavior {} is not supported (expected Isolated)",
                split.contains("behavior") ? split["behavior"].dump() : "missing");
  expect_flag(split, "invert", false, "Split");
  const json& pat = field(split, "pattern", "Split");
  KESTREL_CHECK(pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string(),
                "tokenizer.json: Split.pattern must be {{\"Regex\": ...}}, got {}", pat.dump());
  KESTREL_CHECK(bl.is_object() && bl.value("type", "") == "ByteLevel",
                "tokenizer.json: pre_tokenizer[1] must be ByteLevel, got {}", bl.dump());
  expect_flag(bl, "add_prefix_space", false, "ByteLevel");
  expect_flag(bl, "use_regex", false, "ByteLevel");

  const std::string re = translate_regex(pat["Regex"].get<std::string>());
  int err = 0;
  PCRE2_SIZE off = 0;
  regex_.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK, &err, &off, nullptr);
  if (!regex_.code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    KESTREL_FAIL("tokenizer.json: Split regex does not compile at offset {}: {}", off,
                 reinterpret_cast<const char*>(msg));
  }
  const int jit = pcre2_jit_compile(regex_.code, PCRE2_JIT_COMPLETE);
  KESTREL_CHECK(jit == 0, "PCRE2 JIT compilation of the Split regex failed ({})", jit);
}

void BpeTokenizer::load_model(const json& model) {
  KESTREL_CHECK(model.is_object() && model.value("type", "") == "BPE",
                "tokenizer.json: model.type must be BPE, got {}",
                model.is_object() && model.contains("type") ? model["type"].dump() : "none");
  expect_flag(model, "byte_fallback", false, "model");
  expect_flag(model, "fuse_unk", false, "model");
  KESTREL_CHECK(!model.contains("unk_token") || model["unk_token"].is_null(),
                "tokenizer.json: model.unk_token {} is not supported (Qwen has no unk)",
                model["unk_token"].dump());
  KESTREL_CHECK(!model.contains("dropout") || model["dropout"].is_null(),
                "tokenizer.json: model.dropout is not supported");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    KESTREL_CHECK(!model.contains(k) || model[k].is_null() || model[k] == "",
                  "tokenizer.json: model.{} {} is not supported", k, model[k].dump());
  }
  if (model.contains("ignore_merges") && model["ignore_merges"].is_boolean())
    ignore_merges_ = model["ignore_merges"].get<bool>();

  const json& vocab = field(model, "vocab", "model");
  KESTREL_CHECK(vocab.is_object() && !vocab.empty(), "tokenizer.json: model.vocab must be a non-empty object");
  int32_t max_id = -1;
  vocab_.reserve(vocab.size() * 2);
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    KESTREL_CHECK(it.value().is_number_integer(), "tokenizer.json: vocab[\"{}\"] is not an integer id",
                  it.key());
    const int64_t id = it.value().get<int64_t>();
    KESTREL_CHECK(id >= 0 && id < (1 << 30), "tokenizer.json: vocab id {} out of range", id);
    vocab_.emplace(it.key(), static_cast<int32_t>(id));
    max_id = std::max<int32_t>(max_id, static_cast<int32_t>(id));
  }
  pieces_.assign(max_id + 1, std::string());
  bytes_.assign(max_id + 1, std::string());
  std::vector<uint8_t> seen(max_id + 1, 0);

  const auto b2c = byte_to_cp();
  std::unordered_map<char32_t, uint8_t> c2b;
  for (int b = 0; b < 256; ++b) {
    c2b[b2c[b]] = static_cast<uint8_t>(b);
    byte_str_[b].clear();
    utf8::append_cp(byte_str_[b], b2c[b]);
  }
  for (const auto& [piece, id] : vocab_) {
    KESTREL_CHECK(!seen[id], "tokenizer.json: vocab id {} is used twice", id);
    seen[id] = 1;
    pieces_[id] = piece;
    lookup_.emplace(piece, id);
    // ByteLevel decoder: every char maps back to its byte; a token with a char outside the map
    // decodes to its raw UTF-8 (as HF's decoder does).
    std::string raw;
    bool all_mapped = true;
    for (size_t i = 0; i < piece.size() && all_mapped;) {
      KESTREL_CHECK(utf8::next_seq(piece, i).kind == utf8::SeqKind::kValid,
                    "tokenizer.json: vocab token {} is not valid UTF-8", id);
      const char32_t cp = utf8::decode_cp(piece, i);
      auto f = c2b.find(cp);
      if (f == c2b.end()) all_mapped = false;
      else raw.push_back(static_cast<char>(f->second));
    }
    bytes_[id] = all_mapped ? raw : piece;
  }
  for (int b = 0; b < 256; ++b) {
    auto it = vocab_.find(byte_str_[b]);
    KESTREL_CHECK(it != vocab_.end(), "tokenizer.json: vocab lacks the byte token for 0x{:02X} (\"{}\")",
                  b, byte_str_[b]);
    byte_id_[b] = it->second;
  }

  const json& merges = field(model, "merges", "model");
  KESTREL_CHECK(merges.is_array(), "tokenizer.json: model.merges must be an array");
  merges_.reserve(merges.size());
  int32_t rank = 0;
  for (const json& m : merges) {
    std::string a, b;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      KESTREL_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                    "tokenizer.json: merge {} is not \"A B\"", rank);
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      KESTREL_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                    "tokenizer.json: merge {} must be [\"A\", \"B\"] or \"A B\", got {}", rank, m.dump());
      a = m[0].get<std::string>();
      b = m[1].get<std::string>();
    }
    auto ia = vocab_.find(a), ib = vocab_.find(b), inew = vocab_.find(a + b);
    KESTREL_CHECK(ia != vocab_.end() && ib != vocab_.end(),
                  "tokenizer.json: merge {} (\"{}\" \"{}\") uses a token outside the vocab", rank, a, b);
    KESTREL_CHECK(inew != vocab_.end(), "tokenizer.json: merge {} result \"{}\" is not in the vocab",
                  rank, a + b);
    // HF keeps the first occurrence of a duplicated pair (later ranks never apply).
    merges_.insert(ia->second, ib->second, MergeInfo{rank, inew->second});
    ++rank;
  }
}

void BpeTokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  const size_t n = piece.size();
  if (n == 0) return;
  if (n == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (ignore_merges_) {
    std::string s;
    for (char c : piece) s += byte_str_[static_cast<unsigned char>(c)];
    auto it = vocab_.find(s);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Sym {
    int32_t id, prev, next;
    bool alive;
  };
  struct Entry {
    int32_t rank, pos, new_id;
    bool operator<(const Entry& o) const {  // max-heap on (-rank, -pos)
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Entry> heap;
  syms.resize(n);
  heap.clear();
  for (size_t i = 0; i < n; ++i) {
    syms[i] = {byte_id_[static_cast<unsigned char>(piece[i])], static_cast<int32_t>(i) - 1,
               i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  }
  for (size_t i = 0; i + 1 < n; ++i) {
    if (const MergeInfo* m = merges_.find(syms[i].id, syms[i + 1].id))
      heap.push_back({m->rank, static_cast<int32_t>(i), m->new_id});
  }
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Entry top = heap.back();
    heap.pop_back();
    Sym& s = syms[top.pos];
    if (!s.alive || s.next < 0) continue;
    Sym& r = syms[s.next];
    const MergeInfo* m = merges_.find(s.id, r.id);
    if (!m || m->new_id != top.new_id) continue;
    s.id = top.new_id;
    r.alive = false;
    s.next = r.next;
    if (s.next >= 0) syms[s.next].prev = top.pos;
    if (s.prev >= 0) {
      if (const MergeInfo* pm = merges_.find(syms[s.prev].id, s.id)) {
        heap.push_back({pm->rank, s.prev, pm->new_id});
        std::push_heap(heap.begin(), heap.end());
      }
    }
    if (s.next >= 0) {
      if (const MergeInfo* nm = merges_.find(s.id, syms[s.next].id)) {
        heap.push_back({nm->rank, top.pos, nm->new_id});
        std::push_heap(heap.begin(), heap.end());
      }
    }
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

bool is_ascii(std::string_view s) {
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    unsigned long long w;
    std::memcpy(&w, s.data() + i, 8);
    if (w & 0x8080808080808080ULL) return false;
  }
  for (; i < s.size(); ++i)
    if (static_cast<unsigned char>(s[i]) & 0x80) return false;
  return true;
}

void BpeTokenizer::encode_segment(std::string_view seg, std::vector<int32_t>& out) const {
  if (seg.empty()) return;
  std::string normalized;
  if (!is_ascii(seg)) {  // ASCII is always NFC
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t len =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(seg.data()),
                     static_cast<utf8proc_ssize_t>(seg.size()), &dst,
                     static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
    if (len < 0) {
      std::free(dst);
      KESTREL_FAIL("NFC normalisation failed: {}", utf8proc_errmsg(len));
    }
    normalized.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(len));
    std::free(dst);
    seg = normalized;
  }
  MatchState& ms = match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(seg.data());
  size_t pos = 0, last = 0;
  while (pos < seg.size()) {
    const int rc = pcre2_jit_match(regex_.code, subject, seg.size(), pos, PCRE2_NO_UTF_CHECK, ms.md,
                                   ms.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    KESTREL_CHECK(rc > 0, "PCRE2 match error {} at byte {}", rc, pos);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
    const size_t s = ov[0], e = ov[1];
    if (s > last) bpe(seg.substr(last, s - last), out);  // Isolated: the gap is its own piece
    if (e > s) {
      bpe(seg.substr(s, e - s), out);
      pos = last = e;
    } else {  // empty match: step one code point
      pos = s + utf8::next_seq(seg, s).len;
    }
  }
  if (last < seg.size()) bpe(seg.substr(last), out);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool parse_special) const {
  const size_t bad = utf8::first_invalid(text);
  KESTREL_CHECK(bad == std::string_view::npos, "input is not valid UTF-8 (first bad byte 0x{:02X} at offset {})",
                static_cast<unsigned char>(text[bad]), bad);
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 4);
  if (!parse_special || added_list_.empty()) {
    encode_segment(text, out);
    return out;
  }
  size_t seg_start = 0;
  for (size_t i = 0; i < text.size();) {
    const auto& cands = added_by_first_[static_cast<unsigned char>(text[i])];
    const AddedToken* hit = nullptr;
    for (size_t k : cands) {
      const std::string& c = added_list_[k].content;
      if (text.size() - i >= c.size() && std::memcmp(text.data() + i, c.data(), c.size()) == 0) {
        hit = &added_list_[k];
        break;
      }
    }
    if (!hit) {
      ++i;
      continue;
    }
    encode_segment(text.substr(seg_start, i - seg_start), out);
    out.push_back(hit->id);
    i += hit->content.size();
    seg_start = i;
  }
  encode_segment(text.substr(seg_start), out);
  return out;
}

std::string BpeTokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  std::string raw;
  for (int32_t id : ids) {
    check_id(id);
    if (skip_special && special_[id]) continue;
    raw += bytes_[id];
  }
  std::string out;
  out.reserve(raw.size());
  utf8::append_lossy(out, raw);
  return out;
}

}  // namespace

std::unique_ptr<Tokenizer> Tokenizer::load(const std::filesystem::path& model_dir) {
  try {
    return std::make_unique<BpeTokenizer>(model_dir);
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong JSON type
    KESTREL_FAIL("{}: malformed tokenizer.json/tokenizer_config.json: {}", model_dir.string(), e.what());
  }
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += tok_.token_bytes(id);
  // Emit every complete sequence; an ill-formed subpart can be decided now (it becomes U+FFFD);
  // a truncated but so-far valid tail waits for the next token.
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const utf8::Seq q = utf8::next_seq(pending_, i);
    if (q.kind == utf8::SeqKind::kIncomplete) break;
    if (q.kind == utf8::SeqKind::kValid) out.append(pending_, i, q.len);
    else out += utf8::kReplacement;
    i += q.len;
  }
  pending_.erase(0, i);
  return out;
}

std::string StreamDecoder::flush() {
  std::string out;
  utf8::append_lossy(out, pending_);
  pending_.clear();
  return out;
}

}  // namespace kestrel
