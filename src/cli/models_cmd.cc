// `hxfer models`: the built-in presets, with their architecture, layer counts by kind and the
// cache footprint of one unsharded rank (tp=1, the config's dtypes, 32 tokens per block).
#include <cstdio>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "cli/table.h"
#include "model/presets.h"

namespace hxfer::cli {
namespace {

struct Footprint {
  uint32_t attention = 0, mamba2 = 0, gdn = 0, mamba1 = 0, none = 0;
  uint64_t kv_bytes_per_token = 0;
  uint64_t state_bytes_per_request = 0;
};

StatusOr<Footprint> footprint(const ModelSpec& m) {
  Footprint f;
  for (const LayerSpec& l : m.layers) {
    f.attention += l.hasAttention();
    f.mamba2 += l.recurrent == LayerKind::kMamba2;
    f.gdn += l.recurrent == LayerKind::kGdn;
    f.mamba1 += l.recurrent == LayerKind::kMamba1;
    f.none += !l.hasCache();
    for (Role role : layerRoles(l)) {
      ASSIGN_OR_RETURN(uint64_t bytes, localRecordBytes(recordSections(m, l, role), 1, 0));
      if (role == Role::kKv) {
        f.kv_bytes_per_token += bytes / m.tokens_per_block;
      } else {
        f.state_bytes_per_request += bytes;
      }
    }
  }
  return f;
}

}  // namespace

void addModelsCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand("models", "List the built-in model presets");
  auto json = std::make_shared<bool>(false);
  cmd->add_flag("--json", *json, "Print JSON (top-level \"models\" array)");
  cmd->callback([json] {
    nlohmann::ordered_json doc;
    doc["default"] = kDefaultPreset;
    doc["models"] = nlohmann::ordered_json::array();
    Table t({"name", "architecture", "layers", "attention", "mamba2", "gdn", "mamba1", "no-cache",
             "kv B/token", "state B/request"},
            {false, false, true, true, true, true, true, true, true, true});
    for (const std::string& name : presetNames()) {
      auto m = loadPreset(name);
      if (!m.isOk()) throw CLI::RuntimeError(reportError(m.status()));
      auto f = footprint(*m);
      if (!f.isOk()) throw CLI::RuntimeError(reportError(f.status()));
      nlohmann::ordered_json e;
      e["name"] = name;
      e["architecture"] = m->architecture;
      e["layers"] = m->numLayers();
      e["attention"] = f->attention;
      e["mamba2"] = f->mamba2;
      e["gdn"] = f->gdn;
      e["mamba1"] = f->mamba1;
      e["no_cache"] = f->none;
      e["kv_dtype"] = dtypeName(m->kv_dtype);
      e["kv_bytes_per_token"] = f->kv_bytes_per_token;
      e["state_bytes_per_request"] = f->state_bytes_per_request;
      doc["models"].push_back(std::move(e));
      t.add({name + (name == kDefaultPreset ? " *" : ""), m->architecture,
             std::to_string(m->numLayers()), std::to_string(f->attention),
             std::to_string(f->mamba2), std::to_string(f->gdn), std::to_string(f->mamba1),
             std::to_string(f->none), std::to_string(f->kv_bytes_per_token),
             std::to_string(f->state_bytes_per_request)});
    }
    if (*json) {
      std::printf("%s\n", doc.dump(2).c_str());
      return;
    }
    t.print(stdout);
    std::printf(
        "\n* default. Bytes are for one rank at tp=1 with the config's dtypes (SSM fp32)\n"
        "and 32 tokens per block; a parallel-hybrid layer counts as attention and mamba2.\n"
        "Use a name with --model, or pass a path to any supported config.json.\n");
  });
}

}  // namespace hxfer::cli
