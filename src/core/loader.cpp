// TensorLoader: every tensor is taken by name with its expected dtype and shape, or skipped by an
// explicit prefix; finish() reports leftovers.
#include "core/loader.h"

#include "core/check.h"

namespace kestrel {

namespace {
std::string shape_string(const std::vector<int64_t>& s) {
  std::string r = "[";
  for (size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
  return r + "]";
}
std::string dtypes_string(std::initializer_list<DType> d) {
  std::string r;
  for (auto t : d) r += (r.empty() ? "" : " or ") + std::string(dtype_name(t));
  return r;
}
}  // namespace

const TensorInfo* TensorLoader::take_optional(const std::string& name,
                                              std::initializer_list<DType> dtypes,
                                              const std::vector<int64_t>& shape) {
  const TensorInfo* t = ckpt_.find(name);
  if (!t) return nullptr;
  KESTREL_CHECK(!used_.count(name), "tensor '{}' taken twice", name);
  bool ok = false;
  for (auto d : dtypes) ok |= d == t->dtype;
  KESTREL_CHECK(ok, "{}: tensor '{}' has dtype {}, expected {}", t->file, name,
                dtype_name(t->dtype), dtypes_string(dtypes));
  KESTREL_CHECK(t->shape == shape, "{}: tensor '{}' has shape {}, expected {}", t->file, name,
                t->shape_str(), shape_string(shape));
  used_.insert(name);
  return t;
}

const TensorInfo& TensorLoader::take(const std::string& name, std::initializer_list<DType> dtypes,
                                     const std::vector<int64_t>& shape) {
  const TensorInfo* t = take_optional(name, dtypes, shape);
  KESTREL_CHECK(t, "missing tensor '{}' ({} {}) in the checkpoint", name, dtypes_string(dtypes),
                shape_string(shape));
  return *t;
}

void TensorLoader::skip_prefix(const std::string& prefix) {
  for (const auto& [name, _] : ckpt_.all())
    if (name.rfind(prefix, 0) == 0) used_.insert(name);
}

void TensorLoader::finish() const {
  std::vector<std::string> left;
  for (const auto& [name, _] : ckpt_.all())
    if (!used_.count(name)) left.push_back(name);
  if (left.empty()) return;
  std::string list;
  for (size_t i = 0; i < left.size() && i < 10; ++i) list += (i ? ", " : "") + left[i];
  if (left.size() > 10) list += fmt::format(", ... ({} more)", left.size() - 10);
  KESTREL_FAIL("{} unexpected tensor(s) in the checkpoint: {}", left.size(), list);
}

}  // namespace kestrel
