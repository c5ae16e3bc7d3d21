// Staging a part as one run: gather on the context rank, scatter on the generation rank, lands
// every byte where the direct ops would; both sides lay out the slot alone.
#include "plan/staging.h"

#include <gtest/gtest.h>

#include "cache/engine_layout.h"
#include "plan/local_transfer.h"
#include "plan/oracle.h"
#include "plan/plan_test_util.h"

namespace hxfer {
namespace {

using namespace testing;

TEST(Staging, RunsAreSortedJoinedAndOffsetByTheBytesBefore) {
  const std::vector<CopyOp> ops = {
      {0, 0, 2, 100, 10}, {0, 50, 1, 0, 8}, {0, 70, 2, 110, 5}, {0, 90, 2, 0, 4}};
  auto runs = stagingRuns(ops);
  ASSERT_TRUE(runs.isOk()) << runs.status().toString();
  const std::vector<StagedRun> want = {{1, 0, 0, 8}, {2, 0, 8, 4}, {2, 100, 12, 15}};
  EXPECT_EQ(*runs, want);
  EXPECT_EQ(stagingBytes(*runs), 27u);
  // As ops: each op to its place in the slot, each run from it.
  auto gather = gatherOps(ops, *runs, 9);
  ASSERT_TRUE(gather.isOk());
  const std::vector<CopyOp> want_gather = {
      {0, 0, 9, 12, 10}, {0, 50, 9, 0, 8}, {0, 70, 9, 22, 5}, {0, 90, 9, 8, 4}};
  EXPECT_EQ(*gather, want_gather);
  const std::vector<CopyOp> want_scatter = {
      {9, 100, 1, 0, 8}, {9, 108, 2, 0, 4}, {9, 112, 2, 100, 15}};
  EXPECT_EQ(scatterOps(*runs, 9, 100), want_scatter);
  const std::vector<CopyOp> want_back = {
      {0, 0, 9, 0, 10}, {0, 50, 9, 10, 8}, {0, 70, 9, 18, 5}, {0, 90, 9, 23, 4}};
  EXPECT_EQ(backToBack(ops, 9), want_back);
  // Prepared for windows: in slot order. A window [6, 16): ops and runs cut at its edges, placed
  // from its start.
  auto prepared = slotGather(ops, *runs);
  ASSERT_TRUE(prepared.isOk());
  const std::vector<CopyOp> want_sorted = {
      {0, 50, 0, 0, 8}, {0, 90, 0, 8, 4}, {0, 0, 0, 12, 10}, {0, 70, 0, 22, 5}};
  EXPECT_EQ(prepared->ops, want_sorted);
  EXPECT_EQ(prepared->bytes, 27u);
  auto window = windowOps(*prepared, 9, StagingWindow{6, 10});
  ASSERT_TRUE(window.isOk());
  const std::vector<CopyOp> want_window = {{0, 56, 9, 0, 2}, {0, 90, 9, 2, 4}, {0, 0, 9, 6, 4}};
  EXPECT_EQ(*window, want_window);
  EXPECT_EQ(*windowOps(*prepared, 9), *windowOps(*prepared, 9, StagingWindow{0, 27}));
  EXPECT_EQ(windowOps(*prepared, 9)->size(), 4u);
  EXPECT_TRUE(windowOps(*prepared, 9, StagingWindow{27, 5})->empty());
  EXPECT_TRUE(windowOps(*prepared, 9, StagingWindow{14, 0})->empty());
  EXPECT_NE(windowOps(*prepared, 9, StagingWindow{28, 1}).status().message().find("starts past"),
            std::string::npos);
  auto cut = windowRuns(*runs, StagingWindow{6, 10});
  ASSERT_TRUE(cut.isOk());
  const std::vector<StagedRun> want_cut = {{1, 6, 0, 2}, {2, 0, 2, 4}, {2, 100, 6, 4}};
  EXPECT_EQ(*cut, want_cut);
  EXPECT_TRUE(windowRuns(*runs, StagingWindow{27, 5})->empty());
  EXPECT_NE(windowRuns(*runs, StagingWindow{28, 1}).status().message().find("starts past"),
            std::string::npos);
  const std::vector<CopyOp> elsewhere = {{0, 0, 3, 0, 1}};
  EXPECT_EQ(gatherOps(elsewhere, *runs, 9).status().code(), StatusCode::kInvalidArgument);
  const std::vector<CopyOp> overlap = {{0, 0, 2, 100, 10}, {0, 50, 2, 105, 8}};
  EXPECT_NE(stagingRuns(overlap).status().message().find("twice"), std::string::npos);
}

// Every engine pair at 4:1 and 1:4 (per-token runs for NHD and token-major): gathering each
// context rank's part into a slot laid out from its own ops and scattering it by runs laid out
// from a plan with other source ids leaves the generation pages as the oracle wants them, whole
// or window by window (windows of an uneven size, cutting ops and runs anywhere).
TEST(Staging, GatherThenScatterMovesEveryByteForEveryEnginePair) {
  const ModelSpec model = enginePairModel();
  int cases = 0;
  for (const EngineLayout& ce : allEngineLayouts()) {
    for (const EngineLayout& ge : allEngineLayouts()) {
      for (auto [ctp, gtp] : {std::pair<uint32_t, uint32_t>{4, 1}, {1, 4}}) {
        LocalTransferOptions o;
        o.use_regions = false;
        o.ctx = {ctp, 1, {}};
        o.gen = {gtp, 1, {}};
        o.tokens = 45;
        o.seed = static_cast<uint64_t>(cases);
        const uint32_t blocks = 3;
        auto ctx = makeLocalInstance(model, o.ctx, ce, blocks, o, 1, true);
        auto gen = makeLocalInstance(model, o.gen, ge, blocks, o, 2, true);
        if (!ctx.isOk() || !gen.isOk()) continue;  // a vllm page too small at 16 tokens
        std::vector<RankLayout> layouts;
        for (LocalRank& r : *ctx) {
          ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, o.request_id).isOk());
          layouts.push_back(r.layout);
        }
        const std::string what = ce.toString() + " -> " + ge.toString() + " tp " +
                                 std::to_string(ctp) + ":" + std::to_string(gtp);
        const BlockRange range{0, blocks, o.tokens};
        for (LocalRank& g : *gen) {
          for (LocalRank& c : *ctx) {
            auto planner = Planner::createForSource(c.layout, g.layout);
            ASSERT_TRUE(planner.isOk()) << what << ": " << planner.status().toString();
            auto plan = planner->planRank(0, c.ids, g.ids, range);
            ASSERT_TRUE(plan.isOk()) << what << ": " << plan.status().toString();
            if (plan->ops.empty()) continue;
            // The generation side's view: the same request from other source ids.
            RankIds other;
            for (uint32_t i = 0; i < blocks; ++i) other.blocks.push_back(blocks - 1 - i);
            auto theirs = planner->planRank(0, other, g.ids, range);
            ASSERT_TRUE(theirs.isOk());
            auto mine = stagingRuns(plan->ops);
            auto scatter = stagingRuns(theirs->ops);
            ASSERT_TRUE(mine.isOk() && scatter.isOk());
            ASSERT_EQ(*mine, *scatter) << what;
            EXPECT_EQ(stagingBytes(*mine), plan->bytes) << what;
            std::vector<uint8_t> packed(plan->scratch_bytes);
            ASSERT_TRUE(packScratch(*plan, c.mem, packed).isOk());
            auto prepared = slotGather(plan->ops, *mine);
            ASSERT_TRUE(prepared.isOk()) << what << ": " << prepared.status().toString();
            std::vector<uint8_t> slot(plan->bytes);
            ASSERT_TRUE(gatherStaged(*prepared, c.mem, packed, slot).isOk()) << what;
            // The same gather as ops (what a device runs): the same slot.
            std::vector<uint8_t> by_ops(plan->bytes + 64, 0xEE);
            const RankMemory area = {{by_ops.data() + 64, plan->bytes}};
            auto gather = gatherOps(plan->ops, *mine, 0);
            ASSERT_TRUE(gather.isOk()) << what << ": " << gather.status().toString();
            ASSERT_TRUE(executeOps(*gather, c.mem, area, packed).isOk()) << what;
            ASSERT_TRUE(std::equal(slot.begin(), slot.end(), by_ops.begin() + 64)) << what;
            // Window by window, gathered either way: the same bytes as the whole slot's.
            const uint64_t step = plan->bytes / 3 + 7;
            std::vector<StagingWindow> windows;
            for (uint64_t at = 0; at < plan->bytes; at += step) windows.push_back({at, step});
            for (const StagingWindow& w : windows) {
              const uint64_t n = std::min(step, plan->bytes - w.offset);
              std::vector<uint8_t> part(n), part_ops(n);
              ASSERT_TRUE(gatherStaged(*prepared, c.mem, packed, part, w).isOk()) << what;
              auto cut = windowOps(*prepared, 0, w);
              ASSERT_TRUE(cut.isOk()) << what << ": " << cut.status().toString();
              const RankMemory window_area = {{part_ops.data(), n}};
              ASSERT_TRUE(executeOps(*cut, c.mem, window_area, packed).isOk()) << what;
              ASSERT_TRUE(std::equal(part.begin(), part.end(), slot.begin() + w.offset)) << what;
              ASSERT_EQ(part, part_ops) << what;
            }
            // A third of the cases scatter as ops, from a slot at an offset of a larger region;
            // a third window by window, as a run each and as ops in turn.
            const RankMemory staging = {{}, {}, {by_ops.data(), by_ops.size()}};
            if (cases % 3 == 0) {
              ASSERT_TRUE(scatterStaged(*scatter, slot, g.mem).isOk()) << what;
            } else if (cases % 3 == 1) {
              ASSERT_TRUE(executeOps(scatterOps(*scatter, 2, 64), staging, g.mem).isOk()) << what;
            } else {
              for (size_t i = 0; i < windows.size(); ++i) {
                auto cut = windowRuns(*scatter, windows[i]);
                ASSERT_TRUE(cut.isOk()) << what;
                const uint64_t at = windows[i].offset;
                if (i % 2 == 0) {
                  const auto bytes = std::span<const uint8_t>(slot).subspan(at);
                  ASSERT_TRUE(scatterStaged(*cut, bytes, g.mem).isOk()) << what;
                } else {
                  ASSERT_TRUE(executeOps(scatterOps(*cut, 2, 64 + at), staging, g.mem).isOk())
                      << what;
                }
              }
            }
          }
          auto report = checkRank(g.layout, g.mem, g.ids, o.request_id, range);
          ASSERT_TRUE(report.isOk()) << report.status().toString();
          EXPECT_TRUE(report->ok()) << what << ": " << report->toString();
        }
        ++cases;
      }
    }
  }
  EXPECT_GE(cases, static_cast<int>(allEngineLayouts().size() * allEngineLayouts().size()));
}

}  // namespace
}  // namespace hxfer
