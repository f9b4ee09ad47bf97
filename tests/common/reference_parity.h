// Runs a transformers reference (reference.safetensors written by tools/make_fixtures.py or
// tools/make_mlx_fixture.py: prompt_ids, prompt_logits [T, V], greedy_tokens [S+1],
// decode_logits [S, V]) through a backend: one prefill of the prompt with logits at every position,
// then S single-token steps fed with the reference greedy tokens. Shared by the CPU and quant tests.
#pragma once
#include "core/safetensors.h"
#include "engine/engine.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace kestrel::testing {

template <class T>
std::vector<T> read_reference_tensor(const SafetensorsFile& f, const std::string& name) {
  const auto& t = f.tensors().at(name);
  std::vector<T> v(t.nbytes / sizeof(T));
  std::memcpy(v.data(), t.data, t.nbytes);
  return v;
}

// max|a - b| / max|b| over one row of logits.
inline double logits_rel_err(const float* a, const float* b, int64_t n) {
  double md = 0, mr = 0;
  for (int64_t i = 0; i < n; ++i) {
    md = std::max(md, std::abs(double(a[i]) - b[i]));
    mr = std::max(mr, std::abs(double(b[i])));
  }
  return md / mr;
}

inline int64_t argmax_of(const float* x, int64_t n) { return std::max_element(x, x + n) - x; }

struct ParityResult {
  double prompt_worst = 0, decode_worst = 0;
  int greedy_mismatches = 0;
};

// Compares every prompt position and decode step with `tol` (EXPECT_LE) and counts greedy mismatches.
inline ParityResult run_reference_parity(Backend& be, const std::filesystem::path& ref_path,
                                         const std::string& label, double tol) {
  SafetensorsFile f(ref_path);
  const auto prompt = read_reference_tensor<int32_t>(f, "prompt_ids");
  const auto greedy = read_reference_tensor<int32_t>(f, "greedy_tokens");
  const auto prompt_logits = read_reference_tensor<float>(f, "prompt_logits");
  const auto decode_logits = read_reference_tensor<float>(f, "decode_logits");
  const int64_t V = be.config().vocab_size, T = int64_t(prompt.size());
  EXPECT_EQ(int64_t(prompt_logits.size()), T * V);
  const SeqId s = be.create_sequence(T + int64_t(greedy.size()) + 1);
  StepRequest req{s, prompt, true};
  StepResult res;
  be.step({&req, 1}, {&res, 1});
  EXPECT_EQ(res.n_rows, T);
  ParityResult r;
  for (int64_t t = 0; t < T; ++t) {
    const double e = logits_rel_err(res.logits.data() + t * V, prompt_logits.data() + t * V, V);
    r.prompt_worst = std::max(r.prompt_worst, e);
    EXPECT_LE(e, tol) << label << " prompt position " << t;
  }
  r.greedy_mismatches += argmax_of(res.logits.data() + (T - 1) * V, V) != greedy[0];
  const int64_t S = int64_t(decode_logits.size()) / V;
  for (int64_t i = 0; i < S; ++i) {
    const int32_t tok = greedy[size_t(i)];
    StepRequest q{s, {&tok, 1}, false};
    StepResult o;
    be.step({&q, 1}, {&o, 1});
    const double e = logits_rel_err(o.logits.data(), decode_logits.data() + i * V, V);
    r.decode_worst = std::max(r.decode_worst, e);
    EXPECT_LE(e, tol) << label << " decode step " << i;
    r.greedy_mismatches += argmax_of(o.logits.data(), V) != greedy[size_t(i + 1)];
  }
  std::printf("[parity] %s: %lld prompt positions max rel err %.3e; %lld decode steps max rel err "
              "%.3e; greedy mismatches %d\n",
              label.c_str(), (long long)T, r.prompt_worst, (long long)S, r.decode_worst,
              r.greedy_mismatches);
  return r;
}

}  // namespace kestrel::testing
