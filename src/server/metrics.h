// Prometheus text metrics of the server. Label values come from fixed sets (route names, status
// codes), never from client input, so no request can add series; no prompt text is ever recorded.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace kestrel::server {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  void observe(double v);
  void render(std::string& out, const std::string& name, const std::string& help) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t n_ = 0;
};

struct Gauges {
  int queued = 0, running = 0;
  uint64_t nonfinite = 0, cancelled = 0, steps = 0;
  bool ready = false;
};

class Metrics {
 public:
  Metrics();
  // route: one of a fixed list ("chat", "completions", "models", ..., "other").
  void request(const std::string& route, int status);
  void tokens(uint64_t prompt, uint64_t generated);
  void ttft(double seconds) { ttft_.observe(seconds); }
  void tpot(double seconds) { tpot_.observe(seconds); }
  std::string render(const Gauges& g) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;
  uint64_t prompt_tokens_ = 0, generated_tokens_ = 0;
  Histogram ttft_, tpot_;
};

}  // namespace kestrel::server
