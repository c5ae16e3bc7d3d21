// Named regressions for the planner's known failure modes, compatibility refusals and the
// API contract the engine relies on.
#include "plan/planner.h"

#include <gtest/gtest.h>

#include <chrono>
#include <set>
#include <string>

#include "plan/local_transfer.h"
#include "plan/oracle.h"
#include "plan/plan_test_util.h"

namespace hxfer {
namespace {

using namespace testing;

// Context indices whose ops write byte `offset` of region `region` (each plan is one gen rank).
std::vector<uint32_t> writersOf(const RequestPlan& plan, uint32_t region, uint64_t offset) {
  std::vector<uint32_t> out;
  for (const RankPlan& rp : plan.ranks) {
    for (const CopyOp& op : rp.ops) {
      if (op.dst_region == region && offset >= op.dst_offset && offset < op.dst_offset + op.bytes) {
        out.push_back(rp.ctx_index);
      }
    }
  }
  return out;
}

std::vector<RankLayout> layoutsOf(const std::vector<LocalRank>& ranks) {
  std::vector<RankLayout> out;
  for (const LocalRank& r : ranks) out.push_back(r.layout);
  return out;
}
std::vector<RankIds> idsOf(const std::vector<LocalRank>& ranks) {
  std::vector<RankIds> out;
  for (const LocalRank& r : ranks) out.push_back(r.ids);
  return out;
}

LocalTransferOptions opts(uint32_t ctx_tp, uint32_t gen_tp) {
  LocalTransferOptions o;
  o.use_regions = false;
  o.ctx.tp = ctx_tp;
  o.gen.tp = gen_tp;
  o.tokens = 13;
  return o;
}

void expectVerified(const ModelSpec& m, const LocalTransferOptions& o) {
  auto r = runLocalTransfer(m, o);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_TRUE(r->verified()) << "ctx tp " << o.ctx.tp << " pp " << o.ctx.pp << " -> gen tp "
                             << o.gen.tp << " pp " << o.gen.pp << ": " << r->oracle.toString()
                             << " / " << r->first_coverage_error;
}

const PoolView& viewOf(const RankLayout& l, Role role) {
  for (const PoolView& v : l.views) {
    if (v.role == role) return v;
  }
  ADD_FAILURE() << "no view for role " << roleName(role);
  return l.views.front();
}

// Mamba2 conv state is [x | B | C]. Copying a context rank's conv record as one flat range
// into "its share" of the generation record puts B and C bytes where x heads belong. The
// planner splits per section; the oracle proves the flat split corrupts and ours does not.
TEST(Planner, ConvSplitAsOneFlatRangeWouldCorrupt) {
  const ModelSpec m = makeModel({mamba2Layer(4, 2, 2, 3, 4), mamba2Layer(4, 2, 2, 3, 4)});
  LocalTransferOptions o = opts(2, 1);
  auto ctx = makeLocalInstance(m, o.ctx, StateLayout::kPaged, 1, o, 1, true);
  auto gen = makeLocalInstance(m, o.gen, StateLayout::kPaged, 1, o, 2, true);
  ASSERT_TRUE(ctx.isOk() && gen.isOk());
  for (LocalRank& r : *ctx) ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, 9).isOk());
  LocalRank& g = (*gen)[0];
  const PoolView& gconv = viewOf(g.layout, Role::kConv);

  // The flat split: ctx rank r's whole conv record lands at r * record_bytes; ssm done right.
  auto planner = Planner::create(layoutsOf(*ctx), g.layout);
  ASSERT_TRUE(planner.isOk()) << planner.status().toString();
  auto good = planner->plan(idsOf(*ctx), g.ids, {0, 0});
  ASSERT_TRUE(good.isOk());
  for (uint32_t r = 0; r < 2; ++r) {
    const LocalRank& c = (*ctx)[r];
    const PoolView& cconv = viewOf(c.layout, Role::kConv);
    std::vector<CopyOp> flat;
    for (uint32_t l = 0; l < 2; ++l) {
      flat.push_back({cconv.region_id, cconv.offset(c.ids.slot, l), gconv.region_id,
                      gconv.offset(g.ids.slot, l) + r * cconv.record_bytes, cconv.record_bytes});
    }
    ASSERT_TRUE(executeOps(flat, c.mem, g.mem).isOk());
  }
  auto flat_report = checkRank(g.layout, g.mem, g.ids, 9, {0, 0});
  ASSERT_TRUE(flat_report.isOk());
  ASSERT_FALSE(flat_report->ok());
  EXPECT_EQ(flat_report->first->role, Role::kConv);
  EXPECT_EQ(flat_report->first->section_name, "x");
  EXPECT_EQ(flat_report->first->unit, 2u);  // rank 0's B lands on x head 2

  // The planner: per section, every conv byte in place.
  for (const RankPlan& rp : good->ranks) {
    ASSERT_TRUE(executeOps(rp.ops, (*ctx)[rp.ctx_index].mem, g.mem).isOk());
  }
  auto report = checkRank(g.layout, g.mem, g.ids, 9, {0, 0});
  ASSERT_TRUE(report.isOk());
  EXPECT_TRUE(report->ok()) << report->toString();
  // Rank 1's conv slice reaches the generation record in three places: x, B, C.
  const uint64_t x_half = 2 * 2 * 3 * 2;  // 2 heads * P=2 * (k-1)=3 * bf16
  const uint64_t g_conv0 = gconv.offset(g.ids.slot, 0);
  EXPECT_EQ(writersOf(*good, gconv.region_id, g_conv0 + x_half), std::vector<uint32_t>{1});
  EXPECT_EQ(writersOf(*good, gconv.region_id, g_conv0), std::vector<uint32_t>{0});
}

// n_groups = 1: every rank of a tp>1 instance holds the same B and C group. Each generation
// rank gets it from exactly one context rank, and the writers rotate over the holders.
TEST(Planner, ReplicatedBcGroupsAtNGroupsOne) {
  const LayerSpec l = mamba2Layer(8, 2, 1, 3, 4);
  const ModelSpec m = makeModel({l, l, l, l});
  for (auto [ctx_tp, gen_tp] :
       {std::pair{4u, 1u}, {1u, 4u}, {4u, 2u}, {2u, 4u}, {4u, 4u}, {8u, 1u}, {8u, 2u}, {1u, 8u}}) {
    for (StateLayout gl : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
      LocalTransferOptions o = opts(ctx_tp, gen_tp);
      o.gen_layout = gl;
      expectVerified(m, o);
    }
  }
  // 4 -> 1: the B group of each layer has one writer; over four layers all four holders serve.
  LocalTransferOptions o = opts(4, 1);
  auto ctx = makeLocalInstance(m, o.ctx, StateLayout::kPaged, 1, o, 1, false);
  auto gen = makeLocalInstance(m, o.gen, StateLayout::kPaged, 1, o, 2, false);
  ASSERT_TRUE(ctx.isOk() && gen.isOk());
  const RankLayout& g = (*gen)[0].layout;
  auto planner = Planner::create(layoutsOf(*ctx), g);
  ASSERT_TRUE(planner.isOk());
  auto plan = planner->plan(idsOf(*ctx), (*gen)[0].ids, {0, 0});
  ASSERT_TRUE(plan.isOk());
  const PoolView& gconv = viewOf(g, Role::kConv);
  const uint64_t b_offset = 8 * 2 * 3 * 2;  // after x: 8 heads * P * (k-1) * bf16
  std::set<uint32_t> writers;
  for (uint32_t layer = 0; layer < 4; ++layer) {
    for (uint64_t section_off : {b_offset, b_offset + 3 * 3 * 2}) {  // B, then C
      auto w =
          writersOf(*plan, gconv.region_id, gconv.offset((*gen)[0].ids.slot, layer) + section_off);
      ASSERT_EQ(w.size(), 1u) << "layer " << layer;
      writers.insert(w[0]);
    }
  }
  EXPECT_EQ(writers.size(), 4u);
}

// Fewer kv heads than ranks: heads are replicated on the context side. One writer per byte,
// spread over the holders; at equal tp every rank reads only from its twin.
TEST(Planner, ReplicatedKvHeads) {
  const ModelSpec m = makeModel(
      {attentionLayer(2, 3), attentionLayer(2, 3), attentionLayer(2, 3), attentionLayer(2, 3)});
  for (auto [ctx_tp, gen_tp] :
       {std::pair{8u, 2u}, {8u, 1u}, {4u, 8u}, {2u, 8u}, {8u, 8u}, {4u, 1u}, {1u, 4u}}) {
    expectVerified(m, opts(ctx_tp, gen_tp));
  }
  LocalTransferOptions o = opts(8, 2);
  auto ctx = makeLocalInstance(m, o.ctx, StateLayout::kPaged, 4, o, 1, false);
  auto gen = makeLocalInstance(m, o.gen, StateLayout::kPaged, 4, o, 2, false);
  ASSERT_TRUE(ctx.isOk() && gen.isOk());
  for (const LocalRank& g : *gen) {
    auto planner = Planner::create(layoutsOf(*ctx), g.layout);
    ASSERT_TRUE(planner.isOk());
    auto plan = planner->plan(idsOf(*ctx), g.ids, {0, 4});
    ASSERT_TRUE(plan.isOk());
    const PoolView& kv = viewOf(g.layout, Role::kKv);
    std::set<uint32_t> writers;
    for (uint32_t layer = 0; layer < 4; ++layer) {
      auto w = writersOf(*plan, kv.region_id, kv.offset(g.ids.blocks[0], layer));
      ASSERT_EQ(w.size(), 1u);
      // Head g.tp_rank is held by ctx ranks [4 * tp_rank, 4 * tp_rank + 4).
      EXPECT_GE(w[0], 4 * g.layout.tp_rank);
      EXPECT_LT(w[0], 4 * g.layout.tp_rank + 4);
      writers.insert(w[0]);
    }
    EXPECT_EQ(writers.size(), 4u) << "gen rank " << g.layout.tp_rank;
  }
  // Same tp: rank r sends to rank r only.
  LocalTransferOptions same = opts(8, 8);
  auto c8 = makeLocalInstance(m, same.ctx, StateLayout::kPaged, 4, same, 1, false);
  auto g8 = makeLocalInstance(m, same.gen, StateLayout::kPaged, 4, same, 2, false);
  ASSERT_TRUE(c8.isOk() && g8.isOk());
  for (const LocalRank& g : *g8) {
    auto planner = Planner::create(layoutsOf(*c8), g.layout);
    ASSERT_TRUE(planner.isOk());
    ASSERT_EQ(planner->sources().size(), 1u);
    EXPECT_EQ(planner->sources()[0].ctx_index, g.layout.tp_rank);
  }
}

// Layers 0..5 form one attention group and one mamba2 group. The context splits them {1, 5},
// the generation side {3, 2, 1}: generation stage 0 receives from both context stages, and
// each layer from the stage that holds it.
TEST(Planner, PpStageBoundaryInsideALayerGroup) {
  const LayerSpec a = attentionLayer(2, 3);
  const LayerSpec s = mamba2Layer(4, 2, 2, 3, 3);
  const ModelSpec m = makeModel({a, s, a, s, a, s});
  for (StateLayout cl : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    for (StateLayout gl : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
      LocalTransferOptions o = opts(2, 1);
      o.ctx.pp = 2;
      o.ctx.layers_per_stage = {1, 5};
      o.gen.pp = 3;
      o.gen.layers_per_stage = {3, 2, 1};
      o.ctx_layout = cl;
      o.gen_layout = gl;
      expectVerified(m, o);
    }
  }
  LocalTransferOptions o = opts(1, 1);
  o.ctx = {1, 2, {1, 5}};
  o.gen = {1, 3, {3, 2, 1}};
  auto ctx = makeLocalInstance(m, o.ctx, StateLayout::kPaged, 4, o, 1, false);
  auto gen = makeLocalInstance(m, o.gen, StateLayout::kPaged, 4, o, 2, false);
  ASSERT_TRUE(ctx.isOk() && gen.isOk());
  auto stage0 = Planner::create(layoutsOf(*ctx), (*gen)[0].layout);
  ASSERT_TRUE(stage0.isOk());
  ASSERT_EQ(stage0->sources().size(), 2u);  // layer 0 from ctx stage 0, layers 1-2 from stage 1
  EXPECT_EQ(stage0->sources()[0].kv_bytes_per_block, (*ctx)[0].layout.kvBytesPerBlock());
  EXPECT_EQ(stage0->sources()[1].state_bytes, (*gen)[0].layout.stateBytesPerSlot());
  auto stage2 = Planner::create(layoutsOf(*ctx), (*gen)[2].layout);
  ASSERT_TRUE(stage2.isOk());
  ASSERT_EQ(stage2->sources().size(), 1u);
  EXPECT_EQ(stage2->sources()[0].ctx_index, 1u);
}

// The generation side already holds the first blocks: they are not sent, a partly held block
// is sent whole, and the bytes moved are blocks sent x block record bytes + state.
TEST(Planner, PrefixBlocksAreNotSent) {
  const ModelSpec m = makeModel({attentionLayer(4, 3), mamba2Layer(4, 2, 2, 3, 3)}, 4);
  LocalTransferOptions o = opts(2, 4);
  o.tokens = 40;         // 10 blocks
  o.prefix_tokens = 13;  // 3 whole blocks + 1 token: block 3 is sent
  auto r = runLocalTransfer(m, o);
  ASSERT_TRUE(r.isOk()) << r.status().toString();
  EXPECT_EQ(r->blocks.first_block, 3u);
  EXPECT_EQ(r->blocks.num_blocks, 7u);
  // Coverage proves that no byte of blocks 0-2 was written.
  EXPECT_TRUE(r->verified()) << r->first_coverage_error << r->oracle.toString();

  auto ctx = makeLocalInstance(m, o.ctx, StateLayout::kPaged, 10, o, 1, false);
  auto gen = makeLocalInstance(m, o.gen, StateLayout::kPaged, 10, o, 2, false);
  ASSERT_TRUE(ctx.isOk() && gen.isOk());
  const RankLayout& g = (*gen)[1].layout;
  auto planner = Planner::create(layoutsOf(*ctx), g);
  ASSERT_TRUE(planner.isOk());
  auto plan = planner->plan(idsOf(*ctx), (*gen)[1].ids, {3, 7});
  ASSERT_TRUE(plan.isOk());
  EXPECT_EQ(plan->total_bytes, 7 * g.kvBytesPerBlock() + g.stateBytesPerSlot());
  const PoolView& kv = viewOf(g, Role::kKv);
  for (uint32_t pos = 0; pos < 3; ++pos) {
    EXPECT_TRUE(writersOf(*plan, kv.region_id, kv.offset((*gen)[1].ids.blocks[pos], 0)).empty())
        << "prefix position " << pos;
  }
}

// Same tp, same layout, contiguous ids: one op per pool and block run, not one per record.
TEST(Planner, SameTpSameLayoutCoalescesToFewOps) {
  const ModelSpec m =
      makeModel({mamba2Layer(4, 2, 2, 3, 3), attentionLayer(4, 3), mamba2Layer(4, 2, 2, 3, 3),
                 attentionLayer(4, 3), mamba1Layer(4, 2, 3), mamba1Layer(4, 2, 3)},
                4);
  for (StateLayout layout : {StateLayout::kPaged, StateLayout::kLayerMajor}) {
    LocalTransferOptions o = opts(2, 2);
    o.ctx_layout = o.gen_layout = layout;
    o.shuffle_blocks = false;
    auto ctx = makeLocalInstance(m, o.ctx, layout, 12, o, 1, false);
    auto gen = makeLocalInstance(m, o.gen, layout, 12, o, 2, false);
    ASSERT_TRUE(ctx.isOk() && gen.isOk());
    for (uint32_t runs : {1u, 3u}) {
      std::vector<RankIds> ctx_ids = idsOf(*ctx);
      RankIds dst = (*gen)[0].ids;
      if (runs == 3) {  // break the destination run twice: [0,4) [4,8) [8,12) land apart
        for (uint32_t i = 4; i < 12; ++i) dst.blocks[i] = (*gen)[0].ids.blocks[i] + 3 * (i / 4);
      }
      const RankLayout& g = (*gen)[0].layout;
      // Extend the destination pool so the shifted ids are valid.
      auto big = makeLocalInstance(m, o.gen, layout, 12 + 8, o, 2, false);
      ASSERT_TRUE(big.isOk());
      auto planner = Planner::create(layoutsOf(*ctx), (*big)[0].layout);
      ASSERT_TRUE(planner.isOk());
      auto plan = planner->planRank(0, ctx_ids[0], dst, {0, 12});
      ASSERT_TRUE(plan.isOk()) << plan.status().toString();
      uint64_t kv_pools = 0, state_records = 0;
      for (const PoolView& v : g.views) {
        if (v.role == Role::kKv) {
          ++kv_pools;
        } else {
          state_records += layout == StateLayout::kPaged ? 1 : v.layers.size();
        }
      }
      const uint64_t state_regions = g.regions.size() - kv_pools;
      const uint64_t bound =
          kv_pools * runs + (layout == StateLayout::kPaged ? state_regions : state_records);
      EXPECT_LE(plan->ops.size(), bound) << stateLayoutName(layout) << " runs " << runs;
      EXPECT_EQ(plan->bytes, 12 * g.kvBytesPerBlock() + g.stateBytesPerSlot());
    }
  }
}

TEST(Planner, SingleSourcePlannerMatchesWholeInstancePlanner) {
  const ModelSpec m = makeModel({attentionLayer(2, 3), mamba2Layer(4, 2, 1, 3, 3),
                                 gdnLayer(2, 4, 2, 3, 3), attentionLayer(2, 3)});
  LocalTransferOptions o = opts(4, 2);
  o.ctx.pp = 2;
  auto ctx = makeLocalInstance(m, o.ctx, StateLayout::kPaged, 5, o, 1, false);
  auto gen = makeLocalInstance(m, o.gen, StateLayout::kLayerMajor, 5, o, 2, false);
  ASSERT_TRUE(ctx.isOk() && gen.isOk());
  for (const LocalRank& g : *gen) {
    auto whole = Planner::create(layoutsOf(*ctx), g.layout);
    ASSERT_TRUE(whole.isOk());
    for (uint32_t i = 0; i < ctx->size(); ++i) {
      auto one = Planner::createForSource((*ctx)[i].layout, g.layout);
      ASSERT_TRUE(one.isOk());
      auto a = whole->planRank(i, (*ctx)[i].ids, g.ids, {1, 4});
      auto b = one->planRank(0, (*ctx)[i].ids, g.ids, {1, 4});
      ASSERT_TRUE(a.isOk() && b.isOk());
      EXPECT_EQ(a->ops, b->ops) << "ctx " << i;
      EXPECT_EQ(a->bytes, b->bytes);
    }
  }
}

// ---- compatibility refusals name the field and both values ----

struct Pair {
  RankLayout ctx, gen;
};
Pair layouts(const ModelSpec& c, const ModelSpec& g, uint32_t ctx_tp = 1, uint32_t gen_tp = 1) {
  auto a = buildRankLayout(c, {ctx_tp, 1, {}}, 0, 0, StateLayout::kPaged, 4, 2);
  auto b = buildRankLayout(g, {gen_tp, 1, {}}, 0, 0, StateLayout::kPaged, 4, 2);
  EXPECT_TRUE(a.isOk() && b.isOk());
  return {*a, *b};
}

ModelSpec hybrid() { return makeModel({mamba2Layer(8, 2, 2, 3, 4), attentionLayer(4, 3)}, 4); }

TEST(PlannerCompat, SsmDtypeMismatchNamesBothDtypes) {
  ModelSpec g = hybrid();
  g.ssm_dtype = DType::kBf16;
  auto [c, gen] = layouts(hybrid(), g);
  Status s = checkCompatible(c, gen);
  EXPECT_EQ(s.code(), StatusCode::kIncompatible);
  EXPECT_EQ(s.message(), "ctx ssm dtype fp32 != gen ssm dtype bf16");
}

TEST(PlannerCompat, KvAndConvDtypeMismatchesAreRefused) {
  ModelSpec g = hybrid();
  g.kv_dtype = DType::kFp8;
  auto p1 = layouts(hybrid(), g);
  EXPECT_EQ(checkCompatible(p1.ctx, p1.gen).message(), "ctx kv dtype bf16 != gen kv dtype fp8");
  g = hybrid();
  g.conv_dtype = DType::kFp32;
  auto p2 = layouts(hybrid(), g);
  EXPECT_EQ(checkCompatible(p2.ctx, p2.gen).message(),
            "ctx conv dtype bf16 != gen conv dtype fp32");
}

// Tokens per block are not part of compatibility: kv then moves by token ranges. The planner
// says which tokens move and refuses a context side that does not hold them all.
TEST(PlannerCompat, TokensPerBlockMayDifferAndKvMovesByTokenRanges) {
  ModelSpec g = hybrid();
  g.tokens_per_block = 8;
  auto [c, gen] = layouts(hybrid(), g);
  EXPECT_TRUE(checkCompatible(c, gen).isOk()) << checkCompatible(c, gen).toString();
  auto p = Planner::create({c}, gen);
  ASSERT_TRUE(p.isOk()) << p.status().toString();
  EXPECT_TRUE(p->byToken());
  // 10 tokens: generation positions [0, 2) of 8 tokens, clipped to the request's 10 tokens.
  EXPECT_EQ(p->kvTokens({0, 2, 10}), (std::pair<uint64_t, uint64_t>{0, 10}));
  EXPECT_EQ(p->kvTokens({1, 1, 10}), (std::pair<uint64_t, uint64_t>{8, 10}));
  EXPECT_EQ(p->kvTokens({0, 2, 0}), (std::pair<uint64_t, uint64_t>{0, 16}));
  EXPECT_EQ(p->expectedBytes(BlockRange{0, 2, 10}),
            10 * (gen.kvBytesPerBlock() / 8) + gen.stateBytesPerSlot());
  // The context rank must hold every token that moves: 10 tokens in blocks of 4 are 3 blocks.
  RankIds src{{0, 1}, 0}, dst{{0, 1}, 0};
  auto short_src = p->planRank(0, src, dst, {0, 2, 10});
  EXPECT_EQ(short_src.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(short_src.status().message(),
            "ctx block ids: 2 given, tokens up to 10 are sent, in 3 blocks of 4 tokens");
}

TEST(PlannerCompat, DifferentModelsAreRefusedByFingerprint) {
  ModelSpec g = hybrid();
  g.layers[1].attention->head_dim = 4;
  auto [c, gen] = layouts(hybrid(), g);
  Status s = checkCompatible(c, gen);
  EXPECT_EQ(s.code(), StatusCode::kIncompatible);
  EXPECT_NE(s.message().find("ctx model fingerprint 0x"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("!= gen model fingerprint 0x"), std::string::npos);
}

TEST(PlannerCompat, IndivisibleTpNamesTheSection) {
  auto [c, gen] = layouts(hybrid(), hybrid());
  gen.tp = 3;  // as a peer might claim
  Status s = checkCompatible(c, gen);
  EXPECT_EQ(s.code(), StatusCode::kIncompatible);
  EXPECT_EQ(s.message(), "gen tp=3 does not divide layer 1 attention kv K units=4");
}

TEST(PlannerCompat, DifferentSectionsForTheSameLayerAreRefused) {
  auto [c, gen] = layouts(hybrid(), hybrid(), 2, 1);
  for (PoolView& v : gen.views) {
    if (v.role == Role::kConv) v.sections[1].name = "Z";
  }
  Status s = checkCompatible(c, gen);
  EXPECT_EQ(s.code(), StatusCode::kIncompatible);
  EXPECT_NE(s.message().find("layer 0 conv sections: ctx x:8x12B B:2x18B C:2x18B != gen x:8x12B "
                             "Z:2x18B"),
            std::string::npos)
      << s.message();
}

TEST(PlannerCompat, IncompleteOrDuplicatedInstanceIsRefused) {
  const ModelSpec m = hybrid();
  auto r0 = buildRankLayout(m, {2, 1, {}}, 0, 0, StateLayout::kPaged, 4, 2);
  auto r1 = buildRankLayout(m, {2, 1, {}}, 1, 0, StateLayout::kPaged, 4, 2);
  ASSERT_TRUE(r0.isOk() && r1.isOk());
  EXPECT_EQ(checkInstance({*r0}).message(), "context instance has 1 ranks, tp*pp=2");
  EXPECT_EQ(checkInstance({*r0, *r0}).message(), "ctx rank (tp_rank 0, pp_rank 0) appears twice");
  EXPECT_TRUE(checkInstance({*r1, *r0}).isOk());
  EXPECT_FALSE(Planner::create({*r0}, *r0).isOk());
}

TEST(PlannerCompat, BadRequestIdsAreRefusedBeforePlanning) {
  const ModelSpec m = hybrid();
  auto c = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kPaged, 4, 2);
  auto g = buildRankLayout(m, {1, 1, {}}, 0, 0, StateLayout::kPaged, 4, 2);
  ASSERT_TRUE(c.isOk() && g.isOk());
  auto p = Planner::create({*c}, *g);
  ASSERT_TRUE(p.isOk());
  const RankIds src{{0, 1, 2}, 0};
  EXPECT_EQ(p->planRank(0, src, {{3, 1, 3}, 1}, {0, 3}).status().message(),
            "gen block id 3 appears twice in positions [0, 3)");
  EXPECT_EQ(p->planRank(0, src, {{0, 1, 4}, 1}, {0, 3}).status().message(),
            "gen block id 4 at position 2 >= num_blocks=4");
  EXPECT_EQ(p->planRank(0, src, {{0, 1}, 1}, {0, 3}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(p->planRank(0, src, {{0, 1, 2}, 2}, {0, 3}).status().message(),
            "gen state id 2 of group 0 >= num_slots=2");
  // A repeated id inside the prefix is fine: those blocks are not written.
  EXPECT_TRUE(p->planRank(0, src, {{3, 3, 1}, 1}, {2, 1}).isOk());
}

// A peer's wire 1.5 claim of 65536 state groups with one id pool, and a request of a million
// blocks: the id check once took groups x (groups + blocks) comparisons (26 s on a context rank's
// progress thread). Linear now; the generous bound only catches the quadratic walk (~7e10 steps).
TEST(StateIds, CheckIsLinearInGroupsAndBlocksForAHostileClaim) {
  RankLayout l;
  l.joint_ids = true;
  l.state_groups = 1u << 16;
  l.num_slots = l.num_blocks = 1u << 22;
  RankIds ids;
  ids.slot = 0;
  for (uint32_t g = 1; g < l.state_groups; ++g) ids.group_slots.push_back(g);
  for (uint32_t b = 0; b < (1u << 20); ++b) ids.blocks.push_back(l.state_groups + b);
  const auto start = std::chrono::steady_clock::now();
  EXPECT_TRUE(checkStateIds(l, ids, "gen").isOk());
  ids.blocks.back() = 4242;  // group 4242's state, named again as the last block
  Status s = checkStateIds(l, ids, "gen");
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("gen state id 4242 of group 4242 is also the request's block at "
                             "position 1048575"),
            std::string::npos)
      << s.toString();
  ids.group_slots.back() = 7;
  s = checkStateIds(l, ids, "gen");
  EXPECT_NE(s.message().find("gen state id 7 of group 65535 is also group 7's"), std::string::npos)
      << s.toString();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace hxfer
