// The official Qwen3.6 chat template (../shared/reference/chat_template.jinja), rendered in C++.
// No C++ Jinja engine is packaged for Debian, so the one template this model uses is implemented by
// hand and tested byte-for-byte against Python jinja2 configured as transformers configures it.
// (Interface contract shared by the template, the CLI and the server.)
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kestrel {

struct ChatOptions {
  bool add_generation_prompt = true;
  // enable_thinking: unset = template default (thinking on). false adds the empty think block.
  std::optional<bool> enable_thinking;
  bool preserve_thinking = false;
  bool add_vision_id = false;
};

// messages: OpenAI-shaped array (role, content as string or parts, reasoning_content / reasoning,
// tool_calls with arguments as objects or JSON strings, tool_call_id...); tools: array or null.
// The role "developer" is rendered as "system". Throws kestrel::Error with the template's message
// where the template raises (system message not first, unknown role, no user query, ...).
std::string render_chat(const nlohmann::json& messages, const nlohmann::json& tools,
                        const ChatOptions& opts);

// ---- additions (tok) ----
class Tokenizer;

// The rendered prompt plus the byte ranges [first, second) where the template itself wrote a control
// token (<|im_start|>, <|im_end|>, <think>, <tool_call>, <tool_response>, <|vision_start|>, ...).
// Everything else, message content included, is ordinary text: encode it with encode_chat so that a
// user who types "<|im_start|>" gets plain-text tokens (no special-token injection).
struct RenderedChat {
  std::string text;
  std::vector<std::pair<size_t, size_t>> controls;
};

// As render_chat, on insertion-ordered JSON: tool schemas and tool-call arguments keep the key
// order of the request (as Python's json/jinja2 do). nlohmann::json (std::map) sorts keys, so the
// server should parse requests as nlohmann::ordered_json and call these.
RenderedChat render_chat_ordered(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                                 const ChatOptions& opts);
// Same text as render_chat(messages, tools, opts) with the key order preserved.
std::string render_chat_text(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
                             const ChatOptions& opts);

// Token ids of a rendered prompt: control ranges become their added-token ids, all other text is
// encoded with special-token parsing off. Equal to HF's encode of the rendered text whenever the
// content holds no added-token literals.
std::vector<int32_t> encode_chat(const Tokenizer& tok, const RenderedChat& rendered);

// The official Qwen3.6 template text (model-spec §6, 7,764 bytes).
const std::string& official_chat_template();
// Checks that a model directory's chat template (chat_template.jinja, else tokenizer_config.json's
// "chat_template") is the official one, which is the only template this renderer implements; a
// trailing newline is tolerated (it renders identically). kestrel::Error otherwise.
void check_chat_template(const std::filesystem::path& model_dir);

}  // namespace kestrel
