// Property suite over random record descriptions. Where planner_property_test.cc
// uses the named engine layouts, here every view of every rank is laid out at random:
//   * its RecordLayout: the role's logical dims in a random order (the sharded unit dim
//     anywhere, holding the rank's units of every section in order, as record_layout.h
//     requires), each stride the extent of the dims inside it plus, sometimes, a gap; or no
//     description at all (hxfer's contiguous order);
//   * the views: K and V in one view or in views of their own (with or without a size-1 "kv"
//     dim), a layer group in one view or one view per layer;
//   * the regions: several views sharing one on a common pitch (vLLM's [conv | ssm] page,
//     trtllm-v2's coalesced per-block buffers, even kv next to state), index-major (paged) or
//     layer-major, with padding before, between and after records and pages.
// The two sides of a case and every rank of a side get layouts of their own. Over tp and pp
// pairs, every case runs the whole transfer (runLocalTransfer) and proves, on every generation
// rank, that each destination byte was written exactly once, holds what the oracle says, and
// that nothing else was written: padding, gaps inside records, other blocks and the other slot
// (checkCoverage compares the ops' destination intervals with the records' bytes exactly).
//
// One restriction, by design (docs/layouts.md): kv records are never staged, so a kv pair
// whose every run would be one element is refused. Both sides of a case therefore keep the
// same kv dim ("dim" or "token", the case draws which) innermost and contiguous, as engines do
// with head_dim; every other kv dim and every state dim goes anywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "cache/layout.h"
#include "cache/record_layout.h"
#include "plan/local_transfer.h"
#include "plan/memory.h"
#include "plan/oracle.h"
#include "plan/plan_test_util.h"
#include "plan/planner.h"

namespace hxfer {
namespace {

using testing::makeModel;
using testing::randomModel;
using testing::randomSplit;

constexpr uint64_t kSeed = 20250114;

using Rng = std::mt19937_64;

uint32_t pick(Rng& rng, uint32_t lo, uint32_t hi) {
  return std::uniform_int_distribution<uint32_t>(lo, hi)(rng);
}
bool oneIn(Rng& rng, uint32_t n) { return pick(rng, 1, n) == 1; }

// How often the generator took each choice, so that the suite can insist it took all of them.
struct Stats {
  int views = 0, undescribed = 0, gapped = 0, unit_dim_moved = 0;
  int kv_joined = 0, kv_split = 0, kv_split_with_kv_dim = 0;
  int multi_layer_views = 0, shared_regions = 0, kv_and_state_regions = 0;
  int layer_major_regions = 0, padded_pitches = 0;
};

// Which kv dim a record (`canonical`: its sizes) keeps innermost and contiguous: `preferred` unless
// it has size 1 ("token" at tokens_per_block 1, "dim" at head_dim 1), then the other one.
std::string kvInnermost(const RecordLayout& canonical, const std::string& preferred) {
  const std::string other = preferred == "dim" ? "token" : "dim";
  return canonical.find(preferred)->size > 1 ? preferred : other;
}

// The innermost dim of size > 1 of a contiguous record ("" when every dim has size 1).
std::string innermostDim(const RecordLayout& r) {
  for (size_t i = r.dims.size(); i-- > 0;) {
    if (r.dims[i].size > 1) return r.dims[i].name;
  }
  return "";
}

// A random description of view `v` on rank `l`, or none (hxfer's order) when `v` may stay
// undescribed. kv records keep kvInnermost(kv_inner) innermost at stride element_bytes.
std::optional<RecordLayout> randomRecord(Rng& rng, const ModelSpec& model, const RankLayout& l,
                                         const PoolView& v, const std::string& kv_inner,
                                         Stats* stats) {
  const uint32_t e = static_cast<uint32_t>(dtypeSize(l.dtypeOf(v.role)));
  const std::vector<uint32_t> local = localUnitCounts(v.sections, l.tp, l.tp_rank).value();
  RecordLayout r = canonicalRecordLayout(v.kind, v.role, v.sections, local, e,
                                         innerSizes(model, model.layers[v.layers[0]], v.role))
                       .value();
  const std::string unit_dim = logicalDims(v.kind, v.role).unit_dim;
  const size_t canonical_unit_pos =
      std::find_if(r.dims.begin(), r.dims.end(),
                   [&](const RecordDim& d) { return d.name == unit_dim; }) -
      r.dims.begin();
  std::string inner;  // kv only: the dim that stays innermost and contiguous
  if (v.role == Role::kKv) inner = kvInnermost(r, kv_inner);
  // Undescribed: hxfer's contiguous order, whose innermost kv dim must be the agreed one.
  if (oneIn(rng, 5) &&
      (v.role != Role::kKv || innermostDim(r) == inner || r.find(inner)->size == 1)) {
    ++stats->undescribed;
    return std::nullopt;
  }
  if (v.role == Role::kKv && v.sections.size() == 1 && oneIn(rng, 2)) {
    r.dims.insert(r.dims.begin(), {"kv", 1, 0});  // K alone, still naming the section dim
    ++stats->kv_split_with_kv_dim;
  }
  std::shuffle(r.dims.begin(), r.dims.end(), rng);
  if (!inner.empty()) {
    auto it = std::find_if(r.dims.begin(), r.dims.end(),
                           [&](const RecordDim& d) { return d.name == inner; });
    std::rotate(it, it + 1, r.dims.end());
  }
  uint64_t extent = e;  // one past the last byte of the dims inside the current one
  bool gapped = false;
  for (size_t i = r.dims.size(); i-- > 0;) {
    RecordDim& d = r.dims[i];
    const bool contiguous = i + 1 == r.dims.size() && !inner.empty();
    const uint64_t gap = !contiguous && d.size > 1 && oneIn(rng, 3) ? e * pick(rng, 1, 3) : 0;
    gapped |= gap > 0;
    d.stride = extent + gap;
    extent += uint64_t{d.size - 1} * d.stride;
  }
  const size_t unit_pos = std::find_if(r.dims.begin(), r.dims.end(),
                                       [&](const RecordDim& d) { return d.name == unit_dim; }) -
                          r.dims.begin();
  stats->gapped += gapped;
  stats->unit_dim_moved += unit_pos != canonical_unit_pos;
  return r;
}

std::string describeLayout(const RankLayout& l) {
  std::string s = "  rank (tp_rank " + std::to_string(l.tp_rank) + ", pp_rank " +
                  std::to_string(l.pp_rank) + "):\n";
  for (const RegionSpec& r : l.regions) {
    s += "    region " + std::to_string(r.id) + " length " + std::to_string(r.length) + "\n";
  }
  for (const PoolView& v : l.views) {
    s += "    " + std::string(roleName(v.role)) + " " + std::string(layerKindName(v.kind)) +
         " layers";
    for (uint32_t layer : v.layers) s += " " + std::to_string(layer);
    s += " sections";
    for (const Section& sec : v.sections) s += " " + sec.name;
    s += " region " + std::to_string(v.region_id) + " base " + std::to_string(v.base) +
         " index_stride " + std::to_string(v.index_stride) + " layer_stride " +
         std::to_string(v.layer_stride) + ": " +
         (v.record ? v.record->toString() : std::string("hxfer order")) + "\n";
  }
  return s;
}

// Rank (tp_rank, pp_rank) of `model` at `pc` with every view and region laid out at random
// (the file banner). Deterministic in `seed`.
StatusOr<RankLayout> randomRankLayout(const ModelSpec& model, const ParallelConfig& pc,
                                      uint32_t tp_rank, uint32_t pp_rank, uint32_t num_blocks,
                                      uint32_t num_slots, uint64_t seed,
                                      const std::string& kv_inner, Stats* stats) {
  Stats ignored;
  if (stats == nullptr) stats = &ignored;
  Rng rng(seed);
  ASSIGN_OR_RETURN(RankLayout out, buildRankLayout(model, pc, tp_rank, pp_rank, StateLayout::kPaged,
                                                   num_blocks, num_slots));
  const std::vector<PoolView> groups = std::move(out.views);
  out.views.clear();
  out.regions.clear();
  // The views: K|V joined or apart, a group's layers in one view or one view each.
  std::vector<PoolView> views;
  for (const PoolView& g : groups) {
    std::vector<std::vector<Section>> parts = {g.sections};
    if (g.role == Role::kKv && oneIn(rng, 2)) {
      parts = {{g.sections[0]}, {g.sections[1]}};
      stats->kv_split += 2;
    } else if (g.role == Role::kKv) {
      ++stats->kv_joined;
    }
    std::vector<std::vector<uint32_t>> layer_sets = {g.layers};
    if (g.layers.size() > 1 && oneIn(rng, 2)) {
      layer_sets.clear();
      for (uint32_t layer : g.layers) layer_sets.push_back({layer});
    }
    for (const auto& sections : parts) {
      for (const auto& layers : layer_sets) {
        PoolView v = g;
        v.sections = sections;
        v.layers = layers;
        ASSIGN_OR_RETURN(v.record_bytes, localRecordBytes(sections, out.tp, out.tp_rank));
        v.record = randomRecord(rng, model, out, v, kv_inner, stats);
        stats->multi_layer_views += layers.size() > 1;
        ++stats->views;
        views.push_back(std::move(v));
      }
    }
  }
  // The regions: views with the same number of layers (so that they interleave on one pitch)
  // share one, a few at a time; kv and state apart, except now and then.
  const bool mix_roles = oneIn(rng, 4);
  std::shuffle(views.begin(), views.end(), rng);
  std::stable_sort(views.begin(), views.end(), [&](const PoolView& a, const PoolView& b) {
    if (a.layers.size() != b.layers.size()) return a.layers.size() < b.layers.size();
    return !mix_roles && a.indexedByBlock() && !b.indexedByBlock();
  });
  for (size_t begin = 0; begin < views.size();) {
    size_t end = begin + 1;
    const size_t want = pick(rng, 1, 4);
    while (end < views.size() && end - begin < want &&
           views[end].layers.size() == views[begin].layers.size() &&
           (mix_roles || views[end].indexedByBlock() == views[begin].indexedByBlock())) {
      ++end;
    }
    // One cell holds a record of every member, at its own offset: [pad|rec|pad|rec|...|pad].
    uint64_t cell = oneIn(rng, 2) ? pick(rng, 1, 24) : 0;
    const uint64_t head = oneIn(rng, 2) ? pick(rng, 1, 100) : 0;  // bytes before the first cell
    bool has_kv = false, has_state = false;
    uint64_t indices = 0, fewest = UINT64_MAX;
    for (size_t i = begin; i < end; ++i) {
      views[i].base = head + cell;
      cell += views[i].span() + (oneIn(rng, 3) ? pick(rng, 1, 24) : 0);
      indices = std::max<uint64_t>(indices, views[i].num_indices);
      fewest = std::min<uint64_t>(fewest, views[i].num_indices);
      (views[i].indexedByBlock() ? has_kv : has_state) = true;
    }
    const uint64_t layers = views[begin].layers.size();
    const uint64_t pad_cells = oneIn(rng, 3) ? pick(rng, 1, 2) : 0;  // a page or layer padded
    // Layer-major, a view of one index steps by the layer pitch, the others by the cell:
    // validate() wants one common stride in a shared region, so not with kv of one block
    // next to state of two slots.
    const bool layer_major = layers > 1 && (fewest > 1 || fewest == indices) && oneIn(rng, 2);
    uint64_t index_stride = cell, layer_stride = 0, length = indices * cell;
    if (layers > 1 && !layer_major) {
      layer_stride = cell;
      index_stride = (layers + pad_cells) * cell;
      length = indices * index_stride;
    } else if (layer_major) {
      layer_stride = (indices + pad_cells) * cell;
      length = layers * layer_stride;
    } else {
      index_stride = cell + pad_cells * pick(rng, 1, 16);
      length = indices * index_stride;
    }
    const uint32_t region = static_cast<uint32_t>(out.regions.size());
    out.regions.push_back({region, head + length + (oneIn(rng, 2) ? pick(rng, 1, 64) : 0),
                           "r" + std::to_string(region)});
    for (size_t i = begin; i < end; ++i) {
      views[i].region_id = region;
      views[i].index_stride = index_stride;
      views[i].layer_stride = layer_stride;
    }
    stats->shared_regions += end - begin > 1;
    stats->kv_and_state_regions += has_kv && has_state;
    stats->layer_major_regions += layer_major;
    stats->padded_pitches += pad_cells > 0;
    begin = end;
  }
  out.views = std::move(views);
  if (Status s = out.validate(); !s.isOk()) return s.withContext("\n" + describeLayout(out));
  return out;
}

// One case: the layouts of both sides are drawn from `seed`.
struct Case {
  ModelSpec model;
  LocalTransferOptions options;
  uint64_t seed = 0;
  std::string kv_inner;  // "dim" or "token"
};

RankLayoutBuilder randomBuilder(uint64_t side_seed, const std::string& kv_inner, Stats* stats) {
  return [=](const ModelSpec& m, const ParallelConfig& pc, uint32_t tp_rank, uint32_t pp_rank,
             uint32_t num_blocks, uint32_t num_slots) {
    return randomRankLayout(m, pc, tp_rank, pp_rank, num_blocks, num_slots,
                            side_seed * 1000003 + pp_rank * 64 + tp_rank, kv_inner, stats);
  };
}

Case makeCase(const ModelSpec& model, uint32_t ctx_tp, uint32_t ctx_pp, uint32_t gen_tp,
              uint32_t gen_pp, uint64_t seed, Stats* stats) {
  Rng rng(seed);
  Case c;
  c.model = model;
  c.seed = seed;
  c.kv_inner = oneIn(rng, 2) ? "dim" : "token";
  LocalTransferOptions& o = c.options;
  o.use_regions = false;
  o.ctx.tp = ctx_tp;
  o.gen.tp = gen_tp;
  o.ctx.pp = std::min(ctx_pp, model.numLayers());
  o.gen.pp = std::min(gen_pp, model.numLayers());
  o.ctx.layers_per_stage = randomSplit(rng, model.numLayers(), o.ctx.pp);
  o.gen.layers_per_stage = randomSplit(rng, model.numLayers(), o.gen.pp);
  o.tokens = 1 + pick(rng, 0, 5 * model.tokens_per_block);
  o.prefix_tokens = oneIn(rng, 3) ? pick(rng, 0, o.tokens) : 0;
  // A generation side with its own tokens per block: kv moves by token ranges.
  if (oneIn(rng, 4)) o.gen_tokens_per_block = 1 + pick(rng, 0, 2 * model.tokens_per_block);
  o.spare_blocks = pick(rng, 0, 3);
  o.seed = rng();
  o.request_id = rng();
  o.ctx_builder = randomBuilder(rng(), c.kv_inner, stats);
  o.gen_builder = randomBuilder(rng(), c.kv_inner, stats);
  return c;
}

// Everything needed to reproduce and read a failing case: the seeds, the model, the
// parallelism and every rank's layout on both sides.
std::string describe(const Case& c) {
  const LocalTransferOptions& o = c.options;
  std::string s = "seed " + std::to_string(kSeed) + ", case seed " + std::to_string(c.seed) +
                  ", kv innermost " + c.kv_inner + "; layers:";
  for (const LayerSpec& l : c.model.layers) s += " " + l.kindName();
  s += " T=" + std::to_string(c.model.tokens_per_block) +
       (o.gen_tokens_per_block ? " (gen T=" + std::to_string(o.gen_tokens_per_block) + ")" : "") +
       "; ctx tp" + std::to_string(o.ctx.tp) + " pp" + std::to_string(o.ctx.pp) + " -> gen tp" +
       std::to_string(o.gen.tp) + " pp" + std::to_string(o.gen.pp) + ", tokens " +
       std::to_string(o.tokens) + " prefix " + std::to_string(o.prefix_tokens) + "\n";
  for (const auto& [name, pc, build] :
       {std::tuple{"ctx", o.ctx, o.ctx_builder}, std::tuple{"gen", o.gen, o.gen_builder}}) {
    ModelSpec m = c.model;
    if (std::string(name) == "gen" && o.gen_tokens_per_block) {
      m.tokens_per_block = o.gen_tokens_per_block;
    }
    const uint32_t t = m.tokens_per_block;
    const uint32_t blocks = (o.tokens + t - 1) / t + o.spare_blocks;
    s += std::string(name) + ":\n";
    for (uint32_t pp = 0; pp < pc.pp; ++pp) {
      for (uint32_t tp = 0; tp < pc.tp; ++tp) {
        auto l = build(m, pc, tp, pp, std::max(blocks, 1u), std::max(o.num_slots, 1u));
        s += l.isOk() ? describeLayout(*l) : "  " + l.status().toString() + "\n";
      }
    }
  }
  return s;
}

TEST(PlannerRandomLayout, RandomRecordDescriptionsOnBothSidesMoveEveryByteExactlyOnce) {
  Rng rng(kSeed);
  const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}, {4, 1}, {1, 4},
                                               {2, 4}, {4, 2}, {2, 2}, {8, 2}};
  const std::pair<uint32_t, uint32_t> pps[] = {{1, 1}, {2, 1}, {1, 2}, {2, 2}};
  // Every kind in one model, replicated units (1 kv head, 1 B/C group) at tp > 1, alongside
  // the random models.
  LayerSpec hybrid = testing::mamba2Layer(8, 3, 1, 5, 4);
  hybrid.attention = AttentionShape{2, 3};
  std::vector<ModelSpec> models = {
      makeModel({testing::attentionLayer(1, 5), testing::mamba2Layer(8, 3, 1, 5, 4),
                 testing::gdnLayer(2, 4, 3, 2, 3), testing::mamba1Layer(8, 3, 4), hybrid,
                 LayerSpec{}, testing::attentionLayer(1, 5)},
                3)};
  for (int i = 0; i < 40; ++i) models.push_back(randomModel(rng));
  Stats stats;
  int cases = 0, staged = 0;
  for (const ModelSpec& model : models) {
    ASSERT_TRUE(model.validate().isOk()) << model.validate().toString();
    for (const auto& [ctx_tp, gen_tp] : tps) {
      if (!checkShardable(model, {ctx_tp, 1, {}}).isOk() ||
          !checkShardable(model, {gen_tp, 1, {}}).isOk()) {
        continue;
      }
      for (int draw = 0; draw < 2; ++draw) {  // two of the pp pairs, random layouts each
        const auto [ctx_pp, gen_pp] = pps[pick(rng, 0, 3)];
        const Case c = makeCase(model, ctx_tp, ctx_pp, gen_tp, gen_pp, rng(), &stats);
        auto r = runLocalTransfer(c.model, c.options);
        ASSERT_TRUE(r.isOk()) << r.status().toString() << "\n" << describe(c);
        EXPECT_EQ(r->coverage_errors, 0u) << r->first_coverage_error << "\n" << describe(c);
        EXPECT_TRUE(r->oracle.ok()) << r->oracle.toString() << "\n" << describe(c);
        EXPECT_EQ(r->total_bytes, r->expected_bytes) << describe(c);
        EXPECT_EQ(r->oracle.bytes_checked, r->expected_bytes) << describe(c);
        ASSERT_TRUE(r->verified()) << describe(c);
        staged += r->total_pack_ops > 0;
        ++cases;
      }
    }
  }
  // The suite proves something only if the generator took every road.
  EXPECT_GT(cases, 100);
  EXPECT_GT(staged, 10) << "element orders that differ inside state units";
  EXPECT_GT(stats.undescribed, 0);
  EXPECT_GT(stats.gapped, 0);
  EXPECT_GT(stats.unit_dim_moved, 0);
  EXPECT_GT(stats.kv_joined, 0);
  EXPECT_GT(stats.kv_split, 0);
  EXPECT_GT(stats.kv_split_with_kv_dim, 0);
  EXPECT_GT(stats.multi_layer_views, 0);
  EXPECT_GT(stats.shared_regions, 0);
  EXPECT_GT(stats.kv_and_state_regions, 0);
  EXPECT_GT(stats.layer_major_regions, 0);
  EXPECT_GT(stats.padded_pitches, 0);
  std::printf(
      "[ random layouts ] seed %llu: %d cases (%d staged), %d views: %d undescribed, %d with "
      "gaps, %d unit dim moved, kv %d joined / %d apart (%d naming kv), %d multi-layer; "
      "regions: %d shared, %d kv+state, %d layer-major, %d padded pitch\n",
      static_cast<unsigned long long>(kSeed), cases, staged, stats.views, stats.undescribed,
      stats.gapped, stats.unit_dim_moved, stats.kv_joined, stats.kv_split,
      stats.kv_split_with_kv_dim, stats.multi_layer_views, stats.shared_regions,
      stats.kv_and_state_regions, stats.layer_major_regions, stats.padded_pitches);
}

// `l` described wrongly: every view gets a contiguous record with its dims nested the other
// way round (kv keeps its innermost dim, so that kv still plans). The span never grows, so the
// layout stays valid, but where two dims have size > 1 elements sit elsewhere, and where the
// true record has gaps they sit in other bytes (*gapped).
RankLayout misdescribed(const ModelSpec& model, RankLayout l, bool* gapped) {
  for (PoolView& v : l.views) {
    const uint32_t e = static_cast<uint32_t>(dtypeSize(l.dtypeOf(v.role)));
    const std::vector<uint32_t> local = localUnitCounts(v.sections, l.tp, l.tp_rank).value();
    const std::vector<uint32_t> inner = innerSizes(model, model.layers[v.layers[0]], v.role);
    const RecordLayout r =
        v.record ? *v.record
                 : canonicalRecordLayout(v.kind, v.role, v.sections, local, e, inner).value();
    std::vector<std::string> order;
    for (const RecordDim& d : r.dims) order.push_back(d.name);
    std::reverse(order.begin(), order.end() - (v.role == Role::kKv ? 1 : 0));
    v.record = contiguousRecordLayout(v.kind, v.role, v.sections, local, e, inner, order).value();
    *gapped |= r.span() != v.record_bytes;
  }
  return l;
}

struct Verification {
  OracleReport oracle;
  uint64_t coverage_errors = 0;
  std::string first_coverage_error;
};

// runLocalTransfer's steps, except that the plan is made for misdescribed() layouts of the
// chosen side while the bytes are filled, moved and checked in the true ones.
StatusOr<Verification> runMisplanned(const Case& c, bool wrong_ctx, bool wrong_gen, bool* gapped) {
  const LocalTransferOptions& o = c.options;
  const uint32_t t = c.model.tokens_per_block;
  const uint32_t request_blocks = (o.tokens + t - 1) / t;
  const BlockRange blocks{o.prefix_tokens / t, request_blocks - o.prefix_tokens / t};
  ASSIGN_OR_RETURN(std::vector<LocalRank> ctx,
                   makeLocalInstance(c.model, o.ctx, o.ctx_builder, request_blocks, o, 1, true));
  ASSIGN_OR_RETURN(std::vector<LocalRank> gen,
                   makeLocalInstance(c.model, o.gen, o.gen_builder, request_blocks, o, 2, true));
  std::vector<RankLayout> ctx_planned;
  std::vector<RankIds> ctx_ids;
  bool ignored = false;
  for (LocalRank& r : ctx) {
    RETURN_IF_ERROR(fillRank(r.layout, r.mem, r.ids, o.request_id));
    ctx_planned.push_back(wrong_ctx ? misdescribed(c.model, r.layout, &ignored) : r.layout);
    ctx_ids.push_back(r.ids);
  }
  Verification out;
  for (LocalRank& g : gen) {
    const RankLayout planned = wrong_gen ? misdescribed(c.model, g.layout, gapped) : g.layout;
    ASSIGN_OR_RETURN(Planner planner, Planner::create(ctx_planned, planned));
    ASSIGN_OR_RETURN(RequestPlan plan, planner.plan(ctx_ids, g.ids, blocks));
    for (const RankPlan& rp : plan.ranks) {
      RETURN_IF_ERROR(executePlan(rp, ctx[rp.ctx_index].mem, g.mem));
    }
    out.coverage_errors += checkCoverage(plan, g.layout, g.ids, blocks, &out.first_coverage_error);
    ASSIGN_OR_RETURN(OracleReport report, checkRank(g.layout, g.mem, g.ids, o.request_id, blocks));
    out.oracle.merge(report);
  }
  return out;
}

// The suite above can fail: with the same random layouts, a plan made for a layout other than
// the one the bytes are executed on does not verify. A generation rank whose records lie in
// another order than planned fails the oracle, and where its true records have gaps, also the
// coverage check (the plan writes into the padding and leaves record bytes unwritten). A
// context rank described wrongly fails the oracle alone: the destination bytes written are
// still exactly the records'.
TEST(PlannerRandomLayout, ExecutingOnALayoutOtherThanThePlannedOneFailsVerification) {
  using namespace testing;
  const ModelSpec model = makeModel({attentionLayer(4, 8), mamba2Layer(8, 2, 2, 4, 4),
                                     mamba1Layer(8, 4, 3), attentionLayer(4, 8)},
                                    4);
  Rng rng(kSeed + 1);
  const std::pair<uint32_t, uint32_t> tps[] = {{1, 1}, {2, 1}, {1, 2}, {2, 4}};
  int coverage_failures = 0;
  for (const auto& [ctx_tp, gen_tp] : tps) {
    for (int i = 0; i < 3; ++i) {
      const Case c = makeCase(model, ctx_tp, 1, gen_tp, i == 2 ? 2 : 1, rng(), nullptr);
      bool gapped = false;
      auto gen_wrong = runMisplanned(c, false, true, &gapped);
      ASSERT_TRUE(gen_wrong.isOk()) << gen_wrong.status().toString() << "\n" << describe(c);
      EXPECT_GT(gen_wrong->oracle.mismatched_bytes, 0u) << describe(c);
      if (gapped) {
        EXPECT_GT(gen_wrong->coverage_errors, 0u) << describe(c);
        ++coverage_failures;
      }
      bool unused = false;
      auto ctx_wrong = runMisplanned(c, true, false, &unused);
      ASSERT_TRUE(ctx_wrong.isOk()) << ctx_wrong.status().toString() << "\n" << describe(c);
      EXPECT_GT(ctx_wrong->oracle.mismatched_bytes, 0u) << describe(c);
      EXPECT_EQ(ctx_wrong->coverage_errors, 0u) << ctx_wrong->first_coverage_error << "\n"
                                                << describe(c);
      // The same case planned for the layouts it runs on verifies.
      auto right = runMisplanned(c, false, false, &unused);
      ASSERT_TRUE(right.isOk()) << right.status().toString() << "\n" << describe(c);
      EXPECT_TRUE(right->oracle.ok() && right->coverage_errors == 0)
          << right->oracle.toString() << " / " << right->first_coverage_error << "\n"
          << describe(c);
    }
  }
  EXPECT_GT(coverage_failures, 0);
}

}  // namespace
}  // namespace hxfer
