// The tensor loader accounts for every tensor of a checkpoint: each expected tensor is asked for by
// name with its expected dtype(s) and shape; finish() fails on any tensor that was neither taken nor
// skipped by an explicit prefix (model.visual.*, mtp.*).
#pragma once
#include "core/safetensors.h"

#include <initializer_list>
#include <set>
#include <string>
#include <vector>

namespace kestrel {

class TensorLoader {
 public:
  explicit TensorLoader(const Checkpoint& ckpt) : ckpt_(ckpt) {}

  // The tensor `name` with one of `dtypes` and exactly `shape`; a clear error otherwise.
  const TensorInfo& take(const std::string& name, std::initializer_list<DType> dtypes,
                         const std::vector<int64_t>& shape);
  // As take(), or nullptr when absent.
  const TensorInfo* take_optional(const std::string& name, std::initializer_list<DType> dtypes,
                                  const std::vector<int64_t>& shape);
  bool has(const std::string& name) const { return ckpt_.find(name) != nullptr; }
  // Marks every tensor whose name starts with `prefix` as deliberately unused.
  void skip_prefix(const std::string& prefix);
  // Throws listing (up to 10) tensors nobody took or skipped.
  void finish() const;
  const Checkpoint& checkpoint() const { return ckpt_; }

 private:
  const Checkpoint& ckpt_;
  std::set<std::string> used_;
};

}  // namespace kestrel
