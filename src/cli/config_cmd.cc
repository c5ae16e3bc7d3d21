// `hxfer config`: resolves backend and state layout the way every rank does at start-up
// (DESIGN §8) and, with --explain, prints each decision and why. An impossible combination
// exits 1 with a message naming both settings.
#include <nlohmann/json.hpp>

#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "engine/routing.h"

namespace hxfer::cli {
namespace {

struct ConfigOptions {
  ModelOptions model;
  std::string backend = "auto";
  std::string state_layout = "auto";
  bool explain = false;
  bool json = false;
  bool other_host = false;
  bool single_process = false;
  bool ucx_rma = false;
  std::string memory = "shareable";
};

int runConfig(const ConfigOptions& o) {
  auto model = resolveModel(o.model);
  if (!model.isOk()) return reportError(model.status());
  auto backend = engine::parseBackendRequest(o.backend);
  if (!backend.isOk()) return reportError(backend.status().withContext("--backend"));
  auto layout = engine::parseStateLayoutRequest(o.state_layout);
  if (!layout.isOk()) return reportError(layout.status().withContext("--state-layout"));

  engine::RoutingEnvironment env = engine::probeRoutingEnvironment();
  env.peers_same_host = !o.other_host;
  env.single_process = o.single_process;
  env.ucx_cheap_small_writes = o.ucx_rma;
  if (o.memory != "shareable" && o.memory != "private" && o.memory != "device") {
    return reportError(
        InvalidArgument("--memory=" + o.memory + " is not one of: shareable, private, device"));
  }
  env.memory_shareable = o.memory == "shareable";
  env.memory_device = o.memory == "device";
  const auto preference = engine::preferredStateLayout(*model);
  engine::RoutingExplanation e = engine::explainRouting({*backend, *layout}, env, preference);

  if (o.json) {
    nlohmann::json j;
    j["model"] = model->name;
    j["requested"] = {{"backend", o.backend}, {"state_layout", o.state_layout}};
    j["memory"] = o.memory;
    j["decisions"] = nlohmann::json::array();
    for (const auto& d : e.decisions) {
      j["decisions"].push_back({{"setting", d.setting}, {"value", d.value}, {"reason", d.reason}});
    }
    j["ok"] = e.status.isOk();
    if (e.routing) {
      j["backend"] = engine::backendName(e.routing->backend);
      j["state_layout"] = stateLayoutName(e.routing->state_layout);
    } else {
      j["error"] = e.status.toString();
    }
    std::printf("%s\n", j.dump(2).c_str());
  } else if (o.explain) {
    std::printf("model %s: %s\n", model->name.c_str(),
                preference ? ("prefers " + std::string(stateLayoutName(*preference))).c_str()
                           : "no preferred state layout");
    int step = 1;
    for (const auto& d : e.decisions) {
      std::printf("%d. %s = %s\n   because %s\n", step++, d.setting.c_str(), d.value.c_str(),
                  d.reason.c_str());
    }
  } else if (e.routing) {
    std::printf("backend=%s state_layout=%s\n",
                std::string(engine::backendName(e.routing->backend)).c_str(),
                std::string(stateLayoutName(e.routing->state_layout)).c_str());
  }
  if (!e.status.isOk()) return reportError(e.status);
  return 0;
}

}  // namespace

void addConfigCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "config", "Resolve backend and state layout (auto) for a deployment; --explain says why");
  auto o = std::make_shared<ConfigOptions>();
  addModelOptions(cmd, &o->model);
  cmd->add_option("--backend", o->backend, "auto, shm, ucx, inproc or cuda")->default_val("auto");
  cmd->add_option("--state-layout", o->state_layout, "auto, paged or layer-major")
      ->default_val("auto");
  cmd->add_flag("--explain", o->explain, "Print each decision and why");
  cmd->add_flag("--json", o->json, "Print the decisions as JSON");
  cmd->add_flag("--other-host", o->other_host, "The peers run on another host (no shm)");
  cmd->add_flag("--single-process", o->single_process,
                "Every rank runs in this one process (inproc can reach them)");
  cmd->add_flag("--ucx-rma", o->ucx_rma,
                "UCX has real one-sided RMA here (RDMA, cuda_ipc), so small writes are cheap");
  cmd->add_option("--memory", o->memory,
                  "The pools: shareable (hxfer's own, or engine pools with a memfd) or private "
                  "(engine memory shm cannot share; auto then picks ucx) or device (CUDA "
                  "memory; auto then picks cuda on one host)")
      ->default_val("shareable");
  cmd->callback([o] {
    const int rc = runConfig(*o);
    if (rc != 0) throw CLI::RuntimeError(rc);
  });
}

}  // namespace hxfer::cli
