// kestrel template: render a conversation with the official Qwen3.6 chat template (as the server
// does) and print the prompt; --ids also prints the token ids encode_chat produces.
#include "chat/chat_template.h"
#include "cli/commands.h"
#include "core/check.h"
#include "tokenizer/tokenizer.h"

#include <cstdio>
#include <fstream>
#include <sstream>

namespace {

nlohmann::ordered_json read_json(const std::string& path, const char* what) {
  std::ifstream f(path, std::ios::binary);
  KESTREL_CHECK(f.good(), "cannot open {} file {}", what, path);
  try {
    return nlohmann::ordered_json::parse(f);
  } catch (const nlohmann::json::exception& e) {
    KESTREL_FAIL("{} file {}: malformed JSON: {}", what, path, e.what());
  }
}

void setup_template(CLI::App& root) {
  struct Args {
    std::string model, messages, tools;
    bool no_thinking = false, preserve_thinking = false, no_generation_prompt = false, ids = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = root.add_subcommand("template", "render a conversation with the chat template");
  cmd->add_option("--model", a->model, "model directory (chat template and tokenizer)")->required();
  cmd->add_option("--messages", a->messages,
                  "JSON file: an array of messages, or an object with \"messages\" (and \"tools\")")
      ->required();
  cmd->add_option("--tools", a->tools, "JSON file with the tools array");
  cmd->add_flag("--no-thinking", a->no_thinking, "enable_thinking=false (empty think block)");
  cmd->add_flag("--preserve-thinking", a->preserve_thinking, "keep the reasoning of earlier turns");
  cmd->add_flag("--no-generation-prompt", a->no_generation_prompt, "do not append <|im_start|>assistant");
  cmd->add_flag("--ids", a->ids, "also print the token ids (content never becomes special tokens)");
  cmd->callback([a] {
    kestrel::check_chat_template(a->model);
    nlohmann::ordered_json doc = read_json(a->messages, "--messages");
    nlohmann::ordered_json messages = doc, tools = nullptr;
    if (doc.is_object()) {
      KESTREL_CHECK(doc.contains("messages"), "--messages file: object without \"messages\"");
      messages = doc["messages"];
      if (doc.contains("tools")) tools = doc["tools"];
    }
    if (!a->tools.empty()) tools = read_json(a->tools, "--tools");
    kestrel::ChatOptions o;
    o.add_generation_prompt = !a->no_generation_prompt;
    if (a->no_thinking) o.enable_thinking = false;
    o.preserve_thinking = a->preserve_thinking;
    const kestrel::RenderedChat r = kestrel::render_chat_ordered(messages, tools, o);
    std::fwrite(r.text.data(), 1, r.text.size(), stdout);
    if (a->ids) {
      auto tok = kestrel::Tokenizer::load(a->model);
      const auto ids = kestrel::encode_chat(*tok, r);
      std::string line;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i) line += ',';
        line += std::to_string(ids[i]);
      }
      std::printf("\n---\n%zu tokens: %s\n", ids.size(), line.c_str());
    }
  });
}

}  // namespace

KESTREL_COMMAND(setup_template);
