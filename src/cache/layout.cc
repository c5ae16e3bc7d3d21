#include "cache/layout.h"

#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

#include "cache/record_layout.h"

namespace hxfer {

std::string_view stateLayoutName(StateLayout l) {
  switch (l) {
    case StateLayout::kPaged:
      return "paged";
    case StateLayout::kLayerMajor:
      return "layer-major";
  }
  return "unknown";
}

StatusOr<StateLayout> parseStateLayout(std::string_view name) {
  if (name == "paged" || name == "v2" || name == "slot-major") return StateLayout::kPaged;
  if (name == "layer-major" || name == "legacy") return StateLayout::kLayerMajor;
  return InvalidArgument("unknown state layout '" + std::string(name) +
                         "' (expected paged or layer-major)");
}

namespace {

// Layers whose records of one kind share a pool: same kind, same sections for every role.
struct Group {
  LayerKind kind;
  std::vector<Section> kv, conv, ssm;
  std::vector<uint32_t> layers;
};

bool sameShape(const Group& g, LayerKind kind, const std::vector<Section>& kv,
               const std::vector<Section>& conv, const std::vector<Section>& ssm) {
  return g.kind == kind && g.kv == kv && g.conv == conv && g.ssm == ssm;
}

// a*b + c with overflow detection.
bool mulAdd(uint64_t a, uint64_t b, uint64_t c, uint64_t* out) {
  uint64_t m;
  if (__builtin_mul_overflow(a, b, &m)) return false;
  return !__builtin_add_overflow(m, c, out);
}

// Bytes of a pool of `count` indices of `n_layers` records each, overflow-checked. The
// products of any partial stride are then below it and cannot overflow either.
Status poolBytes(uint64_t record, uint64_t n_layers, uint64_t count, std::string_view what,
                 uint64_t* out) {
  uint64_t per_index = 0;
  if (__builtin_mul_overflow(record, n_layers, &per_index) ||
      __builtin_mul_overflow(per_index, count, out)) {
    return ResourceExhausted(std::string(what) + " pool of " + std::to_string(count) + " x " +
                             std::to_string(n_layers) + " layers x " + std::to_string(record) +
                             " bytes overflows 64 bits");
  }
  return OkStatus();
}

// The records of one view seen from above: [begin, end) bounds them all and, when `stride`
// is non-zero, every record starts at begin + k*stride for some k >= 0 (a superset claim;
// the view may skip some k). One-record views have stride 0 and `single` set.
struct Footprint {
  size_t view = 0;
  uint64_t begin = 0, end = 0, record = 0, stride = 0;
  bool single = false;
};

// Checks that the records of `v` do not overlap one another and returns its footprint.
// REQUIRES: v.num_indices > 0 and `end` = one past its last byte (overflow-checked).
// The test is sufficient, not necessary: the strides must nest (the inner one at least a
// record, the outer one at least the inner run). Every layout buildRankLayout makes nests.
StatusOr<Footprint> footprintOf(const PoolView& v, uint64_t end) {
  Footprint fp;
  fp.begin = v.base;
  fp.end = end;
  fp.record = v.span();
  struct Dim {
    uint64_t stride, count;
  };
  std::vector<Dim> dims;
  if (v.num_indices > 1) dims.push_back({v.index_stride, v.num_indices});
  if (v.layers.size() > 1) dims.push_back({v.layer_stride, v.layers.size()});
  if (dims.size() == 2 && dims[1].stride < dims[0].stride) std::swap(dims[0], dims[1]);
  auto overlap = [&](std::string why) { return InvalidArgument("records overlap: " + why); };
  if (dims.empty()) {
    fp.single = true;
    return fp;
  }
  const Dim inner = dims[0];
  if (inner.stride < v.span()) {
    return overlap("stride " + std::to_string(inner.stride) + " < record span " +
                   std::to_string(v.span()));
  }
  fp.stride = inner.stride;
  if (dims.size() == 2) {
    const Dim outer = dims[1];
    // inner.stride * (count-1) + record <= the pool length, already overflow-checked.
    const uint64_t run = inner.stride * (inner.count - 1) + v.span();
    if (outer.stride < run) {
      return overlap("stride " + std::to_string(outer.stride) + " < inner run of " +
                     std::to_string(run) + " bytes");
    }
    if (outer.stride % inner.stride != 0) fp.stride = 0;  // not one progression
  }
  return fp;
}

// False only when the two views provably share no byte.
bool mayOverlap(const Footprint& x, const Footprint& y) {
  if (x.end <= y.begin || y.end <= x.begin) return false;
  // A view of several records that is not one progression cannot be compared modulo a step.
  if ((!x.single && x.stride == 0) || (!y.single && y.stride == 0)) return true;
  // Both inside one progression of stride g: compare the record positions modulo g.
  uint64_t g = x.stride ? x.stride : y.stride;
  if (g == 0) return true;
  if ((x.stride && x.stride != g) || (y.stride && y.stride != g)) return true;
  if (x.record > g || y.record > g) return true;
  const Footprint& lo = x.begin <= y.begin ? x : y;
  const Footprint& hi = x.begin <= y.begin ? y : x;
  const uint64_t delta = (hi.begin - lo.begin) % g;
  return !(delta >= lo.record && delta + hi.record <= g);
}

// The bytes one record of `v` occupies, relative to its start: merged [begin, end) runs in
// address order; nullopt when it has more than kMaxRuns of them (not worth comparing).
std::optional<std::vector<std::pair<uint64_t, uint64_t>>> recordRuns(const PoolView& v) {
  constexpr uint64_t kMaxRuns = 1 << 16;
  std::vector<std::pair<uint64_t, uint64_t>> runs;
  if (!v.record) {
    runs.push_back({0, v.record_bytes});
    return runs;
  }
  std::vector<BoxDim> box;
  uint64_t elements = 1;
  for (const RecordDim& d : v.record->dims) {
    box.push_back({d.size, d.stride, d.stride});
    elements *= d.size;
  }
  const uint64_t e = v.record->element_bytes;
  const uint64_t run = runBytes(box, e);
  if (run == 0 || elements * e / run > kMaxRuns) return std::nullopt;
  forEachRun(box, e, 0, 0, [&](uint64_t, uint64_t b, uint64_t n) {
    if (!runs.empty() && runs.back().second == b) {
      runs.back().second += n;
    } else {
      runs.push_back({b, b + n});
    }
  });
  std::sort(runs.begin(), runs.end());
  return runs;
}

// Whether the records of two views of one progression (the same stride g, one index each at a
// time) interleave without sharing a byte although their extents overlap: vLLM's CPU attention
// keeps a head's K and then its V in one page, K and V being views of their own.
bool interleaveCleanly(const PoolView& vx, const Footprint& x, const PoolView& vy,
                       const Footprint& y) {
  if ((!x.single && x.stride == 0) || (!y.single && y.stride == 0)) return false;
  const uint64_t g = x.stride ? x.stride : y.stride;
  if (g == 0 || (x.stride && x.stride != g) || (y.stride && y.stride != g)) return false;
  if (x.begin % g + x.record > g || y.begin % g + y.record > g) return false;
  auto rx = recordRuns(vx), ry = recordRuns(vy);
  if (!rx || !ry) return false;
  const uint64_t ox = x.begin % g, oy = y.begin % g;
  size_t i = 0, j = 0;
  while (i < rx->size() && j < ry->size()) {
    const uint64_t xb = (*rx)[i].first + ox, xe = (*rx)[i].second + ox;
    const uint64_t yb = (*ry)[j].first + oy, ye = (*ry)[j].second + oy;
    if (xb < ye && yb < xe) return false;
    (xe <= ye ? i : j)++;
  }
  return true;
}

// Views of different id groups that share an index space: every record of index i inside
// the window [w + i * stride, w + (i + 1) * stride) in both, w the same multiple of the stride
// (0, or where a layer slot starts in an allocation that holds several: vLLM 0.32 keeps all
// of them in one buffer), so only records of the same index meet (allowed under joint ids:
// never live together).
bool jointlyIndexed(const PoolView& x, const PoolView& y) {
  auto group = [](const PoolView& v) { return v.role == Role::kKv ? 0 : 1 + v.state_group; };
  auto inside = [](const PoolView& v) {
    uint64_t extent = 0;  // base % stride + (L-1) * layer_stride + span
    if (__builtin_mul_overflow(v.layers.size() - 1, v.layer_stride, &extent) ||
        __builtin_add_overflow(extent, v.span(), &extent) ||
        __builtin_add_overflow(extent, v.base % v.index_stride, &extent)) {
      return false;
    }
    return extent <= v.index_stride;
  };
  return group(x) != group(y) && x.index_stride != 0 && x.index_stride == y.index_stride &&
         x.num_indices == y.num_indices && x.base / x.index_stride == y.base / y.index_stride &&
         inside(x) && inside(y);
}

}  // namespace

StatusOr<RankLayout> buildRankLayout(const ModelSpec& model, const ParallelConfig& pc,
                                     uint32_t tp_rank, uint32_t pp_rank, StateLayout layout,
                                     uint32_t num_blocks, uint32_t num_slots) {
  RETURN_IF_ERROR(model.validate());
  RETURN_IF_ERROR(pc.validate(model.numLayers()));
  RETURN_IF_ERROR(checkShardable(model, pc));
  if (tp_rank >= pc.tp) {
    return InvalidArgument("tp_rank=" + std::to_string(tp_rank) +
                           " >= tp=" + std::to_string(pc.tp));
  }
  ASSIGN_OR_RETURN(LayerRange stage, stageLayers(pc, model.numLayers(), pp_rank));

  RankLayout out;
  out.tp = pc.tp;
  out.pp = pc.pp;
  out.tp_rank = tp_rank;
  out.pp_rank = pp_rank;
  ASSIGN_OR_RETURN(out.layers_per_stage, resolvedLayersPerStage(pc, model.numLayers()));
  out.state_layout = layout;
  out.tokens_per_block = model.tokens_per_block;
  out.kv_dtype = model.kv_dtype;
  out.conv_dtype = model.conv_dtype;
  out.ssm_dtype = model.ssm_dtype;
  out.model_fingerprint = modelFingerprint(model);
  out.num_blocks = num_blocks;
  out.num_slots = num_slots;

  std::vector<Group> attention_groups, recurrent_groups;
  for (uint32_t id = stage.first; id < stage.end(); ++id) {
    const LayerSpec& l = model.layers[id];
    if (l.hasAttention()) {
      auto kv = recordSections(model, l, Role::kKv);
      Group* g = nullptr;
      for (auto& c : attention_groups) {
        if (sameShape(c, LayerKind::kAttention, kv, {}, {})) g = &c;
      }
      if (!g) g = &attention_groups.emplace_back(Group{LayerKind::kAttention, kv, {}, {}, {}});
      g->layers.push_back(id);
    }
    if (l.hasRecurrent()) {
      auto conv = recordSections(model, l, Role::kConv);
      auto ssm = recordSections(model, l, Role::kSsm);
      Group* g = nullptr;
      for (auto& c : recurrent_groups) {
        if (sameShape(c, l.recurrent, {}, conv, ssm)) g = &c;
      }
      if (!g) g = &recurrent_groups.emplace_back(Group{l.recurrent, {}, conv, ssm, {}});
      g->layers.push_back(id);
    }
  }
  if (!attention_groups.empty() && num_blocks == 0) {
    return InvalidArgument("num_blocks=0 but rank has attention layers");
  }
  if (!recurrent_groups.empty() && num_slots == 0) {
    return InvalidArgument("num_slots=0 but rank has recurrent layers");
  }

  auto addRegion = [&](std::string name, uint64_t length) {
    uint32_t id = static_cast<uint32_t>(out.regions.size());
    out.regions.push_back({id, length, std::move(name)});
    return id;
  };
  auto makeView = [&](Role role, LayerKind kind, const Group& g,
                      const std::vector<Section>& sections) -> StatusOr<PoolView> {
    PoolView v;
    v.role = role;
    v.kind = kind;
    v.layers = g.layers;
    v.sections = sections;
    ASSIGN_OR_RETURN(v.record_bytes, localRecordBytes(sections, pc.tp, tp_rank));
    v.num_indices = role == Role::kKv ? num_blocks : num_slots;
    return v;
  };

  int kv_count = 0;
  for (const Group& g : attention_groups) {
    ASSIGN_OR_RETURN(PoolView v, makeView(Role::kKv, LayerKind::kAttention, g, g.kv));
    const uint64_t n_layers = g.layers.size();
    uint64_t length = 0;
    RETURN_IF_ERROR(poolBytes(v.record_bytes, n_layers, num_blocks, "kv", &length));
    v.layer_stride = v.record_bytes;
    v.index_stride = v.record_bytes * n_layers;
    v.base = 0;
    v.region_id = addRegion("kv" + std::to_string(kv_count++), length);
    out.views.push_back(std::move(v));
  }

  int state_count = 0;
  for (const Group& g : recurrent_groups) {
    ASSIGN_OR_RETURN(PoolView conv, makeView(Role::kConv, g.kind, g, g.conv));
    ASSIGN_OR_RETURN(PoolView ssm, makeView(Role::kSsm, g.kind, g, g.ssm));
    const uint64_t n_layers = g.layers.size();
    const std::string suffix = std::to_string(state_count++);
    if (layout == StateLayout::kPaged && conv.record_bytes == ssm.record_bytes) {
      // Coalesced equal-size pool: [ssm_l0|conv_l0|ssm_l1|conv_l1|...] per slot.
      const uint64_t rec = ssm.record_bytes;
      uint64_t length = 0;
      RETURN_IF_ERROR(poolBytes(rec, 2 * n_layers, num_slots, "state", &length));
      const uint32_t region = addRegion("state" + suffix, length);
      for (PoolView* v : {&ssm, &conv}) {
        v->region_id = region;
        v->layer_stride = 2 * rec;
        v->index_stride = 2 * rec * n_layers;
      }
      ssm.base = 0;
      conv.base = rec;
    } else {
      for (PoolView* v : {&conv, &ssm}) {
        const std::string name = std::string(roleName(v->role)) + suffix;
        uint64_t length = 0;
        RETURN_IF_ERROR(poolBytes(v->record_bytes, n_layers, num_slots, name, &length));
        if (layout == StateLayout::kPaged) {
          v->layer_stride = v->record_bytes;
          v->index_stride = v->record_bytes * n_layers;
        } else {
          v->index_stride = v->record_bytes;
          v->layer_stride = v->record_bytes * num_slots;
        }
        v->base = 0;
        v->region_id = addRegion(name, length);
      }
    }
    out.views.push_back(std::move(conv));
    out.views.push_back(std::move(ssm));
  }
  RETURN_IF_ERROR(out.validate());
  return out;
}

const RegionSpec* RankLayout::findRegion(uint32_t id) const {
  for (const RegionSpec& r : regions) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

LayerRange RankLayout::stageLayers() const {
  uint32_t first = 0;
  for (uint32_t s = 0; s < pp_rank; ++s) first += layers_per_stage[s];
  return {first, layers_per_stage[pp_rank]};
}

uint64_t RankLayout::kvBytesPerBlock() const {
  uint64_t total = 0;
  for (const PoolView& v : views) {
    if (v.role == Role::kKv) total += v.record_bytes * v.layers.size();
  }
  return total;
}

uint64_t RankLayout::stateBytesPerSlot() const {
  uint64_t total = 0;
  for (const PoolView& v : views) {
    if (v.role != Role::kKv) total += v.record_bytes * v.layers.size();
  }
  return total;
}

Status RankLayout::validate(const Names& names) const {
  if (tp == 0 || pp == 0) return InvalidArgument("tp and pp must be >= 1");
  if (tp_rank >= tp) {
    return InvalidArgument("tp_rank=" + std::to_string(tp_rank) + " >= tp=" + std::to_string(tp));
  }
  if (pp_rank >= pp) {
    return InvalidArgument("pp_rank=" + std::to_string(pp_rank) + " >= pp=" + std::to_string(pp));
  }
  if (layers_per_stage.size() != pp) {
    return InvalidArgument("layers_per_stage has " + std::to_string(layers_per_stage.size()) +
                           " entries, pp=" + std::to_string(pp));
  }
  if (tokens_per_block == 0) return InvalidArgument("tokens_per_block=0");
  uint64_t first = 0, total = 0;
  for (uint32_t s = 0; s < pp; ++s) {
    if (s < pp_rank) first += layers_per_stage[s];
    total += layers_per_stage[s];
  }
  if (total > std::numeric_limits<uint32_t>::max()) {
    return InvalidArgument("layers_per_stage sums to " + std::to_string(total));
  }
  const uint64_t end = first + layers_per_stage[pp_rank];
  for (size_t i = 0; i < regions.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (regions[i].id == regions[j].id) {
        return InvalidArgument("duplicate region id " + std::to_string(regions[i].id));
      }
    }
  }
  if (state_groups == 0) return InvalidArgument("state_groups=0 (at least 1)");
  if (joint_ids && num_slots != num_blocks) {
    return InvalidArgument("joint_ids: num_slots=" + std::to_string(num_slots) +
                           " but num_blocks=" + std::to_string(num_blocks) +
                           " (block and state ids are drawn from one pool)");
  }
  auto regionName = [&](uint32_t id) {
    return names.region ? names.region(id) : "region " + std::to_string(id);
  };
  std::vector<Footprint> footprints;
  // (role, layer, section): one place per section of a record (a layout may keep K and V in
  // views of their own, never one section twice).
  std::set<std::tuple<Role, uint32_t, std::string>> seen;
  for (size_t vi = 0; vi < views.size(); ++vi) {
    const PoolView& v = views[vi];
    const std::string where =
        names.view ? names.view(vi)
                   : "view " + std::to_string(vi) + " (" + std::string(roleName(v.role)) + ")";
    if (v.layers.empty()) return InvalidArgument(where + " has no layers");
    for (uint32_t layer : v.layers) {
      for (const Section& sec : v.sections) {
        if (!seen.insert({v.role, layer, sec.name}).second) {
          return InvalidArgument(where + " layer " + std::to_string(layer) + " already has a " +
                                 std::string(roleName(v.role)) + " view holding section " +
                                 sec.name);
        }
      }
    }
    for (size_t i = 0; i < v.layers.size(); ++i) {
      if (v.layers[i] < first || v.layers[i] >= end) {
        return InvalidArgument(where + " layer " + std::to_string(v.layers[i]) +
                               " is outside pp stage " + std::to_string(pp_rank) + " [" +
                               std::to_string(first) + ", " + std::to_string(end) + ")");
      }
      if (i > 0 && v.layers[i] <= v.layers[i - 1]) {
        return InvalidArgument(where + " layers are not strictly ascending");
      }
    }
    if ((v.role == Role::kKv) != (v.kind == LayerKind::kAttention) || v.kind == LayerKind::kNone) {
      return InvalidArgument(where + " role " + std::string(roleName(v.role)) +
                             " does not match kind " + std::string(layerKindName(v.kind)));
    }
    if (v.state_group >= (v.role == Role::kKv ? 1 : state_groups)) {
      return InvalidArgument(where + " state_group=" + std::to_string(v.state_group) +
                             (v.role == Role::kKv
                                  ? " on a kv view (kv views have none)"
                                  : " >= state_groups=" + std::to_string(state_groups)));
    }
    if (v.sections.empty()) return InvalidArgument(where + " has no sections");
    for (const Section& s : v.sections) {
      if (s.units == 0 || s.unit_bytes == 0) {
        return InvalidArgument(where + " section " + s.name + " is empty");
      }
    }
    auto bytes = localRecordBytes(v.sections, tp, tp_rank);
    if (!bytes.isOk()) return bytes.status().withContext(where);
    if (*bytes != v.record_bytes) {
      return InvalidArgument(where + " record_bytes=" + std::to_string(v.record_bytes) +
                             " but its sections hold " + std::to_string(*bytes) + " bytes at tp=" +
                             std::to_string(tp) + " rank " + std::to_string(tp_rank));
    }
    if (v.record) {
      Status s =
          checkRecordLayout(*v.record, v.kind, v.role, v.sections, tp, tp_rank,
                            static_cast<uint32_t>(dtypeSize(dtypeOf(v.role))), tokens_per_block);
      if (!s.isOk()) return s.withContext(where);
    }
    const uint32_t expect = v.role == Role::kKv ? num_blocks : num_slots;
    if (v.num_indices != expect) {
      return InvalidArgument(where + " num_indices=" + std::to_string(v.num_indices) +
                             " but the rank has " + std::to_string(expect));
    }
    const RegionSpec* region = findRegion(v.region_id);
    if (!region)
      return InvalidArgument(where + " names unknown region " + std::to_string(v.region_id));
    if (v.num_indices == 0) continue;
    // Last byte of the last record: base + (n-1)*index_stride + (L-1)*layer_stride + record.
    uint64_t a, b;
    if (!mulAdd(v.num_indices - 1, v.index_stride, v.base, &a) ||
        !mulAdd(v.layers.size() - 1, v.layer_stride, a, &b) ||
        __builtin_add_overflow(b, v.span(), &a) || a > region->length) {
      return InvalidArgument(where + " records run past " + regionName(region->id) + " of length " +
                             std::to_string(region->length));
    }
    StatusOr<Footprint> fp = footprintOf(v, a);
    if (!fp.isOk()) return fp.status().withContext(where);
    fp->view = vi;
    footprints.push_back(*fp);
  }
  // Views sharing a region (the coalesced pool) must interleave without touching.
  for (size_t i = 0; i < footprints.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      const Footprint& x = footprints[i];
      const Footprint& y = footprints[j];
      if (views[x.view].region_id != views[y.view].region_id) continue;
      if (!mayOverlap(x, y)) continue;
      if (joint_ids && jointlyIndexed(views[x.view], views[y.view])) continue;
      if (interleaveCleanly(views[x.view], x, views[y.view], y)) continue;
      if (names.view) {
        return InvalidArgument(names.view(y.view) + " and " + names.view(x.view) + " overlap in " +
                               regionName(views[x.view].region_id));
      }
      return InvalidArgument("views " + std::to_string(y.view) + " and " + std::to_string(x.view) +
                             " overlap in " + regionName(views[x.view].region_id));
    }
  }
  return OkStatus();
}

StatusOr<RecordLayout> kvRecordLayout(const RankLayout& l, const PoolView& v) {
  if (v.record) return *v.record;
  if (v.role != Role::kKv || v.sections.empty()) {
    return InvalidArgument("kvRecordLayout: view of role " + std::string(roleName(v.role)) +
                           " is not a kv view");
  }
  const uint64_t e = dtypeSize(l.kv_dtype), row = uint64_t{l.tokens_per_block} * e;
  const uint64_t unit = v.sections[0].unit_bytes;
  if (row == 0 || unit % row != 0) {
    return InvalidArgument(
        "kv section " + v.sections[0].name + " unit_bytes=" + std::to_string(unit) +
        " is not a multiple of tokens_per_block=" + std::to_string(l.tokens_per_block) + " x " +
        std::to_string(e) + "-byte elements");
  }
  ASSIGN_OR_RETURN(std::vector<uint32_t> local, localUnitCounts(v.sections, l.tp, l.tp_rank));
  return canonicalRecordLayout(v.kind, v.role, v.sections, local, static_cast<uint32_t>(e),
                               {l.tokens_per_block, static_cast<uint32_t>(unit / row)});
}

}  // namespace hxfer
