// The engine interface every front end (CLI, server, bench) uses: load a model directory onto a
// backend, create sequences, run a step over a batch of sequences (each with its own new tokens),
// read logits. Backends: CPU (the reference, src/cpu) and CUDA (src/cuda).
#pragma once
#include "core/config.h"
#include "core/weights.h"

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kestrel {

enum class DeviceKind : uint8_t { Cpu, Cuda };
DeviceKind parse_device(const std::string& s);  // "cpu" | "cuda", clear error otherwise

using SeqId = int64_t;

// One sequence's work in a step: append `tokens` (at positions length..length+n-1) and return the
// logits of the last token, or of every token when all_logits is set.
struct StepRequest {
  SeqId seq = -1;
  std::span<const int32_t> tokens;
  bool all_logits = false;
};

struct StepResult {
  int n_rows = 0;             // 1, or tokens.size() with all_logits
  std::vector<float> logits;  // fp32 [n_rows, vocab]
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual const ModelConfig& config() const = 0;
  virtual std::string name() const = 0;  // "cpu", "cuda"

  // Allocates all state of a sequence up front for up to max_tokens tokens.
  virtual SeqId create_sequence(int64_t max_tokens) = 0;
  virtual void free_sequence(SeqId seq) = 0;
  virtual int64_t sequence_length(SeqId seq) const = 0;
  virtual int64_t sequence_capacity(SeqId seq) const = 0;

  // Runs the model over a batch; out.size() == batch.size(). A request whose tokens would exceed
  // the sequence's capacity is an error (thrown before any state changes).
  virtual void step(std::span<const StepRequest> batch, std::span<StepResult> out) = 0;
};

struct BackendOptions {
  DeviceKind device = DeviceKind::Cpu;
  LoadOptions load;
  int threads = 0;  // CPU threads; 0 = all cores
};

std::unique_ptr<Backend> load_backend(const std::filesystem::path& model_dir,
                                      const BackendOptions& opts);

}  // namespace kestrel
