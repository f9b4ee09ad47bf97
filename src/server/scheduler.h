// The bounded request queue in front of the engine's step interface. One worker thread owns the
// Backend: it admits queued jobs up to max_running sequences, runs one Backend::step over all running
// sequences (prefill for new ones, one token for the others), samples each row with the job's own
// Sampler, and pushes token events into the job's GenStream. Cancellation (client gone, stop string
// found, shutdown) is checked before every step, so a cancelled job stops within one step; a job
// cancelled while still queued never reaches the backend.
// Refuses: a submit when max_queue jobs are waiting (QueueFull -> 429).
#pragma once
#include "engine/engine.h"
#include "engine/sampler.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace kestrel::server {

struct GenEvent {
  int32_t token = -1;
  float logprob = 0;
  std::vector<TokenLogprob> top;
  bool forced = false;  // injected by a forced prefix (no logprob)
  bool eos = false;     // a stop token: counted, not shown
};

enum class GenEnd { None, Eos, Length, Cancelled, Error, Shutdown };

class GenStream {
 public:
  // Moves pending events into `out`, waiting up to `timeout` for at least one; returns true once the
  // generation has ended and every event has been delivered.
  bool wait(std::vector<GenEvent>& out, std::chrono::milliseconds timeout);
  void cancel() { cancel_.store(true); }
  bool cancelled() const { return cancel_.load(); }
  GenEnd end() const;
  std::string error() const;

 private:
  friend class Scheduler;
  void push(GenEvent ev);
  void finish(GenEnd e, std::string err = {});
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<GenEvent> q_;
  GenEnd end_ = GenEnd::None;
  std::string error_;
  std::atomic<bool> cancel_{false};
};

struct GenJob {
  std::vector<int32_t> prompt;
  std::vector<int32_t> forced_prefix;  // emitted as output right after the prompt
  int32_t force_trigger = -1;          // after this sampled token, forced_after is emitted
  std::vector<int32_t> forced_after;
  int max_tokens = 16;                 // generated tokens (forced ones included)
  SamplingParams sampling;
  std::vector<int32_t> stop_ids;
  bool ignore_eos = false;
};

struct QueueFull : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct ShuttingDown : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct SchedulerOptions {
  int max_queue = 64;   // jobs waiting for a slot
  int max_running = 4;  // sequences stepped together
};

class Scheduler {
 public:
  Scheduler(Backend& backend, SchedulerOptions opts);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  std::shared_ptr<GenStream> submit(GenJob job);  // QueueFull, ShuttingDown
  // Cancels every queued and running job with GenEnd::Shutdown and stops the worker.
  void shutdown();
  int queued() const;
  int running() const { return running_.load(); }
  uint64_t nonfinite_total() const { return nonfinite_.load(); }
  uint64_t cancelled_total() const { return cancelled_.load(); }
  uint64_t steps_total() const { return steps_.load(); }

 private:
  struct Active;
  void loop();
  Backend& backend_;
  SchedulerOptions opts_;
  int vocab_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<GenJob, std::shared_ptr<GenStream>>> queue_;
  bool stop_ = false;
  std::atomic<int> running_{0};
  std::atomic<uint64_t> nonfinite_{0}, cancelled_{0}, steps_{0};
  std::thread worker_;
};

}  // namespace kestrel::server
