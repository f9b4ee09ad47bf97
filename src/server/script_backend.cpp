// TEST-ONLY scripted backend (see script_backend.h).
#include "server/script_backend.h"

#include "core/check.h"
#include "server/text_stream.h"

#include <chrono>
#include <fstream>
#include <sstream>
#include <thread>

namespace kestrel::server {

ScriptBackend::ScriptBackend(const std::filesystem::path& script, ModelConfig cfg, const Tokenizer& tok,
                             int32_t end_token)
    : cfg_(std::move(cfg)), tok_(tok), end_(end_token) {
  std::ifstream f(script);
  KESTREL_CHECK(f.good(), "--test-script: cannot open '{}'", script.string());
  std::stringstream ss;
  ss << f.rdbuf();
  nlohmann::json j;
  KESTREL_CHECK(try_parse_json(ss.str(), j) && j.is_object(), "--test-script '{}': not a JSON object",
                script.string());
  auto tokens = [&](const nlohmann::json& r) {
    KESTREL_CHECK(r.contains("output") && r["output"].is_string(), "--test-script: every rule needs a string 'output'");
    std::string text;
    int rep = r.value("repeat", 1);
    KESTREL_CHECK(rep >= 1 && rep <= 100000, "--test-script: 'repeat' {} out of range", rep);
    for (int i = 0; i < rep; ++i) text += r["output"].get<std::string>();
    return tok_.encode(text, true);
  };
  delay_ms_ = j.value("step_delay_ms", 0);
  KESTREL_CHECK(delay_ms_ >= 0 && delay_ms_ <= 10000, "--test-script: step_delay_ms {} out of range", delay_ms_);
  if (j.contains("rules")) {
    KESTREL_CHECK(j["rules"].is_array(), "--test-script: 'rules' must be an array");
    for (const auto& r : j["rules"]) {
      KESTREL_CHECK(r.is_object() && r.contains("match") && r["match"].is_string(),
                    "--test-script: every rule needs a string 'match'");
      rules_.push_back({r["match"].get<std::string>(), tokens(r)});
    }
  }
  if (j.contains("default")) default_ = tokens(nlohmann::json{{"output", j["default"]}});
  KESTREL_CHECK(cfg_.vocab_size > 0, "--test-script: the model config has no vocab_size");
}

SeqId ScriptBackend::create_sequence(int64_t max_tokens) {
  KESTREL_CHECK(max_tokens > 0, "create_sequence: max_tokens {} must be positive", max_tokens);
  std::lock_guard lk(mu_);
  SeqId id = next_++;
  seqs_[id].capacity = max_tokens;
  return id;
}

void ScriptBackend::free_sequence(SeqId seq) {
  std::lock_guard lk(mu_);
  KESTREL_CHECK(seqs_.erase(seq) == 1, "free_sequence: unknown sequence {}", seq);
}

int64_t ScriptBackend::sequence_length(SeqId seq) const {
  std::lock_guard lk(mu_);
  auto it = seqs_.find(seq);
  KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", seq);
  return it->second.length;
}

int64_t ScriptBackend::sequence_capacity(SeqId seq) const {
  std::lock_guard lk(mu_);
  auto it = seqs_.find(seq);
  KESTREL_CHECK(it != seqs_.end(), "unknown sequence {}", seq);
  return it->second.capacity;
}

int ScriptBackend::live_sequences() const {
  std::lock_guard lk(mu_);
  return int(seqs_.size());
}

void ScriptBackend::step(std::span<const StepRequest> batch, std::span<StepResult> out) {
  KESTREL_CHECK(out.size() == batch.size(), "step: {} results for {} requests", out.size(), batch.size());
  if (delay_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms_));
  std::lock_guard lk(mu_);
  for (const auto& r : batch) {
    auto it = seqs_.find(r.seq);
    KESTREL_CHECK(it != seqs_.end(), "step: unknown sequence {}", r.seq);
    KESTREL_CHECK(!r.tokens.empty(), "step: empty token list");
    KESTREL_CHECK(it->second.length + int64_t(r.tokens.size()) <= it->second.capacity,
                  "step: {} tokens exceed the capacity {} of sequence {}", it->second.length + int64_t(r.tokens.size()),
                  it->second.capacity, r.seq);
  }
  for (size_t i = 0; i < batch.size(); ++i) {
    Seq& s = seqs_[batch[i].seq];
    if (s.length == 0) {
      std::string prompt = tok_.decode(batch[i].tokens, false);
      size_t u = prompt.rfind("<|im_start|>user");
      std::string_view turn = u == std::string::npos ? std::string_view(prompt) : std::string_view(prompt).substr(u);
      s.script = &default_;
      for (const auto& rule : rules_)
        if (turn.find(rule.match) != std::string_view::npos) {
          s.script = &rule.tokens;
          break;
        }
    } else {
      s.cursor += batch[i].tokens.size();
    }
    s.length += int64_t(batch[i].tokens.size());
    int32_t next = s.cursor < s.script->size() ? (*s.script)[s.cursor] : end_;
    out[i].n_rows = 1;
    out[i].logits.assign(size_t(cfg_.vocab_size), 0.0f);
    if (next >= 0 && next < cfg_.vocab_size) out[i].logits[size_t(next)] = 40.0f;
  }
}

}  // namespace kestrel::server
