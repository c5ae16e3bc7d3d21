#include "wire/rank_info.h"

#include <algorithm>
#include <set>
#include <string>

namespace hxfer::wire {

std::string_view instanceRoleName(InstanceRole r) {
  switch (r) {
    case InstanceRole::kContext:
      return "context";
    case InstanceRole::kGeneration:
      return "generation";
  }
  return "unknown";
}

StatusOr<InstanceRole> parseInstanceRole(std::string_view name) {
  if (name == "context" || name == "ctx" || name == "prefill") return InstanceRole::kContext;
  if (name == "generation" || name == "gen" || name == "decode") return InstanceRole::kGeneration;
  return InvalidArgument("unknown instance role '" + std::string(name) +
                         "' (expected context or generation)");
}

const Bytes* RankInfo::findKey(uint32_t region_id) const {
  for (const RegionKey& k : region_keys) {
    if (k.region_id == region_id) return &k.key;
  }
  return nullptr;
}

namespace {

std::string versionText(uint16_t major, uint16_t minor) {
  return std::to_string(major) + "." + std::to_string(minor);
}

Status over(const std::string& field, uint64_t value, uint64_t limit) {
  return Corruption(field + "=" + std::to_string(value) + " exceeds the limit " +
                    std::to_string(limit));
}

Status checkRecordLimits(const RecordLayout& r, const std::string& path) {
  if (r.element_bytes == 0 || r.element_bytes > kMaxElementBytes) {
    return Corruption(path + "element_bytes=" + std::to_string(r.element_bytes) +
                      " is not in [1, " + std::to_string(kMaxElementBytes) + "]");
  }
  if (r.dims.empty() || r.dims.size() > kMaxRecordDims) {
    return Corruption(path + "dims.count=" + std::to_string(r.dims.size()) + " is not in [1, " +
                      std::to_string(kMaxRecordDims) + "]");
  }
  for (size_t i = 0; i < r.dims.size(); ++i) {
    const RecordDim& d = r.dims[i];
    const std::string at = path + "dims[" + std::to_string(i) + "].";
    if (d.name.size() > kMaxNameBytes)
      return over(at + "name.length", d.name.size(), kMaxNameBytes);
    if (d.stride > kMaxRegionBytes) return over(at + "stride", d.stride, kMaxRegionBytes);
  }
  return OkStatus();
}

// The limits the decoder enforces while reading, re-checked on a whole value so that a locally
// built RankInfo gets the same verdict a peer would give it.
Status checkLayoutLimits(const RankLayout& l, const std::string& path) {
  if (l.tp > kMaxTp) return over(path + "tp", l.tp, kMaxTp);
  if (l.pp > kMaxPp) return over(path + "pp", l.pp, kMaxPp);
  if (l.layers_per_stage.size() > kMaxPp) {
    return over(path + "layers_per_stage.count", l.layers_per_stage.size(), kMaxPp);
  }
  uint64_t total_layers = 0;
  for (uint32_t n : l.layers_per_stage) total_layers += n;
  if (total_layers > kMaxLayers)
    return over(path + "layers_per_stage(sum)", total_layers, kMaxLayers);
  if (l.tokens_per_block > kMaxTokensPerBlock) {
    return over(path + "tokens_per_block", l.tokens_per_block, kMaxTokensPerBlock);
  }
  if (l.regions.size() > kMaxRegions)
    return over(path + "regions.count", l.regions.size(), kMaxRegions);
  for (size_t i = 0; i < l.regions.size(); ++i) {
    const RegionSpec& r = l.regions[i];
    const std::string at = path + "regions[" + std::to_string(i) + "].";
    if (r.length > kMaxRegionBytes) return over(at + "length", r.length, kMaxRegionBytes);
    if (r.name.size() > kMaxNameBytes)
      return over(at + "name.length", r.name.size(), kMaxNameBytes);
  }
  if (l.views.size() > kMaxViews) return over(path + "views.count", l.views.size(), kMaxViews);
  if (l.state_groups > kMaxStateGroups) {
    return over(path + "state_groups", l.state_groups, kMaxStateGroups);
  }
  for (size_t i = 0; i < l.views.size(); ++i) {
    const PoolView& v = l.views[i];
    const std::string at = path + "views[" + std::to_string(i) + "].";
    if (v.layers.size() > kMaxLayers) return over(at + "layers.count", v.layers.size(), kMaxLayers);
    if (v.sections.size() > kMaxSections) {
      return over(at + "sections.count", v.sections.size(), kMaxSections);
    }
    // The whole (unsharded) record must be representable: localRecordBytes sums without
    // overflow checks, so a hostile unit size could otherwise wrap around to a small value.
    uint64_t global = 0;
    for (size_t s = 0; s < v.sections.size(); ++s) {
      const Section& sec = v.sections[s];
      const std::string sat = at + "sections[" + std::to_string(s) + "].";
      if (sec.name.size() > kMaxNameBytes) {
        return over(sat + "name.length", sec.name.size(), kMaxNameBytes);
      }
      if (sec.unit_bytes > kMaxRegionBytes) {
        return over(sat + "unit_bytes", sec.unit_bytes, kMaxRegionBytes);
      }
      uint64_t bytes = 0;
      if (__builtin_mul_overflow(uint64_t{sec.units}, sec.unit_bytes, &bytes) ||
          __builtin_add_overflow(global, bytes, &global) || global > kMaxRegionBytes) {
        return Corruption(sat + "units=" + std::to_string(sec.units) + " x unit_bytes=" +
                          std::to_string(sec.unit_bytes) + " makes the record larger than " +
                          std::to_string(kMaxRegionBytes) + " bytes");
      }
    }
    if (v.record) RETURN_IF_ERROR(checkRecordLimits(*v.record, at + "record."));
    const std::pair<const char*, uint64_t> sizes[] = {{"record_bytes", v.record_bytes},
                                                      {"base", v.base},
                                                      {"index_stride", v.index_stride},
                                                      {"layer_stride", v.layer_stride}};
    for (const auto& [field, value] : sizes) {
      if (value > kMaxRegionBytes) return over(at + field, value, kMaxRegionBytes);
    }
  }
  return OkStatus();
}

void encodeLayout(const RankLayout& l, Bytes& out) {
  putVarint64(out, l.tp);
  putVarint64(out, l.pp);
  putVarint64(out, l.tp_rank);
  putVarint64(out, l.pp_rank);
  putVarint64(out, l.layers_per_stage.size());
  for (uint32_t n : l.layers_per_stage) putVarint64(out, n);
  putFixed8(out, static_cast<uint8_t>(l.state_layout));
  putVarint64(out, l.tokens_per_block);
  putFixed8(out, static_cast<uint8_t>(l.kv_dtype));
  putFixed8(out, static_cast<uint8_t>(l.conv_dtype));
  putFixed8(out, static_cast<uint8_t>(l.ssm_dtype));
  putFixed64(out, l.model_fingerprint);
  putVarint64(out, l.num_blocks);
  putVarint64(out, l.num_slots);
  putVarint64(out, l.regions.size());
  for (const RegionSpec& r : l.regions) {
    putVarint64(out, r.id);
    putVarint64(out, r.length);
    putString(out, r.name);
  }
  putVarint64(out, l.views.size());
  for (const PoolView& v : l.views) {
    putFixed8(out, static_cast<uint8_t>(v.role));
    putFixed8(out, static_cast<uint8_t>(v.kind));
    putVarint64(out, v.layers.size());
    for (uint32_t id : v.layers) putVarint64(out, id);
    putVarint64(out, v.sections.size());
    for (const Section& s : v.sections) {
      putString(out, s.name);
      putVarint64(out, s.units);
      putVarint64(out, s.unit_bytes);
    }
    putVarint64(out, v.record_bytes);
    putVarint64(out, v.region_id);
    putVarint64(out, v.base);
    putVarint64(out, v.index_stride);
    putVarint64(out, v.layer_stride);
    putVarint64(out, v.num_indices);
  }
}

Status readLayout(WireReader& r, RankLayout* l) {
  auto scope = r.scope("layout.");
  RETURN_IF_ERROR(r.varint32("tp", kMaxTp, &l->tp));
  RETURN_IF_ERROR(r.varint32("pp", kMaxPp, &l->pp));
  RETURN_IF_ERROR(r.varint32("tp_rank", kMaxTp, &l->tp_rank));
  RETURN_IF_ERROR(r.varint32("pp_rank", kMaxPp, &l->pp_rank));
  size_t n = 0;
  RETURN_IF_ERROR(r.count("layers_per_stage.count", kMaxPp, 1, &n));
  l->layers_per_stage.resize(n);
  for (size_t i = 0; i < n; ++i) {
    RETURN_IF_ERROR(r.varint32("layers_per_stage", kMaxLayers, &l->layers_per_stage[i]));
  }
  uint8_t e = 0;
  RETURN_IF_ERROR(r.enumByte("state_layout", kMaxStateLayout, &e));
  l->state_layout = static_cast<StateLayout>(e);
  RETURN_IF_ERROR(r.varint32("tokens_per_block", kMaxTokensPerBlock, &l->tokens_per_block));
  RETURN_IF_ERROR(r.enumByte("kv_dtype", kMaxDType, &e));
  l->kv_dtype = static_cast<DType>(e);
  RETURN_IF_ERROR(r.enumByte("conv_dtype", kMaxDType, &e));
  l->conv_dtype = static_cast<DType>(e);
  RETURN_IF_ERROR(r.enumByte("ssm_dtype", kMaxDType, &e));
  l->ssm_dtype = static_cast<DType>(e);
  RETURN_IF_ERROR(r.u64Fixed("model_fingerprint", &l->model_fingerprint));
  RETURN_IF_ERROR(r.varint32("num_blocks", UINT32_MAX, &l->num_blocks));
  RETURN_IF_ERROR(r.varint32("num_slots", UINT32_MAX, &l->num_slots));

  // Smallest region: id, length, empty name = 3 bytes.
  RETURN_IF_ERROR(r.count("regions.count", kMaxRegions, 3, &n));
  l->regions.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto el = r.element("regions", i);
    RegionSpec& g = l->regions[i];
    RETURN_IF_ERROR(r.varint32("id", UINT32_MAX, &g.id));
    RETURN_IF_ERROR(r.varint("length", kMaxRegionBytes, &g.length));
    RETURN_IF_ERROR(r.string("name", kMaxNameBytes, &g.name));
  }

  // Smallest view: 2 enum bytes, 2 counts, 6 varints = 10 bytes.
  RETURN_IF_ERROR(r.count("views.count", kMaxViews, 10, &n));
  l->views.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto el = r.element("views", i);
    PoolView& v = l->views[i];
    RETURN_IF_ERROR(r.enumByte("role", kMaxRole, &e));
    v.role = static_cast<Role>(e);
    RETURN_IF_ERROR(r.enumByte("kind", kMaxLayerKind, &e));
    v.kind = static_cast<LayerKind>(e);
    size_t m = 0;
    RETURN_IF_ERROR(r.count("layers.count", kMaxLayers, 1, &m));
    v.layers.resize(m);
    for (size_t j = 0; j < m; ++j) {
      RETURN_IF_ERROR(r.varint32("layers", kMaxLayers - 1, &v.layers[j]));
    }
    // Smallest section: empty name, units, unit_bytes = 3 bytes.
    RETURN_IF_ERROR(r.count("sections.count", kMaxSections, 3, &m));
    v.sections.resize(m);
    for (size_t j = 0; j < m; ++j) {
      auto sel = r.element("sections", j);
      Section& s = v.sections[j];
      RETURN_IF_ERROR(r.string("name", kMaxNameBytes, &s.name));
      RETURN_IF_ERROR(r.varint32("units", UINT32_MAX, &s.units));
      RETURN_IF_ERROR(r.varint("unit_bytes", kMaxRegionBytes, &s.unit_bytes));
    }
    RETURN_IF_ERROR(r.varint("record_bytes", kMaxRegionBytes, &v.record_bytes));
    RETURN_IF_ERROR(r.varint32("region_id", UINT32_MAX, &v.region_id));
    RETURN_IF_ERROR(r.varint("base", kMaxRegionBytes, &v.base));
    RETURN_IF_ERROR(r.varint("index_stride", kMaxRegionBytes, &v.index_stride));
    RETURN_IF_ERROR(r.varint("layer_stride", kMaxRegionBytes, &v.layer_stride));
    RETURN_IF_ERROR(r.varint32("num_indices", UINT32_MAX, &v.num_indices));
  }
  return OkStatus();
}

// One entry's view index of a list by ascending view (records, id groups): below the layout's
// view count and above the previous entry's (`next_view` is one past it, and is advanced).
Status readViewIndex(WireReader& r, const RankLayout& l, size_t* next_view, uint32_t* view) {
  RETURN_IF_ERROR(r.varint32("view", kMaxViews, view));
  if (*view < *next_view || *view >= l.views.size()) {
    return Corruption(
        r.name("view") + "=" + std::to_string(*view) +
        (*view >= l.views.size()
             ? " names no view (the layout has " + std::to_string(l.views.size()) + ")"
             : " is not above the previous entry's view " + std::to_string(*next_view - 1)));
  }
  *next_view = size_t{*view} + 1;
  return OkStatus();
}

// rank_info.records (minor 3): the described records of the views, by ascending view index.
Status readRecords(WireReader& r, RankLayout* l) {
  size_t n = 0;
  // Smallest entry: view, element_bytes, one dim of an empty name, size and stride = 6 bytes.
  RETURN_IF_ERROR(r.count("records.count", l->views.size(), 6, &n));
  size_t next_view = 0;  // views below it have been given a record or skipped
  for (size_t i = 0; i < n; ++i) {
    auto el = r.element("records", i);
    uint32_t view = 0;
    RETURN_IF_ERROR(readViewIndex(r, *l, &next_view, &view));
    RecordLayout rec;
    RETURN_IF_ERROR(r.varint32("element_bytes", kMaxElementBytes, &rec.element_bytes));
    size_t dims = 0;
    // Smallest dim: empty name, size, stride = 3 bytes.
    RETURN_IF_ERROR(r.count("dims.count", kMaxRecordDims, 3, &dims));
    rec.dims.resize(dims);
    for (size_t d = 0; d < dims; ++d) {
      auto del = r.element("dims", d);
      RETURN_IF_ERROR(r.string("name", kMaxNameBytes, &rec.dims[d].name));
      RETURN_IF_ERROR(r.varint32("size", UINT32_MAX, &rec.dims[d].size));
      RETURN_IF_ERROR(r.varint("stride", kMaxRegionBytes, &rec.dims[d].stride));
    }
    l->views[view].record = std::move(rec);
  }
  return OkStatus();
}

// rank_info.id_groups (minor 5): joint ids, state groups, and the views of state group > 0 by
// ascending view index.
Status readIdGroups(WireReader& r, RankLayout* l) {
  RETURN_IF_ERROR(r.boolean("joint_ids", &l->joint_ids));
  RETURN_IF_ERROR(r.varint32("state_groups", kMaxStateGroups, &l->state_groups));
  size_t n = 0;
  // Smallest entry: view, group = 2 bytes.
  RETURN_IF_ERROR(r.count("state_group_views.count", l->views.size(), 2, &n));
  size_t next_view = 0;
  for (size_t i = 0; i < n; ++i) {
    auto el = r.element("state_group_views", i);
    uint32_t view = 0;
    RETURN_IF_ERROR(readViewIndex(r, *l, &next_view, &view));
    uint32_t group = 0;
    RETURN_IF_ERROR(r.varint32("state_group", kMaxStateGroups - 1, &group));
    if (group == 0) return Corruption(r.name("state_group") + "=0 is the default, never listed");
    l->views[view].state_group = group;
  }
  return OkStatus();
}

// Whether `l` uses what minor 5 added: one id pool, or state ids per group.
bool usesIdGroups(const RankLayout& l) {
  return l.joint_ids || l.state_groups != 1 ||
         std::any_of(l.views.begin(), l.views.end(),
                     [](const PoolView& v) { return v.state_group != 0; });
}

Status checkRankInfoAt(const RankInfo& info, const std::string& path) {
  if (info.version_major != kWireVersionMajor) {
    return Incompatible(path + "version: peer speaks " +
                        versionText(info.version_major, info.version_minor) +
                        ", this build speaks " + versionText(kWireVersionMajor, kWireVersionMinor) +
                        " (major versions differ)");
  }
  if (info.instance_id.size() > kMaxIdBytes) {
    return over(path + "instance_id.length", info.instance_id.size(), kMaxIdBytes);
  }
  if (static_cast<uint8_t>(info.role) > kMaxInstanceRole) {
    return Corruption(path + "role: unknown value " +
                      std::to_string(static_cast<unsigned>(info.role)));
  }
  if (info.address.size() > kMaxAddressBytes) {
    return over(path + "address.length", info.address.size(), kMaxAddressBytes);
  }
  if (info.version_minor < kRecordsMinor) {
    for (size_t i = 0; i < info.layout.views.size(); ++i) {
      if (info.layout.views[i].record) {
        return Corruption(
            path + "layout.views[" + std::to_string(i) +
            "].record: a described record needs version_minor >= " + std::to_string(kRecordsMinor) +
            " (this rank_info says " + std::to_string(info.version_minor) + ")");
      }
    }
  }
  if (info.version_minor < kStateGroupsMinor && usesIdGroups(info.layout)) {
    return Corruption(path + "layout: one id pool or state ids per group need version_minor >= " +
                      std::to_string(kStateGroupsMinor) + " (this rank_info says " +
                      std::to_string(info.version_minor) + ")");
  }
  RETURN_IF_ERROR(checkLayoutLimits(info.layout, path + "layout."));
  Status valid = info.layout.validate();
  if (!valid.isOk()) return Corruption(path + "layout: " + valid.message());
  if (info.region_keys.size() > kMaxRegions) {
    return over(path + "region_keys.count", info.region_keys.size(), kMaxRegions);
  }
  for (size_t i = 0; i < info.region_keys.size(); ++i) {
    const RegionKey& k = info.region_keys[i];
    const std::string at = path + "region_keys[" + std::to_string(i) + "].";
    if (k.key.size() > kMaxKeyBytes) return over(at + "key.length", k.key.size(), kMaxKeyBytes);
    if (!info.layout.findRegion(k.region_id)) {
      return Corruption(at + "region_id=" + std::to_string(k.region_id) +
                        " names no region of the layout");
    }
    for (size_t j = 0; j < i; ++j) {
      if (info.region_keys[j].region_id == k.region_id) {
        return Corruption(at + "region_id=" + std::to_string(k.region_id) +
                          " has a second key (first at region_keys[" + std::to_string(j) + "])");
      }
    }
  }
  return OkStatus();
}

}  // namespace

Status checkRankInfo(const RankInfo& info) { return checkRankInfoAt(info, "rank_info."); }

Status checkPeerReadsLayout(const RankLayout& self, uint16_t peer_minor) {
  if (peer_minor < kStateGroupsMinor && usesIdGroups(self)) {
    return Incompatible("peer speaks " + versionText(kWireVersionMajor, peer_minor) +
                        ", which knows one state id per request and separate block and state "
                        "pools, but this rank's layout draws them from one pool with " +
                        std::to_string(self.state_groups) +
                        " state ids per request (vLLM's shared tensors); that needs " +
                        versionText(kWireVersionMajor, kStateGroupsMinor) + " or later");
  }
  if (peer_minor < kSplitDimsMinor) {
    for (size_t i = 0; i < self.views.size(); ++i) {
      const PoolView& v = self.views[i];
      if (!v.record) continue;
      std::set<std::string> names;
      for (const RecordDim& d : v.record->dims) {
        if (names.insert(d.name).second) continue;
        return Incompatible("peer speaks " + versionText(kWireVersionMajor, peer_minor) +
                            ", which reads every record dim once, but this rank's views[" +
                            std::to_string(i) + "] splits dim " + d.name + " (" +
                            v.record->toString() + "); split dims need " +
                            versionText(kWireVersionMajor, kSplitDimsMinor) + " or later");
      }
    }
  }
  if (peer_minor >= kRecordsMinor) return OkStatus();
  for (size_t i = 0; i < self.views.size(); ++i) {
    const PoolView& v = self.views[i];
    if (!v.record) continue;
    return Incompatible("peer speaks " + versionText(kWireVersionMajor, peer_minor) +
                        ", which reads every record in hxfer's own order, but this rank's views[" +
                        std::to_string(i) + "] (" + std::string(roleName(v.role)) + " of layer " +
                        std::to_string(v.layers.front()) + ") is an engine layout (" +
                        v.record->toString() + "); engine layouts need " +
                        versionText(kWireVersionMajor, kRecordsMinor) + " or later");
  }
  return OkStatus();
}

void encodeRankInfo(const RankInfo& info, Bytes& out) {
  putFixed16(out, info.version_major);
  putFixed16(out, info.version_minor);
  putString(out, info.instance_id);
  putFixed8(out, static_cast<uint8_t>(info.role));
  putBytes(out, info.address);
  encodeLayout(info.layout, out);
  putVarint64(out, info.region_keys.size());
  for (const RegionKey& k : info.region_keys) {
    putVarint64(out, k.region_id);
    putBytes(out, k.key);
  }
  if (info.version_minor < kRecordsMinor) return;
  const std::vector<PoolView>& views = info.layout.views;
  putVarint64(out, std::count_if(views.begin(), views.end(),
                                 [](const PoolView& v) { return v.record.has_value(); }));
  for (size_t i = 0; i < views.size(); ++i) {
    if (!views[i].record) continue;
    const RecordLayout& r = *views[i].record;
    putVarint64(out, i);
    putVarint64(out, r.element_bytes);
    putVarint64(out, r.dims.size());
    for (const RecordDim& d : r.dims) {
      putString(out, d.name);
      putVarint64(out, d.size);
      putVarint64(out, d.stride);
    }
  }
  if (info.version_minor < kStateGroupsMinor) return;
  putFixed8(out, info.layout.joint_ids ? 1 : 0);
  putVarint64(out, info.layout.state_groups);
  putVarint64(out, std::count_if(views.begin(), views.end(),
                                 [](const PoolView& v) { return v.state_group != 0; }));
  for (size_t i = 0; i < views.size(); ++i) {
    if (views[i].state_group == 0) continue;
    putVarint64(out, i);
    putVarint64(out, views[i].state_group);
  }
}

Bytes encodeRankInfo(const RankInfo& info) {
  Bytes out;
  encodeRankInfo(info, out);
  return out;
}

namespace internal {

StatusOr<RankInfo> decodeRankInfo(std::span<const uint8_t> in, std::string path) {
  WireReader r(in, path);
  RankInfo info;
  RETURN_IF_ERROR(r.u16("version_major", &info.version_major));
  RETURN_IF_ERROR(r.u16("version_minor", &info.version_minor));
  if (info.version_major != kWireVersionMajor) {
    // Nothing after the version is readable under another major.
    return Incompatible(path + "version: peer speaks " +
                        versionText(info.version_major, info.version_minor) +
                        ", this build speaks " + versionText(kWireVersionMajor, kWireVersionMinor) +
                        " (major versions differ)");
  }
  RETURN_IF_ERROR(r.string("instance_id", kMaxIdBytes, &info.instance_id));
  uint8_t e = 0;
  RETURN_IF_ERROR(r.enumByte("role", kMaxInstanceRole, &e));
  info.role = static_cast<InstanceRole>(e);
  RETURN_IF_ERROR(r.bytes("address", kMaxAddressBytes, &info.address));
  RETURN_IF_ERROR(readLayout(r, &info.layout));
  size_t n = 0;
  // Smallest key entry: region id, empty key = 2 bytes.
  RETURN_IF_ERROR(r.count("region_keys.count", kMaxRegions, 2, &n));
  info.region_keys.resize(n);
  for (size_t i = 0; i < n; ++i) {
    auto el = r.element("region_keys", i);
    RETURN_IF_ERROR(r.varint32("region_id", UINT32_MAX, &info.region_keys[i].region_id));
    RETURN_IF_ERROR(r.bytes("key", kMaxKeyBytes, &info.region_keys[i].key));
  }
  if (info.version_minor >= kRecordsMinor) RETURN_IF_ERROR(readRecords(r, &info.layout));
  if (info.version_minor >= kStateGroupsMinor) RETURN_IF_ERROR(readIdGroups(r, &info.layout));
  // A newer minor may append fields this build does not know: skip them. Same or older minor:
  // the body must end exactly here.
  if (info.version_minor > kWireVersionMinor) {
    r.skipRest();
  } else {
    RETURN_IF_ERROR(r.expectEnd("end"));
  }
  RETURN_IF_ERROR(checkRankInfoAt(info, path));
  return info;
}

}  // namespace internal

StatusOr<RankInfo> decodeRankInfo(std::span<const uint8_t> in) {
  return internal::decodeRankInfo(in, "rank_info.");
}

}  // namespace hxfer::wire
