// safetensors over mmap: single files and sharded checkpoints (model.safetensors.index.json).
// Owns byte ranges and header validation only; no tensor semantics (see loader.h).
// Validation: header length inside the file, JSON well formed, every offset/size inside the data
// section, no overlaps, shape x dtype size == byte length, all arithmetic overflow-checked.
#pragma once
#include "core/dtype.h"

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace kestrel {

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;  // inside the mmap
  size_t nbytes = 0;
  std::string file;  // file name, for messages

  int64_t numel() const;
  std::string shape_str() const;  // "[8192, 2048]"
};

// A read-only memory map of one file.
class MappedFile {
 public:
  explicit MappedFile(const std::filesystem::path& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const MappedFile& file() const { return *file_; }

 private:
  std::unique_ptr<MappedFile> file_;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// All safetensors of a model directory: model.safetensors, or the shards named by
// model.safetensors.index.json (every index entry must exist in the named shard, and every tensor of
// a shard must be in the index).
class Checkpoint {
 public:
  static std::unique_ptr<Checkpoint> open(const std::filesystem::path& model_dir);
  const TensorInfo* find(const std::string& name) const;
  const std::map<std::string, const TensorInfo*>& all() const { return index_; }
  size_t total_bytes() const;

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorInfo*> index_;
};

// Writes one safetensors file (used by `kestrel quantize`, the synthetic-model writer and tests).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::span<const uint8_t> bytes;
};
void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace kestrel
