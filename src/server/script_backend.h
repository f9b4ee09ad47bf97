// TEST-ONLY backend for `kestrel serve --test-script FILE`: replays scripted output so that tests of
// the server (tool calls, thinking, stop strings, cancellation) see a deterministic model. It is never
// chosen implicitly: only that flag selects it, and the server logs a warning banner and reports
// "backend": "test-script" in /v1/models and /health.
//
// It implements the real Backend interface and returns fp32 logits that are strongly peaked (+40 over
// a flat 0) on the next scripted token, so the whole serving pipeline runs unchanged: sampling (with
// penalties and seeds), detokenization, stop strings, the reasoning / tool-call parser and streaming.
//
// Script file (JSON):
//   {"step_delay_ms": 2,
//    "rules": [{"match": "weather", "output": "<tool_call>\n<function=get_weather>\n..."}, ...],
//    "default": "Hello!"}
// The first rule whose `match` occurs in the last user turn of the prompt (the text after the last
// "<|im_start|>user", or the whole prompt for raw completions) is replayed; its `output` is tokenized
// with special tokens parsed (so "<think>" / "<tool_call>" become their single tokens), and then the
// first stop id (<|im_end|>) is peaked forever. `repeat`: N repeats the output N times.
#pragma once
#include "engine/engine.h"
#include "tokenizer/tokenizer.h"

#include <filesystem>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace kestrel::server {

class ScriptBackend : public Backend {
 public:
  ScriptBackend(const std::filesystem::path& script, ModelConfig cfg, const Tokenizer& tok, int32_t end_token);
  const ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return "test-script"; }
  SeqId create_sequence(int64_t max_tokens) override;
  void free_sequence(SeqId seq) override;
  int64_t sequence_length(SeqId seq) const override;
  int64_t sequence_capacity(SeqId seq) const override;
  void step(std::span<const StepRequest> batch, std::span<StepResult> out) override;
  int live_sequences() const;

 private:
  struct Rule {
    std::string match;
    std::vector<int32_t> tokens;
  };
  struct Seq {
    int64_t capacity = 0, length = 0;
    const std::vector<int32_t>* script = nullptr;
    size_t cursor = 0;
  };
  ModelConfig cfg_;
  const Tokenizer& tok_;
  int32_t end_;
  int delay_ms_ = 0;
  std::vector<Rule> rules_;
  std::vector<int32_t> default_;
  mutable std::mutex mu_;
  std::map<SeqId, Seq> seqs_;
  SeqId next_ = 1;
};

}  // namespace kestrel::server
