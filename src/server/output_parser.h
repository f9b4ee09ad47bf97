// Splits Qwen3.6 output text into reasoning, content and OpenAI tool calls, incrementally.
//
// Grammar (openai-api.md §2.2): [reasoning] </think> [content] (<tool_call> <function=NAME>
// (<parameter=P> VALUE </parameter>)* </function> </tool_call>)* [content].
// Design against the known parser bugs (§2.3):
//  - <tool_call> inside reasoning ends the reasoning (the call is not lost);
//  - tool mode is committed only once "<function=NAME>" is complete; a literal "<tool_call>" in prose
//    that is not followed by it goes back to content (the stream never goes silent);
//  - </parameter> ends a value only when followed by <parameter=, </function>, </tool_call> or a
//    duplicate </parameter> (or the end); otherwise it is part of the value; missing closers are
//    recovered at line-start "<parameter=" / "</function>" / "</tool_call>";
//  - values are typed by the request's JSON Schema (never evaluated as code); arguments are always a
//    valid JSON object; string values stream incrementally, other values per parameter;
//  - malformed or truncated output never throws: before commitment it falls back to content, after
//    commitment the call is closed with what was parsed.
// Feeding the same text in any chunking yields the same concatenated events (tested).
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <random>
#include <string>
#include <string_view>
#include <vector>

namespace kestrel::server {

struct ParserEvent {
  enum class Kind { Reasoning, Content, ToolStart, ToolArgs };
  Kind kind = Kind::Content;
  std::string text;  // Reasoning/Content text, or a ToolArgs JSON fragment
  int index = 0;     // tool call index (ToolStart, ToolArgs)
  std::string id;    // ToolStart
  std::string name;  // ToolStart
};

struct ParserOptions {
  bool start_in_reasoning = false;  // the prompt ended inside <think>
  bool parse_tools = false;         // tools present and tool_choice != none
  nlohmann::json tools = nlohmann::json::array();  // the request's tools (for typing values)
  bool parallel_tool_calls = true;                 // false: only the first call is reported
  uint64_t id_seed = 0;                            // tool call ids: call_<24 hex>
};

class OutputParser {
 public:
  explicit OutputParser(ParserOptions opts);
  std::vector<ParserEvent> feed(std::string_view text);
  std::vector<ParserEvent> finish();
  bool in_reasoning() const { return st_ == St::Reasoning; }
  int tool_calls() const { return reported_calls_; }

 private:
  enum class St { Reasoning, Content, ToolOpen, FuncBody, ParamValue, ParamClose, FuncClose, Between };
  void advance(bool final);
  bool step(bool final);  // one state transition; false = needs more input
  void emit_section(ParserEvent::Kind kind, std::string_view text);
  void close_section();
  void emit_args(std::string_view frag);
  void open_call(std::string name);
  void close_call();
  void open_param(std::string name);
  void stream_value();
  void close_value();
  bool reporting() const { return opts_.parallel_tool_calls || call_index_ == 0; }

  ParserOptions opts_;
  St st_;
  std::string buf_;
  size_t pos_ = 0;
  bool output_start_ = true;  // nothing consumed yet
  std::vector<ParserEvent> out_;
  // Current text section (reasoning or content): leading newlines stripped, trailing ones held.
  bool lead_ = true;
  std::string held_nl_;
  // Tool call state.
  std::string open_ws_;  // whitespace after <tool_call> (for the fallback)
  int call_index_ = -1;
  int reported_calls_ = 0;
  std::string call_name_;
  const nlohmann::json* call_props_ = nullptr;
  int params_ = 0;
  std::string stray_;
  std::string param_name_;
  bool param_is_string_ = true;
  const nlohmann::json* param_schema_ = nullptr;
  std::string value_;
  size_t value_sent_ = 0;
  std::mt19937_64 rng_;
};

// Converts a raw parameter value by its JSON Schema (vLLM qwen3_coder's table; never evaluates).
nlohmann::json convert_param_value(const std::string& value, const nlohmann::json* schema);
// True when a parameter of this schema is emitted as a JSON string (and can stream incrementally).
bool schema_is_string(const nlohmann::json* schema);

}  // namespace kestrel::server
