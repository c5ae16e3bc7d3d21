#include <cstdio>
#include <memory>

#include "cache/layout.h"
#include "cli/commands.h"
#include "cli/model_options.h"

namespace hxfer::cli {

void addDemoCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand("demo", "Run the main job on an embedded default");
  // The callback owns the options; CLI11 writes into them through the bound reference.
  auto opts = std::make_shared<ModelOptions>();
  addModelOptions(cmd, opts.get());
  cmd->callback([opts] {
    auto m = resolveModel(*opts);
    if (!m.isOk()) throw CLI::RuntimeError(reportError(m.status()));
    for (uint32_t r = 0; r < 2; ++r) {
      auto l = buildRankLayout(*m, {2, 1, {}}, r, 0, StateLayout::kPaged, 4, 2);
      if (!l.isOk()) throw CLI::RuntimeError(reportError(l.status()));
      for (const auto& v : l->views) {
        std::printf("tp rank %u: %s %s record %llu bytes\n", r,
                    std::string(layerKindName(v.kind)).c_str(),
                    std::string(roleName(v.role)).c_str(),
                    static_cast<unsigned long long>(v.record_bytes));
      }
    }
  });
}

}  // namespace hxfer::cli
