// Helpers for the loader tests: temporary directories and mutated copies of the tiny fixture.
#pragma once
#include "core/safetensors.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <string>

namespace kestrel::testing {

inline std::filesystem::path fixtures() { return KESTREL_FIXTURES; }

struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::random_device rd;
    path = std::filesystem::temp_directory_path() /
           ("kestrel-test-" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
};

inline void write_file(const std::filesystem::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}
inline std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// Tensors of a checkpoint as owned copies that a test can edit before writing them back.
struct OwnedTensor {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;
};

inline std::vector<OwnedTensor> read_all(const std::filesystem::path& st) {
  SafetensorsFile f(st);
  std::vector<OwnedTensor> v;
  for (const auto& [n, t] : f.tensors())
    v.push_back({n, t.dtype, t.shape, std::vector<uint8_t>(t.data, t.data + t.nbytes)});
  return v;
}

inline void write_all(const std::filesystem::path& st, const std::vector<OwnedTensor>& v) {
  std::vector<TensorToWrite> w;
  for (const auto& t : v) w.push_back({t.name, t.dtype, t.shape, t.bytes});
  write_safetensors(st, w);
}

// A copy of the tiny fixture (config + generation config) whose tensors went through `edit`.
inline void mutated_tiny(const std::filesystem::path& dir,
                         const std::function<void(std::vector<OwnedTensor>&)>& edit) {
  for (const char* f : {"config.json", "generation_config.json"})
    std::filesystem::copy_file(fixtures() / "tiny" / f, dir / f,
                               std::filesystem::copy_options::overwrite_existing);
  auto v = read_all(fixtures() / "tiny" / "model.safetensors");
  edit(v);
  write_all(dir / "model.safetensors", v);
}

// Expects `fn` to throw kestrel::Error whose message contains every one of `parts`.
template <class F>
void expect_error(F&& fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing '" << *parts.begin() << "'";
  } catch (const std::exception& e) {
    const std::string msg = e.what();
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message: " << msg << "\nmissing: " << p;
  }
}

}  // namespace kestrel::testing
