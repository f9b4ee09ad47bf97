// OpenAI request -> engine job. Validates every known field (type and range; errors name the
// `param`), ignores unknown ones, applies the model's generation_config.json defaults, renders the
// chat template and tokenizes the prompt so that client text can never become a control token:
// every added-token string inside client-supplied text is replaced by a placeholder before rendering,
// the rendered text is split at the template's own added tokens, and the client text is put back and
// tokenized as plain text (parse_special=false).
#pragma once
#include "engine/sampler.h"
#include "server/output_parser.h"
#include "server/scheduler.h"
#include "tokenizer/tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

namespace kestrel::server {

struct ModelInfo {
  const Tokenizer* tok = nullptr;
  int64_t ctx = 0;               // context length (prompt + generated)
  int vocab = 0;                 // logits row length
  SamplingParams defaults;       // generation_config.json (temperature, top_p, top_k, ...)
  std::vector<int32_t> stop_ids;  // eos ids (config, generation_config, tokenizer)
  std::vector<std::string> served_names;  // accepted `model` values; [0] is reported
  int32_t think_close_id = -1;   // </think>
  std::vector<std::string> added;  // added-token strings, longest first
  std::optional<bool> default_enable_thinking;  // --chat-template-kwargs / server default
};

// Fills defaults/stop ids from generation_config.json (if present) and the added-token table from the
// tokenizer.
void load_generation_defaults(const std::filesystem::path& model_dir, ModelInfo& mi);
void index_added_tokens(ModelInfo& mi);

struct RenderedChat {
  std::string text;             // the prompt as the template renders it (client text verbatim)
  std::vector<int32_t> ids;     // injection-safe tokenization
  bool thinking = false;        // the prompt ends inside <think>
};
// `body` carries messages, tools, chat_template_kwargs, reasoning_effort (as in a chat request).
RenderedChat render_chat_request(const nlohmann::json& body, const ModelInfo& mi);

struct PreparedRequest {
  bool chat = true;
  GenJob job;
  bool stream = false;
  bool include_usage = false;
  bool logprobs = false;
  int top_logprobs = 0;
  std::vector<std::string> stop;
  ParserOptions parser;  // chat only
  std::string tool_choice = "auto";
  int prompt_tokens = 0;
};

PreparedRequest prepare_chat(const nlohmann::json& body, const ModelInfo& mi);
PreparedRequest prepare_completion(const nlohmann::json& body, const ModelInfo& mi);
// Checks the `model` field against the served names (404 model_not_found).
void check_model(const nlohmann::json& body, const ModelInfo& mi);

}  // namespace kestrel::server
