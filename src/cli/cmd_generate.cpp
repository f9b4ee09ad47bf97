// kestrel generate: greedy generation from token ids or text; prints ids (and text when the model
// directory has a tokenizer) and the prefill / decode speeds.
#include "cli/commands.h"
#include "core/check.h"
#include "engine/engine.h"
#include "quant/progress.h"
#include "tokenizer/tokenizer.h"
#if defined(KESTREL_HAS_CUDA)
#include "cuda/cuda_backend.h"
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>

namespace {

std::vector<int32_t> parse_ids(const std::string& s) {
  std::vector<int32_t> ids;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    KESTREL_CHECK(!item.empty(), "--prompt-ids: empty entry in '{}'", s);
    size_t pos = 0;
    long v = 0;
    try {
      v = std::stol(item, &pos);
    } catch (...) {
      KESTREL_FAIL("--prompt-ids: '{}' is not an integer", item);
    }
    KESTREL_CHECK(pos == item.size() && v >= 0 && v <= INT32_MAX, "--prompt-ids: bad id '{}'", item);
    ids.push_back(int32_t(v));
  }
  KESTREL_CHECK(!ids.empty(), "--prompt-ids: no ids");
  return ids;
}

void setup_generate(CLI::App& root) {
  struct Args {
    std::string model, prompt_ids, prompt, device = "cpu", quant = "none";
    int max_tokens = 32, threads = 0;
    bool ignore_eos = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = root.add_subcommand("generate", "greedy generation (prints ids, text and tok/s)");
  cmd->add_option("--model", a->model, "model directory")->required();
  auto* ids = cmd->add_option("--prompt-ids", a->prompt_ids, "prompt as comma-separated token ids");
  auto* txt = cmd->add_option("--prompt", a->prompt, "prompt text (encoded with the model's tokenizer)");
  ids->excludes(txt);
  cmd->add_option("--max-tokens", a->max_tokens, "tokens to generate")->check(CLI::Range(1, 1 << 20));
  cmd->add_option("--device", a->device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cmd->add_option("--quant", a->quant, "quantize a bf16 checkpoint at load: none or q4")
      ->check(CLI::IsMember({"none", "q4"}));
  cmd->add_option("--threads", a->threads, "CPU threads (0 = all cores)");
  cmd->add_flag("--ignore-eos", a->ignore_eos, "do not stop at end-of-sequence tokens");
  cmd->callback([a] {
    using clock = std::chrono::steady_clock;
    namespace fs = std::filesystem;
    KESTREL_CHECK(!a->prompt_ids.empty() || !a->prompt.empty(), "give --prompt-ids or --prompt");
    std::unique_ptr<kestrel::Tokenizer> tok;
    if (fs::exists(fs::path(a->model) / "tokenizer.json")) tok = kestrel::Tokenizer::load(a->model);
    std::vector<int32_t> prompt;
    if (!a->prompt.empty()) {
      KESTREL_CHECK(tok, "--prompt needs a tokenizer.json in {}", a->model);
      prompt = tok->encode(a->prompt);
      KESTREL_CHECK(!prompt.empty(), "--prompt encodes to no tokens");
    } else {
      prompt = parse_ids(a->prompt_ids);
    }
    kestrel::BackendOptions bo;
    bo.device = kestrel::parse_device(a->device);
    bo.load.quant = a->quant == "q4" ? kestrel::QuantMode::Q4 : kestrel::QuantMode::None;
    bo.threads = a->threads;
    bo.load.progress = kestrel::quant::progress_bar("loading");
    const auto t_load = clock::now();
    auto be = kestrel::load_backend(a->model, bo);
    const double load_s = std::chrono::duration<double>(clock::now() - t_load).count();
    const auto& cfg = be->config();
    std::fprintf(stderr, "loaded %s on %s in %.2f s, resident memory %.2f GB\n", a->model.c_str(),
                 be->name().c_str(), load_s, double(kestrel::quant::resident_bytes()) / 1e9);
    const kestrel::SeqId seq = be->create_sequence(int64_t(prompt.size()) + a->max_tokens);
    // The embedding and lm_head are padded past the tokenizer's last id (248,077 of 248,320 in
    // the real model); those rows are never valid output, so greedy picks among real tokens only.
    const int32_t n_real = tok ? std::min<int32_t>(tok->vocab_size(), cfg.vocab_size) : cfg.vocab_size;
    auto argmax = [&](const std::vector<float>& l) {
      return int32_t(std::max_element(l.begin(), l.begin() + n_real) - l.begin());
    };
    std::unique_ptr<kestrel::StreamDecoder> sd;
    if (tok) sd = std::make_unique<kestrel::StreamDecoder>(*tok);

    kestrel::StepResult res;
    kestrel::StepRequest req{seq, prompt, false};
    const auto t0 = clock::now();
    be->step({&req, 1}, {&res, 1});
    const double prefill_s = std::chrono::duration<double>(clock::now() - t0).count();
    std::vector<int32_t> out{argmax(res.logits)};
    const auto t1 = clock::now();
    auto is_eos = [&](int32_t t) {
      return std::find(cfg.eos_token_ids.begin(), cfg.eos_token_ids.end(), t) != cfg.eos_token_ids.end();
    };
    if (sd) std::fputs(sd->push(out.back()).c_str(), stdout), std::fflush(stdout);
    // On CUDA the decode loop runs on the GPU: argmax there, the token stays there, one CUDA-graph
    // replay per token; the host reads each token one step behind.
    const bool gpu_greedy = be->name() == "cuda";
#if defined(KESTREL_HAS_CUDA)
    if (gpu_greedy && int(out.size()) < a->max_tokens && (a->ignore_eos || !is_eos(out.back())))
      kestrel::cuda::greedy_decode(*be, seq, out.back(), a->max_tokens - int(out.size()),
                                   [&](int32_t t) {
                                     out.push_back(t);
                                     if (sd) std::fputs(sd->push(t).c_str(), stdout), std::fflush(stdout);
                                     return a->ignore_eos || !is_eos(t);
                                   },
                                   n_real);
#endif
    while (!gpu_greedy && int(out.size()) < a->max_tokens && (a->ignore_eos || !is_eos(out.back()))) {
      const int32_t t = out.back();
      kestrel::StepRequest r{seq, {&t, 1}, false};
      be->step({&r, 1}, {&res, 1});
      out.push_back(argmax(res.logits));
      if (sd) std::fputs(sd->push(out.back()).c_str(), stdout), std::fflush(stdout);
    }
    const double decode_s = std::chrono::duration<double>(clock::now() - t1).count();
    if (sd) std::printf("%s\n", sd->flush().c_str());
    std::printf("ids:");
    for (auto t : out) std::printf(" %d", t);
    std::printf("\n");
    const size_t steps = out.size() - 1;
    std::fprintf(stderr, "prompt %zu tokens: prefill %.1f tok/s (%.3f s); decode %zu tokens: %.1f tok/s\n",
                 prompt.size(), prompt.size() / prefill_s, prefill_s, steps,
                 steps ? steps / decode_s : 0.0);
  });
}

}  // namespace

KESTREL_COMMAND(setup_generate);
