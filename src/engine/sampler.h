// Token sampling on the fp32 logits of whichever backend is in use (the CPU reference or CUDA).
// Owns: repetition / presence / frequency penalties over the tokens generated so far, temperature,
// top-k, top-p, min-p, a seeded per-request RNG, and the logprobs of the chosen and top tokens.
// Refuses: non-finite logits (NaN / +inf, or nothing finite at all) -- sample() reports them instead of
// picking an arbitrary token.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <span>
#include <unordered_map>
#include <vector>

namespace kestrel {

struct SamplingParams {
  float temperature = 1.0f;         // 0 = greedy (argmax after penalties)
  float top_p = 1.0f;               // (0, 1]
  int top_k = 0;                    // 0 = off
  float min_p = 0.0f;               // [0, 1]
  float presence_penalty = 0.0f;    // OpenAI: subtracted once per distinct generated token
  float frequency_penalty = 0.0f;   // OpenAI: subtracted per occurrence
  float repetition_penalty = 1.0f;  // HF/vLLM: logit / p if > 0 else logit * p
  uint64_t seed = 0;
  int top_logprobs = 0;  // number of alternatives to report (0..20)
  bool logprobs = false;
};

struct TokenLogprob {
  int32_t id = -1;
  float logprob = 0;
};

struct SampleResult {
  int32_t token = -1;  // -1: the logits were not finite (see SampleStatus)
  float logprob = 0;   // log-softmax of the raw logits (the model's distribution), if requested
  std::vector<TokenLogprob> top;  // the top_logprobs most likely tokens of the raw distribution
};

class Sampler {
 public:
  // `vocab` is the row length of the logits the backend returns.
  Sampler(const SamplingParams& p, int vocab);

  // Picks the next token and records it as generated (it joins the penalty history).
  // Returns token -1 when the logits contain NaN or +inf or no finite value.
  SampleResult sample(std::span<const float> logits);

  // Records a token as generated without sampling it (e.g. a forced prefix).
  void accept(int32_t token);

  const SamplingParams& params() const { return p_; }

 private:
  SamplingParams p_;
  int vocab_;
  std::mt19937_64 rng_;
  std::unordered_map<int32_t, int> counts_;  // generated token -> occurrences
  std::vector<float> work_;                  // penalised logits [vocab]
  std::vector<int32_t> idx_;                 // candidate ids
  std::vector<float> prob_;                  // candidate probabilities
};

// Log-softmax of one raw logit row (for logprobs); the max-subtracted, double-accumulated form.
double log_sum_exp(std::span<const float> logits);

}  // namespace kestrel
