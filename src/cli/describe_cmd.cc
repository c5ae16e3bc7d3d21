// `hxfer describe`: the state layout of one model on every rank of a (tp, pp) instance: per
// layer and role the record bytes and their sections with the units each rank holds, and with
// --layout or --engine the pool views (buildEngineLayout) with where each element of a record
// lies. The JSON form is built first and the human
// table is printed from it, so both always agree.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "cache/engine_layout.h"
#include "cache/layout.h"
#include "cache/record_layout.h"
#include "cli/commands.h"
#include "cli/model_options.h"
#include "cli/table.h"

namespace hxfer::cli {
namespace {

using Json = nlohmann::ordered_json;

struct DescribeOptions {
  ModelOptions model;
  uint32_t tp = 1;
  uint32_t pp = 1;
  std::string layout;  // empty: no pools (unless --engine)
  std::string engine, kv_layout, conv_layout, shared_tensors;
  uint32_t blocks = 16;
  uint32_t slots = 4;
  bool json = false;
};

// Where each element of v's records lies: the described record, or hxfer's own contiguous
// order (canonicalRecordLayout) for a view without one.
StatusOr<RecordLayout> recordOf(const ModelSpec& m, const RankLayout& layout, const PoolView& v) {
  if (v.record) return *v.record;
  ASSIGN_OR_RETURN(std::vector<uint32_t> units,
                   localUnitCounts(v.sections, layout.tp, layout.tp_rank));
  return canonicalRecordLayout(v.kind, v.role, v.sections, units,
                               static_cast<uint32_t>(dtypeSize(layout.dtypeOf(v.role))),
                               innerSizes(m, m.layers.at(v.layers.front()), v.role));
}

StatusOr<Json> poolJson(const ModelSpec& m, const RankLayout& layout, const PoolView& v) {
  const RegionSpec* region = layout.findRegion(v.region_id);
  Json p;
  p["region_id"] = v.region_id;
  p["region"] = region ? region->name : "";
  p["region_bytes"] = region ? region->length : 0;
  p["role"] = roleName(v.role);
  p["kind"] = layerKindName(v.kind);
  p["base"] = v.base;
  p["index_stride"] = v.index_stride;
  p["layer_stride"] = v.layer_stride;
  p["record_bytes"] = v.record_bytes;
  p["num_indices"] = v.num_indices;
  p["indexed_by"] = v.indexedByBlock() ? "block" : "slot";
  if (!v.indexedByBlock()) p["state_group"] = v.state_group;  // which of a request's state ids
  p["layers"] = v.layers;
  // One record: its extent and the byte stride of each dim, outermost first; `described` is
  // false for hxfer's own contiguous order. Records are `span` bytes at a pitch of
  // index_stride (and layer_stride); bytes between them are padding, never copied.
  ASSIGN_OR_RETURN(RecordLayout r, recordOf(m, layout, v));
  Json dims = Json::array();
  for (const RecordDim& d : r.dims) {
    dims.push_back(Json{{"name", d.name}, {"size", d.size}, {"stride", d.stride}});
  }
  p["record"] = Json{{"described", v.record.has_value()},
                     {"element_bytes", r.element_bytes},
                     {"span", v.span()},
                     {"dims", std::move(dims)}};
  return p;
}

StatusOr<Json> describe(const ModelSpec& m, const ParallelConfig& pc,
                        std::optional<EngineLayout> layout, uint32_t blocks, uint32_t slots) {
  RETURN_IF_ERROR(pc.validate(m.numLayers()));
  RETURN_IF_ERROR(checkShardable(m, pc));
  Json doc;
  doc["model"] = m.name;
  doc["architecture"] = m.architecture;
  doc["num_layers"] = m.numLayers();
  doc["tp"] = pc.tp;
  doc["pp"] = pc.pp;
  doc["tokens_per_block"] = m.tokens_per_block;
  doc["kv_dtype"] = dtypeName(m.kv_dtype);
  doc["conv_dtype"] = dtypeName(m.conv_dtype);
  doc["ssm_dtype"] = dtypeName(m.ssm_dtype);
  if (layout) {
    doc["engine_layout"] = layout->toString();
    doc["state_layout"] = stateLayoutName(layout->state);
    doc["blocks"] = blocks;
    doc["slots"] = slots;
  }
  char fingerprint[19];
  std::snprintf(fingerprint, sizeof(fingerprint), "0x%016llx",
                static_cast<unsigned long long>(modelFingerprint(m)));
  doc["fingerprint"] = fingerprint;
  Json ranks = Json::array();
  for (uint32_t pp_rank = 0; pp_rank < pc.pp; ++pp_rank) {
    ASSIGN_OR_RETURN(LayerRange stage, stageLayers(pc, m.numLayers(), pp_rank));
    for (uint32_t tp_rank = 0; tp_rank < pc.tp; ++tp_rank) {
      Json rank;
      rank["rank"] = pp_rank * pc.tp + tp_rank;
      rank["tp_rank"] = tp_rank;
      rank["pp_rank"] = pp_rank;
      rank["first_layer"] = stage.first;
      rank["num_layers"] = stage.count;
      uint64_t kv_per_block = 0, state_per_request = 0;
      Json layers = Json::array();
      for (uint32_t id = stage.first; id < stage.end(); ++id) {
        const LayerSpec& l = m.layers[id];
        Json layer;
        layer["id"] = id;
        layer["kind"] = l.kindName();
        Json records = Json::array();
        for (Role role : layerRoles(l)) {
          const std::vector<Section> sections = recordSections(m, l, role);
          Json secs = Json::array();
          uint64_t bytes = 0;
          for (const Section& s : sections) {
            ASSIGN_OR_RETURN(UnitRange r, shardUnits(s.units, pc.tp, tp_rank, s.name));
            Json sj;
            sj["name"] = s.name;
            sj["units"] = s.units;
            sj["unit_bytes"] = s.unit_bytes;
            sj["first_unit"] = r.first;
            sj["local_units"] = r.count;
            secs.push_back(std::move(sj));
            bytes += uint64_t{r.count} * s.unit_bytes;
          }
          (role == Role::kKv ? kv_per_block : state_per_request) += bytes;
          Json rec;
          rec["role"] = roleName(role);
          rec["bytes"] = bytes;
          rec["sections"] = std::move(secs);
          records.push_back(std::move(rec));
        }
        layer["records"] = std::move(records);
        layers.push_back(std::move(layer));
      }
      // A kv record holds whole blocks of tokens_per_block tokens, so this divides exactly.
      rank["kv_bytes_per_token"] = kv_per_block / m.tokens_per_block;
      rank["kv_bytes_per_block"] = kv_per_block;
      rank["state_bytes_per_request"] = state_per_request;
      rank["layers"] = std::move(layers);
      if (layout) {
        ASSIGN_OR_RETURN(RankLayout rl,
                         buildEngineLayout(m, pc, tp_rank, pp_rank, *layout, blocks, slots));
        Json pools = Json::array();
        for (const PoolView& v : rl.views) {
          ASSIGN_OR_RETURN(Json pool, poolJson(m, rl, v));
          pools.push_back(std::move(pool));
        }
        rank["pools"] = std::move(pools);
        rank["state_groups"] = rl.state_groups;  // state ids a request has on the rank
        rank["joint_ids"] = rl.joint_ids;        // blocks and states from one id pool
      }
      ranks.push_back(std::move(rank));
    }
  }
  doc["ranks"] = std::move(ranks);
  return doc;
}

std::string str(const Json& j) { return j.is_string() ? j.get<std::string>() : j.dump(); }

void printHuman(const ModelSpec& m, const Json& doc) {
  uint32_t attention = 0, none = 0, mamba2 = 0, gdn = 0, mamba1 = 0;
  for (const LayerSpec& l : m.layers) {
    attention += l.hasAttention();
    mamba2 += l.recurrent == LayerKind::kMamba2;
    gdn += l.recurrent == LayerKind::kGdn;
    mamba1 += l.recurrent == LayerKind::kMamba1;
    none += !l.hasCache();
  }
  std::string counts;
  auto add = [&](uint32_t n, const char* what) {
    if (n == 0) return;
    counts += (counts.empty() ? "" : ", ") + std::to_string(n) + " " + what;
  };
  add(attention, "attention");
  add(mamba2, "mamba2");
  add(gdn, "gdn");
  add(mamba1, "mamba1");
  add(none, "without cache");
  std::printf("model %s (%s): %u layers (%s)\n", m.name.c_str(), m.architecture.c_str(),
              m.numLayers(), counts.c_str());
  std::printf("tp=%s pp=%s, kv %s, conv %s, ssm %s, %s tokens per block\n", str(doc["tp"]).c_str(),
              str(doc["pp"]).c_str(), str(doc["kv_dtype"]).c_str(), str(doc["conv_dtype"]).c_str(),
              str(doc["ssm_dtype"]).c_str(), str(doc["tokens_per_block"]).c_str());
  for (const Json& rank : doc["ranks"]) {
    const uint64_t first = rank["first_layer"].get<uint64_t>();
    const uint64_t count = rank["num_layers"].get<uint64_t>();
    std::printf(
        "\nrank %s (tp %s, pp %s): layers %llu-%llu, kv %s B/token (%s B/block), "
        "state %s B/request\n",
        str(rank["rank"]).c_str(), str(rank["tp_rank"]).c_str(), str(rank["pp_rank"]).c_str(),
        static_cast<unsigned long long>(first), static_cast<unsigned long long>(first + count - 1),
        str(rank["kv_bytes_per_token"]).c_str(), str(rank["kv_bytes_per_block"]).c_str(),
        str(rank["state_bytes_per_request"]).c_str());
    Table t({"layer", "kind", "role", "bytes", "sections: name units x unit_bytes [held units]"},
            {true, false, false, true, false});
    std::vector<uint32_t> cacheless;
    for (const Json& layer : rank["layers"]) {
      if (layer["records"].empty()) {
        cacheless.push_back(layer["id"].get<uint32_t>());
        continue;
      }
      bool first_record = true;
      for (const Json& rec : layer["records"]) {
        std::string secs;
        for (const Json& s : rec["sections"]) {
          const uint64_t lo = s["first_unit"].get<uint64_t>();
          const uint64_t hi = lo + s["local_units"].get<uint64_t>();
          if (!secs.empty()) secs += " | ";
          secs += str(s["name"]) + " " + str(s["units"]) + "x" + str(s["unit_bytes"]) + " [" +
                  std::to_string(lo) + "," + std::to_string(hi) + ")";
        }
        t.add({first_record ? str(layer["id"]) : "", first_record ? str(layer["kind"]) : "",
               str(rec["role"]), str(rec["bytes"]), secs});
        first_record = false;
      }
    }
    t.print(stdout, 2);
    if (!cacheless.empty()) {
      std::printf("  layers without cache: %s\n", formatIdList(cacheless).c_str());
    }
    if (rank.contains("pools")) {
      if (rank["joint_ids"].get<bool>()) {
        std::printf(
            "  pools (%s, %s blocks, states drawn from the blocks, state ids per "
            "request: %s):\n",
            str(doc["engine_layout"]).c_str(), str(doc["blocks"]).c_str(),
            str(rank["state_groups"]).c_str());
      } else {
        std::printf("  pools (%s, %s blocks, %s slots):\n", str(doc["engine_layout"]).c_str(),
                    str(doc["blocks"]).c_str(), str(doc["slots"]).c_str());
      }
      Table p({"region", "region_bytes", "role", "kind", "base", "index_stride", "layer_stride",
               "record_bytes", "layers", "indexed_by"},
              {false, true, false, false, true, true, true, true, false, false});
      for (const Json& v : rank["pools"]) {
        const std::string by = v.contains("state_group") && rank["state_groups"].get<int>() > 1
                                   ? "state " + str(v["state_group"])
                                   : str(v["indexed_by"]);
        p.add({str(v["region_id"]) + " " + str(v["region"]), str(v["region_bytes"]), str(v["role"]),
               str(v["kind"]), str(v["base"]), str(v["index_stride"]), str(v["layer_stride"]),
               str(v["record_bytes"]), formatIdList(v["layers"].get<std::vector<uint32_t>>()), by});
      }
      p.print(stdout, 4);
      for (const Json& v : rank["pools"]) {
        if (!v["record"]["described"].get<bool>()) continue;
        std::string dims;
        for (const Json& d : v["record"]["dims"]) {
          if (!dims.empty()) dims += ", ";
          dims += str(d["name"]) + " " + str(d["size"]) + " @" + str(d["stride"]);
        }
        std::printf("    %s %s record: %s (element %s B, span %s B)\n", str(v["region"]).c_str(),
                    str(v["role"]).c_str(), dims.c_str(), str(v["record"]["element_bytes"]).c_str(),
                    str(v["record"]["span"]).c_str());
      }
    }
  }
}

}  // namespace

void addDescribeCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "describe", "Show a model's per-rank cache records, sections and (--layout) pool views");
  auto opts = std::make_shared<DescribeOptions>();
  addModelOptions(cmd, &opts->model);
  addParallelSize(cmd, "--tp", &opts->tp, "Tensor-parallel size", 1);
  addParallelSize(cmd, "--pp", &opts->pp, "Pipeline-parallel size (even split of layers)", 1);
  cmd->add_option("--layout", opts->layout,
                  "Also show the pool views for this state layout: paged or layer-major");
  cmd->add_option("--engine", opts->engine,
                  "Also show the pool views as this engine keeps them: hxfer, trtllm-v1, "
                  "trtllm-v2, vllm, vllm-0.25, sglang (docs/layouts.md)");
  cmd->add_option("--kv-layout", opts->kv_layout,
                  "With --engine: KV order, nhd or hnd (trtllm-v2, vllm-0.25: inside a K or V "
                  "half; vllm: K and V side by side per token and head), cpu or cpu-amx (vllm)");
  cmd->add_option("--conv-layout", opts->conv_layout,
                  "With --engine: conv state order, sd or ds (vllm)");
  cmd->add_option("--shared-tensors", opts->shared_tensors,
                  "With --engine vllm: on for the hybrid manager's shared per-group tensors, "
                  "off (default) for one tensor per layer");
  cmd->add_option("--blocks", opts->blocks, "KV blocks per rank for --layout")->default_val(16);
  cmd->add_option("--slots", opts->slots, "State slots per rank for --layout")->default_val(4);
  cmd->add_flag("--json", opts->json, "Print JSON (top-level \"ranks\" array)");
  cmd->callback([opts] {
    auto fail = [](const Status& s) { throw CLI::RuntimeError(reportError(s)); };
    auto m = resolveModel(opts->model);
    if (!m.isOk()) fail(m.status());
    std::optional<EngineLayout> layout;
    if (!opts->engine.empty() || !opts->kv_layout.empty() || !opts->conv_layout.empty() ||
        !opts->shared_tensors.empty()) {
      const std::string engine = opts->engine.empty() ? "hxfer" : opts->engine;
      if (engine != "hxfer" && !opts->layout.empty()) {
        fail(InvalidArgument("--layout " + opts->layout +
                             ": a state layout applies to --engine hxfer only (" + engine +
                             " lays its state out its own way)"));
      }
      auto l = parseEngineLayout(engine, opts->kv_layout, opts->conv_layout, opts->layout,
                                 opts->shared_tensors);
      if (!l.isOk()) fail(l.status().withContext("--engine"));
      layout = *l;
    } else if (!opts->layout.empty()) {
      auto l = parseStateLayout(opts->layout);
      if (!l.isOk()) fail(l.status().withContext("--layout"));
      layout = EngineLayout{Engine::kHxfer, *l};
    }
    auto doc =
        describe(*m, ParallelConfig{opts->tp, opts->pp, {}}, layout, opts->blocks, opts->slots);
    if (!doc.isOk()) fail(doc.status());
    if (opts->json) {
      std::printf("%s\n", doc->dump(2).c_str());
    } else {
      printHuman(*m, *doc);
    }
  });
}

}  // namespace hxfer::cli
