// safetensors reader/writer. Format: u64 little-endian header length N, N bytes of JSON
// {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}}, then the data
// section; offsets are relative to the start of the data section.
#include "core/safetensors.h"

#include "core/check.h"
#include "core/config.h"

#include <fcntl.h>
#include <nlohmann/json.hpp>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>

namespace kestrel {

using nlohmann::json;

int64_t TensorInfo::numel() const {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

std::string TensorInfo::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

MappedFile::MappedFile(const std::filesystem::path& path) : path_(path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  KESTREL_CHECK(fd >= 0, "cannot open {}: {}", path.string(), std::strerror(errno));
  struct stat st{};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    KESTREL_FAIL("cannot stat {}", path.string());
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      KESTREL_FAIL("cannot mmap {}: {}", path.string(), std::strerror(errno));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

namespace {

bool mul_overflow(uint64_t a, uint64_t b, uint64_t* out) { return __builtin_mul_overflow(a, b, out); }

}  // namespace

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : file_(std::make_unique<MappedFile>(path)) {
  const std::string fname = path.filename().string();
  const uint8_t* base = file_->data();
  const uint64_t fsize = file_->size();
  KESTREL_CHECK(fsize >= 8, "{}: truncated safetensors file ({} bytes, need at least 8)", fname,
                fsize);
  uint64_t hlen = 0;
  std::memcpy(&hlen, base, 8);  // little-endian host (x86-64, aarch64)
  KESTREL_CHECK(hlen <= fsize - 8, "{}: header length {} exceeds the file ({} bytes)", fname, hlen,
                fsize);
  KESTREL_CHECK(hlen <= (uint64_t(100) << 20), "{}: header length {} exceeds 100 MiB", fname, hlen);
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(base + 8),
                         reinterpret_cast<const char*>(base + 8 + hlen));
  } catch (const json::parse_error& e) {
    KESTREL_FAIL("{}: malformed safetensors header JSON: {}", fname, e.what());
  }
  KESTREL_CHECK(header.is_object(), "{}: safetensors header is not a JSON object", fname);
  const uint64_t data_start = 8 + hlen;
  const uint64_t data_size = fsize - data_start;
  const uint8_t* data = base + data_start;

  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& e = it.value();
    if (name == "__metadata__") {
      KESTREL_CHECK(e.is_object(), "{}: __metadata__ is not an object", fname);
      for (auto m = e.begin(); m != e.end(); ++m) {
        KESTREL_CHECK(m.value().is_string(), "{}: __metadata__['{}'] is not a string", fname,
                      m.key());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    KESTREL_CHECK(e.is_object(), "{}: tensor '{}': entry is not an object", fname, name);
    KESTREL_CHECK(e.contains("dtype") && e["dtype"].is_string(),
                  "{}: tensor '{}': missing or non-string dtype", fname, name);
    const std::string dts = e["dtype"].get<std::string>();
    const auto dt = dtype_from_name(dts);
    KESTREL_CHECK(dt.has_value(), "{}: tensor '{}': unknown dtype '{}'", fname, name, dts);
    KESTREL_CHECK(e.contains("shape") && e["shape"].is_array(), "{}: tensor '{}': missing shape",
                  fname, name);
    KESTREL_CHECK(e.contains("data_offsets") && e["data_offsets"].is_array() &&
                      e["data_offsets"].size() == 2,
                  "{}: tensor '{}': data_offsets must be [begin, end]", fname, name);
    TensorInfo t;
    t.name = name;
    t.dtype = *dt;
    t.file = fname;
    uint64_t numel = 1;
    for (const auto& d : e["shape"]) {
      KESTREL_CHECK(d.is_number_unsigned() || (d.is_number_integer() && d.get<int64_t>() >= 0),
                    "{}: tensor '{}': shape entry {} is not a non-negative integer", fname, name,
                    d.dump());
      const uint64_t dim = d.get<uint64_t>();
      KESTREL_CHECK(dim <= (uint64_t(1) << 40), "{}: tensor '{}': dimension {} is too large", fname,
                    name, dim);
      KESTREL_CHECK(!mul_overflow(numel, dim, &numel), "{}: tensor '{}': shape overflows", fname,
                    name);
      t.shape.push_back(int64_t(dim));
    }
    uint64_t nbytes = 0;
    KESTREL_CHECK(!mul_overflow(numel, dtype_size(t.dtype), &nbytes),
                  "{}: tensor '{}': byte size overflows", fname, name);
    const auto& off = e["data_offsets"];
    KESTREL_CHECK(off[0].is_number_unsigned() && off[1].is_number_unsigned(),
                  "{}: tensor '{}': data_offsets are not non-negative integers", fname, name);
    const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
    KESTREL_CHECK(b <= en && en <= data_size,
                  "{}: tensor '{}': data_offsets [{}, {}] outside the data section ({} bytes)",
                  fname, name, b, en, data_size);
    KESTREL_CHECK(en - b == nbytes,
                  "{}: tensor '{}': {} bytes for shape {} x {} ({} bytes expected)", fname, name,
                  en - b, t.shape_str(), dtype_name(t.dtype), nbytes);
    t.data = data + b;
    t.nbytes = size_t(nbytes);
    if (nbytes > 0) ranges.emplace_back(b, en);
    tensors_.emplace(name, std::move(t));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    KESTREL_CHECK(ranges[i].first >= ranges[i - 1].second,
                  "{}: tensor data ranges overlap ([{}, {}] and [{}, {}])", fname,
                  ranges[i - 1].first, ranges[i - 1].second, ranges[i].first, ranges[i].second);
  }
}

std::unique_ptr<Checkpoint> Checkpoint::open(const std::filesystem::path& dir) {
  auto ck = std::unique_ptr<Checkpoint>(new Checkpoint());
  const auto index_path = dir / "model.safetensors.index.json";
  std::vector<std::string> shard_names;
  json index;
  if (std::filesystem::exists(index_path)) {
    index = read_json_file(index_path);
    KESTREL_CHECK(index.is_object() && index.contains("weight_map") &&
                      index["weight_map"].is_object(),
                  "{}: no weight_map object", index_path.string());
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      KESTREL_CHECK(it.value().is_string(), "{}: weight_map['{}'] is not a file name",
                    index_path.string(), it.key());
      const std::string f = it.value().get<std::string>();
      KESTREL_CHECK(f.find('/') == std::string::npos && f.find("..") == std::string::npos,
                    "{}: weight_map['{}'] = '{}' is not a plain file name", index_path.string(),
                    it.key(), f);
      if (std::find(shard_names.begin(), shard_names.end(), f) == shard_names.end())
        shard_names.push_back(f);
    }
    std::sort(shard_names.begin(), shard_names.end());
  } else {
    KESTREL_CHECK(std::filesystem::exists(dir / "model.safetensors"),
                  "{}: neither model.safetensors nor model.safetensors.index.json", dir.string());
    shard_names.push_back("model.safetensors");
  }
  for (const auto& s : shard_names) {
    const auto p = dir / s;
    KESTREL_CHECK(std::filesystem::exists(p), "{}: shard {} named by the index does not exist",
                  dir.string(), s);
    ck->files_.push_back(std::make_unique<SafetensorsFile>(p));
    for (const auto& [name, info] : ck->files_.back()->tensors()) {
      KESTREL_CHECK(!ck->index_.count(name), "tensor '{}' appears in two shards ({} and {})", name,
                    ck->index_[name]->file, info.file);
      ck->index_[name] = &info;
    }
  }
  if (!index.is_null()) {
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      const auto found = ck->index_.find(it.key());
      KESTREL_CHECK(found != ck->index_.end(), "{}: tensor '{}' is listed in the index but not in {}",
                    index_path.string(), it.key(), it.value().get<std::string>());
      KESTREL_CHECK(found->second->file == it.value().get<std::string>(),
                    "{}: tensor '{}' is in {}, the index says {}", index_path.string(), it.key(),
                    found->second->file, it.value().get<std::string>());
    }
    KESTREL_CHECK(ck->index_.size() == index["weight_map"].size(),
                  "{}: the shards hold {} tensors, the index lists {}", index_path.string(),
                  ck->index_.size(), index["weight_map"].size());
  }
  return ck;
}

const TensorInfo* Checkpoint::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : it->second;
}

size_t Checkpoint::total_bytes() const {
  size_t n = 0;
  for (const auto& [_, t] : index_) n += t->nbytes;
  return n;
}

void write_safetensors(const std::filesystem::path& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t off = 0;
  for (const auto& t : tensors) {
    uint64_t numel = 1;
    for (auto d : t.shape) numel *= uint64_t(d);
    KESTREL_CHECK(numel * dtype_size(t.dtype) == t.bytes.size(),
                  "write_safetensors: tensor '{}' has {} bytes, shape needs {}", t.name,
                  t.bytes.size(), numel * dtype_size(t.dtype));
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {off, off + t.bytes.size()}}};
    off += t.bytes.size();
  }
  std::string h = header.dump();
  while ((h.size() + 8) % 8) h.push_back(' ');  // align the data section to 8 bytes
  const auto tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    KESTREL_CHECK(out.good(), "cannot write {}", tmp);
    const uint64_t n = h.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out.write(h.data(), std::streamsize(h.size()));
    for (const auto& t : tensors)
      out.write(reinterpret_cast<const char*>(t.bytes.data()), std::streamsize(t.bytes.size()));
    KESTREL_CHECK(out.good(), "write to {} failed", tmp);
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace kestrel
