// hxfer: the command-line front end. Each subcommand lives in its own file and registers
// itself here.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cache/layout.h"

int main(int argc, char** argv) {
  CLI::App app{"hxfer: move hybrid-LLM cache state between disaggregated serving instances"};
  app.require_subcommand(1);
  auto* demo = app.add_subcommand("demo", "Run the main job on an embedded default");
  demo->callback([] {
    hxfer::ModelSpec m;
    m.name = "tiny";
    hxfer::LayerSpec mamba;
    mamba.recurrent = hxfer::LayerKind::kMamba2;
    mamba.mamba2 = {8, 4, 2, 8, 4};
    hxfer::LayerSpec attn;
    attn.attention = hxfer::AttentionShape{4, 8};
    m.layers = {mamba, attn};
    for (uint32_t r = 0; r < 2; ++r) {
      auto l = hxfer::buildRankLayout(m, {2, 1, {}}, r, 0, hxfer::StateLayout::kPaged, 4, 2);
      if (!l.isOk()) {
        std::fprintf(stderr, "hxfer: %s\n", l.status().toString().c_str());
        throw CLI::RuntimeError(1);
      }
      for (const auto& v : l->views) {
        std::printf("rank %u %s record %llu bytes\n", r, std::string(roleName(v.role)).c_str(),
                    static_cast<unsigned long long>(v.record_bytes));
      }
    }
  });
  CLI11_PARSE(app, argc, argv);
  return 0;
}
