// Prometheus text exposition (version 0.0.4) of the server's counters, gauges and histograms.
#include "server/metrics.h"

#include <fmt/format.h>

namespace kestrel::server {

void Histogram::observe(double v) {
  std::lock_guard lk(mu_);
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  counts_[i] += 1;
  sum_ += v;
  n_ += 1;
}

void Histogram::render(std::string& out, const std::string& name, const std::string& help) const {
  std::lock_guard lk(mu_);
  out += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
  uint64_t cum = 0;
  for (size_t i = 0; i < bounds_.size(); ++i) {
    cum += counts_[i];
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, bounds_[i], cum);
  }
  cum += counts_.back();
  out += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, cum, name, sum_, name, n_);
}

Metrics::Metrics()
    : ttft_({0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}),
      tpot_({0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}) {}

void Metrics::request(const std::string& route, int status) {
  std::lock_guard lk(mu_);
  requests_[{route, status}] += 1;
}

void Metrics::tokens(uint64_t prompt, uint64_t generated) {
  std::lock_guard lk(mu_);
  prompt_tokens_ += prompt;
  generated_tokens_ += generated;
}

std::string Metrics::render(const Gauges& g) const {
  std::string out;
  {
    std::lock_guard lk(mu_);
    out += "# HELP kestrel_requests_total HTTP requests by route and status.\n# TYPE kestrel_requests_total counter\n";
    for (const auto& [k, v] : requests_)
      out += fmt::format("kestrel_requests_total{{route=\"{}\",status=\"{}\"}} {}\n", k.first, k.second, v);
    out += fmt::format(
        "# HELP kestrel_prompt_tokens_total Prompt tokens processed.\n# TYPE kestrel_prompt_tokens_total counter\n"
        "kestrel_prompt_tokens_total {}\n"
        "# HELP kestrel_generated_tokens_total Tokens generated.\n# TYPE kestrel_generated_tokens_total counter\n"
        "kestrel_generated_tokens_total {}\n",
        prompt_tokens_, generated_tokens_);
  }
  out += fmt::format(
      "# HELP kestrel_queue_depth Requests waiting for a slot.\n# TYPE kestrel_queue_depth gauge\nkestrel_queue_depth {}\n"
      "# HELP kestrel_requests_running Sequences being generated.\n# TYPE kestrel_requests_running gauge\n"
      "kestrel_requests_running {}\n"
      "# HELP kestrel_requests_cancelled_total Generations cancelled (client gone, stop string).\n"
      "# TYPE kestrel_requests_cancelled_total counter\nkestrel_requests_cancelled_total {}\n"
      "# HELP kestrel_nonfinite_logits_total Steps whose logits were not finite.\n"
      "# TYPE kestrel_nonfinite_logits_total counter\nkestrel_nonfinite_logits_total {}\n"
      "# HELP kestrel_engine_steps_total Backend steps run.\n# TYPE kestrel_engine_steps_total counter\n"
      "kestrel_engine_steps_total {}\n"
      "# HELP kestrel_ready 1 once the model is loaded.\n# TYPE kestrel_ready gauge\nkestrel_ready {}\n",
      g.queued, g.running, g.cancelled, g.nonfinite, g.steps, g.ready ? 1 : 0);
  ttft_.render(out, "kestrel_time_to_first_token_seconds", "Time from request arrival to the first generated token.");
  tpot_.render(out, "kestrel_time_per_output_token_seconds", "Mean time between generated tokens of a request.");
  return out;
}

}  // namespace kestrel::server
