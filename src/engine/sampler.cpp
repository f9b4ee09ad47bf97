// Sampling: penalties -> temperature -> top-k -> top-p -> min-p -> draw (the order vLLM and HF use).
// Logprobs are reported from the raw logits (the model's distribution), like vLLM's default.
#include "engine/sampler.h"

#include "core/check.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace kestrel {

double log_sum_exp(std::span<const float> logits) {
  float mx = -std::numeric_limits<float>::infinity();
  for (float v : logits) mx = std::max(mx, v);
  if (!std::isfinite(mx)) return mx;
  double s = 0;
  for (float v : logits) s += std::exp(double(v) - double(mx));
  return double(mx) + std::log(s);
}

Sampler::Sampler(const SamplingParams& p, int vocab) : p_(p), vocab_(vocab), rng_(p.seed) {
  KESTREL_CHECK(vocab > 0, "sampler: vocab must be positive, got {}", vocab);
  KESTREL_CHECK(p.temperature >= 0 && std::isfinite(p.temperature), "sampler: temperature {} out of range",
                p.temperature);
  KESTREL_CHECK(p.top_p > 0 && p.top_p <= 1, "sampler: top_p {} not in (0, 1]", p.top_p);
  KESTREL_CHECK(p.top_k >= 0, "sampler: top_k {} negative", p.top_k);
  KESTREL_CHECK(p.min_p >= 0 && p.min_p <= 1, "sampler: min_p {} not in [0, 1]", p.min_p);
  KESTREL_CHECK(p.repetition_penalty > 0, "sampler: repetition_penalty {} must be > 0", p.repetition_penalty);
  KESTREL_CHECK(p.top_logprobs >= 0 && p.top_logprobs <= 20, "sampler: top_logprobs {} not in [0, 20]",
                p.top_logprobs);
  work_.resize(size_t(vocab));
}

void Sampler::accept(int32_t token) { counts_[token] += 1; }

SampleResult Sampler::sample(std::span<const float> logits) {
  SampleResult r;
  if (int(logits.size()) != vocab_) return r;
  bool any_finite = false;
  for (float v : logits) {
    if (std::isnan(v) || v == std::numeric_limits<float>::infinity()) return r;
    any_finite |= std::isfinite(v);
  }
  if (!any_finite) return r;

  std::copy(logits.begin(), logits.end(), work_.begin());
  for (const auto& [tok, n] : counts_) {
    if (tok < 0 || tok >= vocab_) continue;
    float& v = work_[size_t(tok)];
    if (p_.repetition_penalty != 1.0f) v = v > 0 ? v / p_.repetition_penalty : v * p_.repetition_penalty;
    v -= p_.frequency_penalty * float(n) + p_.presence_penalty;
  }

  int32_t chosen = -1;
  if (p_.temperature <= 1e-5f) {
    // Greedy: first maximum (lowest id on ties).
    float best = -std::numeric_limits<float>::infinity();
    for (int i = 0; i < vocab_; ++i)
      if (work_[size_t(i)] > best) { best = work_[size_t(i)]; chosen = i; }
  } else {
    idx_.resize(size_t(vocab_));
    std::iota(idx_.begin(), idx_.end(), 0);
    auto by_logit = [&](int32_t a, int32_t b) {
      float va = work_[size_t(a)], vb = work_[size_t(b)];
      return va > vb || (va == vb && a < b);
    };
    size_t n = idx_.size();
    if (p_.top_k > 0 && size_t(p_.top_k) < n) {
      std::partial_sort(idx_.begin(), idx_.begin() + p_.top_k, idx_.end(), by_logit);
      n = size_t(p_.top_k);
    } else if (p_.top_p < 1.0f) {
      std::sort(idx_.begin(), idx_.end(), by_logit);
    }
    idx_.resize(n);
    // Softmax over the candidates at temperature T (double accumulation, max-subtracted).
    float mx = -std::numeric_limits<float>::infinity();
    for (int32_t i : idx_) mx = std::max(mx, work_[size_t(i)]);
    prob_.resize(n);
    double sum = 0;
    const double inv_t = 1.0 / double(p_.temperature);
    for (size_t j = 0; j < n; ++j) {
      double e = std::exp((double(work_[size_t(idx_[j])]) - double(mx)) * inv_t);
      prob_[j] = float(e);
      sum += e;
    }
    for (auto& q : prob_) q = float(double(q) / sum);
    if (p_.top_p < 1.0f) {  // idx_ is sorted descending here
      double cum = 0;
      size_t keep = n;
      for (size_t j = 0; j < n; ++j) {
        cum += prob_[j];
        if (cum >= double(p_.top_p)) { keep = j + 1; break; }
      }
      n = std::max<size_t>(keep, 1);
    }
    if (p_.min_p > 0.0f) {
      float pmax = *std::max_element(prob_.begin(), prob_.begin() + long(n));
      float thr = p_.min_p * pmax;
      for (size_t j = 0; j < n; ++j)
        if (prob_[j] < thr) prob_[j] = 0;
    }
    double total = 0;
    for (size_t j = 0; j < n; ++j) total += prob_[j];
    // 53 random bits -> u in [0, 1); deterministic for a given seed on every platform.
    double u = double(rng_() >> 11) * (1.0 / 9007199254740992.0) * total;
    double acc = 0;
    for (size_t j = 0; j < n; ++j) {
      if (prob_[j] <= 0) continue;
      acc += prob_[j];
      chosen = idx_[j];
      if (u < acc) break;
    }
  }
  if (chosen < 0) return r;
  r.token = chosen;
  accept(chosen);

  if (p_.logprobs || p_.top_logprobs > 0) {
    const double lse = log_sum_exp(logits);
    r.logprob = float(double(logits[size_t(chosen)]) - lse);
    if (p_.top_logprobs > 0) {
      int k = std::min(p_.top_logprobs, vocab_);
      idx_.resize(size_t(vocab_));
      std::iota(idx_.begin(), idx_.end(), 0);
      std::partial_sort(idx_.begin(), idx_.begin() + k, idx_.end(), [&](int32_t a, int32_t b) {
        return logits[size_t(a)] > logits[size_t(b)] || (logits[size_t(a)] == logits[size_t(b)] && a < b);
      });
      for (int j = 0; j < k; ++j)
        r.top.push_back({idx_[size_t(j)], float(double(logits[size_t(idx_[size_t(j)])]) - lse)});
    }
  }
  return r;
}

}  // namespace kestrel
