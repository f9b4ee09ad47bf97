// Byte-level BPE tokenizer of Qwen3.5/3.6, loaded from a model directory's tokenizer.json and
// tokenizer_config.json; byte-exact with Hugging Face tokenizers. (Interface contract shared by the
// tokenizer, the CLI and the server; the implementation may add members but not change these.)
#pragma once
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel {

class Tokenizer {
 public:
  // Loads tokenizer.json (+ tokenizer_config.json if present) from `model_dir`; kestrel::Error on
  // malformed input.
  static std::unique_ptr<Tokenizer> load(const std::filesystem::path& model_dir);
  virtual ~Tokenizer() = default;

  // Encodes UTF-8 text. parse_special=false (the default, used for all message content): added
  // tokens such as <|im_start|> are ordinary text. parse_special=true: added tokens in the text are
  // matched (longest first) and emitted as their ids. Invalid UTF-8 is an error (kestrel::Error).
  virtual std::vector<int32_t> encode(std::string_view text, bool parse_special = false) const = 0;
  // Decodes ids to UTF-8 (ByteLevel decoder); skip_special drops tokens flagged special.
  // Incomplete/invalid byte sequences become U+FFFD.
  virtual std::string decode(std::span<const int32_t> ids, bool skip_special = false) const = 0;
  // The raw bytes a token stands for (may be a partial UTF-8 sequence).
  virtual std::string token_bytes(int32_t id) const = 0;
  // The token string as in tokenizer.json (byte-level unicode form), for display.
  virtual std::string token_piece(int32_t id) const = 0;
  virtual std::optional<int32_t> token_id(std::string_view token) const = 0;  // exact vocab/added lookup
  virtual bool is_special(int32_t id) const = 0;  // added token with special=true
  virtual bool is_added(int32_t id) const = 0;
  virtual int32_t vocab_size() const = 0;  // number of real tokens (max id + 1)
  // eos_token of tokenizer_config.json (e.g. <|im_end|>), if any.
  virtual std::optional<int32_t> eos_token_id() const = 0;
};

// Incremental detokenizer: push ids, receive only complete UTF-8; never emits a broken sequence.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false);
  // Returns the newly completed text (possibly empty while a multi-byte sequence is pending).
  std::string push(int32_t id);
  // Returns what is left at the end; truly invalid or incomplete trailing bytes become U+FFFD.
  std::string flush();

 private:
  const Tokenizer& tok_;
  bool skip_special_;
  std::string pending_;
};

}  // namespace kestrel
