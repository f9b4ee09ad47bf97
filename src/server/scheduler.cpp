// Bounded queue + step loop (see scheduler.h).
#include "server/scheduler.h"

#include "core/check.h"

#include <spdlog/spdlog.h>

#include <algorithm>

namespace kestrel::server {

bool GenStream::wait(std::vector<GenEvent>& out, std::chrono::milliseconds timeout) {
  std::unique_lock lk(mu_);
  cv_.wait_for(lk, timeout, [&] { return !q_.empty() || end_ != GenEnd::None; });
  while (!q_.empty()) {
    out.push_back(std::move(q_.front()));
    q_.pop_front();
  }
  return end_ != GenEnd::None;
}

GenEnd GenStream::end() const {
  std::lock_guard lk(mu_);
  return end_;
}

std::string GenStream::error() const {
  std::lock_guard lk(mu_);
  return error_;
}

void GenStream::push(GenEvent ev) {
  {
    std::lock_guard lk(mu_);
    q_.push_back(std::move(ev));
  }
  cv_.notify_all();
}

void GenStream::finish(GenEnd e, std::string err) {
  {
    std::lock_guard lk(mu_);
    if (end_ != GenEnd::None) return;
    end_ = e;
    error_ = std::move(err);
  }
  cv_.notify_all();
}

struct Scheduler::Active {
  GenJob job;
  std::shared_ptr<GenStream> stream;
  SeqId seq = -1;
  std::vector<int32_t> input;  // tokens for the next step
  Sampler sampler;
  int generated = 0;
  Active(GenJob j, std::shared_ptr<GenStream> s, int vocab)
      : job(std::move(j)), stream(std::move(s)), sampler(job.sampling, vocab) {}
};

Scheduler::Scheduler(Backend& backend, SchedulerOptions opts)
    : backend_(backend), opts_(opts), vocab_(backend.config().vocab_size) {
  KESTREL_CHECK(opts_.max_queue >= 1, "--max-queue must be >= 1, got {}", opts_.max_queue);
  KESTREL_CHECK(opts_.max_running >= 1, "--parallel must be >= 1, got {}", opts_.max_running);
  worker_ = std::thread([this] { loop(); });
}

Scheduler::~Scheduler() { shutdown(); }

std::shared_ptr<GenStream> Scheduler::submit(GenJob job) {
  auto s = std::make_shared<GenStream>();
  {
    std::lock_guard lk(mu_);
    if (stop_) throw ShuttingDown("server is shutting down");
    if (int(queue_.size()) >= opts_.max_queue)
      throw QueueFull(fmt::format("the request queue is full ({} waiting)", queue_.size()));
    queue_.emplace_back(std::move(job), s);
  }
  cv_.notify_all();
  return s;
}

int Scheduler::queued() const {
  std::lock_guard lk(mu_);
  return int(queue_.size());
}

void Scheduler::shutdown() {
  {
    std::lock_guard lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void Scheduler::loop() {
  std::vector<std::unique_ptr<Active>> active;
  std::vector<StepRequest> batch;
  std::vector<StepResult> results;
  auto release = [&](Active& a, GenEnd e, std::string err = {}) {
    if (a.seq >= 0) {
      try {
        backend_.free_sequence(a.seq);
      } catch (const std::exception& ex) {
        spdlog::error("free_sequence failed: {}", ex.what());
      }
      a.seq = -1;
    }
    if (e == GenEnd::Cancelled) cancelled_.fetch_add(1);
    a.stream->finish(e, std::move(err));
  };
  for (;;) {
    {
      std::unique_lock lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !queue_.empty() || !active.empty(); });
      if (stop_) {
        for (auto& a : active) release(*a, GenEnd::Shutdown, "server shutting down");
        for (auto& [job, s] : queue_) s->finish(GenEnd::Shutdown, "server shutting down");
        queue_.clear();
        running_.store(0);
        return;
      }
      // Jobs cancelled while queued leave without touching the backend.
      for (auto it = queue_.begin(); it != queue_.end();) {
        if (it->second->cancelled()) {
          it->second->finish(GenEnd::Cancelled);
          cancelled_.fetch_add(1);
          it = queue_.erase(it);
        } else {
          ++it;
        }
      }
      while (!queue_.empty() && int(active.size()) < opts_.max_running) {
        auto [job, s] = std::move(queue_.front());
        queue_.pop_front();
        try {
          auto a = std::make_unique<Active>(std::move(job), s, vocab_);
          const int64_t cap = int64_t(a->job.prompt.size()) + a->job.max_tokens + 1;
          a->seq = backend_.create_sequence(cap);
          a->input = a->job.prompt;
          // A forced prefix follows the prompt directly: it is prefilled with it and shown as output.
          for (int32_t t : a->job.forced_prefix) {
            a->input.push_back(t);
            a->sampler.accept(t);
            a->stream->push(GenEvent{t, 0, {}, true, false});
            ++a->generated;
          }
          active.push_back(std::move(a));
        } catch (const std::exception& ex) {
          spdlog::error("could not start a sequence: {}", ex.what());
          s->finish(GenEnd::Error, "could not allocate the sequence");
        }
      }
      running_.store(int(active.size()));
    }
    // Cancelled running jobs stop before the next step.
    for (auto& a : active)
      if (a->stream->cancelled()) release(*a, GenEnd::Cancelled);
    std::erase_if(active, [](const auto& a) { return a->seq < 0; });
    running_.store(int(active.size()));
    if (active.empty()) continue;

    batch.clear();
    for (auto& a : active) batch.push_back(StepRequest{a->seq, a->input, false});
    results.assign(batch.size(), StepResult{});
    try {
      backend_.step(batch, results);
      steps_.fetch_add(1);
    } catch (const std::exception& ex) {
      spdlog::error("backend step failed: {}", ex.what());
      for (auto& a : active) release(*a, GenEnd::Error, "the backend step failed");
      active.clear();
      running_.store(0);
      continue;
    }
    for (size_t i = 0; i < active.size(); ++i) {
      Active& a = *active[i];
      const auto& res = results[i];
      std::span<const float> row(res.logits);
      if (res.n_rows >= 1 && row.size() >= size_t(vocab_)) row = row.subspan((size_t(res.n_rows) - 1) * size_t(vocab_), size_t(vocab_));
      SampleResult sr = a.sampler.sample(row);
      if (sr.token < 0) {
        nonfinite_.fetch_add(1);
        spdlog::error("non-finite logits for a sequence; ending the request");
        release(a, GenEnd::Error, "the model produced non-finite logits");
        continue;
      }
      ++a.generated;
      const bool is_stop = !a.job.ignore_eos &&
                           std::find(a.job.stop_ids.begin(), a.job.stop_ids.end(), sr.token) != a.job.stop_ids.end();
      a.stream->push(GenEvent{sr.token, sr.logprob, std::move(sr.top), false, is_stop});
      if (is_stop) {
        release(a, GenEnd::Eos);
        continue;
      }
      a.input.assign(1, sr.token);
      if (sr.token == a.job.force_trigger && !a.job.forced_after.empty()) {
        for (int32_t t : a.job.forced_after) {
          if (a.generated >= a.job.max_tokens) break;
          a.input.push_back(t);
          a.sampler.accept(t);
          a.stream->push(GenEvent{t, 0, {}, true, false});
          ++a.generated;
        }
        a.job.forced_after.clear();
      }
      if (a.generated >= a.job.max_tokens) release(a, GenEnd::Length);
    }
    std::erase_if(active, [](const auto& a) { return a->seq < 0; });
    running_.store(int(active.size()));
  }
}

}  // namespace kestrel::server
