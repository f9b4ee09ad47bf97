// Subcommand registry: each cmd_*.cpp registers itself with KESTREL_COMMAND(setup_fn), where
// setup_fn(CLI::App& root) adds one subcommand and its callback. main.cpp runs the registry.
#pragma once
#include <CLI/CLI.hpp>

#include <functional>
#include <vector>

namespace kestrel::cli {

using CommandSetup = std::function<void(CLI::App& root)>;

inline std::vector<CommandSetup>& command_registry() {
  static std::vector<CommandSetup> r;
  return r;
}

struct CommandRegistrar {
  explicit CommandRegistrar(CommandSetup fn) { command_registry().push_back(std::move(fn)); }
};

}  // namespace kestrel::cli

#define KESTREL_COMMAND(fn) static ::kestrel::cli::CommandRegistrar kestrel_cmd_registrar_##fn(fn)
