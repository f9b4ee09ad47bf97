// `kestrel quantize --model IN --out OUT --quant q4`: converts an HF bf16 checkpoint once into the
// MLX affine 4-bit layout (routers and shared-expert gates 8-bit), which kestrel (and mlx-lm) load.
#include "cli/commands.h"
#include "core/check.h"
#include "quant/progress.h"
#include "quant/quant.h"

#include <chrono>
#include <cstdio>
#include <string>

namespace {

void setup_quantize(CLI::App& root) {
  struct Args {
    std::string model, out, quant = "q4";
    double shard_gib = 5.0;
  };
  auto args = std::make_shared<Args>();
  CLI::App* cmd = root.add_subcommand(
      "quantize", "Write an MLX-layout affine 4-bit copy of an HF bf16 checkpoint");
  cmd->add_option("--model", args->model, "input model directory (HF layout, bf16)")->required();
  cmd->add_option("--out", args->out, "output directory (must not exist, or be empty)")->required();
  cmd->add_option("--quant", args->quant, "quantization: q4 (affine 4-bit, group 64; routers and "
                  "shared-expert gates 8-bit, as the mlx-community recipe)")
      ->capture_default_str();
  cmd->add_option("--shard-gib", args->shard_gib, "maximum size of one output shard in GiB")
      ->capture_default_str();
  cmd->callback([args] {
    KESTREL_CHECK(args->quant == "q4", "--quant {}: not supported (kestrel quantize writes q4)",
                  args->quant);
    KESTREL_CHECK(args->shard_gib > 0.0, "--shard-gib {} must be positive", args->shard_gib);
    kestrel::quant::ConvertOptions opts;
    opts.bits = 4;
    opts.max_shard_bytes = size_t(args->shard_gib * double(size_t(1) << 30));
    const kestrel::ProgressFn bar = kestrel::quant::progress_bar("quantizing");
    opts.progress = [&](size_t done, size_t total) { bar({done, total}); };
    const auto t0 = std::chrono::steady_clock::now();
    const auto rep = kestrel::quant::convert_hf_to_mlx(args->model, args->out, opts);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("wrote %s: %zu tensors in %zu shard(s), %.3f GB (from %.3f GB of text weights), "
                "%.3f bits per weight, in %.1f s\n",
                args->out.c_str(), rep.tensors_written, rep.shards, double(rep.bytes_out) / 1e9,
                double(rep.bytes_in) / 1e9,
                rep.parameters ? 8.0 * double(rep.bytes_out) / double(rep.parameters) : 0.0, secs);
    if (rep.dropped)
      std::printf("dropped %zu tensors of the vision tower / MTP block (not part of the MLX text "
                  "layout)\n", rep.dropped);
    if (!rep.unquantized.empty())
      std::printf("%zu matrices kept unquantized (input width not a multiple of 64), e.g. %s\n",
                  rep.unquantized.size(), rep.unquantized.front().c_str());
  });
}

}  // namespace

KESTREL_COMMAND(setup_quantize);
