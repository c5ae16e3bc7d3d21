#include "plan/planner.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <map>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace hxfer {
namespace {

std::string hex64(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%016" PRIx64, v);
  return buf;
}

std::string rankName(const RankLayout& l) {
  return "(tp_rank " + std::to_string(l.tp_rank) + ", pp_rank " + std::to_string(l.pp_rank) + ")";
}

uint64_t numLayers(const RankLayout& l) {
  uint64_t n = 0;
  for (uint32_t c : l.layers_per_stage) n += c;
  return n;
}

std::string sectionsText(const std::vector<Section>& sections) {
  std::string s;
  for (const Section& sec : sections) {
    if (!s.empty()) s += " ";
    s += sec.name + ":" + std::to_string(sec.units) + "x" + std::to_string(sec.unit_bytes) + "B";
  }
  return s;
}

std::string viewWhat(const PoolView& v, uint32_t layer, const Section& s) {
  return "layer " + std::to_string(layer) + " " + std::string(layerKindName(v.kind)) + " " +
         std::string(roleName(v.role)) + " " + s.name;
}

// Every section of every view shards at the layout's tp (checked before validate(), so that
// the refusal names the section rather than a record size).
Status checkDivisible(const RankLayout& l, std::string_view side) {
  for (const PoolView& v : l.views) {
    for (const Section& s : v.sections) {
      auto r = shardUnits(s.units, l.tp, 0, viewWhat(v, v.layers.empty() ? 0 : v.layers[0], s));
      if (!r.isOk()) {
        return Status(r.status().code(), std::string(side) + " " + r.status().message());
      }
    }
  }
  return OkStatus();
}

// (global layer, role) -> (view index, local layer) of one rank: the first view holding it.
using RecordIndex = std::map<std::pair<uint32_t, Role>, std::pair<uint32_t, uint32_t>>;

RecordIndex indexRecords(const RankLayout& l) {
  RecordIndex idx;
  for (uint32_t vi = 0; vi < l.views.size(); ++vi) {
    const PoolView& v = l.views[vi];
    for (uint32_t li = 0; li < v.layers.size(); ++li)
      idx.insert({{v.layers[li], v.role}, {vi, li}});
  }
  return idx;
}

// (global layer, role, section name) -> (view index, local layer, index in the view's
// sections) of one rank. A layout may keep a record's sections in several views (K and V).
using SectionIndex =
    std::map<std::tuple<uint32_t, Role, std::string>, std::tuple<uint32_t, uint32_t, size_t>>;

SectionIndex indexSections(const RankLayout& l) {
  SectionIndex idx;
  for (uint32_t vi = 0; vi < l.views.size(); ++vi) {
    const PoolView& v = l.views[vi];
    for (uint32_t li = 0; li < v.layers.size(); ++li) {
      for (size_t si = 0; si < v.sections.size(); ++si) {
        idx[{v.layers[li], v.role, v.sections[si].name}] = {vi, li, si};
      }
    }
  }
  return idx;
}

// The sections of (layer, role) over every view holding them, in view order. A kv unit is
// counted per token (bytes of one token row of a head), so that ranks with different tokens
// per block compare equal.
std::vector<Section> sectionsOf(const RankLayout& l, uint32_t layer, Role role) {
  std::vector<Section> out;
  for (const PoolView& v : l.views) {
    if (v.role != role || !std::binary_search(v.layers.begin(), v.layers.end(), layer)) continue;
    out.insert(out.end(), v.sections.begin(), v.sections.end());
  }
  if (role == Role::kKv) {
    for (Section& s : out) s.unit_bytes /= l.tokens_per_block;
  }
  return out;
}

// The same sections, whichever views hold them.
bool sameSections(std::vector<Section> a, std::vector<Section> b) {
  auto byName = [](const Section& x, const Section& y) { return x.name < y.name; };
  std::sort(a.begin(), a.end(), byName);
  std::sort(b.begin(), b.end(), byName);
  return a == b;
}

// The context TP rank that writes unit `u` of a section of `units` units for generation TP
// rank `gen_rank`, at global layer `layer`.
uint32_t writerTpRank(uint32_t u, uint32_t units, uint32_t ctx_tp, uint32_t gen_tp,
                      uint32_t gen_rank, uint32_t layer) {
  if (units >= ctx_tp) return u / (units / ctx_tp);  // exactly one holder
  const uint32_t reps = ctx_tp / units;
  const uint32_t h0 = u * reps;  // holders [h0, h0 + reps)
  // Context ranks that cover the same slice of the model as gen_rank.
  const uint64_t cover_lo = uint64_t{gen_rank} * ctx_tp / gen_tp;
  const uint64_t cover_hi = (uint64_t{gen_rank + 1} * ctx_tp + gen_tp - 1) / gen_tp;
  const uint64_t lo = std::max<uint64_t>(h0, cover_lo);
  const uint64_t hi = std::min<uint64_t>(h0 + reps, cover_hi);
  if (lo < hi) return static_cast<uint32_t>(lo + (uint64_t{layer} + gen_rank) % (hi - lo));
  return h0 + (layer + gen_rank) % reps;
}

void appendSegment(std::vector<Planner::Segment>& segs, size_t begin, uint64_t src_off,
                   uint64_t dst_off, uint64_t bytes) {
  if (segs.size() > begin) {
    Planner::Segment& b = segs.back();
    if (b.src_off + b.bytes == src_off && b.dst_off + b.bytes == dst_off) {
      b.bytes += bytes;
      return;
    }
  }
  segs.push_back({src_off, dst_off, bytes});
}

// Sorts segs[begin, end) by destination offset and merges the runs that then continue on both
// sides.
void mergeInDestinationOrder(std::vector<Planner::Segment>& segs, size_t begin) {
  std::vector<Planner::Segment> mine(segs.begin() + begin, segs.end());
  std::sort(mine.begin(), mine.end(), [](const Planner::Segment& a, const Planner::Segment& b) {
    return a.dst_off < b.dst_off;
  });
  segs.resize(begin);
  for (const Planner::Segment& x : mine) appendSegment(segs, begin, x.src_off, x.dst_off, x.bytes);
}

// Appends an op, merging it into the previous one when both sides continue contiguously.
inline void appendOp(std::vector<CopyOp>& ops, uint32_t src_region, uint64_t src_off,
                     uint32_t dst_region, uint64_t dst_off, uint64_t bytes) {
  if (!ops.empty()) {
    CopyOp& b = ops.back();
    if (b.src_region == src_region && b.dst_region == dst_region &&
        b.src_offset + b.bytes == src_off && b.dst_offset + b.bytes == dst_off) {
      b.bytes += bytes;
      return;
    }
  }
  ops.push_back({src_region, src_off, dst_region, dst_off, bytes});
}

// The record layout of (view v of rank l): its own, or hxfer's contiguous order with the inner
// sizes of `other` (the same model, so the same sizes; checkCompatible checks them), except
// the kv token dim, which is l's own tokens per block.
StatusOr<RecordLayout> recordOf(const PoolView& v, const RankLayout& l, const RecordLayout& other) {
  if (v.record) return *v.record;
  ASSIGN_OR_RETURN(std::vector<uint32_t> local, localUnitCounts(v.sections, l.tp, l.tp_rank));
  const LogicalDims ld = logicalDims(v.kind, v.role);
  std::vector<uint32_t> inner = innerSizesOf(other, ld);
  for (size_t i = 0; i < ld.inner.size(); ++i) {
    if (ld.inner[i] == "token") inner[i] = l.tokens_per_block;
  }
  return canonicalRecordLayout(v.kind, v.role, v.sections, local, other.element_bytes, inner);
}

// Byte offset of section `i` in a contiguous (undescribed) record: the earlier sections' local
// units.
uint64_t contiguousSectionOffset(const PoolView& v, const RankLayout& l, size_t i) {
  uint64_t off = 0;
  for (size_t j = 0; j < i; ++j) {
    const Section& s = v.sections[j];
    off += uint64_t{shardUnits(s.units, l.tp, l.tp_rank, s.name).value().count} * s.unit_bytes;
  }
  return off;
}

// Where the segments of one record map go. With `packs` (state records), a section whose
// element order differs is staged: each element run goes to the staging area at `*scratch`
// onwards, in the destination's order, and `staged` gets the runs contiguous in the
// destination.
// With `boxes` (kv records between ranks of different tokens per block), a section gives its
// box of shared elements instead of segments (Planner::TokenBox).
struct SegmentSink {
  std::vector<Planner::Segment>* segs;
  size_t seg_begin;
  std::vector<Planner::TokenBox>* boxes = nullptr;
  std::vector<PackOp>* packs = nullptr;
  std::vector<Planner::Segment>* staged = nullptr;
  size_t staged_begin = 0;
  uint64_t* scratch = nullptr;
};

// Appends the segments of one section shared by a context record (section ci of view cv) and a
// generation record (section gi of gv): the units both hold that this context rank writes.
// Undescribed on both sides, a section's units are one run on each side. Otherwise they are
// walked as a box of logical elements (unit, within-unit index, inner dims) in the
// destination's memory order, one segment per run contiguous on both sides. When the element
// order inside units differs so much that every run is one element, a state record is staged
// (SegmentSink); a kv record is refused (Incompatible). With `together` = 2 the sections ci and
// ci + 1 (K and V, the same units) go as one box with a section dim, when both records have
// that dim: K and V side by side per token and head then make one run per token row.
Status sectionSegments(const RankLayout& c, const PoolView& cv, size_t ci, const RankLayout& g,
                       const PoolView& gv, size_t gi, uint32_t layer, const SegmentSink& sink,
                       uint32_t together = 1) {
  auto oneByOne = [&]() -> Status {
    for (uint32_t k = 0; k < together; ++k) {
      RETURN_IF_ERROR(sectionSegments(c, cv, ci + k, g, gv, gi + k, layer, sink));
    }
    return OkStatus();
  };
  std::vector<Planner::Segment>* segs = sink.segs;
  const size_t seg_begin = sink.seg_begin;
  const Section& s = gv.sections[gi];
  const UnitRange rg = shardUnits(s.units, g.tp, g.tp_rank, s.name).value();
  const UnitRange rc = shardUnits(s.units, c.tp, c.tp_rank, s.name).value();
  const uint32_t lo = std::max(rg.first, rc.first);
  const uint32_t hi = std::min(rg.first + rg.count, rc.first + rc.count);
  if (lo >= hi) return OkStatus();
  // A replicated unit (units < ctx tp) is written by one chosen holder only.
  if (s.units < c.tp && writerTpRank(lo, s.units, c.tp, g.tp, g.tp_rank, layer) != c.tp_rank) {
    return OkStatus();
  }
  if (!gv.record && !cv.record && sink.boxes == nullptr) {
    if (together > 1) return oneByOne();
    appendSegment(*segs, seg_begin,
                  contiguousSectionOffset(cv, c, ci) + uint64_t{lo - rc.first} * s.unit_bytes,
                  contiguousSectionOffset(gv, g, gi) + uint64_t{lo - rg.first} * s.unit_bytes,
                  uint64_t{hi - lo} * s.unit_bytes);
    return OkStatus();
  }
  const LogicalDims ld = logicalDims(gv.kind, gv.role);
  RecordLayout g_rec, c_rec;
  if (!gv.record && !cv.record) {  // kv by token ranges
    ASSIGN_OR_RETURN(g_rec, kvRecordLayout(g, gv));
    ASSIGN_OR_RETURN(c_rec, kvRecordLayout(c, cv));
  } else if (gv.record) {
    g_rec = *gv.record;
    ASSIGN_OR_RETURN(c_rec, recordOf(cv, c, g_rec));
  } else {
    c_rec = *cv.record;
    ASSIGN_OR_RETURN(g_rec, recordOf(gv, g, c_rec));
  }
  if (together > 1 &&
      (ld.section_dim.empty() || !g_rec.find(ld.section_dim) || !c_rec.find(ld.section_dim))) {
    return oneByOne();
  }
  const std::vector<uint32_t> inner = innerSizesOf(g_rec, ld);
  const uint64_t e = g_rec.element_bytes;
  ASSIGN_OR_RETURN(uint32_t len, unitLength(s, static_cast<uint32_t>(e), inner));
  const SectionPlacement cp = placeSection(
      c_rec, ld, cv.sections, localUnitCounts(cv.sections, c.tp, c.tp_rank).value(), ci, len);
  const SectionPlacement gp = placeSection(
      g_rec, ld, gv.sections, localUnitCounts(gv.sections, g.tp, g.tp_rank).value(), gi, len);
  std::vector<BoxDim> box = {{hi - lo, cp.unit_stride, gp.unit_stride},
                             {len, cp.within_stride, gp.within_stride}};
  uint64_t unit_elements = len;
  uint32_t token_dim = 0;
  auto whole = [](const RecordLayout& r, const std::string& n) {
    return std::count_if(r.dims.begin(), r.dims.end(),
                         [&](const RecordDim& d) { return d.name == n; }) == 1;
  };
  for (const std::string& n : ld.inner) {
    std::vector<BoxDim> factors;
    if (n == "token" && whole(c_rec, n) && whole(g_rec, n)) {
      // The sides' tokens per block may differ: the box spans the destination's block.
      factors = {{g_rec.find(n)->size, c_rec.find(n)->stride, g_rec.find(n)->stride}};
    } else {
      ASSIGN_OR_RETURN(factors, logicalBox(c_rec, g_rec, n));
    }
    if (n == "token") {
      // Token ranges (tokens per block differ) cut the token dim: it must be one dim there.
      if (sink.boxes != nullptr && factors.size() != 1) {
        return Incompatible("layer " + std::to_string(layer) + " kv: the token dim is split (ctx " +
                            c_rec.toString() + "; gen " + g_rec.toString() +
                            "), which moving by token ranges between different tokens per "
                            "block does not support");
      }
      token_dim = static_cast<uint32_t>(box.size());
    }
    box.insert(box.end(), factors.begin(), factors.end());
    unit_elements *= g_rec.sizeOf(n);
  }
  if (together > 1) {
    box.push_back(
        {together, c_rec.find(ld.section_dim)->stride, g_rec.find(ld.section_dim)->stride});
    // Together only where it lengthens runs; one element at a time, each section goes alone
    // (and is refused there when its own units need element runs).
    if (runBytes(box, e) == e) return oneByOne();
    unit_elements *= together;
  }
  const uint64_t c_base = cp.base + uint64_t{lo - rc.first} * cp.unit_stride;
  const uint64_t g_base = gp.base + uint64_t{lo - rg.first} * gp.unit_stride;
  if (sink.boxes != nullptr) {
    sink.boxes->push_back({std::move(box), token_dim, c_base, g_base, e});
    return OkStatus();
  }
  if (runBytes(box, e) == e && unit_elements > 1) {
    if (sink.packs == nullptr) {
      return Incompatible("layer " + std::to_string(layer) + " " + std::string(roleName(gv.role)) +
                          " section " + s.name + ": the element order inside a unit differs (ctx " +
                          c_rec.toString() + "; gen " + g_rec.toString() +
                          "), so every op would move one " + std::to_string(e) +
                          "-byte element; staging is built for state records only");
    }
    // One gather into the staging area, the elements in the destination's order there (so
    // contiguous, row-major over the dims in that order), then the destination's runs.
    PackOp pack;
    pack.src_offset = c_base;
    pack.scratch_offset = *sink.scratch;
    pack.element_bytes = static_cast<uint32_t>(e);
    pack.dims = inBOrder(std::move(box));
    std::vector<BoxDim> to_dest = pack.dims;
    uint64_t stride = e;
    for (size_t i = pack.dims.size(); i-- > 0;) {
      to_dest[i] = {pack.dims[i].size, stride, pack.dims[i].b_stride};
      pack.dims[i].b_stride = stride;
      stride *= pack.dims[i].size;
    }
    forEachRun(std::move(to_dest), e, *sink.scratch, g_base,
               [&](uint64_t a, uint64_t b, uint64_t n) {
                 appendSegment(*sink.staged, sink.staged_begin, a, b, n);
               });
    *sink.scratch += stride;
    sink.packs->push_back(std::move(pack));
    return OkStatus();
  }
  forEachRun(box, e, c_base, g_base,
             [&](uint64_t a, uint64_t b, uint64_t n) { appendSegment(*segs, seg_begin, a, b, n); });
  return OkStatus();
}

struct PendingMap {
  bool by_block;
  uint32_t src_view, dst_view, src_layer;
  Planner::RecordMap map;
};

// The mapping from context rank `c` to generation rank `g`. REQUIRES: checkCompatible(c, g).
StatusOr<Planner::SourceMap> buildSourceMap(const RankLayout& c, const RankLayout& g) {
  Planner::SourceMap out;
  out.by_token = c.tokens_per_block != g.tokens_per_block;
  const SectionIndex ctx_sections = indexSections(c);
  std::vector<PendingMap> pending;
  for (uint32_t gvi = 0; gvi < g.views.size(); ++gvi) {
    const PoolView& gv = g.views[gvi];
    for (uint32_t gl = 0; gl < gv.layers.size(); ++gl) {
      const uint32_t layer = gv.layers[gl];
      // The context records holding this record's sections (one, unless one side keeps K and
      // V apart), in the order their first section appears.
      struct Source {
        uint32_t view, layer;
        std::vector<std::pair<size_t, size_t>> sections;  // (ctx index, gen index)
      };
      std::vector<Source> sources;
      for (size_t gi = 0; gi < gv.sections.size(); ++gi) {
        auto it = ctx_sections.find({layer, gv.role, gv.sections[gi].name});
        if (it == ctx_sections.end()) continue;  // another pp stage holds this layer
        const uint32_t cvi = std::get<0>(it->second), cl = std::get<1>(it->second);
        const size_t ci = std::get<2>(it->second);
        auto src = std::find_if(sources.begin(), sources.end(),
                                [&](const Source& x) { return x.view == cvi && x.layer == cl; });
        if (src == sources.end()) src = sources.insert(sources.end(), Source{cvi, cl, {}});
        src->sections.push_back({ci, gi});
      }
      for (const Source& src : sources) {
        const PoolView& cv = c.views[src.view];
        const uint32_t cl = src.layer, cvi = src.view;
        const size_t seg_begin = out.segments.size();
        const size_t pack_begin = out.packs.size(), staged_begin = out.staged.size();
        const size_t box_begin = out.token_boxes.size();
        SegmentSink sink{&out.segments, seg_begin};
        if (gv.indexedByBlock() && out.by_token) sink.boxes = &out.token_boxes;
        if (!gv.indexedByBlock()) {
          sink.packs = &out.packs;
          sink.staged = &out.staged;
          sink.staged_begin = staged_begin;
          sink.scratch = &out.scratch_bytes;
        }
        // K and V of one view on both sides go as one box (sectionSegments).
        const bool kv_pair = gv.role == Role::kKv && src.sections.size() == 2 &&
                             gv.sections.size() == 2 && cv.sections.size() == 2 &&
                             src.sections[0] == std::pair<size_t, size_t>{0, 0} &&
                             src.sections[1] == std::pair<size_t, size_t>{1, 1};
        if (kv_pair) {
          RETURN_IF_ERROR(sectionSegments(c, cv, 0, g, gv, 0, layer, sink, 2));
        } else {
          for (const auto& [ci, gi] : src.sections) {
            RETURN_IF_ERROR(sectionSegments(c, cv, ci, g, gv, gi, layer, sink));
          }
        }
        if (src.sections.size() > 1 && out.segments.size() - seg_begin > 1) {
          // Sections interleaved in both records (vLLM keeps K and V side by side per token
          // and head): their runs, taken in destination order, continue one another.
          mergeInDestinationOrder(out.segments, seg_begin);
        }
        if (out.segments.size() == seg_begin && out.staged.size() == staged_begin &&
            out.token_boxes.size() == box_begin) {
          continue;
        }
        Planner::RecordMap m;
        m.layer = layer;
        m.src_region = cv.region_id;
        m.dst_region = gv.region_id;
        m.src_group = cv.state_group;
        m.dst_group = gv.state_group;
        m.src_base = cv.offset(0, cl);
        m.src_stride = cv.index_stride;
        m.dst_base = gv.offset(0, gl);
        m.dst_stride = gv.index_stride;
        m.seg_begin = static_cast<uint32_t>(seg_begin);
        m.seg_end = static_cast<uint32_t>(out.segments.size());
        m.pack_begin = static_cast<uint32_t>(pack_begin);
        m.pack_end = static_cast<uint32_t>(out.packs.size());
        m.staged_begin = static_cast<uint32_t>(staged_begin);
        m.staged_end = static_cast<uint32_t>(out.staged.size());
        m.box_begin = static_cast<uint32_t>(box_begin);
        m.box_end = static_cast<uint32_t>(out.token_boxes.size());
        for (uint32_t i = m.box_begin; i < m.box_end; ++i) {
          const Planner::TokenBox& b = out.token_boxes[i];
          uint64_t per_token = b.element_bytes;
          for (uint32_t d = 0; d < b.dims.size(); ++d) {
            if (d != b.token_dim) per_token *= b.dims[d].size;
          }
          out.kv_bytes_per_token += per_token;
        }
        uint64_t bytes = 0;
        for (uint32_t i = m.seg_begin; i < m.seg_end; ++i) bytes += out.segments[i].bytes;
        for (uint32_t i = m.staged_begin; i < m.staged_end; ++i) bytes += out.staged[i].bytes;
        (gv.indexedByBlock() ? out.kv_bytes_per_block : out.state_bytes) += bytes;
        pending.push_back({gv.indexedByBlock(), cvi, gvi, cl, m});
      }
    }
  }
  // kv: grouped by (source view, destination view), layers in source order, so that one
  // block's records follow each other in the source pool. State: in source address order, so
  // that interleaved pools ([ssm_l0|conv_l0|ssm_l1|...]) read front to back.
  std::stable_sort(pending.begin(), pending.end(), [](const PendingMap& a, const PendingMap& b) {
    if (a.by_block != b.by_block) return a.by_block;
    if (a.by_block) {
      return std::tie(a.src_view, a.dst_view, a.src_layer) <
             std::tie(b.src_view, b.dst_view, b.src_layer);
    }
    return std::tie(a.map.src_region, a.map.src_base) < std::tie(b.map.src_region, b.map.src_base);
  });
  for (size_t i = 0; i < pending.size(); ++i) {
    const PendingMap& p = pending[i];
    if (!p.by_block) {
      out.slot_maps.push_back(p.map);
      continue;
    }
    if (i == 0 || pending[i - 1].src_view != p.src_view || pending[i - 1].dst_view != p.dst_view) {
      Planner::BlockGroup grp;
      grp.map_begin = static_cast<uint32_t>(out.block_maps.size());
      out.block_groups.push_back(grp);
    }
    out.block_maps.push_back(p.map);
    out.block_groups.back().map_end = static_cast<uint32_t>(out.block_maps.size());
  }
  if (out.by_token) out.kv_bytes_per_block = out.kv_bytes_per_token * g.tokens_per_block;
  return out;
}

}  // namespace

Status checkCompatible(const RankLayout& ctx, const RankLayout& gen) {
  if (ctx.model_fingerprint != gen.model_fingerprint) {
    return Incompatible("ctx model fingerprint " + hex64(ctx.model_fingerprint) +
                        " != gen model fingerprint " + hex64(gen.model_fingerprint));
  }
  const std::tuple<const char*, DType, DType> dtypes[] = {{"kv", ctx.kv_dtype, gen.kv_dtype},
                                                          {"conv", ctx.conv_dtype, gen.conv_dtype},
                                                          {"ssm", ctx.ssm_dtype, gen.ssm_dtype}};
  for (const auto& [name, a, b] : dtypes) {
    if (a != b) {
      return Incompatible(std::string("ctx ") + name + " dtype " + std::string(dtypeName(a)) +
                          " != gen " + name + " dtype " + std::string(dtypeName(b)));
    }
  }
  if (numLayers(ctx) != numLayers(gen)) {
    return Incompatible("ctx num_layers " + std::to_string(numLayers(ctx)) + " != gen num_layers " +
                        std::to_string(numLayers(gen)));
  }
  RETURN_IF_ERROR(checkDivisible(ctx, "ctx"));
  RETURN_IF_ERROR(checkDivisible(gen, "gen"));
  if (Status s = ctx.validate(); !s.isOk()) return s.withContext("ctx layout " + rankName(ctx));
  if (Status s = gen.validate(); !s.isOk()) return s.withContext("gen layout " + rankName(gen));

  // Every layer both stages hold has the same records on both sides.
  const LayerRange c_stage = ctx.stageLayers(), g_stage = gen.stageLayers();
  const uint64_t c_first = c_stage.first, c_end = c_stage.end();
  const uint64_t g_first = g_stage.first, g_end = g_stage.end();
  const RecordIndex c_idx = indexRecords(ctx);
  const RecordIndex g_idx = indexRecords(gen);
  for (uint64_t layer = std::max(c_first, g_first); layer < std::min(c_end, g_end); ++layer) {
    for (uint8_t r = 0; r <= kMaxRole; ++r) {
      const Role role = static_cast<Role>(r);
      const std::pair<uint32_t, Role> key{static_cast<uint32_t>(layer), role};
      auto ci = c_idx.find(key);
      auto gi = g_idx.find(key);
      const std::string what = "layer " + std::to_string(layer) + " " + std::string(roleName(role));
      if ((ci == c_idx.end()) != (gi == g_idx.end())) {
        return Incompatible(what + " record: ctx " + (ci == c_idx.end() ? "has none" : "has one") +
                            " != gen " + (gi == g_idx.end() ? "has none" : "has one"));
      }
      if (ci == c_idx.end()) continue;
      const PoolView& cv = ctx.views[ci->second.first];
      const PoolView& gv = gen.views[gi->second.first];
      if (cv.kind != gv.kind) {
        return Incompatible(what + " kind: ctx " + std::string(layerKindName(cv.kind)) +
                            " != gen " + std::string(layerKindName(gv.kind)));
      }
      const auto c_secs = sectionsOf(ctx, static_cast<uint32_t>(layer), role);
      const auto g_secs = sectionsOf(gen, static_cast<uint32_t>(layer), role);
      if (!sameSections(c_secs, g_secs)) {
        return Incompatible(what + " sections: ctx " + sectionsText(c_secs) + " != gen " +
                            sectionsText(g_secs));
      }
      // Described records: the same inner dims (the sections agree, so this checks how the
      // unit bytes divide into rows, e.g. head_dim against window).
      for (const PoolView& a : ctx.views) {
        if (a.role != role || !a.record ||
            !std::binary_search(a.layers.begin(), a.layers.end(), layer)) {
          continue;
        }
        for (const PoolView& b : gen.views) {
          if (b.role != role || !b.record ||
              !std::binary_search(b.layers.begin(), b.layers.end(), layer)) {
            continue;
          }
          for (const std::string& n : logicalDims(b.kind, role).inner) {
            if (n == "token") continue;  // tokens per block may differ
            const uint64_t x = a.record->sizeOf(n), y = b.record->sizeOf(n);
            if (x != y) {
              return Incompatible(what + " record dim " + n + ": ctx " + std::to_string(x) +
                                  " != gen " + std::to_string(y));
            }
          }
        }
      }
    }
  }
  return OkStatus();
}

Status checkInstance(const std::vector<RankLayout>& ctx) {
  if (ctx.empty()) return InvalidArgument("context instance has no ranks");
  const RankLayout& a = ctx[0];
  std::vector<bool> seen(uint64_t{a.tp} * a.pp, false);
  for (const RankLayout& l : ctx) {
    const std::string who = "ctx rank " + rankName(l);
    if (l.tp != a.tp || l.pp != a.pp) {
      return Incompatible(who + " has tp=" + std::to_string(l.tp) + " pp=" + std::to_string(l.pp) +
                          " != tp=" + std::to_string(a.tp) + " pp=" + std::to_string(a.pp) +
                          " of " + rankName(a));
    }
    if (l.layers_per_stage != a.layers_per_stage) {
      return Incompatible(who + " has a different layers_per_stage than " + rankName(a));
    }
    // Same model, dtypes and block size as the first rank: reuse the pairwise check's fields.
    if (l.model_fingerprint != a.model_fingerprint || l.kv_dtype != a.kv_dtype ||
        l.conv_dtype != a.conv_dtype || l.ssm_dtype != a.ssm_dtype ||
        l.tokens_per_block != a.tokens_per_block) {
      return Incompatible(who + " disagrees with " + rankName(a) +
                          " on model fingerprint, dtypes or tokens_per_block");
    }
    if (l.tp_rank >= l.tp || l.pp_rank >= l.pp) {
      return InvalidArgument(who + " is outside tp=" + std::to_string(l.tp) +
                             " pp=" + std::to_string(l.pp));
    }
    const uint64_t pos = uint64_t{l.pp_rank} * l.tp + l.tp_rank;
    if (seen[pos]) return InvalidArgument(who + " appears twice");
    seen[pos] = true;
  }
  if (ctx.size() != seen.size()) {
    return InvalidArgument("context instance has " + std::to_string(ctx.size()) +
                           " ranks, tp*pp=" + std::to_string(seen.size()));
  }
  return OkStatus();
}

StatusOr<Planner> Planner::build(std::vector<RankLayout> ctx, RankLayout gen) {
  for (const RankLayout& c : ctx) {
    if (Status s = checkCompatible(c, gen); !s.isOk()) {
      return s.withContext("ctx rank " + rankName(c) + " -> gen rank " + rankName(gen));
    }
  }
  Planner p;
  p.ctx_ = std::move(ctx);
  p.gen_ = std::move(gen);
  for (uint32_t i = 0; i < p.ctx_.size(); ++i) {
    auto map = buildSourceMap(p.ctx_[i], p.gen_);
    if (!map.isOk()) {
      return map.status().withContext("ctx rank " + rankName(p.ctx_[i]) + " -> gen rank " +
                                      rankName(p.gen_));
    }
    p.maps_.push_back(std::move(*map));
    const SourceMap& m = p.maps_.back();
    if (!m.block_maps.empty() || !m.slot_maps.empty()) {
      p.sources_.push_back({i, m.kv_bytes_per_block, m.state_bytes});
    }
  }
  return p;
}

StatusOr<Planner> Planner::create(std::vector<RankLayout> ctx, RankLayout gen) {
  RETURN_IF_ERROR(checkInstance(ctx));
  return build(std::move(ctx), std::move(gen));
}

StatusOr<Planner> Planner::createForSource(RankLayout ctx, RankLayout gen) {
  std::vector<RankLayout> one;
  one.push_back(std::move(ctx));
  return build(std::move(one), std::move(gen));
}

std::pair<uint64_t, uint64_t> Planner::kvTokens(BlockRange blocks) const {
  const uint64_t t = gen_.tokens_per_block;
  const uint64_t first = blocks.first_block * t;
  uint64_t end = blocks.end() * t;
  if (byToken() && blocks.num_tokens != 0) end = std::min(end, blocks.num_tokens);
  return {first, std::max(first, end)};
}

uint64_t Planner::expectedBytes(BlockRange blocks) const {
  if (!byToken())
    return uint64_t{blocks.num_blocks} * gen_.kvBytesPerBlock() + gen_.stateBytesPerSlot();
  const auto [first, end] = kvTokens(blocks);
  return (end - first) * (gen_.kvBytesPerBlock() / gen_.tokens_per_block) +
         gen_.stateBytesPerSlot();
}

uint64_t PackOp::elements() const {
  uint64_t n = 1;
  for (const BoxDim& d : dims) n *= d.size;
  return n;
}

RankIds placeholderIds(const RankLayout& l, uint64_t blocks) {
  RankIds out;  // states on ids 0.., the blocks after them where both share a pool
  const uint32_t first = l.joint_ids && l.num_blocks > l.state_groups ? l.state_groups : 0;
  const uint32_t span = std::max(l.num_blocks - first, 1u);
  for (uint64_t i = 0; i < blocks; ++i) {
    out.blocks.push_back(first + static_cast<uint32_t>(i % span));
  }
  for (uint32_t g = 1; g < l.state_groups; ++g) out.group_slots.push_back(g);
  return out;
}

Status checkStateIds(const RankLayout& l, const RankIds& ids, std::string_view side) {
  const std::string who(side);
  if (ids.group_slots.size() + 1 != l.state_groups) {
    return InvalidArgument(who + " state ids: " + std::to_string(ids.group_slots.size() + 1) +
                           " given (slot and " + std::to_string(ids.group_slots.size()) +
                           " group slots), the rank's layout has " +
                           std::to_string(l.state_groups) + " state groups");
  }
  auto what = [&](uint32_t id, uint32_t g) {
    return who + " state id " + std::to_string(id) + " of group " + std::to_string(g);
  };
  // Linear in groups + blocks: a peer may claim 65536 state groups and a million blocks.
  std::unordered_map<uint32_t, uint32_t> group_of;  // state id -> its (first) group
  if (l.joint_ids) group_of.reserve(l.state_groups);
  for (uint32_t g = 0; g < l.state_groups; ++g) {
    const uint32_t id = ids.stateId(g);
    if (id >= l.num_slots) {
      return InvalidArgument(what(id, g) + " >= num_slots=" + std::to_string(l.num_slots));
    }
    if (!l.joint_ids) continue;
    if (auto [it, fresh] = group_of.emplace(id, g); !fresh) {
      return InvalidArgument(what(id, g) + " is also group " + std::to_string(it->second) +
                             "'s (block and state ids share one pool)");
    }
  }
  if (!l.joint_ids) return OkStatus();
  for (size_t i = 0; i < ids.blocks.size(); ++i) {
    if (auto it = group_of.find(ids.blocks[i]); it != group_of.end()) {
      return InvalidArgument(what(it->first, it->second) +
                             " is also the request's block at position " + std::to_string(i) +
                             " (block and state ids share one pool)");
    }
  }
  return OkStatus();
}

Status Planner::checkDst(const RankIds& dst, BlockRange blocks) const {
  bool kv = false, state = false;
  for (const PoolView& v : gen_.views) (v.indexedByBlock() ? kv : state) = true;
  if (kv && blocks.num_blocks > 0) {
    if (dst.blocks.size() < blocks.end()) {
      return InvalidArgument("gen block ids: " + std::to_string(dst.blocks.size()) +
                             " given, blocks up to position " + std::to_string(blocks.end()) +
                             " are sent");
    }
    for (uint64_t i = blocks.first_block; i < blocks.end(); ++i) {
      const uint32_t d = dst.blocks[i];
      if (d >= gen_.num_blocks) {
        return InvalidArgument("gen block id " + std::to_string(d) + " at position " +
                               std::to_string(i) +
                               " >= num_blocks=" + std::to_string(gen_.num_blocks));
      }
    }
    // Each destination block is written by this request once: no id twice in the range. Sorted
    // rather than a bitmap of the pool, whose size is the peer's claim (up to 2^32 blocks).
    std::vector<uint32_t> sorted(dst.blocks.begin() + blocks.first_block,
                                 dst.blocks.begin() + blocks.end());
    std::sort(sorted.begin(), sorted.end());
    if (auto twice = std::adjacent_find(sorted.begin(), sorted.end()); twice != sorted.end()) {
      return InvalidArgument("gen block id " + std::to_string(*twice) +
                             " appears twice in positions [" + std::to_string(blocks.first_block) +
                             ", " + std::to_string(blocks.end()) + ")");
    }
  }
  if (state) return checkStateIds(gen_, dst, "gen");
  return OkStatus();
}

Status Planner::checkSrc(uint32_t ctx_index, const RankIds& src, BlockRange blocks) const {
  const SourceMap& m = maps_[ctx_index];
  const RankLayout& c = ctx_[ctx_index];
  if (m.by_token && !m.block_maps.empty()) {
    // Token ranges: the context blocks holding the tokens that move.
    const auto [first, end] = kvTokens(blocks);
    const uint64_t t = c.tokens_per_block;
    const uint64_t lo = first / t, hi = (end + t - 1) / t;
    if (end > first && src.blocks.size() < hi) {
      return InvalidArgument("ctx block ids: " + std::to_string(src.blocks.size()) +
                             " given, tokens up to " + std::to_string(end) + " are sent, in " +
                             std::to_string(hi) + " blocks of " + std::to_string(t) + " tokens");
    }
    for (uint64_t i = lo; end > first && i < hi; ++i) {
      if (src.blocks[i] >= c.num_blocks) {
        return InvalidArgument("ctx block id " + std::to_string(src.blocks[i]) + " at position " +
                               std::to_string(i) +
                               " >= num_blocks=" + std::to_string(c.num_blocks));
      }
    }
  } else if (!m.block_maps.empty() && blocks.num_blocks > 0) {
    if (src.blocks.size() < blocks.end()) {
      return InvalidArgument("ctx block ids: " + std::to_string(src.blocks.size()) +
                             " given, blocks up to position " + std::to_string(blocks.end()) +
                             " are sent");
    }
    for (uint64_t i = blocks.first_block; i < blocks.end(); ++i) {
      if (src.blocks[i] >= c.num_blocks) {
        return InvalidArgument("ctx block id " + std::to_string(src.blocks[i]) + " at position " +
                               std::to_string(i) +
                               " >= num_blocks=" + std::to_string(c.num_blocks));
      }
    }
  }
  if (!m.slot_maps.empty()) {
    return checkStateIds(c, src, "ctx");
  }
  return OkStatus();
}

void Planner::emit(uint32_t ctx_index, const RankIds& src, const RankIds& dst, BlockRange blocks,
                   LayerRange layers, RankPlan* out) const {
  const SourceMap& m = maps_[ctx_index];
  out->ctx_index = ctx_index;
  out->ops.clear();
  out->pack_ops.clear();
  out->scratch_bytes = m.slot_maps.empty() ? 0 : m.scratch_bytes;
  const bool moves_kv = !m.block_maps.empty() && blocks.num_blocks > 0;
  size_t estimate = m.slot_maps.empty() ? 0 : m.segments.size();
  if (moves_kv && !m.by_token) {
    size_t per_block = 0;
    for (const RecordMap& r : m.block_maps) per_block += r.seg_end - r.seg_begin;
    estimate += per_block * blocks.num_blocks;
  }
  std::vector<CopyOp>& ops = out->ops;
  ops.reserve(estimate);
  const Segment* segs = m.segments.data();
  uint64_t kv_bytes = moves_kv ? m.kv_bytes_per_block * blocks.num_blocks : 0;
  if (moves_kv && m.by_token) {
    // kv by token ranges: each piece is a run of tokens inside one context block and one
    // generation block; pieces of the same offsets and length share their segments.
    const auto [first, end] = kvTokens(blocks);
    const uint64_t tc = ctx_[ctx_index].tokens_per_block, tg = gen_.tokens_per_block;
    std::map<std::tuple<uint32_t, uint64_t, uint64_t, uint64_t>, std::vector<Segment>> memo;
    for (const BlockGroup& grp : m.block_groups) {
      for (uint64_t t = first; t < end;) {
        const uint64_t ci = t % tc, gi = t % tg;
        const uint64_t n = std::min({tc - ci, tg - gi, end - t});
        const uint64_t s = src.blocks[t / tc], d = dst.blocks[t / tg];
        for (uint32_t k = grp.map_begin; k < grp.map_end; ++k) {
          const RecordMap& r = m.block_maps[k];
          if (!layers.contains(r.layer)) continue;
          const auto inserted = memo.try_emplace({k, ci, gi, n});
          std::vector<Segment>& piece = inserted.first->second;
          if (inserted.second) {
            for (uint32_t b = r.box_begin; b < r.box_end; ++b) {
              const TokenBox& box = m.token_boxes[b];
              std::vector<BoxDim> dims = box.dims;
              dims[box.token_dim].size = n;
              const uint64_t ctx_at = box.ctx_base + ci * box.dims[box.token_dim].a_stride;
              const uint64_t gen_at = box.gen_base + gi * box.dims[box.token_dim].b_stride;
              forEachRun(std::move(dims), box.element_bytes, ctx_at, gen_at,
                         [&piece](uint64_t a, uint64_t b2, uint64_t bytes) {
                           appendSegment(piece, 0, a, b2, bytes);
                         });
            }
          }
          const uint64_t sb = r.src_base + s * r.src_stride;
          const uint64_t db = r.dst_base + d * r.dst_stride;
          for (const Segment& g : piece) {
            appendOp(ops, r.src_region, sb + g.src_off, r.dst_region, db + g.dst_off, g.bytes);
          }
        }
        t += n;
      }
    }
    kv_bytes = (end - first) * m.kv_bytes_per_token;
  } else if (moves_kv) {
    for (const BlockGroup& grp : m.block_groups) {
      for (uint64_t i = blocks.first_block; i < blocks.end(); ++i) {
        const uint64_t s = src.blocks[i], d = dst.blocks[i];
        for (uint32_t k = grp.map_begin; k < grp.map_end; ++k) {
          const RecordMap& r = m.block_maps[k];
          if (!layers.contains(r.layer)) continue;
          const uint64_t sb = r.src_base + s * r.src_stride;
          const uint64_t db = r.dst_base + d * r.dst_stride;
          for (uint32_t j = r.seg_begin; j < r.seg_end; ++j) {
            appendOp(ops, r.src_region, sb + segs[j].src_off, r.dst_region, db + segs[j].dst_off,
                     segs[j].bytes);
          }
        }
      }
    }
  }
  for (const RecordMap& r : m.slot_maps) {
    if (!layers.contains(r.layer)) continue;
    const uint64_t sb = r.src_base + uint64_t{src.stateId(r.src_group)} * r.src_stride;
    const uint64_t db = r.dst_base + uint64_t{dst.stateId(r.dst_group)} * r.dst_stride;
    for (uint32_t j = r.seg_begin; j < r.seg_end; ++j) {
      appendOp(ops, r.src_region, sb + segs[j].src_off, r.dst_region, db + segs[j].dst_off,
               segs[j].bytes);
    }
    for (uint32_t j = r.pack_begin; j < r.pack_end; ++j) {
      PackOp pack = m.packs[j];
      pack.src_region = r.src_region;
      pack.src_offset += sb;
      out->pack_ops.push_back(std::move(pack));
    }
    for (uint32_t j = r.staged_begin; j < r.staged_end; ++j) {
      appendOp(ops, kScratchRegion, m.staged[j].src_off, r.dst_region, db + m.staged[j].dst_off,
               m.staged[j].bytes);
    }
  }
  out->bytes = kv_bytes + (m.slot_maps.empty() ? 0 : m.state_bytes);
  if (layers != kAllLayers) {
    out->bytes = 0;
    for (const CopyOp& op : ops) out->bytes += op.bytes;
  }
}

Status Planner::planRankInto(uint32_t ctx_index, const RankIds& src, const RankIds& dst,
                             BlockRange blocks, RankPlan* out, LayerRange layers) const {
  if (ctx_index >= maps_.size()) {
    return InvalidArgument("ctx_index=" + std::to_string(ctx_index) + " but the planner has " +
                           std::to_string(maps_.size()) + " context ranks");
  }
  RETURN_IF_ERROR(checkDst(dst, blocks));
  RETURN_IF_ERROR(checkSrc(ctx_index, src, blocks));
  emit(ctx_index, src, dst, blocks, layers, out);
  return OkStatus();
}

StatusOr<RankPlan> Planner::planRank(uint32_t ctx_index, const RankIds& src, const RankIds& dst,
                                     BlockRange blocks, LayerRange layers) const {
  RankPlan plan;
  RETURN_IF_ERROR(planRankInto(ctx_index, src, dst, blocks, &plan, layers));
  return plan;
}

Status Planner::planInto(const std::vector<RankIds>& ctx_ids, const RankIds& dst, BlockRange blocks,
                         RequestPlan* out) const {
  if (ctx_ids.size() != ctx_.size()) {
    return InvalidArgument("ctx ids for " + std::to_string(ctx_ids.size()) +
                           " ranks, the planner has " + std::to_string(ctx_.size()));
  }
  RETURN_IF_ERROR(checkDst(dst, blocks));
  for (const SourceSummary& s : sources_) {
    if (Status st = checkSrc(s.ctx_index, ctx_ids[s.ctx_index], blocks); !st.isOk()) {
      return st.withContext("ctx rank " + rankName(ctx_[s.ctx_index]));
    }
  }
  out->ranks.resize(ctx_.size());
  out->total_bytes = out->total_ops = out->total_pack_ops = 0;
  for (uint32_t i = 0; i < ctx_.size(); ++i) {
    emit(i, ctx_ids[i], dst, blocks, kAllLayers, &out->ranks[i]);
    out->total_bytes += out->ranks[i].bytes;
    out->total_ops += out->ranks[i].ops.size();
    out->total_pack_ops += out->ranks[i].pack_ops.size();
  }
  return OkStatus();
}

StatusOr<RequestPlan> Planner::plan(const std::vector<RankIds>& ctx_ids, const RankIds& dst,
                                    BlockRange blocks) const {
  RequestPlan out;
  RETURN_IF_ERROR(planInto(ctx_ids, dst, blocks, &out));
  return out;
}

StatusOr<RequestPlan> planRequest(const std::vector<RankLayout>& ctx,
                                  const std::vector<RankIds>& ctx_ids, const RankLayout& gen,
                                  const RankIds& gen_ids, BlockRange blocks) {
  ASSIGN_OR_RETURN(Planner p, Planner::create(ctx, gen));
  return p.plan(ctx_ids, gen_ids, blocks);
}

}  // namespace hxfer
