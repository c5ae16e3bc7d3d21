// hxfer: the command-line front end. Each subcommand lives in its own *_cmd.cc file and is
// registered here.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "common/logging.h"
#include "wire/codec.h"

namespace {

// The exit code of a command line CLI11 refuses (an unknown option, a value out of range, a
// missing required one); a command's own errors exit 1.
constexpr int kUsageError = 2;

}  // namespace

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
    if (!hxfer::setLogLevel(log_level)) {
      throw CLI::ValidationError(
          "--log-level", "'" + log_level + "' is not trace, debug, info, warn, error or off");
    }
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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version (exit code 0) and a command's own failure (RuntimeError, already
    // reported by the command) as CLI11 has them; an option CLI11 refuses while parsing in
    // hxfer's one-line form, with the usage error's exit code.
    if (e.get_exit_code() == 0 || e.get_name() == "RuntimeError") return app.exit(e);
    std::string message = e.what();
    std::replace(message.begin(), message.end(), '\n', ' ');
    std::fprintf(stderr, "hxfer: InvalidArgument: %s\n", message.c_str());
    return kUsageError;
  }
  return 0;
}
