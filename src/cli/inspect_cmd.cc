// `hxfer inspect FILE [--json]`: decodes one wire frame (any message type) and prints it. The
// JSON form is built first and the human form is printed from it, so both always agree. Bytes
// fields print as hex; an auth token prints as its length only. Undecodable input exits 1
// with one line naming the field that is wrong.
#include <cstdio>
#include <memory>
#include <string>
#include <variant>

#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "cli/model_options.h"
#include "cli/table.h"
#include "wire/messages.h"

namespace hxfer::cli {
namespace {

using Json = nlohmann::ordered_json;

std::string hex(std::span<const uint8_t> b) {
  static const char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(2 * b.size());
  for (uint8_t c : b) {
    s += kDigits[c >> 4];
    s += kDigits[c & 15];
  }
  return s;
}

std::string hex64(uint64_t v) {
  char text[19];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(v));
  return text;
}

Json statusJson(const Status& s) {
  Json j;
  j["code"] = statusCodeName(s.code());
  j["message"] = s.message();
  return j;
}

Json layoutJson(const wire::RankInfo& info) {
  const RankLayout& l = info.layout;
  Json j;
  j["tp"] = l.tp;
  j["pp"] = l.pp;
  j["tp_rank"] = l.tp_rank;
  j["pp_rank"] = l.pp_rank;
  j["layers_per_stage"] = l.layers_per_stage;
  j["state_layout"] = stateLayoutName(l.state_layout);
  j["tokens_per_block"] = l.tokens_per_block;
  j["kv_dtype"] = dtypeName(l.kv_dtype);
  j["conv_dtype"] = dtypeName(l.conv_dtype);
  j["ssm_dtype"] = dtypeName(l.ssm_dtype);
  j["model_fingerprint"] = hex64(l.model_fingerprint);
  j["num_blocks"] = l.num_blocks;
  j["num_slots"] = l.num_slots;
  j["state_groups"] = l.state_groups;
  j["joint_ids"] = l.joint_ids;
  Json regions = Json::array();
  for (const RegionSpec& r : l.regions) {
    Json rj;
    rj["id"] = r.id;
    rj["name"] = r.name;
    rj["length"] = r.length;
    const Bytes* key = info.findKey(r.id);
    rj["key"] = key ? Json(hex(*key)) : Json(nullptr);
    regions.push_back(std::move(rj));
  }
  j["regions"] = std::move(regions);
  Json views = Json::array();
  for (const PoolView& v : l.views) {
    Json vj;
    vj["role"] = roleName(v.role);
    vj["kind"] = layerKindName(v.kind);
    vj["layers"] = v.layers;
    Json sections = Json::array();
    for (const Section& s : v.sections) {
      sections.push_back(Json{{"name", s.name}, {"units", s.units}, {"unit_bytes", s.unit_bytes}});
    }
    vj["sections"] = std::move(sections);
    vj["record_bytes"] = v.record_bytes;
    vj["region_id"] = v.region_id;
    vj["base"] = v.base;
    vj["index_stride"] = v.index_stride;
    vj["layer_stride"] = v.layer_stride;
    vj["num_indices"] = v.num_indices;
    if (v.role != Role::kKv) vj["state_group"] = v.state_group;
    if (v.record) {
      Json dims = Json::array();
      for (const RecordDim& d : v.record->dims) {
        dims.push_back(Json{{"name", d.name}, {"size", d.size}, {"stride", d.stride}});
      }
      vj["record"] = Json{{"element_bytes", v.record->element_bytes}, {"dims", std::move(dims)}};
    }
    views.push_back(std::move(vj));
  }
  j["views"] = std::move(views);
  return j;
}

Json bodyJson(const wire::Hello& m) {
  const wire::RankInfo& i = m.rank_info;
  Json r;
  r["version"] = std::to_string(i.version_major) + "." + std::to_string(i.version_minor);
  r["instance_id"] = i.instance_id;
  r["role"] = wire::instanceRoleName(i.role);
  r["rank"] = i.globalRank();
  r["address"] = hex(i.address);
  r["layout"] = layoutJson(i);
  Json j;
  j["rank_info"] = std::move(r);
  j["auth_token_bytes"] = m.auth_token.size();  // never the secret itself
  j["incarnation"] = m.incarnation;
  return j;
}

Json bodyJson(const wire::TransferRequest& m) {
  Json j;
  j["request_id"] = m.request_id;
  j["gen_tp_rank"] = m.gen_tp_rank;
  j["gen_pp_rank"] = m.gen_pp_rank;
  j["dst_block_ids"] = m.dst_block_ids;
  j["dst_slot"] = m.dst_slot ? Json(*m.dst_slot) : Json(nullptr);
  j["first_block"] = m.first_block;
  j["num_tokens"] = m.num_tokens;
  j["aux"] = hex(m.aux);
  j["epoch"] = m.epoch;
  j["staging"] = m.staging ? Json{{"region", m.staging->region},
                                  {"offset", m.staging->offset},
                                  {"bytes", m.staging->bytes}}
                           : Json(nullptr);
  j["dst_group_slots"] = m.dst_group_slots;
  return j;
}

Json bodyJson(const wire::TransferDone& m) {
  Json j;
  j["request_id"] = m.request_id;
  j["status"] = statusJson(m.status);
  j["bytes"] = m.bytes;
  j["checksum"] = m.checksum ? Json(hex64(*m.checksum)) : Json(nullptr);
  j["aux"] = hex(m.aux);
  j["epoch"] = m.epoch;
  return j;
}

Json bodyJson(const wire::Cancel& m) {
  Json j;
  j["request_id"] = m.request_id;
  j["reason"] = m.reason;
  j["epoch"] = m.epoch;
  return j;
}

Json bodyJson(const wire::Error& m) {
  Json j;
  j["status"] = statusJson(m.status);
  return j;
}

Json messageJson(const wire::Message& m, size_t frame_bytes) {
  Json j;
  j["type"] = wire::messageTypeName(wire::messageType(m));
  j["frame_bytes"] = frame_bytes;
  Json body = std::visit([](const auto& v) { return bodyJson(v); }, m);
  for (auto& [key, value] : body.items()) j[key] = value;
  return j;
}

// Strings from the wire may hold any bytes; invalid UTF-8 prints as U+FFFD.
std::string dump(const Json& j, int indent = -1) {
  return j.dump(indent, ' ', false, Json::error_handler_t::replace);
}

std::string str(const Json& j) { return j.is_string() ? j.get<std::string>() : dump(j); }

void printHello(const Json& j) {
  const Json& r = j["rank_info"];
  const Json& l = r["layout"];
  std::printf("hello: %s bytes, auth token %s, incarnation %s\n", str(j["frame_bytes"]).c_str(),
              j["auth_token_bytes"].get<uint64_t>() ? "present" : "absent",
              str(j["incarnation"]).c_str());
  std::printf("  rank_info %s: instance %s, role %s, rank %s (tp %s/%s, pp %s/%s)\n",
              str(r["version"]).c_str(), str(r["instance_id"]).c_str(), str(r["role"]).c_str(),
              str(r["rank"]).c_str(), str(l["tp_rank"]).c_str(), str(l["tp"]).c_str(),
              str(l["pp_rank"]).c_str(), str(l["pp"]).c_str());
  std::printf("  address %s\n", r["address"].get<std::string>().empty()
                                    ? "(none)"
                                    : ("hex " + str(r["address"])).c_str());
  std::printf("  layers per stage %s, %s layout, %s tokens per block, kv %s, conv %s, ssm %s\n",
              str(l["layers_per_stage"]).c_str(), str(l["state_layout"]).c_str(),
              str(l["tokens_per_block"]).c_str(), str(l["kv_dtype"]).c_str(),
              str(l["conv_dtype"]).c_str(), str(l["ssm_dtype"]).c_str());
  std::printf("  model fingerprint %s, %s blocks, %s slots\n", str(l["model_fingerprint"]).c_str(),
              str(l["num_blocks"]).c_str(), str(l["num_slots"]).c_str());
  if (l["joint_ids"].get<bool>() || l["state_groups"].get<int>() != 1) {
    std::printf("  ids: %s, %s state ids per request (a view's state group picks one)\n",
                l["joint_ids"].get<bool>() ? "blocks and states from one pool" : "separate pools",
                str(l["state_groups"]).c_str());
  }
  Table regions({"region", "name", "length", "key"}, {true, false, true, false});
  for (const Json& g : l["regions"]) {
    regions.add(
        {str(g["id"]), str(g["name"]), str(g["length"]), g["key"].is_null() ? "-" : str(g["key"])});
  }
  regions.print(stdout, 2);
  Table views({"view", "role", "kind", "region", "base", "index_stride", "layer_stride",
               "record_bytes", "indices", "layers", "group", "sections"},
              {true, false, false, true, true, true, true, true, true, false, true, false});
  size_t i = 0;
  for (const Json& v : l["views"]) {
    std::string secs;
    for (const Json& s : v["sections"]) {
      if (!secs.empty()) secs += " | ";
      secs += str(s["name"]) + " " + str(s["units"]) + "x" + str(s["unit_bytes"]);
    }
    views.add({std::to_string(i++), str(v["role"]), str(v["kind"]), str(v["region_id"]),
               str(v["base"]), str(v["index_stride"]), str(v["layer_stride"]),
               str(v["record_bytes"]), str(v["num_indices"]),
               formatIdList(v["layers"].get<std::vector<uint32_t>>()),
               v.contains("state_group") ? str(v["state_group"]) : "-", secs});
  }
  views.print(stdout, 2);
  // Engine layouts: where each element of a described record lies (docs/layouts.md).
  i = 0;
  for (const Json& v : l["views"]) {
    const size_t view = i++;
    if (!v.contains("record")) continue;
    std::string dims;
    for (const Json& d : v["record"]["dims"]) {
      if (!dims.empty()) dims += ", ";
      dims += str(d["name"]) + " " + str(d["size"]) + " @" + str(d["stride"]);
    }
    std::printf("  view %zu record: %s (element %s B)\n", view, dims.c_str(),
                str(v["record"]["element_bytes"]).c_str());
  }
}

void printHuman(const Json& j) {
  if (j["type"] == "hello") return printHello(j);
  std::printf("%s: %s bytes\n", str(j["type"]).c_str(), str(j["frame_bytes"]).c_str());
  for (const auto& [key, value] : j.items()) {
    if (key == "type" || key == "frame_bytes") continue;
    std::string text = str(value);
    if (value.is_object() && value.contains("code")) {
      text =
          str(value["code"]) + (str(value["message"]).empty() ? "" : ": " + str(value["message"]));
    } else if (value.is_null()) {
      text = "-";
    }
    std::printf("  %-14s %s\n", key.c_str(), text.c_str());
  }
}

StatusOr<Bytes> readFile(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return NotFound("cannot open " + path);
  Bytes bytes;
  uint8_t buf[65536];
  size_t n;
  // A frame is at most kMaxFrameBodyBytes plus its header and trailer; read one byte more
  // so that a longer file is reported as trailing bytes, not silently cut.
  const size_t cap =
      wire::kMaxFrameBodyBytes + wire::kFrameHeaderBytes + wire::kFrameTrailerBytes + 1;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0 && bytes.size() < cap) {
    bytes.insert(bytes.end(), buf, buf + n);
  }
  const bool failed = std::ferror(f);
  std::fclose(f);
  if (failed) return Unavailable("reading " + path + " failed");
  return bytes;
}

}  // namespace

void addInspectCommand(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect", "Decode a wire message (e.g. from `hxfer metadata`)");
  auto file = std::make_shared<std::string>();
  auto json = std::make_shared<bool>(false);
  cmd->add_option("file", *file, "File holding one encoded frame")->required();
  cmd->add_flag("--json", *json, "Print JSON");
  cmd->callback([file, json] {
    auto fail = [](const Status& s) { throw CLI::RuntimeError(reportError(s)); };
    auto bytes = readFile(*file);
    if (!bytes.isOk()) fail(bytes.status());
    auto message = wire::decodeMessage(*bytes);
    if (!message.isOk()) fail(message.status().withContext(*file));
    const Json j = messageJson(*message, bytes->size());
    if (*json) {
      std::printf("%s\n", dump(j, 2).c_str());
    } else {
      printHuman(j);
    }
  });
}

}  // namespace hxfer::cli
