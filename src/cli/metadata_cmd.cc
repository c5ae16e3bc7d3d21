// `hxfer metadata`: builds the real cache of one rank (HybridCacheManager: regions allocated and
// pre-faulted) and writes what that rank would publish to its peers, an encoded Hello frame
// holding its RankInfo. `hxfer inspect FILE` reads it back.
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

#include "cache/cache_manager.h"
#include "cache/engine_layout.h"
#include "cli/commands.h"
#include "cli/model_options.h"
#include "wire/messages.h"
#include "wire/rank_info.h"

namespace hxfer::cli {
namespace {

struct MetadataOptions {
  ModelOptions model;
  uint32_t tp = 1;
  uint32_t pp = 1;
  uint32_t rank = 0;  // global: tp_rank = rank % tp, pp_rank = rank / tp
  std::string layout = "paged";
  bool layout_given = false;  // --layout on the command line: refused with another engine
  std::string engine = "hxfer", kv_layout, conv_layout, shared_tensors;
  uint32_t blocks = 16;
  uint32_t slots = 4;
  std::string role = "context";
  std::string instance_id;  // empty: "<role>-<model>"
  std::string address;
  std::string out;
};

Status writeFile(const std::string& path, const Bytes& bytes) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) return InvalidArgument("--out " + path + ": " + std::strerror(errno));
  bool ok = std::fwrite(bytes.data(), 1, bytes.size(), f) == bytes.size();
  ok = std::fclose(f) == 0 && ok;
  if (!ok) return Unavailable("writing " + path + " failed: " + std::strerror(errno));
  return OkStatus();
}

Status run(const MetadataOptions& o) {
  ASSIGN_OR_RETURN(ModelSpec model, resolveModel(o.model));
  const ParallelConfig pc{o.tp, o.pp, {}};
  RETURN_IF_ERROR(pc.validate(model.numLayers()));
  if (o.rank >= pc.worldSize()) {
    return InvalidArgument("--rank " + std::to_string(o.rank) +
                           " >= tp*pp=" + std::to_string(pc.worldSize()));
  }
  const EngineOptions engine{o.engine, o.kv_layout, o.conv_layout, o.shared_tensors};
  ASSIGN_OR_RETURN(EngineLayout layout, resolveEngineLayout(engine, "", o.layout, o.layout_given));
  auto role = wire::parseInstanceRole(o.role);
  if (!role.isOk()) return role.status().withContext("--role");

  ASSIGN_OR_RETURN(auto cache,
                   HybridCacheManager::create(model, pc, o.rank % o.tp, o.rank / o.tp, layout,
                                              Capacity::counts(o.blocks, o.slots)));
  wire::Hello hello;
  wire::RankInfo& info = hello.rank_info;
  info.instance_id = o.instance_id.empty()
                         ? std::string(wire::instanceRoleName(*role)) + "-" + model.name
                         : o.instance_id;
  info.role = *role;
  info.address.assign(o.address.begin(), o.address.end());
  info.layout = cache->layout();
  // Shared-memory regions need no transport key; a UCX build adds one per region here. The
  // auth token is never in a Hello: transports prove it (docs/reliability.md).
  RETURN_IF_ERROR(wire::checkMessage(hello));

  const Bytes frame = wire::encodeMessage(hello);
  RETURN_IF_ERROR(writeFile(o.out, frame));
  std::printf("wrote %zu bytes to %s: %s\n", frame.size(), o.out.c_str(),
              wire::summarize(hello).c_str());
  return OkStatus();
}

}  // namespace

void addMetadataCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "metadata", "Build one rank's cache and write the RankInfo it publishes (a Hello frame)");
  auto o = std::make_shared<MetadataOptions>();
  addModelOptions(cmd, &o->model);
  addParallelSize(cmd, "--tp", &o->tp, "Tensor-parallel size", 1);
  addParallelSize(cmd, "--pp", &o->pp, "Pipeline-parallel size (even split of layers)", 1);
  cmd->add_option("--rank", o->rank, "Global rank: tp_rank = R % tp, pp_rank = R / tp")
      ->default_val(0);
  auto* layout = cmd->add_option("--layout", o->layout,
                                 "State layout of --engine hxfer (refused with another engine): "
                                 "paged or layer-major")
                     ->default_val("paged");
  cmd->add_option("--engine", o->engine,
                  "Engine layout of the pools: hxfer, trtllm-v1, trtllm-v2, vllm, vllm-0.25, "
                  "sglang (docs/layouts.md)")
      ->default_val("hxfer");
  cmd->add_option("--kv-layout", o->kv_layout,
                  "KV order: nhd or hnd (trtllm-v2, vllm-0.25: inside a K or V half; vllm: K "
                  "and V side by side per token and head), cpu or cpu-amx (vllm)");
  cmd->add_option("--conv-layout", o->conv_layout, "Conv state order: sd or ds (vllm)");
  cmd->add_option("--shared-tensors", o->shared_tensors,
                  "vllm: on for the hybrid manager's shared per-group tensors (one id pool "
                  "of --blocks + --slots x state groups pages, the states pages of it), off "
                  "(default) for one tensor per layer");
  cmd->add_option("--blocks", o->blocks, "KV blocks to allocate")->default_val(16);
  cmd->add_option("--slots", o->slots, "Recurrent-state slots to allocate")->default_val(4);
  cmd->add_option("--role", o->role, "Instance role: context or generation")
      ->default_val("context");
  cmd->add_option("--instance-id", o->instance_id, "Instance id (default: <role>-<model>)");
  cmd->add_option("--address", o->address, "Transport address to publish");
  cmd->add_option("--out", o->out, "File to write")->required();
  cmd->callback([o, layout] {
    o->layout_given = layout->count() > 0;
    Status s = run(*o);
    if (!s.isOk()) throw CLI::RuntimeError(reportError(s));
  });
}

}  // namespace hxfer::cli
