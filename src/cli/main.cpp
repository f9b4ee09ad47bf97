// kestrel: the command-line entry point. Subcommands live in cmd_*.cpp and register themselves.
#include "cli/commands.h"
#include "core/check.h"

#include <cstdio>
#include <exception>

int main(int argc, char** argv) {
  CLI::App app{"kestrel: an inference engine and OpenAI-compatible server for Qwen3.6-35B-A3B"};
  app.require_subcommand(1);
  for (auto& setup : kestrel::cli::command_registry()) setup(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const kestrel::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
