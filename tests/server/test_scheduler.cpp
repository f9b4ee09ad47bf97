// Scheduler: bounded queue, batching over several sequences, stop ids, max tokens, cancellation of
// running and queued jobs, forced tokens, backend failures and non-finite logits.
#include "server/scheduler.h"

#include "core/check.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <mutex>
#include <thread>

using namespace kestrel;
using namespace kestrel::server;
using namespace std::chrono_literals;

namespace {
// Next token = (last input token + 1) % vocab; optional per-step delay, failures and NaN rows.
class CountingBackend : public Backend {
 public:
  explicit CountingBackend(int vocab = 64) { cfg_.vocab_size = vocab; cfg_.max_position_embeddings = 4096; }
  const ModelConfig& config() const override { return cfg_; }
  std::string name() const override { return "counting"; }
  SeqId create_sequence(int64_t max_tokens) override {
    std::lock_guard lk(mu_);
    SeqId id = next_++;
    caps_[id] = max_tokens;
    lens_[id] = 0;
    ++created;
    return id;
  }
  void free_sequence(SeqId s) override {
    std::lock_guard lk(mu_);
    KESTREL_CHECK(caps_.erase(s) == 1, "double free {}", s);
    lens_.erase(s);
  }
  int64_t sequence_length(SeqId s) const override { std::lock_guard lk(mu_); return lens_.at(s); }
  int64_t sequence_capacity(SeqId s) const override { std::lock_guard lk(mu_); return caps_.at(s); }
  void step(std::span<const StepRequest> batch, std::span<StepResult> out) override {
    if (delay.count()) std::this_thread::sleep_for(delay);
    if (fail) KESTREL_FAIL("injected failure");
    std::lock_guard lk(mu_);
    max_batch = std::max<int>(max_batch, int(batch.size()));
    for (size_t i = 0; i < batch.size(); ++i) {
      auto& len = lens_.at(batch[i].seq);
      KESTREL_CHECK(len + int64_t(batch[i].tokens.size()) <= caps_.at(batch[i].seq), "capacity exceeded");
      len += int64_t(batch[i].tokens.size());
      out[i].n_rows = 1;
      out[i].logits.assign(size_t(cfg_.vocab_size), 0.0f);
      out[i].logits[size_t((batch[i].tokens.back() + 1) % cfg_.vocab_size)] = 50.0f;
      if (nan_for == batch[i].tokens.back()) out[i].logits[0] = std::nanf("");
    }
    ++steps;
  }
  int live() const { std::lock_guard lk(mu_); return int(caps_.size()); }
  std::atomic<int> created{0}, steps{0}, max_batch{0};
  std::chrono::milliseconds delay{0};
  std::atomic<bool> fail{false};
  std::atomic<int> nan_for{-100};

 private:
  ModelConfig cfg_;
  mutable std::mutex mu_;
  std::map<SeqId, int64_t> caps_, lens_;
  SeqId next_ = 1;
};

GenJob job(std::vector<int32_t> prompt, int max_tokens) {
  GenJob j;
  j.prompt = std::move(prompt);
  j.max_tokens = max_tokens;
  j.sampling.temperature = 0;
  return j;
}

std::vector<GenEvent> collect(GenStream& s, std::chrono::milliseconds limit = 5000ms) {
  std::vector<GenEvent> all;
  auto t0 = std::chrono::steady_clock::now();
  while (!s.wait(all, 10ms))
    if (std::chrono::steady_clock::now() - t0 > limit) break;
  return all;
}
}  // namespace

TEST(Scheduler, GeneratesUntilMaxTokens) {
  CountingBackend be;
  Scheduler sch(be, {});
  auto s = sch.submit(job({1, 2, 3}, 5));
  auto evs = collect(*s);
  ASSERT_EQ(evs.size(), 5u);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(evs[size_t(i)].token, 4 + i);
  EXPECT_EQ(s->end(), GenEnd::Length);
  for (int i = 0; i < 100 && be.live(); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(be.live(), 0);
}

TEST(Scheduler, StopsAtStopIdAndCountsIt) {
  CountingBackend be;
  Scheduler sch(be, {});
  GenJob j = job({10}, 50);
  j.stop_ids = {13};
  auto s = sch.submit(j);
  auto evs = collect(*s);
  ASSERT_EQ(evs.size(), 3u);
  EXPECT_TRUE(evs.back().eos);
  EXPECT_EQ(s->end(), GenEnd::Eos);
  j.ignore_eos = true;
  j.max_tokens = 6;
  auto s2 = sch.submit(j);
  EXPECT_EQ(collect(*s2).size(), 6u);
  EXPECT_EQ(s2->end(), GenEnd::Length);
}

TEST(Scheduler, BatchesSeveralSequences) {
  CountingBackend be;
  be.delay = 2ms;
  Scheduler sch(be, {64, 4});
  std::vector<std::shared_ptr<GenStream>> ss;
  for (int i = 0; i < 6; ++i) ss.push_back(sch.submit(job({i * 10}, 20)));
  for (int i = 0; i < 6; ++i) {
    auto evs = collect(*ss[size_t(i)]);
    ASSERT_EQ(evs.size(), 20u);
    EXPECT_EQ(evs[0].token, i * 10 + 1);  // each sequence keeps its own state
  }
  EXPECT_GT(be.max_batch.load(), 1);
  EXPECT_LE(be.max_batch.load(), 4);
}

TEST(Scheduler, QueueBoundIsEnforced) {
  CountingBackend be;
  be.delay = 5ms;
  Scheduler sch(be, {2, 1});
  auto a = sch.submit(job({1}, 200));
  for (int i = 0; i < 200 && sch.running() == 0; ++i) std::this_thread::sleep_for(1ms);
  auto b = sch.submit(job({1}, 5));
  auto c = sch.submit(job({1}, 5));
  EXPECT_THROW(sch.submit(job({1}, 5)), QueueFull);
  a->cancel();
  collect(*b);
  collect(*c);
  EXPECT_EQ(b->end(), GenEnd::Length);
}

TEST(Scheduler, CancelStopsARunningJobWithinASTep) {
  CountingBackend be;
  be.delay = 2ms;
  Scheduler sch(be, {});
  auto s = sch.submit(job({1}, 100000));
  std::vector<GenEvent> evs;
  while (evs.size() < 3) s->wait(evs, 10ms);
  auto t0 = std::chrono::steady_clock::now();
  s->cancel();
  collect(*s);
  auto dt = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(s->end(), GenEnd::Cancelled);
  EXPECT_LT(dt, 100ms);
  EXPECT_EQ(sch.cancelled_total(), 1u);
  for (int i = 0; i < 100 && be.live(); ++i) std::this_thread::sleep_for(1ms);
  EXPECT_EQ(be.live(), 0);
}

TEST(Scheduler, QueuedCancelNeverReachesTheBackend) {
  CountingBackend be;
  be.delay = 5ms;
  Scheduler sch(be, {8, 1});
  auto a = sch.submit(job({1}, 30));
  for (int i = 0; i < 200 && sch.running() == 0; ++i) std::this_thread::sleep_for(1ms);
  auto b = sch.submit(job({1}, 30));
  b->cancel();
  collect(*a);
  collect(*b);
  EXPECT_EQ(b->end(), GenEnd::Cancelled);
  EXPECT_EQ(be.created.load(), 1);
}

TEST(Scheduler, ForcedTokens) {
  CountingBackend be;
  Scheduler sch(be, {});
  GenJob j = job({1}, 6);
  j.forced_prefix = {40, 41};
  auto s = sch.submit(j);
  auto evs = collect(*s);
  ASSERT_EQ(evs.size(), 6u);
  EXPECT_TRUE(evs[0].forced);
  EXPECT_EQ(evs[0].token, 40);
  EXPECT_EQ(evs[1].token, 41);
  EXPECT_EQ(evs[2].token, 42);  // continues after the forced tokens
  EXPECT_FALSE(evs[2].forced);
  GenJob k = job({1}, 8);
  k.force_trigger = 3;
  k.forced_after = {20, 21};
  auto s2 = sch.submit(k);
  auto e2 = collect(*s2);
  std::vector<int> toks;
  for (auto& e : e2) toks.push_back(e.token);
  EXPECT_EQ(toks, (std::vector<int>{2, 3, 20, 21, 22, 23, 24, 25}));
}

TEST(Scheduler, BackendFailureAndNonFiniteLogitsEndTheRequest) {
  CountingBackend be;
  Scheduler sch(be, {});
  be.nan_for = 3;
  auto s = sch.submit(job({1}, 10));
  collect(*s);
  EXPECT_EQ(s->end(), GenEnd::Error);
  EXPECT_EQ(sch.nonfinite_total(), 1u);
  be.nan_for = -100;
  be.fail = true;
  auto t = sch.submit(job({1}, 10));
  collect(*t);
  EXPECT_EQ(t->end(), GenEnd::Error);
  be.fail = false;
  auto u = sch.submit(job({1}, 3));
  EXPECT_EQ(collect(*u).size(), 3u);
}

TEST(Scheduler, ShutdownEndsEverything) {
  CountingBackend be;
  be.delay = 2ms;
  auto sch = std::make_unique<Scheduler>(be, SchedulerOptions{8, 1});
  auto a = sch->submit(job({1}, 100000));
  auto b = sch->submit(job({1}, 100000));
  std::this_thread::sleep_for(20ms);
  sch->shutdown();
  EXPECT_EQ(a->end(), GenEnd::Shutdown);
  EXPECT_EQ(b->end(), GenEnd::Shutdown);
  EXPECT_THROW(sch->submit(job({1}, 1)), ShuttingDown);
  EXPECT_EQ(be.live(), 0);
}
