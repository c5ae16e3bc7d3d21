// Subcommand registration. Each add*Command lives in its own *_cmd.cc file.
#pragma once

#include <CLI/CLI.hpp>

namespace hxfer::cli {

void addDemoCommand(CLI::App& app);
void addConfigCommand(CLI::App& app);
void addServeCommand(CLI::App& app);
void addModelsCommand(CLI::App& app);
void addDescribeCommand(CLI::App& app);
void addPlanCommand(CLI::App& app);
void addMetadataCommand(CLI::App& app);
void addInspectCommand(CLI::App& app);
void addBenchCommand(CLI::App& app);
void addBenchWorkloadsCommand(CLI::App& app);  // after addBenchCommand: joins `bench`

}  // namespace hxfer::cli
