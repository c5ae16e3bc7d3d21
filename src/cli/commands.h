// Subcommand registration. Each add*Command lives in its own *_cmd.cc file.
#pragma once

#include <CLI/CLI.hpp>

namespace hxfer::cli {

void addDemoCommand(CLI::App& app);

}  // namespace hxfer::cli
