// hxfer: the command-line front end. Each subcommand lives in its own *_cmd.cc file and is
// registered here.
#include <CLI/CLI.hpp>

#include "cli/commands.h"
#include "common/logging.h"
#include "wire/codec.h"

int main(int argc, char** argv) {
  CLI::App app{"hxfer: move hybrid-LLM cache state between disaggregated serving instances"};
  app.require_subcommand(1);
  // The project version (CMakeLists.txt project()), the one hxfer.__version__ and the library's
  // SONAME carry too, and the wire version this build speaks.
  app.set_version_flag("--version", std::string("hxfer ") + HXFER_VERSION + " (wire " +
                                        std::to_string(hxfer::wire::kWireVersionMajor) + "." +
                                        std::to_string(hxfer::wire::kWireVersionMinor) + ")");
  std::string log_level = "warn";
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error, off")
      ->default_val("warn");
  app.parse_complete_callback([&] {
    if (!hxfer::setLogLevel(log_level)) throw CLI::ValidationError("--log-level", log_level);
  });
  hxfer::cli::addDemoCommand(app);
  hxfer::cli::addConfigCommand(app);
  hxfer::cli::addServeCommand(app);
  hxfer::cli::addModelsCommand(app);
  hxfer::cli::addDescribeCommand(app);
  hxfer::cli::addPlanCommand(app);
  hxfer::cli::addMetadataCommand(app);
  hxfer::cli::addInspectCommand(app);
  hxfer::cli::addBenchCommand(app);
  hxfer::cli::addBenchWorkloadsCommand(app);
  CLI11_PARSE(app, argc, argv);
  return 0;
}
