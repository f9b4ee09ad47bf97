// The official Qwen3.6 chat template (../shared/reference/chat_template.jinja), rendered in C++.
// No C++ Jinja engine is packaged for Debian, so the one template this model uses is implemented by
// hand and tested byte-for-byte against Python jinja2 configured as transformers configures it.
// (Interface contract shared by the template, the CLI and the server.)
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <string>

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

}  // namespace kestrel
