// kestrel tokenize: encode text with a model directory's tokenizer and print ids and pieces (for
// debugging prompts). Message content is ordinary text by default; --special parses added tokens
// such as <|im_start|> the way a raw /v1/completions prompt with special parsing would.
#include "cli/commands.h"
#include "core/check.h"
#include "tokenizer/tokenizer.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace {

std::string escape_bytes(const std::string& s) {
  std::string out;
  for (unsigned char c : s) {
    if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c == '\\') out += "\\\\";
    else if (c < 0x20 || c == 0x7f) out += fmt::format("\\x{:02x}", c);
    else out.push_back(static_cast<char>(c));
  }
  return out;
}

void setup_tokenize(CLI::App& root) {
  struct Args {
    std::string model, text, file;
    bool special = false, ids_only = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = root.add_subcommand("tokenize", "encode text and print token ids and pieces");
  cmd->add_option("--model", a->model, "model directory (tokenizer.json)")->required();
  auto* t = cmd->add_option("--text", a->text, "text to encode");
  auto* f = cmd->add_option("--file", a->file, "file whose bytes are encoded");
  t->excludes(f);
  cmd->add_flag("--special", a->special, "match added tokens (<|im_start|>, ...) in the text");
  cmd->add_flag("--ids-only", a->ids_only, "print only the comma-separated ids");
  cmd->callback([a, t, f] {
    KESTREL_CHECK(t->count() + f->count() == 1, "give exactly one of --text or --file");
    std::string text = a->text;
    if (f->count()) {
      std::ifstream in(a->file, std::ios::binary);
      KESTREL_CHECK(in.good(), "cannot open {}", a->file);
      std::ostringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    auto tok = kestrel::Tokenizer::load(a->model);
    const auto ids = tok->encode(text, a->special);
    if (a->ids_only) {
      std::string line;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i) line += ',';
        line += std::to_string(ids[i]);
      }
      std::printf("%s\n", line.c_str());
      return;
    }
    std::printf("%zu tokens, %zu bytes\n", ids.size(), text.size());
    for (int32_t id : ids) {
      const char* kind = tok->is_special(id) ? " special" : (tok->is_added(id) ? " added" : "");
      std::printf("%8d  %-24s  \"%s\"%s\n", id, tok->token_piece(id).c_str(),
                  escape_bytes(tok->token_bytes(id)).c_str(), kind);
    }
  });
}

}  // namespace

KESTREL_COMMAND(setup_tokenize);
