// kestrel synth-model: writes a deterministic random HF-layout checkpoint for a config.json (the
// real-width fixture's weights; see core/synth.h).
#include "cli/commands.h"
#include "core/check.h"
#include "core/config.h"
#include "core/synth.h"

#include <cstdio>
#include <filesystem>

namespace {

void setup_synth(CLI::App& root) {
  struct Args {
    std::string config, out;
    uint64_t seed = 1;
    bool fused = false;
  };
  auto a = std::make_shared<Args>();
  auto* cmd = root.add_subcommand("synth-model", "write a deterministic random checkpoint for a config");
  cmd->add_option("--config", a->config, "config.json to synthesize weights for")->required();
  cmd->add_option("--out", a->out, "output model directory (created)")->required();
  cmd->add_option("--seed", a->seed, "seed (default 1)");
  cmd->add_flag("--fused-experts", a->fused, "store experts as fused 3-D tensors");
  cmd->callback([a] {
    namespace fs = std::filesystem;
    const fs::path cfg_path(a->config);
    const auto cfg = kestrel::parse_config(kestrel::read_json_file(cfg_path), cfg_path.string());
    fs::create_directories(a->out);
    // Copy the directory's other model files (config, generation config, tokenizer, template).
    for (const auto& e : fs::directory_iterator(cfg_path.parent_path().empty() ? "." : cfg_path.parent_path())) {
      const auto n = e.path().filename().string();
      if (n == "config.json" || n == "generation_config.json" || n == "tokenizer.json" ||
          n == "tokenizer_config.json" || n == "chat_template.jinja")
        fs::copy_file(e.path(), fs::path(a->out) / n, fs::copy_options::overwrite_existing);
    }
    const size_t bytes =
        kestrel::write_synthetic_checkpoint(cfg, a->out, {a->seed, a->fused, true});
    std::printf("wrote %s/model.safetensors (%.1f MB, seed %llu)\n", a->out.c_str(), bytes / 1e6,
                (unsigned long long)a->seed);
  });
}

}  // namespace

KESTREL_COMMAND(setup_synth);
