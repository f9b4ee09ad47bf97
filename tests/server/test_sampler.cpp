// Sampler: greedy, seeded reproducibility, distribution, top-k/top-p/min-p, penalties, logprobs,
// non-finite logits.
#include "engine/sampler.h"

#include "core/check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>

using kestrel::Sampler;
using kestrel::SamplingParams;

namespace {
std::vector<float> probs_to_logits(std::vector<double> p) {
  std::vector<float> l;
  for (double x : p) l.push_back(x > 0 ? float(std::log(x)) : -std::numeric_limits<float>::infinity());
  return l;
}
std::map<int, int> histogram(SamplingParams sp, const std::vector<float>& logits, int n) {
  Sampler s(sp, int(logits.size()));
  std::map<int, int> h;
  for (int i = 0; i < n; ++i) h[s.sample(logits).token]++;
  return h;
}
}  // namespace

TEST(Sampler, GreedyPicksFirstMaximum) {
  SamplingParams sp;
  sp.temperature = 0;
  Sampler s(sp, 5);
  std::vector<float> l = {0.1f, 3.0f, -1.0f, 3.0f, 2.0f};
  EXPECT_EQ(s.sample(l).token, 1);
}

TEST(Sampler, SameSeedSameSequence) {
  std::vector<float> l = probs_to_logits({0.2, 0.2, 0.2, 0.2, 0.2});
  SamplingParams sp;
  sp.seed = 77;
  Sampler a(sp, 5), b(sp, 5);
  std::vector<int> xa, xb;
  for (int i = 0; i < 64; ++i) {
    xa.push_back(a.sample(l).token);
    xb.push_back(b.sample(l).token);
  }
  EXPECT_EQ(xa, xb);
  sp.seed = 78;
  Sampler c(sp, 5);
  std::vector<int> xc;
  for (int i = 0; i < 64; ++i) xc.push_back(c.sample(l).token);
  EXPECT_NE(xa, xc);
}

TEST(Sampler, FollowsTheDistribution) {
  SamplingParams sp;
  sp.seed = 1;
  auto h = histogram(sp, probs_to_logits({0.7, 0.2, 0.1}), 20000);
  EXPECT_NEAR(h[0] / 20000.0, 0.7, 0.02);
  EXPECT_NEAR(h[1] / 20000.0, 0.2, 0.02);
  EXPECT_NEAR(h[2] / 20000.0, 0.1, 0.02);
  // Temperature 0.5 squares the odds: 0.49 : 0.04 : 0.01 -> 0.907 : 0.074 : 0.0185.
  sp.temperature = 0.5f;
  h = histogram(sp, probs_to_logits({0.7, 0.2, 0.1}), 20000);
  EXPECT_NEAR(h[0] / 20000.0, 0.49 / 0.54, 0.02);
}

TEST(Sampler, TopKTopPMinP) {
  std::vector<float> l = probs_to_logits({0.5, 0.3, 0.15, 0.05});
  SamplingParams sp;
  sp.seed = 3;
  sp.top_k = 2;
  auto h = histogram(sp, l, 5000);
  EXPECT_EQ(h.count(2) + h.count(3), 0u);
  EXPECT_NEAR(h[0] / 5000.0, 0.5 / 0.8, 0.03);
  sp.top_k = 0;
  sp.top_p = 0.85f;  // 0.5 + 0.3 = 0.8 < 0.85 -> keeps three
  h = histogram(sp, l, 5000);
  EXPECT_EQ(h.count(3), 0u);
  EXPECT_GT(h[2], 0);
  sp.top_p = 0.4f;  // only the top token
  h = histogram(sp, l, 1000);
  EXPECT_EQ(h[0], 1000);
  sp.top_p = 1.0f;
  sp.min_p = 0.5f;  // keep p >= 0.25: tokens 0 and 1
  h = histogram(sp, l, 5000);
  EXPECT_EQ(h.count(2) + h.count(3), 0u);
}

TEST(Sampler, PenaltiesOverGeneratedTokens) {
  SamplingParams sp;
  sp.temperature = 0;
  sp.presence_penalty = 1.0f;
  Sampler s(sp, 3);
  std::vector<float> l = {2.0f, 1.5f, 0.0f};
  EXPECT_EQ(s.sample(l).token, 0);  // 2.0
  EXPECT_EQ(s.sample(l).token, 1);  // 0 now 1.0 < 1.5
  EXPECT_EQ(s.sample(l).token, 0);  // 1.0 vs 0.5
  sp.presence_penalty = 0;
  sp.frequency_penalty = 0.3f;
  Sampler f(sp, 2);
  std::vector<float> l2 = {1.0f, 0.5f};
  EXPECT_EQ(f.sample(l2).token, 0);  // 1.0
  EXPECT_EQ(f.sample(l2).token, 0);  // 0.7
  EXPECT_EQ(f.sample(l2).token, 1);  // 0.4 < 0.5
  sp.frequency_penalty = 0;
  sp.repetition_penalty = 2.0f;
  Sampler r(sp, 2);
  std::vector<float> l3 = {1.0f, 0.6f};
  EXPECT_EQ(r.sample(l3).token, 0);
  EXPECT_EQ(r.sample(l3).token, 1);  // 1.0 / 2 = 0.5 < 0.6
  std::vector<float> l4 = {-1.0f, -1.5f};
  Sampler r2(sp, 2);
  r2.accept(0);
  EXPECT_EQ(r2.sample(l4).token, 1);  // -1 * 2 = -2 < -1.5
}

TEST(Sampler, LogprobsOfRawDistribution) {
  SamplingParams sp;
  sp.temperature = 0;
  sp.logprobs = true;
  sp.top_logprobs = 2;
  Sampler s(sp, 3);
  auto r = s.sample(probs_to_logits({0.6, 0.3, 0.1}));
  EXPECT_EQ(r.token, 0);
  EXPECT_NEAR(r.logprob, std::log(0.6), 1e-5);
  ASSERT_EQ(r.top.size(), 2u);
  EXPECT_EQ(r.top[0].id, 0);
  EXPECT_EQ(r.top[1].id, 1);
  EXPECT_NEAR(r.top[1].logprob, std::log(0.3), 1e-5);
}

TEST(Sampler, NonFiniteLogitsAreReported) {
  SamplingParams sp;
  Sampler s(sp, 3);
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(s.sample(std::vector<float>{0, std::nanf(""), 1}).token, -1);
  EXPECT_EQ(s.sample(std::vector<float>{0, inf, 1}).token, -1);
  EXPECT_EQ(s.sample(std::vector<float>{-inf, -inf, -inf}).token, -1);
  EXPECT_EQ(s.sample(std::vector<float>{-inf, 1, -inf}).token, 1);
  EXPECT_EQ(s.sample(std::vector<float>{0, 1}).token, -1);  // wrong row length
}

TEST(Sampler, RejectsBadParameters) {
  SamplingParams sp;
  sp.top_p = 0;
  EXPECT_THROW(Sampler(sp, 4), kestrel::Error);
  sp = {};
  sp.temperature = -1;
  EXPECT_THROW(Sampler(sp, 4), kestrel::Error);
  sp = {};
  sp.top_logprobs = 21;
  EXPECT_THROW(Sampler(sp, 4), kestrel::Error);
  sp = {};
  EXPECT_THROW(Sampler(sp, 0), kestrel::Error);
}
