// The device kernels' index arithmetic, run on the CPU as a launch's threads would run it:
// batched copies and packs built from real plans land every byte where the memcpy executor
// and the oracle say, for every engine-layout pair; storms, alignments and bad ranges.
#include "device/copy_table_builder.h"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <random>

#include "cache/engine_layout.h"
#include "plan/local_transfer.h"
#include "plan/oracle.h"
#include "plan/plan_test_util.h"

namespace hxfer::device {
namespace {

using namespace hxfer::testing;

TEST(DeviceIndex, EntryOfFindsTheRunOfEveryChunkAcrossUnevenRuns) {
  const std::vector<uint64_t> bytes = {1, kChunkBytes, kChunkBytes + 1, 3 * kChunkBytes - 1, 7};
  std::vector<CopyRun> runs;
  for (uint64_t b : bytes) runs.push_back(CopyRun{0, 0, b});
  auto t = copyTable(runs);
  ASSERT_TRUE(t.isOk());
  const std::vector<uint64_t> want_first = {0, 1, 2, 4, 7, 8};
  EXPECT_EQ(t->first_chunk, want_first);
  const CopyTable v = t->view();
  EXPECT_EQ(v.num_chunks, 8u);
  const uint32_t want_run[] = {0, 1, 2, 2, 3, 3, 3, 4};
  for (uint64_t c = 0; c < v.num_chunks; ++c) {
    const ChunkSpan s = chunkSpan(v, c);
    EXPECT_EQ(s.run, want_run[c]) << "chunk " << c;
    EXPECT_LE(s.end - s.begin, kChunkBytes);
    EXPECT_GT(s.end, s.begin);
  }
  EXPECT_EQ(chunkSpan(v, 3).begin, kChunkBytes);
  EXPECT_EQ(chunkSpan(v, 3).end, kChunkBytes + 1);
}

TEST(DeviceIndex, EmptyRunsAreDroppedAndTheRestKeepTheirOrder) {
  const std::vector<CopyRun> runs = {{1, 2, 0}, {3, 4, 10}, {5, 6, 0}, {7, 8, 20}};
  auto t = copyTable(runs);
  ASSERT_TRUE(t.isOk());
  ASSERT_EQ(t->runs.size(), 2u);
  EXPECT_EQ(t->runs[0].src, 3u);
  EXPECT_EQ(t->runs[1].src, 7u);
  EXPECT_EQ(t->bytes(), 30u);
}

// Every misalignment of source and destination (0..17 bytes) and lengths around the word
// sizes and the chunk: each byte lands once, nothing around it is touched.
TEST(DeviceIndex, EveryAlignmentAndLengthCopiesExactlyTheRun) {
  std::vector<uint8_t> src(3 * kChunkBytes + 64), dst(src.size());
  std::iota(src.begin(), src.end(), uint8_t{1});
  for (uint64_t so : {0, 1, 2, 4, 8, 15, 16, 17}) {
    for (uint64_t dof : {0, 1, 2, 4, 8, 15, 16, 17}) {
      for (uint64_t n : {1, 2, 3, 15, 16, 17, 255, 4095, 4096, 4097, 2 * 4096 + 33}) {
        std::fill(dst.begin(), dst.end(), 0xEE);
        const CopyRun r{reinterpret_cast<uint64_t>(src.data() + so),
                        reinterpret_cast<uint64_t>(dst.data() + dof), n};
        auto t = copyTable(std::span<const CopyRun>(&r, 1));
        ASSERT_TRUE(t.isOk());
        runOnHost(t->view(), 256);
        SCOPED_TRACE("src+" + std::to_string(so) + " dst+" + std::to_string(dof) + " n " +
                     std::to_string(n));
        ASSERT_EQ(std::memcmp(dst.data() + dof, src.data() + so, n), 0);
        for (uint64_t i = 0; i < dof; ++i) ASSERT_EQ(dst[i], 0xEE);
        for (uint64_t i = dof + n; i < dst.size(); ++i) ASSERT_EQ(dst[i], 0xEE);
      }
    }
  }
}

// The storm the batched copy is for: 262,528 runs of 64 bytes in a shuffled order, one table,
// one launch (here: one emulated launch of 32 threads per block).
TEST(DeviceIndex, AStormOfRunsIsOneTableAndMovesEveryRun) {
  constexpr uint32_t kRuns = 262'528;
  constexpr uint64_t kRun = 64;
  std::vector<uint8_t> src(kRuns * kRun), dst(kRuns * kRun, 0);
  std::mt19937_64 rng(7);
  for (auto& b : src) b = static_cast<uint8_t>(rng());
  const ShuffledRuns storm = shuffledRuns(reinterpret_cast<uint64_t>(src.data()),
                                          reinterpret_cast<uint64_t>(dst.data()), kRuns, kRun, 7);
  auto t = copyTable(storm.runs);
  ASSERT_TRUE(t.isOk());
  EXPECT_EQ(t->view().num_chunks, kRuns);
  runOnHost(t->view(), 32);
  for (uint32_t i = 0; i < kRuns; i += 997) {
    ASSERT_EQ(
        std::memcmp(dst.data() + storm.destinationOffset(i), src.data() + uint64_t{i} * kRun, kRun),
        0)
        << "run " << i;
  }
  EXPECT_EQ(std::accumulate(dst.begin(), dst.end(), uint64_t{0}),
            std::accumulate(src.begin(), src.end(), uint64_t{0}));
}

TEST(DeviceIndex, RangesOutsideTheirRegionsAreRefusedNamingTheOp) {
  std::vector<uint8_t> a(100), b(100);
  const RankMemory src = {{a.data(), a.size()}};
  const RankMemory dst = {{b.data(), b.size()}};
  const std::vector<CopyOp> ops = {{0, 0, 0, 0, 50}, {0, 60, 0, 0, 50}};
  auto t = copyTable(ops, src, dst);
  ASSERT_FALSE(t.isOk());
  EXPECT_NE(t.status().message().find("op 1 source"), std::string::npos) << t.status().toString();
  const std::vector<CopyOp> far = {{0, 0, 0, 90, 20}};
  t = copyTable(far, src, dst);
  ASSERT_FALSE(t.isOk());
  EXPECT_NE(t.status().message().find("op 0 destination"), std::string::npos)
      << t.status().toString();
}

TEST(DeviceIndex, DimsThatContinueEachOtherMergeAndSizeOneDimsGo) {
  std::vector<uint8_t> mem(1 << 18);
  RankPlan plan;
  PackOp op;
  op.src_region = 0;
  op.element_bytes = 2;
  // [2][1][3][4] where the inner two are one contiguous run on both sides: 2 dims remain.
  op.dims = {{2, 100, 24}, {1, 7, 7}, {3, 8, 8}, {4, 2, 2}};
  plan.pack_ops = {op};
  plan.scratch_bytes = 48;
  auto t = packTable(plan, RankMemory{{mem.data(), mem.size()}}, 0, 48);
  ASSERT_TRUE(t.isOk()) << t.status().toString();
  ASSERT_EQ(t->packs.size(), 1u);
  EXPECT_EQ(t->packs[0].ndims, 2u);
  EXPECT_EQ(t->packs[0].size[1], 12u);
  EXPECT_EQ(t->view().num_elements, 24u);
  plan.pack_ops[0].dims.assign(kMaxPackDims + 1, BoxDim{2, 0, 0});
  for (uint32_t i = 0; i <= kMaxPackDims; ++i) {
    plan.pack_ops[0].dims[i] = BoxDim{2, uint64_t{2} << (2 * i), uint64_t{2} << i};
  }
  plan.scratch_bytes = 2 << (kMaxPackDims + 1);
  auto deep = packTable(plan, RankMemory{{mem.data(), mem.size()}}, 0, plan.scratch_bytes);
  ASSERT_FALSE(deep.isOk());
  EXPECT_NE(deep.status().message().find("pack op 0: a box of 9 dims"), std::string::npos)
      << deep.status().toString();
}

// Every engine pair at 4:1 and 1:4: each context rank's pack ops run as the pack kernel's
// threads run them give the staging area packScratch gives, bit for bit; its ops as one
// batched copy leave the generation pages as the oracle wants them.
TEST(DeviceIndex, PackAndBatchedCopyMoveEveryByteForEveryEnginePair) {
  const ModelSpec model = enginePairModel();
  int cases = 0, staged = 0;
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
        for (LocalRank& r : *ctx) {
          ASSERT_TRUE(fillRank(r.layout, r.mem, r.ids, o.request_id).isOk());
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
            std::vector<uint8_t> want(plan->scratch_bytes), got(plan->scratch_bytes, 0xEE);
            ASSERT_TRUE(packScratch(*plan, c.mem, want).isOk());
            auto pack = packTable(*plan, c.mem, reinterpret_cast<uint64_t>(got.data()), got.size());
            ASSERT_TRUE(pack.isOk()) << what << ": " << pack.status().toString();
            runOnHost(pack->view());
            ASSERT_EQ(got, want) << what;
            staged += !plan->pack_ops.empty();
            auto copy = copyTable(plan->ops, c.mem, g.mem, got);
            ASSERT_TRUE(copy.isOk()) << what << ": " << copy.status().toString();
            EXPECT_EQ(copy->bytes(), plan->bytes) << what;
            runOnHost(copy->view(), 64);
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
  EXPECT_GT(staged, 0) << "no pair needed staging: the pack was never exercised";
}

}  // namespace
}  // namespace hxfer::device
